"""How every command line of the project reports the errors a user can cause: one line each, an exit code."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, NoReturn

from diloco.config import Config, ConfigError
from diloco.config import loader as config_load
from diloco.files import DISK_ERRNOS, OutputError, describe


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the project's habit for a command line it cannot read: one line, ``error: ...``, naming
    ``--help``, and exit code 2 (argparse's own prints its whole usage first)."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}; `{self.prog} --help` lists the options", file=sys.stderr)
        sys.exit(2)


def config_for(command: str, what: str, config_file: str | None, overrides: list[str],
               used: tuple[str, ...]) -> Config:
    """The config of a command that reads only the sections ``used`` of it (or none), from ``--config FILE``
    and ``--section.key VALUE`` as train takes them: loaded and checked as train's (a typo is refused alike,
    :class:`ConfigError`), with one line on stderr naming the keys given that ``command`` does not use, since
    it ``what``: none is ignored silently."""
    cfg, given = config_load.load_given(config_file, overrides)
    unused = sorted(k for k in given if not k.startswith(tuple(f"{s}." for s in used)))
    if unused:
        print(f"note: {command} {what}; it does not use {', '.join('--' + k for k in unused)}", file=sys.stderr)
    return cfg


def run_command(body: Callable[[], int], failures: tuple[type[BaseException], ...],
                interrupted: str = "interrupted") -> int:
    """Run a command's ``body`` and return its exit code.

    A bad command line or config (:class:`ConfigError`) prints each problem as ``error: ...`` and
    returns 2; one of ``failures`` (a run that could not go on: unreachable peers, corrupted
    checkpoint, ...), an output that cannot be written (:class:`OutputError`) or a disk that refuses a
    write (full, read-only: an ``OSError`` of :data:`DISK_ERRNOS`) prints its one-line message and returns
    1; Ctrl-C prints ``interrupted`` and returns 130; a reader of stdout that left (``| head``) ends it
    quietly with 141, as the shell counts SIGPIPE.  Anything else is a bug and keeps its traceback.
    """
    try:
        return body()
    except ConfigError as e:
        for problem in e.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    except (OutputError, *failures) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if e.errno not in DISK_ERRNOS:
            raise
        print(f"error: {describe(e.filename or 'a file', e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout left (`| head`): nothing more to say, to anyone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


__all__ = ["ArgumentParser", "config_for", "run_command"]
