"""Soak run: N islands for many rounds while a random island (the first one included) is SIGKILLed at a
random moment and restarted with exactly its original command plus ``--resume``.

    python -m experiments.soak --islands 4 --kill-every 2 [--rate 20mbit] [--section.key VALUE ...]

With ``--rate`` every island runs on its own emulated host (network namespace behind a token-bucket
link, see :mod:`experiments.netns`; needs root, else it says so and stops).  Kills come at random
moments (uniformly between 0.5 and 1.5 times ``--kill-every`` round lengths apart), not at phase
boundaries.  Prints, per island, rounds committed and rolled back, kills survived and exit codes; then
the spread of θ_global across islands at the end (0 means bit-identical), the share of rounds committed
among rounds with no kill in flight, and the longest stretch without a committed round; writes them
to ``--out`` (``results.md``, ``results.json``) with ``timeline.png`` (every island's rounds over time).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

from diloco.config.loader import load
from diloco.engine.metrics import read_metrics
from diloco.launch.simulate import Cluster
from experiments.compare_results import link_tx_bytes
from experiments.report import format_bytes, json_safe, markdown_table

SOAK_DEFAULTS = {
    "model.preset": "tiny", "diloco.outer_steps": 40, "diloco.inner_steps": 40, "inner.batch_size": 4,
    "checkpoint.every": 1, "wandb.mode": "disabled", "averaging.matchmaking_time": 2.0,
    "averaging.request_timeout": 0.5, "averaging.matchmaking_timeout": 12.0, "averaging.vote_timeout": 4.0,
    "averaging.allreduce_timeout": 10.0, "averaging.next_chunk_timeout": 3.0,
    "averaging.state_download_timeout": 10.0, "averaging.member_ttl": 20.0, "data.max_bytes": 2_000_000,
    "logging.run_dir": "runs/soak",
}


def current_round(run_dir: Path) -> int:
    """The last outer step an island logged (0 before its first round)."""
    steps = [r["outer_step"] for r in read_metrics(run_dir) if "round_ok" in r]
    return max(steps, default=0)


def round_report(run_dirs: list[Path], kills: list[float], victims: list[int]) -> dict[str, float]:
    """Rounds committed among rounds with no kill in flight, the longest gap between two commits, and the
    longest an island of the run stood waiting in a round with a kill in flight (its ``stall_seconds``: what
    members that will not come can cost the living, the wait for them and the round again without them).

    A round of an island spans from its previous round record to this one; it had a kill in flight
    when any island was SIGKILLed within that span (``kills[j]``, the time ``victims[j]`` was killed).  The
    round a victim was killed in is not a wait of the living."""
    clean = clean_ok = retried = retried_ok = 0
    waits: list[float] = []
    commits: list[float] = []
    spans: list[float] = []
    for i, d in enumerate(run_dirs):
        rounds = [r for r in read_metrics(d) if "round_ok" in r]
        for prev, r in zip(rounds, rounds[1:]):
            spans.append(r["time"] - prev["time"])
            if not any(prev["time"] < k <= r["time"] for k in kills):
                clean += 1
                clean_ok += int(r["round_ok"])
            elif not any(prev["time"] < k <= r["time"] and v == i for k, v in zip(kills, victims)):
                waits.append(r.get("stall_seconds", 0.0))
        commits += [r["time"] for r in rounds if r["round_ok"]]
        retried += sum(r.get("retried", 0) for r in rounds)
        retried_ok += sum(r.get("retried", 0) * r["round_ok"] for r in rounds)
    commits.sort()
    gap, gap_at = max(((b - a, a) for a, b in zip(commits, commits[1:])), default=(0.0, 0.0))
    round_s = statistics.median(spans) if spans else float("nan")
    return {"clean_rounds": clean, "clean_committed": clean_ok, "longest_gap_s": gap, "longest_gap_from": gap_at,
            "round_s": round_s, "retried": retried, "retried_ok": retried_ok,
            "longest_kill_wait_s": max(waits, default=0.0),
            "median_kill_wait_s": statistics.median(waits) if waits else 0.0}


def log_lines(log: Path, t0: float) -> list[tuple[float, str]]:
    """(wall-clock time, line) of every timestamped line of an island's log (seconds resolution)."""
    day = time.localtime(t0)
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(r"(\d\d):(\d\d):(\d\d) ", line)
        if m:
            t = time.mktime((*day[:3], int(m[1]), int(m[2]), int(m[3]), 0, 0, -1))
            out.append((t + (86400 if t < t0 - 3600 else 0), line))  # the run went past midnight
    return out


