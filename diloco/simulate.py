"""Run N islands on this machine as separate processes on loopback, show progress, print a summary.

Island 0 starts first and bootstraps the DHT; the others join it by the multiaddr it writes to a file.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import tomli_w
import torch

from diloco.config import Config, to_dict
from diloco.metrics import read_metrics
from peers.membership import new_run_key


class SimulationError(RuntimeError):
    """An island of the simulation failed; the message points at its log."""


def island_configs(cfg: Config, n: int) -> list[dict[str, Any]]:
    """Per-island config dicts: disjoint data shards, own run directory, loopback networking."""
    base = Path(cfg.logging.run_dir)
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // n)
    run_key = cfg.averaging.run_key or ("" if cfg.averaging.public else new_run_key())
    out = []
    for i in range(n):
        d = to_dict(cfg)
        d["data"]["shard_index"], d["data"]["num_shards"] = i, n
        d["logging"]["run_dir"] = str(base / f"island{i}")
        d["checkpoint"]["dir"] = str(base / f"island{i}" / "checkpoints") if not cfg.checkpoint.dir else \
            str(Path(cfg.checkpoint.dir) / f"island{i}")
        d["threads"] = threads
        a = d["averaging"]
        a["host_maddrs"] = ["/ip4/127.0.0.1/tcp/0"]
        if not a["target_group_size"]:
            a["target_group_size"] = n
        a["maddr_file"] = str(base / f"island{i}" / "maddrs.txt")
        a["run_key"] = run_key
        if not a["wait_for_islands"]:
            a["wait_for_islands"] = n
        out.append(d)
    return out


def _spawn(d: dict[str, Any], extra: list[str]) -> tuple[subprocess.Popen, Path]:
    run_dir = Path(d["logging"]["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir / "config.toml"
    cfg_path.write_text(tomli_w.dumps(d))
    log_path = run_dir / "train.log"
    env = dict(os.environ, OMP_NUM_THREADS=str(d["threads"]), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "diloco.cli", "train", "--config", str(cfg_path), *extra],
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    return proc, log_path


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _wait_for_file(path: Path, proc: subprocess.Popen, log_path: Path, timeout: float) -> list[str]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists():
            return [line for line in path.read_text().split() if line]
        if proc.poll() is not None:
            raise SimulationError(f"island 0 exited with code {proc.returncode} before it was reachable; "
                                  f"its log {log_path} ends with:\n{_tail(log_path)}")
        time.sleep(0.2)
    raise SimulationError(f"island 0 did not become reachable within {timeout:.0f} s; see {log_path}")


def _stop_all(procs: list[subprocess.Popen], grace: float = 20.0) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.time() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:  # anything left (including p2pd daemons in the island's session) goes hard
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def _progress_line(run_dirs: list[Path], outer_steps: int, t0: float) -> str:
    parts = []
    for i, d in enumerate(run_dirs):
        recs = [r for r in read_metrics(d) if "round_ok" in r]
        if recs:
            r = recs[-1]
            ev = f" eval {r['eval/loss']:.3f}" if "eval/loss" in r else ""
            parts.append(f"island{i} {r['outer_step']}/{outer_steps} loss {r['loss']:.3f}{ev}")
        else:
            parts.append(f"island{i} warming up")
    return f"[{time.time() - t0:6.0f}s] " + " | ".join(parts)


def simulate(cfg: Config, islands: int, extra_args: list[str] | None = None,
             startup_timeout: float = 90.0) -> dict[str, Any]:
    """Run ``islands`` islands to completion; return the per-island summaries and θ_global spread."""
    if islands < 1:
        raise SimulationError(f"--islands must be at least 1, got {islands}")
    configs = island_configs(cfg, islands)
    run_dirs = [Path(d["logging"]["run_dir"]) for d in configs]
    for d in run_dirs:
        for stale in ("maddrs.txt", "summary.json", "metrics.jsonl"):
            (d / stale).unlink(missing_ok=True)
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    t0 = time.time()
    previous_handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def _interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        p0, l0 = _spawn(configs[0], extra_args or [])
        procs.append(p0)
        logs.append(l0)
        if islands > 1:
            maddrs = _wait_for_file(Path(configs[0]["averaging"]["maddr_file"]), p0, l0, startup_timeout)
            for d in configs[1:]:
                d["averaging"]["initial_peers"] = maddrs
                p, lp = _spawn(d, extra_args or [])
                procs.append(p)
                logs.append(lp)
        print(f"started {islands} island(s); logs in {', '.join(map(str, logs))}", flush=True)
        last = ""
        while any(p.poll() is None for p in procs):
            line = _progress_line(run_dirs, cfg.diloco.outer_steps, t0)
            if line.split("] ", 1)[1] != last:
                print(line, flush=True)
                last = line.split("] ", 1)[1]
            for i, p in enumerate(procs):
                if p.poll() not in (None, 0):
                    raise SimulationError(f"island {i} exited with code {p.returncode}; its log {logs[i]} "
                                          f"ends with:\n{_tail(logs[i])}")
            time.sleep(1.0)
        for i, p in enumerate(procs):
            if p.returncode != 0:
                raise SimulationError(f"island {i} exited with code {p.returncode}; its log {logs[i]} ends "
                                      f"with:\n{_tail(logs[i])}")
    except KeyboardInterrupt:
        print("interrupted: stopping every island (each writes a checkpoint)", flush=True)
        _stop_all(procs)
        raise
    except BaseException:
        _stop_all(procs)
        raise
    finally:
        for s, h in previous_handlers.items():
            signal.signal(s, h)
    _stop_all(procs)  # reaps anything the islands left in their sessions
    summaries = [__import__("json").loads((d / "summary.json").read_text()) for d in run_dirs]
    spread = theta_spread([d / "theta_global.pt" for d in run_dirs])
    return {"islands": summaries, "theta_global_max_abs_diff": spread, "wall_seconds": time.time() - t0}


def theta_spread(paths: list[Path]) -> float:
    """Largest absolute difference of any θ_global entry between any island and island 0."""
    states = [torch.load(p, weights_only=True) for p in paths]
    worst = 0.0
    for other in states[1:]:
        for name, t in states[0].items():
            worst = max(worst, (t - other[name]).abs().max().item())
    return worst


def format_summary(result: dict[str, Any]) -> str:
    """A readable table of every island's figures."""
    head = ["island", "eval loss start", "eval loss end", "rounds ok", "rounds failed", "sent", "received",
            "compute s", "comm s", "utilization"]
    rows = []
    for s in result["islands"]:
        util = s["compute_seconds"] / max(s["wall_seconds"], 1e-9)
        rows.append([s["island"], f"{s['eval_loss_start']:.3f}", f"{s['eval_loss_end']:.3f}", str(s["rounds_ok"]),
                     str(s["rounds_failed"]), _mb(s["bytes_sent"]), _mb(s["bytes_received"]),
                     f"{s['compute_seconds']:.1f}", f"{s['comm_seconds']:.1f}", f"{100 * util:.0f}%"])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    ppl = [math.exp(s["eval_loss_end"]) for s in result["islands"]]
    lines.append("")
    lines.append(f"held-out perplexity at the end: {', '.join(f'{p:.2f}' for p in ppl)}")
    lines.append(f"θ_global max |difference| between islands: {result['theta_global_max_abs_diff']:.3g}")
    lines.append(f"wall-clock: {result['wall_seconds']:.0f} s")
    return "\n".join(lines)


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"
