"""Island processes forked from a warm interpreter instead of started cold.

A cold ``python -m diloco.cli train`` spends about 5 s of CPU before its first step: importing torch,
hivemind and the engine (3.3 s) and torch's compiler stack, which building an optimizer imports (1.5 s).
A tiny island trains for well under a second, so where one machine starts many islands in a row (the test
suite, above all: restarts after scripted kills, dozens of short runs) the imports are most of the work.

:func:`start` forks the island from multiprocessing's fork server, which imported all of that once, and
runs the same program a cold start runs (``diloco.cli`` as ``__main__``, or another module or script), in a
session of its own, with the given
environment and its output in the given log: to the island it is the same process.  :func:`start_group`
stands in for ``torchrun --standalone --nproc-per-node N``: a forked agent in a session of its own forks the N
ranks (each in a session of its own, with torchrun's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``... set), ends
them all when one fails, and exits 0 only when every rank did.  An island whose command line is wrapped (a
network namespace, a CPU cgroup) cannot be forked: :class:`~diloco.launch.simulate.Cluster` starts those cold.

The driver's main module is imported by each child, as multiprocessing's fork server does: a script that
starts islands warm keeps its work under ``if __name__ == "__main__":``.

``diloco simulate`` forks its islands so: many islands on one machine share the imports instead of holding them
once each (a ``tiny`` island's processes: 294 MB of PSS forked against 525 MB cold, at 8 islands), and the fork
server starts the one torch shared-memory manager they all use (:mod:`diloco.launch.warm_server`).  Islands on
GPUs and islands whose command line is wrapped start cold.  Elsewhere (``diloco train``, the baseline's workers,
:class:`~diloco.launch.simulate.Cluster` used directly) islands start cold, as they will on their servers,
unless ``DILOCO_WARM_ISLANDS=1`` (the test suite sets it); ``DILOCO_WARM_ISLANDS=0`` starts every island cold.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

from pipeline.mesh import free_port

ENV = "DILOCO_WARM_ISLANDS"

# imported once by the fork server; every island forked from it skips them (the last readies the server's memory
# for the islands: diloco/launch/warm_server.py)
PRELOAD = ["torch", "torch._dynamo", "hivemind", "diloco.cli", "diloco.engine.island", "diloco.launch.baseline",
           "diloco.launch.simulate", "diloco.launch.warm_server"]

CLI = "diloco.cli"
"""The program a warm process runs by default: the ``diloco`` command."""

_context: multiprocessing.context.ForkServerContext | None = None


def enabled(default: bool = False) -> bool:
    """Whether islands of this process start warm: ``DILOCO_WARM_ISLANDS=1`` yes, ``0`` no, else ``default``
    (what the launcher does when nobody said: ``simulate`` forks warm, the other launchers start cold)."""
    value = os.environ.get(ENV, "")
    return value == "1" if value in ("0", "1") else default


def _fork_server() -> multiprocessing.context.ForkServerContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


class WarmProcess:
    """A process forked from the fork server, with the part of :class:`subprocess.Popen`'s interface that
    :class:`~diloco.launch.simulate.Cluster` and the baseline's launcher use (its parent is the fork server, so
    it is waited for through multiprocessing)."""

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


def start(argv: list[str], env: dict[str, str], log: Path, append_log: bool = False, *,
          program: str = CLI) -> WarmProcess:
    """Fork ``python -m <program> <argv>`` (``program`` a module, or the path of a script) from the warm fork
    server, with environment ``env``, stdout and stderr to ``log``, in a session of its own (its process group is
    its pid, as with ``start_new_session``)."""
    process = _fork_server().Process(target=_run, args=(program, argv, env, str(log), append_log), name="warm")
    process.start()
    return WarmProcess(process, [program, *argv])


def start_group(argv: list[str], nproc: int, env: dict[str, str], log: Path, append_log: bool = False, *,
                program: str = CLI) -> WarmProcess:
    """Fork ``torchrun --standalone --nproc-per-node nproc -m <program> <argv>`` warm: an agent (the returned
    process, in a session of its own) and its ``nproc`` ranks, all writing to ``log``."""
    process = _fork_server().Process(target=_run_group, args=(program, argv, nproc, env, str(log), append_log),
                                     name="warm-agent")
    process.start()
    return WarmProcess(process, ["torchrun", f"--nproc-per-node={nproc}", program, *argv])


def _become(program: str, argv: list[str], env: dict[str, str], log: str, append_log: bool) -> None:
    """Turn the forked child into what a cold start of ``program <argv>`` would be: a session of its own, its
    output in ``log``, ``env`` for its environment, a fresh interpreter's multiprocessing start method (fork,
    not the fork server's: hivemind starts its DHT and averager as multiprocessing children)."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append_log else os.O_TRUNC), 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    multiprocessing.set_start_method(None, force=True)
    sys.argv = [program, *argv]


def _run_program(program: str) -> None:
    """Run ``program`` as its cold start would, as ``__main__`` with ``sys.argv`` as set: a module (run, as
    ``python -m`` does, rather than imported: the launcher sits below the command line) or a script."""
    if program.endswith(".py"):
        runpy.run_path(program, run_name="__main__")
        return
    with warnings.catch_warnings():  # that the module is in sys.modules already: the fork server preloaded it
        warnings.filterwarnings("ignore", f"'{program}' found in sys.modules", RuntimeWarning)
        runpy.run_module(program, run_name="__main__", alter_sys=True)


def _run(program: str, argv: list[str], env: dict[str, str], log: str, append_log: bool) -> None:
    """The process, in the forked child: run it and exit as its interpreter would."""
    _become(program, argv, env, log, append_log)
    try:
        _run_program(program)
    finally:
        atexit._run_exitfuncs()  # multiprocessing ends its children with os._exit, past the interpreter's exit


def _run_group(program: str, argv: list[str], nproc: int, env: dict[str, str], log: str, append_log: bool) -> None:
    """The agent of a warm torchrun group: fork the ranks, forward SIGTERM and SIGINT to them, end the others
    (and what they started) when one fails, as torchrun does, and exit 0 only when all succeeded."""
    _become(program, argv, env, log, append_log)
    port = free_port()
    ranks: dict[int, int] = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _rank(program, {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                            "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                            "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        ranks[pid] = rank
    print(f"[warm agent] ranks {' '.join(map(str, ranks))}", flush=True)

    def forward(sig: int, _frame) -> None:
        for pid in ranks:
            try:  # a rank leads a session of its own: SIGKILL takes its helpers (DHT, p2pd) with it
                os.killpg(pid, sig) if sig == signal.SIGKILL else os.kill(pid, sig)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    failed = 0
    while ranks:
        pid, status = os.wait()
        ranks.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = code
            print(f"[warm agent] rank exited with code {code}; ending the others", flush=True)
            try:
                os.killpg(pid, signal.SIGKILL)  # what the failed rank started
            except ProcessLookupError:
                pass
            forward(signal.SIGTERM, None)
            deadline = time.monotonic() + 10
            while ranks and time.monotonic() < deadline:
                done, status = os.waitpid(-1, os.WNOHANG)
                if done:
                    ranks.pop(done, None)
                else:
                    time.sleep(0.1)
            forward(signal.SIGKILL, None)
    sys.stdout.flush()
    os._exit(1 if failed else 0)


def _rank(program: str, env: dict[str, str]) -> None:
    """One rank of a warm group, in the agent's forked child; never returns."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.update(env)
        _run_program(program)  # a torchrun worker of diloco leaves through pipeline.mesh.exit_worker
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
