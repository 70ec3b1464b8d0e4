"""Run N islands on this machine as separate processes, show progress, print a summary.

Island 0 starts first and bootstraps the DHT; the others join it by the multiaddr it writes to a
file.  An island of ``--parallel.tp T --parallel.pp P`` with ``T * P > 1`` is started as its own
``torchrun --standalone --nproc-per-node T*P`` job (gloo on CPU, its own rendezvous port, one
thread per rank unless ``--threads`` says otherwise).  :class:`Cluster` is the reusable part: it
starts, kills and restarts island processes (tests inject faults with it, the soak script churns
islands with it, experiments wrap each island in a network namespace with ``wrap``).
"""

from __future__ import annotations

import errno
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import tomli_w
import torch

from diloco.config import Config, to_dict
from diloco.engine.metrics import read_metrics
from diloco.launch import tail, warm
from peers import IDENTITY, RUN_KEY, descendants, obtain_run_key, peer_id_of, process_table, socket_files

Wrap = Callable[[list[str], int], list[str]]
"""Turns an island's command line into the one to run (e.g. inside island i's network namespace)."""


class SimulationError(RuntimeError):
    """An island of the simulation failed; the message points at its log."""


def island_configs(cfg: Config, n: int, host_addresses: list[str] | None = None) -> list[dict[str, Any]]:
    """Per-island config dicts: disjoint data shards, own run directory, a shared run key file.

    ``host_addresses`` gives each island the IP it listens on (default 127.0.0.1).  The run key is found (or
    generated) here, as the first island of a run would find it, and every island reads it from one file
    (``<run dir>/run.key``, or ``--averaging.run_key_file``): the configs hold its path, never the key.
    """
    base = Path(cfg.logging.run_dir)
    ranks = n * cfg.parallel.processes
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // ranks)
    net = cfg.averaging
    key_file = "" if net.public or net.backend == "local" else str(obtain_run_key(
        net.run_key, net.run_key_file, base / RUN_KEY, net.run_id, read_default=bool(cfg.checkpoint.resume),
        first=not net.initial_peers).file)
    out = []
    for i in range(n):
        d = to_dict(cfg)
        d["data"]["shard_index"], d["data"]["num_shards"] = i, n
        d["logging"]["run_dir"] = str(base / f"island{i}")
        d["checkpoint"]["dir"] = str(Path(cfg.checkpoint.dir or base / f"island{i}" / "checkpoints") /
                                     (f"island{i}" if cfg.checkpoint.dir else ""))
        d["threads"] = threads
        a = d["averaging"]
        host = host_addresses[i] if host_addresses else "127.0.0.1"
        a["host_maddrs"] = [f"/ip4/{host}/tcp/0"]
        a["target_group_size"] = a["target_group_size"] or n
        a["wait_for_islands"] = a["wait_for_islands"] or n
        a["maddr_file"] = str(base / f"island{i}" / "maddrs.txt")
        a["run_key_file"] = key_file
        out.append(d)
    return out