def joined_intervals(log: Path, t0: float) -> list[tuple[float, float]]:
    """Wall-clock spans during which an island was in the run: each life of its process (its log from one
    ``data:`` line to the next) counts from the moment it had joined the peer network and the member
    registry (or caught up, or committed) to its last log line.  Seconds resolution, like the log."""
    lives: list[list[float | None]] = []
    for t, line in log_lines(log, t0):
        if " data: " in line or not lives:
            lives.append([None, t])
        lives[-1][1] = t
        if lives[-1][0] is None and any(k in line for k in ("islands registered", "caught up", "checkpoint written")):
            lives[-1][0] = t
    return [(a, b) for a, b in lives if a is not None]


def stall_story(logs: list[Path], t0: float, start: float, end: float, limit: int = 40) -> list[str]:
    """What the islands logged as warnings or errors from ``start`` to ``end`` (the longest stall), in time
    order, each line prefixed by its second of the soak.  hivemind renames the WARNING level to WARN."""
    lines = sorted((t, line) for log in logs for t, line in log_lines(log, t0)
                   if start - 1 <= t <= end + 1 and re.search(r" (WARN|WARNING|ERROR) ", line))
    return [f"{t - t0:5.0f}s {line}" for t, line in lines[:limit]]


def longest_stall(commits: list[float], joined: list[list[tuple[float, float]]], step: float = 0.1
                  ) -> tuple[float, float, float]:
    """The most seconds, between two consecutive commits, during which at least 2 islands were in the run;
    with those two commits' times."""
    def count(t: float) -> int:
        return sum(any(a <= t <= b for a, b in spans) for spans in joined)

    worst = (0.0, 0.0, 0.0)
    for a, b in zip(commits, commits[1:]):
        if b - a > 3 * step:
            stalled = step * sum(count(a + step * (i + 0.5)) >= 2 for i in range(int((b - a) / step)))
            worst = max(worst, (stalled, a, b))
    return worst


