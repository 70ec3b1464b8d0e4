"""Island processes forked from a warm interpreter instead of started cold.

A cold ``python -m diloco.cli train`` spends about 5 s of CPU before its first step: importing torch,
hivemind and the engine (3.3 s) and torch's compiler stack, which building an optimizer imports (1.5 s).
A tiny island trains for well under a second, so where one machine starts many islands in a row (the test
suite, above all: restarts after scripted kills, dozens of short runs) the imports are most of the work.

:func:`start` forks the island from multiprocessing's fork server, which imported all of that once, and
runs the same ``diloco.cli.main(argv)`` the console command runs, in a session of its own, with the given
environment and its output in the given log: to the island it is the same process.  What it cannot be is an
island of several ranks (torchrun starts those) or one whose command line is wrapped (a network namespace,
a CPU cgroup): :class:`~diloco.launch.simulate.Cluster` starts those cold.

Opt in with ``DILOCO_WARM_ISLANDS=1`` (the test suite does); users' islands start cold, as they will on
their servers.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

ENV = "DILOCO_WARM_ISLANDS"

# imported once by the fork server; every island forked from it skips them
PRELOAD = ["torch", "torch._dynamo", "hivemind", "diloco.cli", "diloco.engine.island", "diloco.launch.baseline",
           "diloco.launch.simulate"]

_context: multiprocessing.context.ForkServerContext | None = None


def enabled() -> bool:
    """Whether islands of this process start warm (``DILOCO_WARM_ISLANDS=1``)."""
    return os.environ.get(ENV, "") == "1"


def _fork_server() -> multiprocessing.context.ForkServerContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


class WarmProcess:
    """An island forked from the fork server, with the part of :class:`subprocess.Popen`'s interface that
    :class:`~diloco.launch.simulate.Cluster` uses (its parent is the fork server, so it is waited for
    through multiprocessing)."""

    def __init__(self, process: multiprocessing.process.BaseProcess, args: list[str]):
        self._process = process
        self.args = args
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        """The exit code, negative for a signal, as Popen's; None while it runs."""
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(argv: list[str], env: dict[str, str], log: Path, append_log: bool = False) -> WarmProcess:
    """Fork ``diloco <argv>`` from the warm fork server, with environment ``env``, stdout and stderr to ``log``,
    in a session of its own (its process group is its pid, as with ``start_new_session``)."""
    process = _fork_server().Process(target=_run, args=(argv, env, str(log), append_log), name="diloco-island")
    process.start()
    return WarmProcess(process, ["diloco", *argv])


def _run(argv: list[str], env: dict[str, str], log: str, append_log: bool) -> None:
    """The island, in the forked child: become what a cold ``python -m diloco.cli <argv>`` would be, run it,
    and exit as its interpreter would."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append_log else os.O_TRUNC), 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    # a fresh interpreter's start method (fork), not the fork server's: hivemind starts its DHT and
    # averager as multiprocessing children
    multiprocessing.set_start_method(None, force=True)
    sys.argv = ["diloco", *argv]
    from diloco.cli import main

    try:
        code = main(argv)
    finally:
        atexit._run_exitfuncs()  # multiprocessing ends its children with os._exit, past the interpreter's exit
    sys.exit(code)
