"""Progress of a long command (training, evaluation): a tqdm bar on stderr when stderr is a terminal, nothing
when it is a file or a pipe, so that logs hold only their lines."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


class Progress:
    """One bar over ``total`` (an amount of work, or 100 for a percentage with ``percent``); lines printed through
    :meth:`write` go above the bar instead of through it."""

    def __init__(self, total: float | None, desc: str, *, unit: str = "it", unit_scale: bool = False,
                 percent: bool = False, enabled: bool | None = None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        fmt = "{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]" if percent else None
        self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, disable=not self.enabled,
                         file=sys.stderr, dynamic_ncols=True, bar_format=fmt, leave=False)

    def set(self, done: float, **postfix: Any) -> None:
        """Move the bar to ``done`` and show ``postfix`` beside it (redrawn at most ~10 times a second)."""
        if not self.enabled:
            return
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(done - self._bar.n)

    def write(self, line: str) -> None:
        """Print ``line`` on stdout, above the bar when there is one."""
        if self.enabled:
            tqdm.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)

    def close(self) -> None:
        self._bar.close()
