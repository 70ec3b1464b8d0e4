"""How every command line of the project reports the errors a user can cause: one line each, an exit code."""

from __future__ import annotations

import sys
from typing import Callable

from diloco.config import ConfigError


def run_command(body: Callable[[], int], failures: tuple[type[BaseException], ...],
                interrupted: str = "interrupted") -> int:
    """Run a command's ``body`` and return its exit code.

    A bad command line or config (:class:`ConfigError`) prints each problem as ``error: ...`` and
    returns 2; one of ``failures`` (a run that could not go on: unreachable peers, corrupted
    checkpoint, ...) prints its one-line message and returns 1; Ctrl-C prints ``interrupted`` and
    returns 130.  Anything else is a bug and keeps its traceback.
    """
    try:
        return body()
    except ConfigError as e:
        for problem in e.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    except failures as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130


__all__ = ["run_command"]
