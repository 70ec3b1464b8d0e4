"""Launching the synchronous baseline: ``k`` worker processes of :mod:`diloco.launch.baseline` (each one
``python -m diloco.launch.baseline ...``, so a launcher can wrap them, e.g. in ``ip netns exec``), their
progress, and stopping all of them on failure or interrupt."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from diloco.launch.baseline import DEFAULT_PORT, BaselineError, worker_threads
from diloco.config import Config, to_dict

log = logging.getLogger("diloco.launch.baseline")


def free_port() -> int:
    """A TCP port that is free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def stop_processes(procs: Sequence[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGTERM each process group, wait up to ``grace`` s, then SIGKILL what is left and reap."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.time() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:  # children left in the worker's session (e.g. a W&B service) go too
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def run_baseline(cfg: Config, workers: int, network: Any = None, *,
                 wrap: Callable[[list[str], int], list[str]] | None = None,
                 progress: bool = True, timeout_s: float = 600.0) -> dict[str, Any]:
    """Train the synchronous data-parallel baseline with ``workers`` processes; return rank 0's summary.

    Worker ``r`` runs ``python -m diloco.launch.baseline --config <run_dir>/config.toml --rank r ...`` with its
    log in ``<run_dir>/rank<r>.log``; rank 0 writes ``metrics.jsonl``, ``summary.json`` and the final
    parameters ``params.pt`` into ``cfg.logging.run_dir``.  With ``network`` (an
    :class:`experiments.netns.EmulatedNetwork` with at least ``workers`` hosts) worker ``r`` runs in
    host ``r``'s namespace and the workers talk over its capped links; otherwise they use loopback.
    ``wrap`` (``(cmd, rank) -> cmd``) overrides how a worker's command is wrapped.  Every worker is
    stopped when one fails, on Ctrl-C/SIGTERM and at the end.
    """
    import tomli_w

    if workers < 1:
        raise BaselineError(f"the baseline needs at least one worker, got {workers}")
    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("summary.json", "metrics.jsonl", "params.pt"):
        (run_dir / stale).unlink(missing_ok=True)
    d = to_dict(cfg)
    d["threads"] = worker_threads(cfg, workers)
    cfg_path = run_dir / "config.toml"
    cfg_path.write_text(tomli_w.dumps(d))
    if network is not None:
        if len(network.hosts) < workers:
            raise BaselineError(f"the emulated network has {len(network.hosts)} hosts but the baseline needs {workers}")
        master = f"{network.hosts[0].address}:{DEFAULT_PORT}"
        iface = network.hosts[0].interface
        wrap = wrap or network.wrap
    else:
        master = f"127.0.0.1:{free_port()}"
        iface = "lo"
    env = dict(os.environ, OMP_NUM_THREADS=str(d["threads"]), PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    previous = signal.getsignal(signal.SIGTERM)
    in_main = _in_main_thread()

    def _interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    if in_main:
        signal.signal(signal.SIGTERM, _interrupt)
    t0 = time.time()
    try:
        for r in range(workers):
            cmd = [sys.executable, "-m", "diloco.launch.baseline", "--config", str(cfg_path), "--rank", str(r),
                   "--workers", str(workers), "--master", master, "--iface", iface, "--timeout", str(timeout_s)]
            if wrap is not None:
                cmd = wrap(cmd, r)
            log_path = run_dir / f"rank{r}.log"
            with open(log_path, "w") as out:
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True))
            logs.append(log_path)
        if progress:
            print(f"started {workers} baseline worker(s) (master {master}); logs in {run_dir}/rank*.log", flush=True)
        seen = 0
        while any(p.poll() is None for p in procs):
            for r, p in enumerate(procs):
                if p.poll() not in (None, 0):
                    raise BaselineError(f"baseline worker {r} exited with code {p.returncode}; its log {logs[r]} "
                                        f"ends with:\n{_tail(logs[r])}")
            if progress:
                seen = _print_progress(logs[0], seen, t0)
            time.sleep(0.5)
        for r, p in enumerate(procs):
            if p.returncode != 0:
                raise BaselineError(f"baseline worker {r} exited with code {p.returncode}; its log {logs[r]} "
                                    f"ends with:\n{_tail(logs[r])}")
        if progress:
            _print_progress(logs[0], seen, t0)
    except KeyboardInterrupt:
        print("interrupted: stopping every baseline worker", flush=True)
        stop_processes(procs)
        raise
    except BaseException:
        stop_processes(procs)
        raise
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    stop_processes(procs)
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise BaselineError(f"baseline rank 0 wrote no {summary_path}; see {logs[0]}")
    summary = json.loads(summary_path.read_text())
    summary["launcher_wall_seconds"] = time.time() - t0
    return summary


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _print_progress(log_path: Path, seen: int, t0: float) -> int:
    try:
        lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.startswith("[baseline] step")]
    except OSError:
        return seen
    for ln in lines[seen:]:
        print(f"[{time.time() - t0:6.0f}s] {ln}", flush=True)
    return len(lines)