def soak(islands: int, kill_every: float, seed: int, rate: str, out: Path, overrides: list[str], *,
         rtt_ms: float = 0.0, jitter_ms: float = 0.0, loss: float = 0.0) -> int:
    """Run the soak; return 0 if every island ended in sync with finite parameters and exit code 0.

    ``rtt_ms``, ``jitter_ms`` and ``loss`` shape the emulated links of ``rate``
    (:class:`experiments.netns.EmulatedNetwork`)."""
    cfg = load(None, [x for k, v in SOAK_DEFAULTS.items() for x in (f"--{k}", str(v))] + overrides)
    network, link_tx = None, []
    if rate:
        from experiments import netns

        ok, why = netns.available(delay=bool(rtt_ms or jitter_ms or loss))
        if not ok:
            print(f"error: --rate needs emulated hosts: {why}", file=sys.stderr)
            return 2
        network = netns.EmulatedNetwork(islands, rate=rate, rtt_ms=rtt_ms, jitter_ms=jitter_ms, loss=loss)
        tx0 = link_tx_bytes(network)
    rng = random.Random(seed)
    kills = {i: 0 for i in range(islands)}
    kill_times: list[float] = []
    victims: list[int] = []
    t0 = time.time()
    stop_at = cfg.diloco.outer_steps - max(6, int(2 * kill_every))  # leave rounds for the last victim to rejoin
    try:
        cluster = Cluster(cfg, islands, wrap=network.wrap if network else None,
                          host_addresses=[h.local_address for h in network.hosts] if network else None)
        cluster.start_all()
        link = f"links capped at {rate}" if network else "loopback"
        print(f"soak: {islands} islands, {cfg.diloco.outer_steps} rounds, {link}, a SIGKILL at a random moment "
              f"every ~{kill_every:g} rounds until round {stop_at}, restart with the original command + --resume",
              flush=True)
        next_kill = None
        while cluster.running():
            leader = max(current_round(d) for d in cluster.run_dirs)
            if next_kill is None and leader >= 1 and kill_every > 0:
                round_s = (time.time() - t0) / leader
                next_kill = time.time() + rng.uniform(0.5, 1.5) * kill_every * round_s
            alive = [i for i in range(islands) if cluster.alive(i)]
            if next_kill is not None and time.time() >= next_kill and leader < stop_at and len(alive) == islands:
                victim = rng.choice(alive)
                print(f"[{time.time() - t0:5.0f}s] round {leader}: SIGKILL island {victim}", flush=True)
                cluster.kill(victim, signal.SIGKILL)
                kill_times.append(time.time())
                victims.append(victim)
                kills[victim] += 1
                time.sleep(rng.uniform(0.5, 3.0))
                cluster.restart(victim, as_launched=True)
                next_kill = None
            failed = cluster.failed()
            if failed:
                print(f"island {failed[0]} exited with an error; see {cluster.logs[failed[0]]}", flush=True)
                return 1
            time.sleep(0.5)
        codes = [cluster.procs[i].returncode for i in range(islands)]
        summaries = cluster.summaries()
        spread = cluster.theta_spread()
        finite = all(torch.isfinite(t).all() for d in cluster.run_dirs
                     for t in torch.load(d / "theta_global.pt", weights_only=True).values())
        report = round_report(cluster.run_dirs, kill_times, victims)
        commits = sorted(r["time"] for d in cluster.run_dirs for r in read_metrics(d) if r.get("round_ok"))
        report["stall_s"], stall_from, stall_to = longest_stall(commits, [joined_intervals(log, t0)
                                                                          for log in cluster.logs])
        report["stall_from_s"], report["stall_to_s"] = stall_from - t0, stall_to - t0
        story = stall_story(cluster.logs, t0, stall_from, stall_to)
        link_tx = [b - a for a, b in zip(tx0, link_tx_bytes(network))] if network else []
    finally:
        if "cluster" in locals():
            cluster.stop_all()
        if network is not None:
            network.close()
    rows = [[i, s["rounds_ok"], s["rounds_failed"], kills[i], codes[i], s["eval_loss_end"], s["bytes_sent"]]
            for i, s in enumerate(summaries)]
    share = report["clean_committed"] / max(1, report["clean_rounds"])
    lines = [
        markdown_table(["island", "committed", "rolled back", "SIGKILLs", "exit", "final eval loss", "bytes sent"],
                       [r[:-1] + [format_bytes(r[-1])] for r in rows], float_fmt="{:.3f}"),
        "",
        f"- faults injected: {sum(kills.values())} SIGKILLs at random moments; every island finished round "
        f"{min(s['outer_step'] for s in summaries)}",
        f"- rounds committed among rounds with no kill in flight: {report['clean_committed']}/"
        f"{report['clean_rounds']} = {share:.0%}",
        f"- longest stretch without a committed round: {report['longest_gap_s']:.0f} s "
        f"({report['longest_gap_s'] / report['round_s']:.1f} median round lengths of {report['round_s']:.1f} s), "
        f"from {report['longest_gap_from'] - t0:.0f} s; counting only the time at least 2 islands were in the run "
        f"(joined the peer network and registry after a (re)start): {report['stall_s']:.0f} s "
        f"({report['stall_s'] / report['round_s']:.1f} round lengths)",
        f"- rounds that lost a member mid-round and were averaged again by the islands left: {report['retried']} "
        f"({report['retried_ok']} of them committed)",
        f"- the longest a living island stood waiting in a round with a kill in flight: "
        f"{report['longest_kill_wait_s']:.1f} s ({report['longest_kill_wait_s'] / report['round_s']:.1f} round "
        f"lengths; median of such rounds {report['median_kill_wait_s']:.1f} s)",
        f"- θ_global spread across islands at the end: {spread:.3g} (all finite: {finite})",
        f"- exit codes: {codes}; wall-clock: {time.time() - t0:.0f} s",
    ]
    if link_tx:
        gaps = [r[-1] / t - 1 for r, t in zip(rows, link_tx)]
        lines.append("- bytes_sent the islands counted vs their hosts' link counters: "
                     + ", ".join(f"{format_bytes(r[-1])} vs {format_bytes(t)} ({100 * g:+.2f}%)"
                                 for r, t, g in zip(rows, link_tx, gaps, strict=True))
                     + (" (a SIGKILLed process loses what it sent since its last checkpoint)" if kill_times else ""))
        report["counted_vs_link"] = gaps
    print("\n" + "\n".join(lines))
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m experiments.soak " + " ".join(sys.argv[1:])
    story_md = (f"\n## The longest stall ({report['stall_from_s']:.0f}–{report['stall_to_s']:.0f} s), as the "
                f"islands logged it\n\n```\n" + "\n".join(story or ["(no warnings)"]) + "\n```\n")
    (out / "results.md").write_text(f"# Soak\n\n`{command}`\n\n" + "\n".join(lines) + "\n" + story_md)
    (out / "results.json").write_text(json.dumps(json_safe(dict(
        report, islands=rows, kill_times=[k - t0 for k in kill_times], victims=victims, spread=spread, exit_codes=codes,
        command=command)), indent=1))
    plot_timeline(cluster.run_dirs, kill_times, t0, out / "timeline.png")
    print(f"results in {out}/ (results.md, results.json, timeline.png)")
    return 0 if finite and spread < 1e-5 and not any(codes) else 1


