"""Soak run: N islands for many rounds while a random island (the first one included) is SIGKILLed at a
random moment and restarted with exactly its original command plus ``--resume``.

    python -m experiments.soak --islands 4 --kill-every 2 [--rate 20mbit] [--section.key VALUE ...]

With ``--rate`` every island runs on its own emulated host (network namespace behind a token-bucket
link, see :mod:`experiments.netns`; needs root, else it says so and stops).  Kills come at random
moments (uniformly between 0.5 and 1.5 times ``--kill-every`` round lengths apart), not at phase
boundaries.  Prints, per island, rounds committed and rolled back, kills survived and exit codes; then
the spread of θ_global across islands at the end (0 means bit-identical), the share of rounds committed
among rounds with no kill in flight, and the longest stretch without a committed round.
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

from diloco.config import load
from diloco.metrics import read_metrics
from diloco.simulate import Cluster

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


def round_report(run_dirs: list[Path], kills: list[float]) -> dict[str, float]:
    """Rounds committed among rounds with no kill in flight, and the longest gap between two commits.

    A round of an island spans from its previous round record to this one; it had a kill in flight
    when any island was SIGKILLed within that span."""
    clean = clean_ok = 0
    commits: list[float] = []
    spans: list[float] = []
    for d in run_dirs:
        rounds = [r for r in read_metrics(d) if "round_ok" in r]
        for prev, r in zip(rounds, rounds[1:]):
            spans.append(r["time"] - prev["time"])
            if not any(prev["time"] < k <= r["time"] for k in kills):
                clean += 1
                clean_ok += int(r["round_ok"])
        commits += [r["time"] for r in rounds if r["round_ok"]]
    commits.sort()
    gap = max((b - a for a, b in zip(commits, commits[1:])), default=0.0)
    round_s = statistics.median(spans) if spans else float("nan")
    return {"clean_rounds": clean, "clean_committed": clean_ok, "longest_gap_s": gap, "round_s": round_s}


def soak(islands: int, kill_every: float, seed: int, rate: str, overrides: list[str]) -> int:
    """Run the soak; return 0 if every island ended in sync with finite parameters and exit code 0."""
    cfg = load(None, [x for k, v in SOAK_DEFAULTS.items() for x in (f"--{k}", str(v))] + overrides)
    network = None
    if rate:
        from experiments import netns

        ok, why = netns.available()
        if not ok:
            print(f"error: --rate needs emulated hosts: {why}", file=sys.stderr)
            return 2
        network = netns.EmulatedNetwork(islands, rate=rate)
    rng = random.Random(seed)
    kills = {i: 0 for i in range(islands)}
    kill_times: list[float] = []
    t0 = time.time()
    stop_at = cfg.diloco.outer_steps - max(6, int(2 * kill_every))  # leave rounds for the last victim to rejoin
    try:
        cluster = Cluster(cfg, islands, wrap=network.wrap if network else None,
                          host_addresses=[h.address for h in network.hosts] if network else None)
        cluster.start_all()
        link = f"links capped at {rate}" if network else "loopback"
        print(f"soak: {islands} islands, {cfg.diloco.outer_steps} rounds, {link}, a SIGKILL at a random moment "
              f"every ~{kill_every:g} rounds until round {stop_at}, restart with the original command + --resume",
              flush=True)
        next_kill = None
        while cluster.running():
            leader = max(current_round(d) for d in cluster.run_dirs)
            if next_kill is None and leader >= 1:
                round_s = (time.time() - t0) / leader
                next_kill = time.time() + rng.uniform(0.5, 1.5) * kill_every * round_s
            alive = [i for i in range(islands) if cluster.alive(i)]
            if next_kill is not None and time.time() >= next_kill and leader < stop_at and len(alive) == islands:
                victim = rng.choice(alive)
                print(f"[{time.time() - t0:5.0f}s] round {leader}: SIGKILL island {victim}", flush=True)
                cluster.kill(victim, signal.SIGKILL)
                kill_times.append(time.time())
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
        report = round_report(cluster.run_dirs, kill_times)
    finally:
        if "cluster" in locals():
            cluster.stop_all()
        if network is not None:
            network.close()
    print()
    print(f"{'island':8} {'committed':>9} {'rolled back':>11} {'SIGKILLs':>8} {'exit':>5} {'final eval loss':>15}")
    for i, s in enumerate(summaries):
        print(f"{i:<8} {s['rounds_ok']:>9} {s['rounds_failed']:>11} {kills[i]:>8} {codes[i]:>5} "
              f"{s['eval_loss_end']:>15.3f}")
    total = sum(kills.values())
    share = report["clean_committed"] / max(1, report["clean_rounds"])
    print(f"\nfaults injected: {total} SIGKILLs at random moments; every island finished round "
          f"{min(s['outer_step'] for s in summaries)}")
    print(f"rounds committed among rounds with no kill in flight: {report['clean_committed']}/"
          f"{report['clean_rounds']} = {share:.0%}")
    print(f"longest stretch without a committed round: {report['longest_gap_s']:.0f} s "
          f"({report['longest_gap_s'] / report['round_s']:.1f} median round lengths of {report['round_s']:.1f} s)")
    print(f"θ_global spread across islands at the end: {spread:.3g} (all finite: {finite})")
    print(f"exit codes: {codes}; wall-clock: {time.time() - t0:.0f} s")
    return 0 if finite and spread < 1e-5 and not any(codes) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--islands", type=int, default=4)
    parser.add_argument("--kill-every", type=float, default=3, help="mean rounds between two kills")
    parser.add_argument("--rate", default="", help="cap every island's link (e.g. 20mbit; needs root)")
    parser.add_argument("--soak-seed", type=int, default=0, help="seed of the choice of victims and moments")
    args, rest = parser.parse_known_args(argv)
    return soak(args.islands, args.kill_every, args.soak_seed, args.rate, rest)


if __name__ == "__main__":
    sys.exit(main())
