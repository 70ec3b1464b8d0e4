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
        try:  # an island stopped early still leaves the rounds it recorded
            cluster.start_all(startup_timeout=max(90.0, cfg.averaging.startup_timeout * 3))
            cluster.wait(timeout=timeout, allow_failures=True)
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


# ---- the calibration figures --------------------------------------------------------------------------------

def model_messages(s: Settings, n: int) -> float:
    """Messages the simulation charges ``cpu_per_message_s`` for, per island and round, at ``n`` islands: counted
    by running it with a per-message cost of 1 s and nothing else on the CPU (registry reads, joins taken in,
    the roster's fan-out, the exchange's parts, the vote)."""
    from experiments.scale_sim import Sim

    probe = dataclasses.replace(s, islands=[n], schemes=["roster"], step_s="0", step_jitter=0.0, cores=0.0,
                                background_cpu=0.0, cpu_per_byte_s=0.0, round_overhead_s=0.0,
                                cpu_per_message_s=1.0, churn=0.0)
    sim = Sim(probe, n, "roster")
    sim.run()
    return sum(sim.cpu.work.values()) / (n * probe.rounds)


@dataclass
class Figure:
    """One calibration figure: its value and where it comes from, in words."""

    key: str
    value: Any
    source: str


def read_islands(results_dir: Path) -> tuple[list[dict[str, Any]], Path]:
    """The islands experiment's counts (``results.json``) and the ``config.toml`` of its first count's island 0."""
    try:
        results = json.loads((results_dir / "results.json").read_text())["results"]
    except (OSError, ValueError, KeyError) as e:
        raise CalibrationError(f"--islands-results {results_dir}: no readable results.json of `diloco experiment "
                               f"islands` there ({e})") from None
    if not results:
        raise CalibrationError(f"--islands-results {results_dir}: its results.json holds no count yet")
    for r in results:
        if not count_config(results_dir, r["islands"]).is_file():
            raise CalibrationError(f"--islands-results {results_dir}: {count_config(results_dir, r['islands'])} is "
                                   f"missing (each count's config is read for its settings)")
    return results, count_config(results_dir, results[0]["islands"])


class CalibrationError(ValueError):
    """Something the calibration cannot use, in one sentence."""


def run_settings(config_file: Path) -> list[Figure]:
    """The figures a run's ``config.toml`` sets: H, rounds, the leader's grace, the group size, the record ttl."""
    from diloco.config import loader as config_load

    cfg = config_load.load(str(config_file))
    where = f"{config_file.parent.parent.name}/island0/config.toml"
    return [Figure("inner_steps", cfg.diloco.inner_steps, f"--diloco.inner_steps, {where}"),
            Figure("rounds", cfg.diloco.outer_steps, f"--diloco.outer_steps, {where}"),
            Figure("matchmaking_time", cfg.averaging.matchmaking_time, f"--averaging.matchmaking_time, {where}"),
            Figure("group_size", cfg.averaging.max_group_size,
                   f"--averaging.max_group_size (above it, two levels), {where}"),
            Figure("record_ttl", cfg.averaging.member_ttl, f"--averaging.member_ttl, {where}")]


def count_config(results_dir: Path, n: int) -> Path:
    """The ``config.toml`` of island 0 of the count of ``n`` islands (each count has timeouts of its own)."""
    return results_dir / "runs" / f"islands-{n}" / "island0" / "config.toml"


