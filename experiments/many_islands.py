"""Many islands on one machine: does a run of 8 to 64 islands stay one run, and what does a round cost?

    diloco experiment islands --counts 8,16,32,64 [--out DIR] [--timeout S] [--memory-every S] [--section.key VALUE ...]

For each count, that many islands of the ``tiny`` model (H = 20, 10 rounds unless ``--diloco.*`` says otherwise)
run as ``diloco simulate`` runs them: processes on this machine, forked from a warm interpreter, averaging over
loopback, every island expected from the start (``--averaging.wait_for_islands``).  Per count it reports:

- rounds committed, and by how many islands each (the islands whose record of the round says it committed), and
  how many of them one group of more than half the run committed;
- distinct θ_global at the end (the islands' ``theta_checksum``), with how many islands hold each: 1 when the run
  stayed one run;
- bytes on the wire per island per round (the kernel's count for the islands' TCP connections: every byte of the
  protocol) against the payload (the encoded pseudo-gradients alone);
- round time: seconds between the ends of consecutive rounds (as the last island to finish each sees them),
  median and 90th percentile, and the seconds each island spent in a round outside its own compute;
- time forming each round's group (``group_seconds``), median and 90th percentile;
- the peak memory of the islands: the PSS of all their processes together (the warm fork server's included), per
  island, and the largest island's process tree;
- how busy the machine's cores were while the count ran.

It writes ``results.md``, ``results.json`` and ``islands.png`` to ``--out`` after every count, and prints a line
per count; each count's islands keep their logs and metrics in ``runs/islands-N/island<i>/``.

Every island shares this machine's cores: 64 islands on 2 cores wait for a core far longer than for loopback, so
CPU starvation, not the network, sets the pace of a round here (a real run's islands each have their own server,
and a WAN instead).  The timeouts grow with the count (:func:`timeouts_for`; any ``--averaging.*`` given wins), so
that a starved island is slow rather than dropped.  A count that fails (an island exits with an error, or the
count runs past ``--timeout``) is reported as such, with its islands' exit codes and the reasons their rounds
failed, and the next count runs.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from diloco.command import ArgumentParser, run_command
from diloco.config import Config, ConfigError
from diloco.config import loader as config_load
from diloco.config import schema as config_mod
from diloco.engine.metrics import read_metrics
from diloco.files import writable_folder
from experiments.report import format_bytes, json_safe, markdown_table
from experiments.scale_sim import quantile

DEFAULT_OUT = Path("experiments/results/islands")
ISLANDS_DEFAULTS: dict[str, Any] = {
    "model.preset": "tiny", "diloco.inner_steps": 20, "diloco.outer_steps": 10, "inner.warmup_steps": 5,
    "logging.eval_every": 5, "logging.eval_batches": 2, "logging.samples": 0, "checkpoint.every": 0,
    "wandb.mode": "disabled", "averaging.backend": "hivemind",
}
"""What each count runs unless the command line says otherwise: small rounds, few evaluations, no W&B process."""


def timeouts_for(n: int, cores: int) -> dict[str, float]:
    """The ``--averaging.*`` timeouts for ``n`` islands on ``cores`` cores: the defaults (made for islands on servers
    of their own) plus what waiting for a core adds.  A step that takes an island 1 s alone takes about
    ``n / cores`` s when every island wants a core at once, and so does each message it answers."""
    load = max(1.0, n / max(cores, 1))
    # the grace a round's leader gives the islands still coming once a majority joined: starved islands reach a
    # round up to a few steps' time apart, and one left out spends its next round catching up (more CPU)
    # a leader opens a connection to each member it has not met to send the roster; 48 islands at once starved it
    # past the default 3 s (+ 5) for 16 of 47 members, in the first round it led
    return {"averaging.matchmaking_time": 5 + load, "averaging.request_timeout": 2.5 + load / 2,
            "averaging.startup_timeout": 20 + 2 * load,
            "averaging.matchmaking_timeout": 60 + 10 * load,
            "averaging.allreduce_timeout": 120 + 8 * load, "averaging.next_chunk_timeout": 30 + 2 * load,
            "averaging.vote_timeout": 15 + 2 * load, "averaging.state_download_timeout": 60 + 4 * load}


def count_timeout(n: int, cfg: Config, cores: int) -> float:
    """Seconds a count of ``n`` islands may run in all (``--timeout 0``): a generous bound, not an expectation."""
    return 600 + 10 * max(1.0, n / max(cores, 1)) * cfg.diloco.outer_steps


# ------------------------------------------------------------------------------------------- reading a count
def island_rounds(run_dir: Path) -> dict[int, dict[str, Any]]:
    """An island's round records by the outer step they end.  Where a step was recorded twice (a round left out
    after a catch-up is recorded at the step it caught up to, which a commit may have recorded already), the
    committed record stands, else the last one."""
    out: dict[int, dict[str, Any]] = {}
    for r in read_metrics(run_dir):
        if "round_ok" in r and "outer_step" in r:
            step = int(r["outer_step"])
            if not (out.get(step, {}).get("round_ok") and not r.get("round_ok")):
                out[step] = r
    return out


def _summary(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": quantile(values, 0.5), "p90": quantile(values, 0.9), "count": len(values)}


def count_result(n: int, rounds: int, run_dirs: list[Path], exit_codes: dict[int, int | None], *,
                 wall_seconds: float = float("nan"), error: str = "", memory: dict[str, Any] | None = None,
                 cpu_busy: float = float("nan"), timed_out: bool = False) -> dict[str, Any]:
    """What one count's islands wrote (``summary.json``, ``metrics.jsonl``), as the figures of the report.

    A round counts as committed when at least one island's record of it says so; ``committed_by`` gives, per round,
    how many islands committed it (a round the run skipped is 0), ``largest_group`` the largest group that did (the
    islands' ``num_peers``: the whole round's, across its groups), and a round counts as committed by a majority
    when more than half the islands committed it in one group.  Bytes per island per round divide the islands'
    totals by the rounds they recorded (an island that died early counts for the rounds it did)."""
    records = [island_rounds(d) for d in run_dirs]
    summaries = [_summary(d) for d in run_dirs]
    committed_by = [sum(1 for rec in records if rec.get(r, {}).get("round_ok") == 1) for r in range(1, rounds + 1)]
    largest_group = [max((int(rec[r].get("num_peers", 0)) for rec in records if rec.get(r, {}).get("round_ok") == 1),
                         default=0) for r in range(1, rounds + 1)]
    checksums = Counter(s["theta_checksum"] for s in summaries if s is not None and s.get("theta_checksum"))
    # the run's rounds end when their last island records them: seconds between consecutive ends
    ends = [max((rec[r]["time"] for rec in records if r in rec and "time" in rec[r]), default=None)
            for r in range(1, rounds + 1)]
    round_seconds = [b - a for a, b in zip(ends, ends[1:]) if a is not None and b is not None]
    every = [r for rec in records for r in rec.values()]
    island_rounds_done = sum(len(rec) for rec in records)
    sent = received = payload = 0.0
    for rec, s in zip(records, summaries):
        last = rec[max(rec)] if rec else {}
        src = s if s is not None else last
        sent += float(src.get("bytes_sent", 0))
        received += float(src.get("bytes_received", 0))
        payload += float(src.get("payload_bytes_sent", 0))
    failures = Counter(r["round_failure"] for r in every if r.get("round_ok") != 1 and r.get("round_failure"))
    failed_islands = {i: c for i, c in exit_codes.items() if c != 0}
    problems = []
    if error:
        problems.append(error)
    if timed_out:
        problems.append("ran past its timeout; the islands still running were stopped")
    if failed_islands:
        problems.append(f"{len(failed_islands)} island(s) exited with an error: "
                        + ", ".join(f"island{i} ({c})" for i, c in sorted(failed_islands.items())))
    missing = sum(1 for s in summaries if s is None)
    if missing:
        problems.append(f"{missing} island(s) wrote no summary")
    if len(checksums) > 1:
        problems.append(f"{len(checksums)} different θ_global at the end")
    return {
        "islands": n, "rounds": rounds, "wall_seconds": wall_seconds, "cpu_busy": cpu_busy,
        "ok": not problems, "problems": problems, "exit_codes": {str(i): c for i, c in sorted(exit_codes.items())},
        "committed_by": committed_by, "largest_group": largest_group,
        "rounds_committed": sum(1 for k in committed_by if k > 0),
        # one group of more than half the run: islands committing the same round in two halves are no majority
        "rounds_committed_by_majority": sum(1 for k, g in zip(committed_by, largest_group) if min(k, g) > n // 2),
        "island_rounds": island_rounds_done,
        "island_rounds_left_out": sum(1 for r in every if r.get("averaging_backend") == "caught-up"),
        "island_rounds_failed": sum(1 for r in every if r.get("round_ok") != 1),
        "round_failures": dict(failures.most_common(8)),
        "theta_distinct": len(checksums), "theta_factions": sorted(checksums.values(), reverse=True),
        "islands_without_summary": missing,
        "wire_bytes_per_island_round": sent / max(island_rounds_done, 1),
        # what the protocol sends by the clock (registry reads, heartbeats) grows with slow rounds, not with rounds
        "wire_bytes_per_island_second": sent / max(len(run_dirs), 1) / wall_seconds if wall_seconds > 0 else float("nan"),
        "received_bytes_per_island_round": received / max(island_rounds_done, 1),
        "payload_bytes_per_island_round": payload / max(island_rounds_done, 1),
        "round_seconds": _spread(round_seconds),
        "stall_seconds": _spread([float(r["stall_seconds"]) for r in every if "stall_seconds" in r]),
        "group_seconds": _spread([float(r["group_seconds"]) for r in every if "group_seconds" in r]),
        "averaging_seconds": _spread([float(r["allreduce_seconds"]) for r in every if "allreduce_seconds" in r]),
        "memory": memory or {},
    }


def committed_text(r: dict[str, Any]) -> str:
    """``10/10`` and by how many islands: ``(16 each)``, or the fewest and most."""
    by = [k for k in r["committed_by"] if k > 0]
    text = f"{r['rounds_committed']}/{r['rounds']}"
    if by:
        text += f" ({by[0]} each)" if min(by) == max(by) else f" ({min(by)}–{max(by)} islands)"
    return text


def theta_text(r: dict[str, Any]) -> str:
    """``1``, or ``3 (7+5+4)``: distinct θ_global and the islands holding each."""
    d = r["theta_distinct"]
    return str(d) if d <= 1 else f"{d} ({'+'.join(map(str, r['theta_factions']))})"


HEADERS = ["islands", "rounds committed", "by a majority", "distinct θ_global", "wire / island / round",
           "payload / island / round", "wire ÷ payload", "round s (median)", "round s (p90)",
           "outside compute s (median)", "group s (median)", "group s (p90)", "PSS / island", "cores busy", "wall s",
           "problems"]


def row(r: dict[str, Any]) -> list[Any]:
    mem = r["memory"].get("pss_per_island_bytes")
    wire, payload = r["wire_bytes_per_island_round"], r["payload_bytes_per_island_round"]
    return [r["islands"], committed_text(r), f"{r['rounds_committed_by_majority']}/{r['rounds']}", theta_text(r),
            format_bytes(wire), format_bytes(payload), f"{wire / payload:.1f}×" if payload else "–",
            f"{r['round_seconds']['median']:.1f}", f"{r['round_seconds']['p90']:.1f}",
            f"{r['stall_seconds']['median']:.1f}", f"{r['group_seconds']['median']:.2f}",
            f"{r['group_seconds']['p90']:.2f}", format_bytes(mem) if mem else "–",
            f"{r['cpu_busy']:.0%}" if r["cpu_busy"] == r["cpu_busy"] else "–", f"{r['wall_seconds']:.0f}",
            "; ".join(r["problems"]) or "none"]


def progress_line(r: dict[str, Any]) -> str:
    """The line printed when a count ends."""
    head = f"{r['islands']} islands: {committed_text(r)} rounds committed, θ_global distinct {theta_text(r)}"
    rs, gs = r["round_seconds"], r["group_seconds"]
    mem = r["memory"].get("pss_per_island_bytes")
    return (f"{head}, wire {format_bytes(r['wire_bytes_per_island_round'])}/island/round (payload "
            f"{format_bytes(r['payload_bytes_per_island_round'])}), round {rs['median']:.1f} s (p90 {rs['p90']:.1f}), "
            f"group {gs['median']:.2f} s, {format_bytes(mem) if mem else '? B'} PSS/island, {r['wall_seconds']:.0f} s"
            + ("" if r["ok"] else f"; PROBLEMS: {'; '.join(r['problems'])}"))


def markdown(results: list[dict[str, Any]], command: str, notes: list[str]) -> str:
    """The report: the table, what it measured, and each count's details."""
    lines = [f"# Islands on one machine: {', '.join(str(r['islands']) for r in results)}", "", f"`{command}`", "",
             markdown_table(HEADERS, [row(r) for r in results]), "", "![islands](islands.png)", ""]
    lines += [f"- {n}" for n in notes]
    for r in results:
        lines += ["", f"## {r['islands']} islands", "",
                  f"- islands committing each round: {r['committed_by']} (largest group: {r['largest_group']})",
                  f"- on the wire: {format_bytes(r['wire_bytes_per_island_round'])} per island per round, "
                  f"{format_bytes(r['wire_bytes_per_island_second'])} per island per second of the count; received "
                  f"{format_bytes(r['received_bytes_per_island_round'])} per island per round",
                  f"- island-rounds: {r['island_rounds']} recorded, {r['island_rounds_failed']} not committed, "
                  f"{r['island_rounds_left_out']} left out (caught up from the run instead)",
                  f"- θ_global: {theta_text(r)} distinct; {r['islands_without_summary']} island(s) without a summary",
                  f"- seconds: round {r['round_seconds']['median']:.2f} / {r['round_seconds']['p90']:.2f}, outside "
                  f"compute {r['stall_seconds']['median']:.2f} / {r['stall_seconds']['p90']:.2f}, group "
                  f"{r['group_seconds']['median']:.2f} / {r['group_seconds']['p90']:.2f}, whole averaging "
                  f"{r['averaging_seconds']['median']:.2f} / {r['averaging_seconds']['p90']:.2f} (median / p90)"]
        by = r.get("sent_by_process_bytes")
        if by and r["island_rounds"]:
            per = {name: b / r["island_rounds"] for name, b in sorted(by.items())}
            lines.append("- sent, by the process holding the connection (per island per round recorded): "
                         + ", ".join(f"{name} {format_bytes(b)}" for name, b in per.items())
                         + " (p2pd: hivemind's daemons, the DHT; python: the islands' transport)")
        mem = r["memory"]
        if mem:
            lines.append(f"- memory at its peak: {format_bytes(mem['pss_total_bytes'])} PSS in all "
                         f"({mem['processes']} processes: "
                         + ", ".join(f"{name} {format_bytes(b)}" for name, b in mem["pss_by_name_bytes"].items())
                         + f"); the largest island's tree {format_bytes(mem['island_pss_max_bytes'])} PSS, "
                         f"{format_bytes(mem['island_rss_max_bytes'])} RSS, {mem['island_processes']} processes")
        if r["round_failures"]:
            lines.append("- why rounds failed (islands' records, most frequent first):")
            lines += [f"  - {count}× `{reason}`" for reason, count in r["round_failures"].items()]
        if r["problems"]:
            lines.append(f"- problems: {'; '.join(r['problems'])}")
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Four panels against the island count: bytes, seconds, commits and θ_global, memory."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 3.8), dpi=110)
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, 4, k) for k in range(1, 5)]
    xs = list(range(len(results)))
    labels = [str(r["islands"]) for r in results]
    mb = lambda key: [r[key] / 1e6 for r in results]  # noqa: E731
    axes[0].plot(xs, mb("wire_bytes_per_island_round"), "o-", label="on the wire")
    axes[0].plot(xs, mb("payload_bytes_per_island_round"), "s--", label="payload")
    axes[0].set_ylabel("MB sent per island per round")
    axes[0].set_ylim(bottom=0)
    for key, label, style in (("round_seconds", "round", "o-"), ("group_seconds", "forming the group", "s--"),
                              ("stall_seconds", "outside compute", "^:")):
        med = [r[key]["median"] for r in results]
        up = [max(r[key]["p90"] - r[key]["median"], 0) for r in results]
        axes[1].errorbar(xs, med, yerr=[[0] * len(xs), up], fmt=style, capsize=3, label=f"{label} (median, to p90)")
    axes[1].set_ylabel("seconds")
    axes[1].set_ylim(bottom=0)
    axes[2].bar(xs, [100 * r["rounds_committed_by_majority"] / max(r["rounds"], 1) for r in results],
                label="rounds committed by a majority")
    for x, r in zip(xs, results):
        share = 100 * r["rounds_committed_by_majority"] / max(r["rounds"], 1)
        axes[2].annotate(f"θ_global: {theta_text(r)}", (x, min(share, 88) + 3), ha="center", fontsize=8)
    axes[2].set_ylabel("% of rounds")
    axes[2].set_ylim(0, 105)
    axes[3].bar(xs, [r["memory"].get("pss_per_island_bytes", 0) / 1e6 for r in results], label="PSS per island")
    axes[3].set_ylabel("MB at the peak")
    for ax in axes:
        ax.set_xticks(xs)
        ax.set_xticklabels(labels)
        ax.set_xlabel("islands")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("islands on one machine (tiny model, loopback, shared cores)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


# ------------------------------------------------------------------------------------------- running a count
def cpu_times() -> tuple[float, float]:
    """This machine's busy and total CPU seconds since boot, from ``/proc/stat`` (all cores)."""
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def memory_figures(sampler: Any, n: int) -> dict[str, Any]:
    """A :class:`~diloco.launch.memory.MemorySampler`'s peaks in bytes, with the PSS per island."""
    total = sampler.peak_total
    islands = list(sampler.peak_island.values())
    if not islands:
        return {}
    return {"pss_total_bytes": total.pss_kb * 1e3, "pss_per_island_bytes": total.pss_kb * 1e3 / n,
            "rss_total_bytes": total.rss_kb * 1e3, "processes": total.processes,
            "pss_by_name_bytes": {k: v * 1e3 for k, v in sorted(total.pss_by_name_kb.items(), key=lambda kv: -kv[1])},
            "island_pss_max_bytes": max(t.pss_kb for t in islands) * 1e3,
            "island_rss_max_bytes": max(t.rss_kb for t in islands) * 1e3,
            "island_processes": max(t.processes for t in islands), "samples": sampler.samples}


def sent_by_connection(roots: list[int]) -> dict[int, tuple[str, int]]:
    """The open TCP connections of the process trees of ``roots``, by socket inode: the name of the process holding
    it (``p2pd``: a hivemind daemon; ``python``: any other) and the frame bytes sent on it so far (the kernel's
    counters, :func:`peers.wire.counters.tcp_connections`)."""
    import socket

    from peers.proctable import process_sockets, process_trees
    from peers.wire.counters import tcp_connections

    owner: dict[int, str] = {}
    for pid, stat in process_trees(roots).items():
        for inode in process_sockets([pid]):
            owner.setdefault(inode, "p2pd" if stat.name == "p2pd" else "python")
    return {inode: (owner[inode], b.sent) for family in (socket.AF_INET, socket.AF_INET6)
            for inode, b in tcp_connections(family).items() if inode in owner}


class WireByProcess:
    """Bytes the islands sent over TCP, split by the process that holds each connection: ``p2pd`` (hivemind's
    daemons: the DHT's records and reads, and hivemind's calls) and ``python`` (the islands' own transport:
    rosters, parts, verdicts, downloads).  Sampled every ``every`` seconds from the kernel's per-connection
    counters (:func:`peers.wire.counters.tcp_connections`); a connection closed between two samples keeps its
    last count.  On loopback every byte one island sends another receives, so the sum is the run's traffic once."""

    def __init__(self, roots: Callable[[], list[int]], every: float = 2.0):
        import threading

        self.roots, self.every = roots, every
        self.sent: dict[int, tuple[str, int]] = {}  # socket inode -> (process name, frame bytes sent so far)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="wire-by-process")

    def __enter__(self) -> WireByProcess:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.every + 5)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.sent.update(sent_by_connection(self.roots()))
            except OSError:
                return

    def totals(self) -> dict[str, int]:
        """Frame bytes sent so far, by process name."""
        out: dict[str, int] = {}
        for name, sent in list(self.sent.values()):
            out[name] = out.get(name, 0) + sent
        return out