def free_port_pair(host: str, tries: int = 20) -> int | None:
    """A TCP port of ``host`` free now together with the next one (an island's DHT port and its transport's,
    ``peers.settings.transport_port``); None when ``host`` is not an address of this machine or none was found.

    Picked below the kernel's ephemeral range when there is room: the island binds them seconds later, and a port
    in that range can be taken meanwhile by any outgoing connection on the machine (a CI run once lost its
    transport's port so)."""
    low = _ephemeral_low()
    for attempt in range(tries):
        try:
            with socket.socket() as first, socket.socket() as second:
                first.bind((host, random.randrange(10_000, low - 2) if low > 12_000 and attempt < tries - 1 else 0))
                port = first.getsockname()[1]
                if port == 65535:
                    continue
                second.bind((host, port + 1))
                return port
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return None
    return None


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections (Linux), else 0."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out: ``CUDA_VISIBLE_DEVICES`` when set, else every device torch sees."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def gpu_assignment(sizes: list[int], gpus: list[str], device: str, share: bool = False) -> list[str | None]:
    """Each island's ``CUDA_VISIBLE_DEVICES``: ``sizes[i]`` GPUs of its own, consecutive in ``gpus``, or None for
    every island when they run on the CPU (``--device cpu``, or ``auto`` on a machine without GPUs).  With
    ``share`` (``--share-gpus``) islands that need more GPUs than there are take them in turn, several processes
    to a GPU (islands average over loopback exactly as across servers).  Raises SimulationError when the islands
    need more GPUs than there are and may not share them."""
    if device == "cpu" or (device == "auto" and not gpus):
        return [None] * len(sizes)
    if device.startswith("cuda:"):
        raise SimulationError(f"simulate gives each island GPUs of its own, so --device {device} cannot hold for "
                              f"all of them: pass --device cuda (or auto)")
    need = sum(sizes)
    if need > len(gpus) and not share:
        shape = f"{len(sizes)} islands of {sizes[0]} processes" if len(set(sizes)) == 1 else f"islands of {sizes} processes"
        raise SimulationError(f"{shape} need {need} GPUs, one per process, but this machine has {len(gpus)}: run "
                              f"fewer islands or smaller ones (--parallel.tp, --parallel.pp), pass --share-gpus to "
                              f"put several processes on a GPU, or pass --device cpu")
    if not gpus:
        raise SimulationError("--device cuda asks for GPUs, but this machine shows none: pass --device cpu")
    if max(sizes) > len(gpus):  # a rank takes the GPU of its local rank: an island's ranks never share one
        raise SimulationError(f"an island of {max(sizes)} processes needs {max(sizes)} GPUs of its own, one per rank, "
                              f"but this machine has {len(gpus)}: make the islands smaller, pass --parallel.gpus "
                              f"{len(gpus)} to put several of an island's ranks on a GPU, or pass --device cpu")
    out, start = [], 0
    for n in sizes:
        out.append(",".join(gpus[(start + j) % len(gpus)] for j in range(n)))
        start += n
    return out