def calibrate(config_file: Path, counts: list[dict[str, Any]], alone: list[RoundCpu], pair: list[RoundCpu],
              cores: int) -> list[Figure]:
    """Every figure of the simulation that a round of the islands experiment depends on, from its settings, the
    payload its runs sent, and the two measurements (``alone``: one island, local averaging; ``pair``: two islands
    over hivemind).  Nothing here reads a round time."""
    from diloco.config import loader as config_load

    h = config_load.load(str(config_file)).diloco.inner_steps
    figures = run_settings(config_file) + [
        Figure("cores", float(cores), "os.cpu_count() of this machine: every island shares them")]
    per_island = [r["payload_bytes_per_island_round"] / (2 * (1 - 1 / r["islands"])) for r in counts
                  if r.get("payload_bytes_per_island_round")]
    figures.append(Figure("payload_mb", statistics.median(per_island) / 1e6,
                          "the runs' payload bytes sent per island per round ÷ 2(1 − 1/n) (an all-reduce sends "
                          f"that many payloads), median over the counts ({', '.join(f'{p / 1e3:.1f} kB' for p in per_island)})"))
    compute = [r.compute_main for r in alone]
    figures.append(Figure("step_s", f"{statistics.median(compute) / h:.5g}",
                          f"one island alone (--averaging.backend local, same settings), CPU seconds of its process "
                          f"from one round's end to its last inner step, ÷ H, median of {len(compute)} rounds "
                          f"({min(compute):.3f}–{max(compute):.3f} s a round)"))
    figures.append(Figure("step_jitter", robust_sigma([math.log(c) for c in compute]),
                          "the same rounds: σ of log(CPU seconds a round), from the median absolute deviation"))
    overhead = statistics.median(r.round_main for r in alone)
    figures.append(Figure("round_overhead_s", overhead,
                          "one island alone: CPU seconds from its last inner step to the round's record (the outer "
                          "step, the round's bookkeeping; an evaluation every few rounds), median"))
    compute_wall = sum(r.compute_wall for r in pair)
    background = sum(r.compute_daemons for r in pair) / compute_wall
    figures.append(Figure("background_cpu", background,
                          f"two islands over hivemind: CPU seconds of each island's other processes (DHT, p2pd) while "
                          f"it computes (no round in flight) ÷ those wall seconds ({compute_wall:.0f} s in all)"))
    protocol = [r.round_main + r.round_daemons - background * r.round_wall - overhead for r in pair]
    base = Settings(**{f.key: f.value for f in figures})
    messages = model_messages(base, 2)
    figures.append(Figure("cpu_per_message_s", max(statistics.median(protocol), 0.0) / messages,
                          f"two islands over hivemind: CPU seconds of each island's tree from its last inner step to "
                          f"the round's record, less the background and round_overhead_s (median "
                          f"{statistics.median(protocol):.3f} s), ÷ the {messages:g} messages per island and round "
                          f"the model charges at 2 islands"))
    figures.append(Figure("cpu_per_byte_s", Settings().cpu_per_byte_s,
                          "the simulation's default, measured with 40M fp32 over loopback (docs/averaging.md); at "
                          "this payload it is below a millisecond a round"))
    figures += [Figure("rtt_ms", "0.05", "loopback (assumed: the rounds here are bound by CPU, not the link)"),
                Figure("rate", "20gbit", "loopback (assumed, as above)"),
                Figure("churn", 0.0, "no island died in the runs"),
                Figure("seed", 0, "the simulation's seed")]
    return figures


# ---- prediction against measurement -------------------------------------------------------------------------

HEADERS = ["islands", "matchmaking_time s", "round s measured (median)", "round s predicted (median)", "predicted ÷ measured",
           "round s measured (p90)", "round s predicted (p90)", "outside compute s measured (median)",
           "outside compute s predicted (median)", "predicted ÷ measured", "group s measured (median)",
           "CPU s / island-round: machine (measured)", "CPU s / island-round: model"]


def compare(figures: list[Figure], counts: list[dict[str, Any]], results_dir: Path) -> list[dict[str, Any]]:
    """The roster rounds simulated at each measured count with ``figures``, side by side with the measurement.

    Round times on both sides: seconds between the ends of consecutive rounds as the last island sees them (the
    simulation's span from its start to the first round's end is left out, as the measurement has none).  CPU
    per island-round: the machine's busy CPU seconds while the count ran (every process on it, the islands'
    start included) ÷ island-rounds, against the CPU the model asks for (its jobs and its background).  Each
    count's own settings (its ``config.toml``: the leader's grace grows with the islands) replace ``figures``'."""
    from experiments.scale_sim import Sim

    rows = []
    for r in counts:
        n = r["islands"]
        given = {f.key: f.value for f in figures + run_settings(count_config(results_dir, n))}
        s = Settings(**{**given, "islands": [n], "schemes": ["roster"]})
        sim = Sim(s, n, "roster")
        got = sim.run()
        spans = got.round_seconds[1:]
        model_cpu = (sum(sim.cpu.work.values()) + s.background_cpu * n * sim.loop.now) / max(got.island_rounds, 1)
        busy = r.get("cpu_busy", float("nan")) * s.cores * r.get("wall_seconds", float("nan"))
        measured, stall = r["round_seconds"], r["stall_seconds"]
        rows.append({
            "islands": n,
            "round_measured": measured["median"], "round_measured_p90": measured["p90"],
            "round_predicted": quantile(spans, 0.5), "round_predicted_p90": quantile(spans, 0.9),
            "idle_measured": stall["median"], "idle_predicted": got.median_idle,
            "group_measured": r["group_seconds"]["median"], "exchange_predicted": got.median_exchange,
            "committed_measured": r["rounds_committed"], "committed_predicted": got.committed,
            "cpu_measured": busy / max(r.get("island_rounds", 0), 1), "cpu_predicted": model_cpu,
            "cpu_busy": r.get("cpu_busy"), "wall_seconds": r.get("wall_seconds"),
            "matchmaking_time": s.matchmaking_time,
        })
    return rows


def table_row(c: dict[str, Any]) -> list[Any]:
    return [c["islands"], f"{c['matchmaking_time']:g}", f"{c['round_measured']:.2f}", f"{c['round_predicted']:.2f}",
            f"{c['round_predicted'] / c['round_measured']:.2f}", f"{c['round_measured_p90']:.2f}",
            f"{c['round_predicted_p90']:.2f}", f"{c['idle_measured']:.2f}", f"{c['idle_predicted']:.2f}",
            f"{c['idle_predicted'] / c['idle_measured']:.2f}", f"{c['group_measured']:.2f}",
            f"{c['cpu_measured']:.2f}", f"{c['cpu_predicted']:.2f}"]