def plot_timeline(run_dirs: list[Path], kill_times: list[float], t0: float, path: Path) -> None:
    """Outer step of each island against wall-clock, committed rounds as dots, failed ones as crosses,
    SIGKILLs as vertical lines."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for k in kill_times:
        ax.axvline(k - t0, color="0.85", lw=0.8, zorder=0)
    for i, d in enumerate(run_dirs):
        rounds = [r for r in read_metrics(d) if "round_ok" in r]
        for ok, marker in ((1, "."), (0, "x")):
            pts = [(r["time"] - t0, r["outer_step"]) for r in rounds if r["round_ok"] == ok]
            if pts:
                ax.scatter(*zip(*pts), s=12 if ok else 24, marker=marker, color=f"C{i}",
                           label=f"island {i}" if ok else None)
    ax.set_xlabel("wall-clock (s); grey lines: SIGKILLs")
    ax.set_ylabel("outer step")
    ax.set_title("Soak: rounds committed (dots) and rolled back or skipped (crosses)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    from diloco.command import run_command
    from diloco.config import ConfigError
    from experiments import netns

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--islands", type=int, default=4)
    parser.add_argument("--kill-every", type=float, default=3, help="mean rounds between two kills (0: none)")
    parser.add_argument("--rate", default="", help="cap every island's link (e.g. 20mbit; needs root)")
    netns.add_link_arguments(parser)
    parser.add_argument("--soak-seed", type=int, default=0, help="seed of the choice of victims and moments")
    parser.add_argument("--out", type=Path, default=Path("runs/soak-results"),
                        help="where results.md, results.json and timeline.png go")
    args, rest = parser.parse_known_args(argv)

    def body() -> int:
        try:
            link = netns.link_arguments(args, args.rate)
        except ValueError as e:
            raise ConfigError([str(e)]) from None
        return soak(args.islands, args.kill_every, args.soak_seed, args.rate, args.out, rest, **link)

    return run_command(body, (netns.NetworkSetupError,))


if __name__ == "__main__":
    sys.exit(main())