class Cluster:
    """Island processes of one run on this machine."""

    def __init__(self, cfg: Config, n: int, *, wrap: Wrap | None = None, host_addresses: list[str] | None = None,
                 env: dict[int, dict[str, str]] | None = None, share_gpus: bool = False, fork_warm: bool = False):
        """``fork_warm``: fork the islands that run on the CPU from the warm interpreter
        (:mod:`diloco.launch.warm`) unless ``DILOCO_WARM_ISLANDS=0``; without it they start cold unless
        ``DILOCO_WARM_ISLANDS=1``.  Wrapped islands always start cold."""
        if n < 1:
            raise SimulationError(f"--islands must be at least 1, got {n}")
        self.cfg, self.n = cfg, n
        self.configs = island_configs(cfg, n, host_addresses)
        self.run_dirs = [Path(d["logging"]["run_dir"]) for d in self.configs]
        self.logs = [d / "train.log" for d in self.run_dirs]
        self.wrap = wrap
        self.env = env or {}
        self.fork_warm = fork_warm
        self.procs: dict[int, subprocess.Popen | warm.WarmProcess] = {}
        self.restarts = 0
        self.gpus = gpu_assignment([self.island_gpus(i) for i in range(n)],
                                   visible_gpus() if cfg.device != "cpu" else [], cfg.device, share_gpus)
        for d in self.run_dirs:
            for stale in ("maddrs.txt", "summary.json", "metrics.jsonl", "theta_global.pt"):
                (d / stale).unlink(missing_ok=True)

    def start(self, i: int, extra_args: list[str] = (), env: dict[str, str] | None = None,
              append_log: bool = False) -> subprocess.Popen | warm.WarmProcess:
        """Start island ``i`` (its config is written next to its log); forked warm where :meth:`forks_warm`."""
        d = self.configs[i]
        self.run_dirs[i].mkdir(parents=True, exist_ok=True)
        cfg_path = self.run_dirs[i] / "config.toml"
        cfg_path.write_text(tomli_w.dumps(d))
        cmd = [sys.executable, "-m", "diloco.cli", "train", "--config", str(cfg_path), *extra_args]
        size = self.island_size(i)
        parallel_env = {}
        if size > 1:  # one torchrun job per island; --standalone picks a free rendezvous port for each
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                   "--nproc-per-node", str(size), *cmd[1:]]
            parallel_env = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        if self.gpus[i] is not None:  # each island on GPUs of its own; its ranks take them by LOCAL_RANK
            parallel_env["CUDA_VISIBLE_DEVICES"] = self.gpus[i]
        if self.wrap is not None:
            cmd = self.wrap(cmd, i)
        full_env = {**os.environ, "OMP_NUM_THREADS": str(d["threads"]), "PYTHONUNBUFFERED": "1", **parallel_env,
                    **self.env.get(i, {}), **(env or {})}
        if self.forks_warm(i):
            argv = ["train", "--config", str(cfg_path), *extra_args]
            self.procs[i] = (warm.start(argv, full_env, self.logs[i], append_log) if size == 1 else
                             warm.start_group(argv, size, full_env, self.logs[i], append_log))
            return self.procs[i]
        log = open(self.logs[i], "a" if append_log else "w")
        self.procs[i] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                         start_new_session=True)
        log.close()
        return self.procs[i]

    def forks_warm(self, i: int) -> bool:
        """Whether island ``i`` is forked from the warm interpreter: never when its command line is wrapped, else as
        ``DILOCO_WARM_ISLANDS`` says, else when the cluster was asked to and the island runs on the CPU (a GPU
        island's imports are a small part of its start, and CUDA is safest in a process that never forked)."""
        return self.wrap is None and warm.enabled(default=self.fork_warm and self.gpus[i] is None)

    def island_size(self, i: int) -> int:
        """Processes of island ``i`` (``dp * pp * tp`` of its config)."""
        par = self.configs[i].get("parallel", {})
        return int(par.get("dp", 1)) * int(par.get("tp", 1)) * int(par.get("pp", 1))

    def island_gpus(self, i: int) -> int:
        """GPUs island ``i`` takes: one per rank, or its ``--parallel.gpus`` when its ranks share fewer."""
        return int(self.configs[i].get("parallel", {}).get("gpus", 0)) or self.island_size(i)

    def maddrs(self, i: int) -> list[str]:
        """Island ``i``'s multiaddrs, once it wrote them (empty before)."""
        path = Path(self.configs[i]["averaging"]["maddr_file"])
        return path.read_text().split() if path.exists() else []

    def wait_reachable(self, i: int, timeout: float) -> list[str]:
        """Wait until island ``i`` published its multiaddrs; raise if it died or took too long."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            found = self.maddrs(i)
            if found:
                return found
            if self.procs[i].poll() is not None:
                raise SimulationError(f"island {i} exited with code {self.procs[i].returncode} before it was "
                                      f"reachable; its log {self.logs[i]} ends with:\n{tail(self.logs[i])}")
            time.sleep(0.2)
        raise SimulationError(f"island {i} did not become reachable within {timeout:.0f} s; see {self.logs[i]}")

    def start_all(self, startup_timeout: float = 90.0) -> None:
        """Start every island at once, the others joining island 0 at the address it will have (its identity
        and port are chosen here; they wait for its port); where no port can be chosen here (island 0 listens
        in another network namespace), start island 0 first and the others once it is reachable."""
        address = self._first_address()
        self.start(0)
        if self.n > 1:
            peers = [address] if address else self.wait_reachable(0, startup_timeout)
            for i in range(1, self.n):
                self.configs[i]["averaging"]["initial_peers"] = peers
                self.start(i)

    def _first_address(self) -> str | None:
        """Island 0's full multiaddr, fixed in its config before it starts (None where its IP is not local): a port
        free with the next one, which its transport takes."""
        a = self.configs[0]["averaging"]
        m = re.fullmatch(r"/ip4/([\d.]+)/tcp/0", a["host_maddrs"][0]) if len(a["host_maddrs"]) == 1 else None
        if m is None or self.n == 1:
            return None
        port = free_port_pair(m[1])
        if port is None:
            return None
        peer_id = peer_id_of(a.get("identity_path") or str(self.run_dirs[0] / IDENTITY))
        a["host_maddrs"] = [f"/ip4/{m[1]}/tcp/{port}"]
        return f"/ip4/{m[1]}/tcp/{port}/p2p/{peer_id}"

    def alive(self, i: int) -> bool:
        return i in self.procs and self.procs[i].poll() is None

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to island ``i``: SIGKILL to everything it started (its p2pd daemons included),
        other signals to its main process, which shuts its helpers down itself."""
        if i in self.procs:
            proc = self.procs[i]
            # a torchrun island's ranks run in sessions of their own, with their helpers (p2pd, DHT)
            tree = descendants(proc.pid) if proc.poll() is None else {}
            workers = tree if self.island_size(i) > 1 else {}
            # what the kill leaves on disk: the socket files of hivemind's daemons and their clients (of the
            # island's session too: helpers outlive a main process that a scripted fault killed)
            leftovers = socket_files([proc.pid, *tree, *(pid for pid, st in process_table().items()
                                                           if st.pgid == proc.pid)]) if sig == signal.SIGKILL else set()
            try:
                if sig == signal.SIGKILL:
                    os.killpg(proc.pid, sig)
                elif workers:
                    # straight to the ranks: torchrun would signal their whole groups, helpers included
                    for pid, stat in workers.items():
                        if stat.parent == proc.pid:
                            _signal(pid, sig)
                else:
                    proc.send_signal(sig)
            except ProcessLookupError:
                pass
            if sig == signal.SIGKILL:
                for pgid in {stat.pgid for stat in workers.values()} - {proc.pid}:
                    try:
                        os.killpg(pgid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
                proc.wait()
                for path in leftovers:
                    Path(path).unlink(missing_ok=True)

    def restart(self, i: int, env: dict[str, str] | None = None,
                as_launched: bool = False) -> subprocess.Popen | warm.WarmProcess:
        """Start island ``i`` again with ``--resume``: with exactly the command it was launched with
        (``as_launched``, as a user would), or joining through any live island."""
        self.kill(i)
        for j in range(self.n):
            if as_launched:
                break
            if j != i and self.alive(j) and self.maddrs(j):
                self.configs[i]["averaging"]["initial_peers"] = self.maddrs(j)
                break
        (self.run_dirs[i] / "maddrs.txt").unlink(missing_ok=True)
        if not as_launched:
            self.configs[i]["averaging"]["wait_for_islands"] = 0
        self.restarts += 1
        return self.start(i, ["--resume"], env=env or {}, append_log=True)

    def failed(self) -> list[int]:
        """Islands that exited with a non-zero code."""
        return [i for i, p in self.procs.items() if p.poll() not in (None, 0)]

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def wait(self, timeout: float | None = None, on_tick: Callable[[], None] | None = None,
             allow_failures: bool = False) -> None:
        """Wait for every island to exit; raise on the first failure unless ``allow_failures``."""
        deadline = None if timeout is None else time.time() + timeout
        while self.running():
            if on_tick is not None:
                on_tick()
            if not allow_failures and self.failed():
                i = self.failed()[0]
                raise SimulationError(f"island {i} exited with code {self.procs[i].returncode}; its log "
                                      f"{self.logs[i]} ends with:\n{tail(self.logs[i])}")
            if deadline is not None and time.time() > deadline:
                raise SimulationError(f"islands still running after {timeout:.0f} s; see {self.run_dirs[0].parent}")
            time.sleep(0.5)
        if not allow_failures and self.failed():
            i = self.failed()[0]
            raise SimulationError(f"island {i} exited with code {self.procs[i].returncode}; its log "
                                  f"{self.logs[i]} ends with:\n{tail(self.logs[i])}")

    def stop_all(self, grace: float = 20.0) -> None:
        """SIGTERM every island (each writes a checkpoint), then SIGKILL whatever is left."""
        for i in self.procs:
            if self.alive(i):
                self.kill(i, signal.SIGTERM)
        deadline = time.time() + grace
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        for i in self.procs:  # reaps daemons left in the island's process group as well
            self.kill(i, signal.SIGKILL)

    def summaries(self) -> list[dict[str, Any]]:
        """Each island's summary.json."""
        return [json.loads((d / "summary.json").read_text()) for d in self.run_dirs]

    def theta_spread(self) -> float:
        """Largest |difference| of θ_global between any island and island 0."""
        return theta_spread([d / "theta_global.pt" for d in self.run_dirs])

    def progress_line(self, t0: float) -> str:
        """One line: every island's round, last loss and held-out loss."""
        parts = []
        for i, d in enumerate(self.run_dirs):
            recs = [r for r in read_metrics(d) if "round_ok" in r]
            if recs:
                r = recs[-1]
                ev = f" eval {r['eval/loss']:.3f}" if "eval/loss" in r else ""
                parts.append(f"island{i} {r['outer_step']}/{self.cfg.diloco.outer_steps * self.cfg.diloco.fragments} loss {r['loss']:.3f}{ev}")
            else:
                parts.append(f"island{i} warming up")
        return f"[{time.time() - t0:6.0f}s] " + " | ".join(parts)


def simulate(cfg: Config, islands: int, startup_timeout: float = 90.0, *, wrap: Wrap | None = None,
             host_addresses: list[str] | None = None, env: dict[int, dict[str, str]] | None = None,
             quiet: bool = False, share_gpus: bool = False) -> dict[str, Any]:
    """Run ``islands`` islands to completion; return the per-island summaries and θ_global spread.

    Islands on the CPU are forked from a warm interpreter (:mod:`diloco.launch.warm`): they share its imports
    (measured with ``diloco experiment islands``: a ``tiny`` island's processes held 294 MB of PSS at 8 islands
    forked warm against 525 MB started cold, 349 MB against 528 MB at 16)."""
    if cfg.averaging.backend == "torch":
        size = cfg.parallel.processes
        raise SimulationError(f"simulate starts every island as its own job; --averaging.backend torch needs them "
                              f"in one torchrun world: torchrun --standalone --nproc-per-node {islands * size} -m "
                              f"diloco.cli train --averaging.backend torch ... (or use --averaging.backend hivemind "
                              f"or auto here)")
    cluster = Cluster(cfg, islands, wrap=wrap, host_addresses=host_addresses, env=env, share_gpus=share_gpus,
                      fork_warm=True)
    t0 = time.time()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def _interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    last = [""]

    def show() -> None:
        line = cluster.progress_line(t0)
        if not quiet and line.split("] ", 1)[1] != last[0]:
            print(line, flush=True)
            last[0] = line.split("] ", 1)[1]

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        cluster.start_all(startup_timeout)
        if not quiet:
            print(f"started {islands} island(s); logs in {', '.join(map(str, cluster.logs))}", flush=True)
        cluster.wait(on_tick=show)
        show()
    except KeyboardInterrupt:
        print("interrupted: stopping every island (each writes a checkpoint)", flush=True)
        cluster.stop_all()
        raise
    except BaseException:
        cluster.stop_all()
        raise
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    cluster.stop_all()  # reaps anything the islands left in their process groups
    return {"islands": cluster.summaries(), "theta_global_max_abs_diff": cluster.theta_spread(),
            "wall_seconds": time.time() - t0, "sample": last_sample(cluster.run_dirs[0])}


def last_sample(run_dir: Path) -> dict[str, Any] | None:
    """The newest sample an island wrote to ``samples.jsonl`` (None if it wrote none)."""
    path = Path(run_dir) / "samples.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1]) if lines else None


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def theta_spread(paths: list[Path]) -> float:
    """Largest absolute difference of any θ_global entry between any island and the first."""
    states = [torch.load(p, weights_only=True) for p in paths]
    worst = 0.0
    for other in states[1:]:
        for name, t in states[0].items():
            worst = max(worst, (t - other[name]).abs().max().item())
    return worst


def format_summary(result: dict[str, Any]) -> str:
    """A readable table of every island's figures."""
    head = ["island", "eval loss start", "eval loss end", "rounds ok", "rounds failed", "caught up", "sent", "received",
            "compute s", "comm s", "stalled s", "utilization"]
    rows = []
    for s in result["islands"]:
        util = s["compute_seconds"] / max(s["wall_seconds"], 1e-9)
        rows.append([s["island"], f"{s['eval_loss_start']:.3f}", f"{s['eval_loss_end']:.3f}", str(s["rounds_ok"]),
                     str(s["rounds_failed"]), str(s.get("rounds_caught_up", 0)),
                     _mb(s["bytes_sent"]), _mb(s["bytes_received"]),
                     f"{s['compute_seconds']:.1f}", f"{s['comm_seconds']:.1f}",
                     f"{s.get('stall_seconds', s['comm_seconds']):.1f}", f"{100 * util:.0f}%"])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    ppl = [math.exp(s["eval_loss_end"]) for s in result["islands"]]
    lines.append("")
    lines.append(f"held-out perplexity at the end: {', '.join(f'{p:.2f}' for p in ppl)}")
    lines.append(f"θ_global max |difference| between islands: {result['theta_global_max_abs_diff']:.3g}")
    lines.append(f"wall-clock: {result['wall_seconds']:.0f} s")
    sample = result.get("sample")
    if sample:
        lines.append(f"sample of θ_global after round {sample['outer_step']} (prompt, then → what the model wrote):")
        lines.append(f"  {sample['prompt']!r} → {sample['continuation']!r}")
    return "\n".join(lines)


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"
