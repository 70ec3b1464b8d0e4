"""The scale simulation checked against islands on this machine: calibrated from measurements that are not round
times, then asked for the round times ``diloco experiment islands`` measured::

    python -m experiments.calibrate_sim --islands-results experiments/results/islands \\
        [--out experiments/results/scale-sim-calibrated] [--measure DIR] [--reuse]

It reads the islands experiment's ``results.json`` and its runs' ``config.toml`` and ``metrics.jsonl`` (read only),
runs two short measurements of its own with the same settings (one island alone with ``--averaging.backend local``,
then two islands over hivemind), derives every figure of :class:`experiments.scale_sim.Settings` that the rounds
depend on from those measurements and the runs' settings (none from the round times: the predictions are not
fitted to what they are compared with), simulates the roster rounds at the measured counts with the islands
sharing this machine's cores, and writes a table per count, measured against predicted, to ``--out``
(``results.md``, ``results.json``, ``calibration.json``: the last is a ``--calibrate`` file for
:mod:`experiments.scale_sim`).

CPU figures are CPU seconds (``/proc/PID/stat``), not wall-clock: the machine is shared (the islands experiment
itself may be running), and CPU time is what the simulation's processor sharing divides among the islands; wall-
clock under someone else's load would count their work as ours.  How each figure is measured is in
``experiments/scale_sim.md`` ("Calibrated against the islands experiment").
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import math
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.report import format_bytes, json_safe, markdown_table
from experiments.scale_sim import Settings, quantile, simulate

DEFAULT_OUT = Path("experiments/results/scale-sim-calibrated")


# ---- measuring islands on this machine ---------------------------------------------------------------------

@dataclass
class CpuTrace:
    """CPU seconds of one island's process tree over time: its training process (``main``) and the processes it
    started (``daemons``: hivemind's DHT process and its p2pd), sampled together with the wall-clock."""

    times: list[float] = field(default_factory=list)
    main: list[float] = field(default_factory=list)
    daemons: list[float] = field(default_factory=list)

    def at(self, t: float) -> tuple[float, float]:
        """(main, daemons) CPU seconds at wall-clock ``t``, linear between the samples around it."""
        k = bisect.bisect_left(self.times, t)
        if k <= 0 or k >= len(self.times):
            k = min(max(k, 0), len(self.times) - 1)
            return self.main[k], self.daemons[k]
        t0, t1 = self.times[k - 1], self.times[k]
        w = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
        return (self.main[k - 1] + w * (self.main[k] - self.main[k - 1]),
                self.daemons[k - 1] + w * (self.daemons[k] - self.daemons[k - 1]))


class CpuSampler:
    """Samples every island's tree (:class:`CpuTrace`) in a thread, every ``every`` seconds (a sample of a few
    islands costs about a millisecond)."""

    def __init__(self, roots: Any, every: float = 0.05) -> None:
        self.roots, self.every = roots, every
        self.traces: dict[int, CpuTrace] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        from diloco.launch.memory import tree_pids
        from peers.proctable import process_table

        while not self._stop.wait(self.every):
            table = process_table()
            children: dict[int, list[int]] = {}
            for pid, stat in table.items():
                children.setdefault(stat.parent, []).append(pid)
            now = time.time()
            for island, root in self.roots().items():
                if root not in table:
                    continue
                trace = self.traces.setdefault(island, CpuTrace())
                trace.times.append(now)
                trace.main.append(table[root].cpu_seconds)
                trace.daemons.append(sum(table[p].cpu_seconds for p in tree_pids(root, children)
                                         if p != root and p in table))


def measure(config_file: Path, n: int, backend: str, run_dir: Path, timeout: float = 600.0) -> dict[int, CpuTrace]:
    """Run ``n`` islands with the islands experiment's settings (its ``config.toml``) and ``backend``, forked warm
    as that experiment forks them, sampling each one's CPU; their metrics go to ``run_dir/island<i>``."""
    from diloco.config import loader as config_load
    from diloco.launch.simulate import Cluster

    overrides = {"logging.run_dir": str(run_dir), "checkpoint.dir": "", "averaging.backend": backend,
                 "averaging.run_id": f"calibrate-{backend}-{n}", "averaging.run_key_file": "",
                 "averaging.wait_for_islands": 0, "averaging.target_group_size": 0,
                 "averaging.min_group_size": min(2, n)}
    cfg = config_load.load(str(config_file), overrides)
    cluster = Cluster(cfg, n, fork_warm=True)
    with CpuSampler(lambda: {i: p.pid for i, p in cluster.procs.items()}) as sampler:
        try:
            cluster.start_all(startup_timeout=max(90.0, cfg.averaging.startup_timeout * 3))
            cluster.wait(timeout=timeout)
        finally:
            cluster.stop_all()
    return sampler.traces


def _save(traces: dict[int, CpuTrace], path: Path) -> None:
    path.write_text(json.dumps({str(i): dataclasses.asdict(t) for i, t in traces.items()}))


def _load(path: Path) -> dict[int, CpuTrace]:
    return {int(i): CpuTrace(**t) for i, t in json.loads(path.read_text()).items()}


@dataclass
class RoundCpu:
    """One island's round, split at its last inner step: CPU seconds and wall seconds of each part."""

    round: int
    compute_main: float
    """CPU of the training process from the previous round's end to its last inner step of this one."""
    compute_daemons: float
    compute_wall: float
    round_main: float
    """CPU of the training process from its last inner step to the round's end (the protocol, the outer step)."""
    round_daemons: float
    round_wall: float


def round_cpu(records: list[dict[str, Any]], trace: CpuTrace, inner_steps: int) -> list[RoundCpu]:
    """Every round of an island after its first (the first pays for connections and warm-up) with the island's
    metrics lines as the marks: the round's record (``round_ok``, its time is the round's end) and the log line of
    its last inner step (``inner_step`` = k × H, which needs ``logging.log_every`` to divide H)."""
    ends = {int(r["outer_step"]): float(r["time"]) for r in records if "round_ok" in r}
    last_step = {int(r["inner_step"]) // inner_steps: float(r["time"]) for r in records
                 if "inner_step" in r and int(r["inner_step"]) % inner_steps == 0}
    out = []
    for k in sorted(ends):
        if k - 1 not in ends or k not in last_step or not ends[k - 1] < last_step[k] < ends[k]:
            continue
        (m0, d0), (m1, d1), (m2, d2) = (trace.at(t) for t in (ends[k - 1], last_step[k], ends[k]))
        out.append(RoundCpu(k, m1 - m0, d1 - d0, last_step[k] - ends[k - 1], m2 - m1, d2 - d1, ends[k] - last_step[k]))
    return out


def robust_sigma(values: list[float]) -> float:
    """The standard deviation of normal values estimated from their median absolute deviation (1.4826 × MAD):
    an evaluation round's extra work does not count as spread."""
    if len(values) < 2:
        return 0.0
    m = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - m) for v in values)