def run_count(cfg: Config, n: int, timeout: float, memory_every: float,
              say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run ``n`` islands of ``cfg`` to the end (or ``timeout``), sampling their memory; return :func:`count_result`."""
    from diloco.launch.memory import MemorySampler
    from diloco.launch.simulate import Cluster, SimulationError

    cluster = Cluster(cfg, n, fork_warm=True)
    rounds = cfg.diloco.outer_steps * cfg.diloco.fragments
    t0, busy0 = time.time(), cpu_times()
    error, timed_out, last = "", False, [t0, ""]

    def tick() -> None:  # a line every 30 s or so while the rounds move
        if time.time() - last[0] < 30:
            return
        last[0] = time.time()
        done = [max(island_rounds(d), default=0) for d in cluster.run_dirs]
        line = f"{n} islands: rounds {min(done)}–{max(done)} of {rounds} done"
        if line != last[1]:
            say(f"[{time.time() - t0:6.0f}s] {line}, {len(cluster.failed())} island(s) exited with an error")
            last[1] = line

    with MemorySampler(lambda: {i: p.pid for i, p in cluster.procs.items()}, every=memory_every) as memory, \
            WireByProcess(lambda: [p.pid for p in cluster.procs.values()]) as wire:
        try:
            cluster.start_all(startup_timeout=max(90.0, cfg.averaging.startup_timeout * 3))
            cluster.wait(timeout=timeout, on_tick=tick, allow_failures=True)
        except SimulationError as e:
            error = str(e).splitlines()[0]
            timed_out = "still running after" in error
        finally:
            cluster.stop_all()
    busy1 = cpu_times()
    cpu_busy = (busy1[0] - busy0[0]) / max(busy1[1] - busy0[1], 1e-9)
    codes = {i: p.returncode for i, p in cluster.procs.items()}
    result = count_result(n, rounds, cluster.run_dirs, codes, wall_seconds=time.time() - t0,
                          error="" if timed_out else error, memory=memory_figures(memory, n), cpu_busy=cpu_busy,
                          timed_out=timed_out)
    result["sent_by_process_bytes"] = wire.totals()
    return result


def run_islands(config_file: str | None, overrides: list[str], counts: list[int], out: Path, timeout: float,
                memory_every: float, command: str) -> list[dict[str, Any]]:
    """Every count in turn; the report rewritten after each."""
    from diloco.launch import warm

    cores = os.cpu_count() or 1
    configs = {}
    for n in counts:  # every count's config checked before the first runs
        cfg = config_load.load(config_file, overrides, defaults={**ISLANDS_DEFAULTS, **timeouts_for(n, cores)})
        cfg.logging.run_dir = str(out / "runs" / f"islands-{n}")
        cfg.averaging.run_id = f"islands-{n}"
        configs[n] = cfg
    results: list[dict[str, Any]] = []
    for n in counts:
        cfg = configs[n]
        limit = timeout or count_timeout(n, cfg, cores)
        print(f"== {n} islands: {cfg.model.preset}, H={cfg.diloco.inner_steps}, {cfg.diloco.outer_steps} rounds, "
              f"matchmaking timeout {cfg.averaging.matchmaking_timeout:.0f} s, at most {limit:.0f} s; logs in "
              f"{cfg.logging.run_dir}/island<i>/train.log", flush=True)
        r = run_count(cfg, n, limit, memory_every, say=lambda line: print(line, flush=True))
        r["config"] = {k: v for k, v in config_mod.to_dict(cfg).items() if k in ("model", "diloco", "averaging")}
        results.append(r)
        print(progress_line(r), flush=True)
        write_report(results, out, command, cores, started_warm=warm.enabled(default=True))
    return results


def write_report(results: list[dict[str, Any]], out: Path, command: str, cores: int, started_warm: bool) -> None:
    """``results.md``, ``results.json`` and ``islands.png`` for the counts run so far."""
    notes = [
        f"{cores} cores shared by every island: CPU starvation, not the network (loopback), sets the pace of a round "
        f"here; 'cores busy' is the share of the machine's CPU time that was busy while the count ran (other "
        f"programs' included)",
        "wire: the kernel's count of bytes the islands sent on their TCP connections (every message of the protocol, "
        "headers included); payload: the encoded pseudo-gradients alone; both per island and round recorded",
        "round s: seconds between the ends of consecutive rounds, as the last island to record each saw them "
        "(compute included); outside compute: each island's seconds of a round not spent training (stall); "
        "group: seconds forming the round's group",
        "PSS / island: the proportional set size of every process of the run at its peak (shared pages counted once), "
        "divided by the islands; by process: island = the islands' training processes, python3 = their DHT "
        "processes and the warm fork server, p2pd = hivemind's daemons, torch_shm_manag = torch's shared-memory "
        "manager (one for all islands forked warm, one per island started cold)",
        f"islands {'forked from a warm interpreter' if started_warm else 'started cold (DILOCO_WARM_ISLANDS=0)'}",
    ]
    (out / "results.md").write_text(markdown(results, command, notes))
    (out / "results.json").write_text(json.dumps(json_safe({"command": command, "cores": cores, "notes": notes,
                                                            "results": results}), indent=1) + "\n")
    plot(results, out / "islands.png")


def parse_counts(text: str) -> list[int]:
    """``8,16,32`` → [8, 16, 32]; ConfigError for anything else."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 2:
        raise ConfigError([f"--counts takes island counts of at least 2 separated by commas (8,16,32), got {text!r}"])
    return counts


def main(argv: list[str] | None = None) -> int:
    """``diloco experiment islands [--counts 8,16,32,64] [--out DIR] [--section.key VALUE ...]``."""
    argv = sys.argv[1:] if argv is None else argv
    parser = ArgumentParser(prog="diloco experiment islands", description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="8,16,32,64", help="island counts, each a run of its own (default "
                                                                "8,16,32,64)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--timeout", type=float, default=0.0,
                        help="seconds a count may run before its islands are stopped (default 0: 600 + 10 s × "
                             "islands per core × rounds)")
    parser.add_argument("--memory-every", type=float, default=5.0,
                        help="seconds between two samples of the islands' memory (default 5; a sample of 64 "
                             "islands costs about 0.4 s of CPU)")
    parser.add_argument("--config", help="TOML config file (applied over this command's defaults)")
    args, rest = parser.parse_known_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def body() -> int:
        counts = parse_counts(args.counts)
        if args.timeout < 0 or args.memory_every <= 0:
            raise ConfigError([f"--timeout must be 0 or more and --memory-every above 0, got {args.timeout:g} and "
                               f"{args.memory_every:g}"])
        out = writable_folder(args.out)
        results = run_islands(args.config, rest, counts, out, args.timeout, args.memory_every,
                              "diloco experiment islands " + " ".join(argv))
        print(f"report: {out / 'results.md'}", flush=True)
        return 0 if all(r["ok"] for r in results) else 1

    from diloco.launch.simulate import SimulationError

    return run_command(body, (SimulationError,), "interrupted: every island was stopped")


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["count_result", "island_rounds", "markdown", "run_count", "timeouts_for", "main"]
