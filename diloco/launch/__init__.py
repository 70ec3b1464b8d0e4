"""Starting islands and workers as processes of this machine: ``simulate``'s islands, the synchronous baseline's
workers (on the island's trainer core, :mod:`diloco.engine.trainer`, with DDP's sync), and the warm interpreter
they may fork from."""

from __future__ import annotations

from pathlib import Path


def tail(path: Path, n: int = 15) -> str:
    """The last ``n`` lines of a log file."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"