def figures_table(figures: list[Figure]) -> str:
    return markdown_table(["figure", "value", "where it comes from"],
                          [[f"`{f.key}`", f"{f.value:.4g}" if isinstance(f.value, float) else f.value, f.source]
                           for f in figures])


def markdown(rows: list[dict[str, Any]], figures: list[Figure], command: str, sources: list[str]) -> str:
    lines = [f"# The scale simulation against islands on this machine: {', '.join(str(c['islands']) for c in rows)}",
             "", f"`{command}`", "", markdown_table(HEADERS, [table_row(c) for c in rows]), "",
             "- round s: seconds between the ends of consecutive rounds, as the last island sees them; outside "
             "compute: per island and round, seconds not spent on its own inner steps (measured: the islands' "
             "stall_seconds); group: seconds forming the round's group (measured only)",
             "- matchmaking_time: the count's own (its config.toml); the table of figures below shows the first "
             "count's run settings",
             "- CPU s / island-round: the machine's busy CPU seconds while the count ran (cores busy × cores × "
             "wall, every program on the machine and the islands' start included) ÷ island-rounds; the model: the "
             "CPU its islands ask for (steps, messages, bytes, round overhead, background)",
             "", "## The calibration", "", figures_table(figures), "", "Measured for it:", ""]
    lines += [f"- {x}" for x in sources]
    return "\n".join(lines) + "\n"


# ---- the command line ---------------------------------------------------------------------------------------

MEASUREMENTS = {"alone": (1, "local"), "pair": (2, "hivemind")}
"""The two runs of the calibration: one island alone (its steps and its outer step), two over hivemind (the
protocol's CPU and the daemons' background)."""


def measured_rounds(run_dir: Path, config_file: Path, n: int, backend: str, reuse: bool) -> list[RoundCpu]:
    """The rounds of a measurement run in ``run_dir`` (run here unless ``reuse`` and its CPU traces are there)."""
    from diloco.config import loader as config_load
    from diloco.engine.metrics import read_metrics

    traces_file = run_dir / "cpu.json"
    if reuse and traces_file.is_file():
        traces = _load(traces_file)
    else:
        print(f"measuring: {n} island(s), --averaging.backend {backend}, in {run_dir} …", flush=True)
        traces = measure(config_file, n, backend, run_dir)
        _save(traces, traces_file)
    h = config_load.load(str(config_file)).diloco.inner_steps
    rounds = [r for i, trace in sorted(traces.items())
              for r in round_cpu(read_metrics(run_dir / f"island{i}"), trace, h)]
    if not rounds:
        raise CalibrationError(f"the measurement in {run_dir} recorded no round after its first: see its "
                               f"island<i>/train.log")
    return rounds


def describe(name: str, rounds: list[RoundCpu]) -> str:
    med = lambda key: statistics.median(getattr(r, key) for r in rounds)  # noqa: E731
    return (f"{name}: {len(rounds)} island-rounds; per round, median CPU s: compute {med('compute_main'):.3f} "
            f"(daemons {med('compute_daemons'):.3f}) over {med('compute_wall'):.2f} s wall; from the last step to "
            f"the round's end {med('round_main'):.3f} (daemons {med('round_daemons'):.3f}) over "
            f"{med('round_wall'):.2f} s wall")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m experiments.calibrate_sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--islands-results", type=Path, required=True,
                   help="the --out folder of `diloco experiment islands` (results.json, runs/)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results folder (default {DEFAULT_OUT})")
    p.add_argument("--reuse", action="store_true",
                   help="use the measurement runs already in --out/runs instead of running them again")
    args = p.parse_args(argv)
    try:
        counts, config_file = read_islands(args.islands_results)
        args.out.mkdir(parents=True, exist_ok=True)
        measured = {name: measured_rounds(args.out / "runs" / name, config_file, n, backend, args.reuse)
                    for name, (n, backend) in MEASUREMENTS.items()}
        figures = calibrate(config_file, counts, measured["alone"], measured["pair"], os.cpu_count() or 1)
    except CalibrationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = compare(figures, counts, args.islands_results)
    command = " ".join(["python -m experiments.calibrate_sim", *argv])
    print(markdown_table(HEADERS, [table_row(c) for c in rows]))
    print(figures_table(figures))
    sources = [describe("one island alone (local)", measured["alone"]),
               describe("two islands (hivemind)", measured["pair"])]
    (args.out / "results.md").write_text(markdown(rows, figures, command, sources))
    (args.out / "calibration.json").write_text(json.dumps({f.key: f.value for f in figures}, indent=1) + "\n")
    (args.out / "results.json").write_text(json.dumps(json_safe({
        "command": command, "islands_results": str(args.islands_results), "comparison": rows,
        "figures": [dataclasses.asdict(f) for f in figures],
        "measurements": {k: [dataclasses.asdict(r) for r in v] for k, v in measured.items()}}), indent=1) + "\n")
    print(f"wrote {args.out}/results.md, results.json, calibration.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
