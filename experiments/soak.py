"""Soak run: N islands for many rounds while a random island is SIGKILLed and restarted every few rounds.

    python -m experiments.soak --islands 4 --kill-every 3 [--section.key VALUE ...]

Prints, per island, rounds committed and rolled back and restarts survived, then the spread of
θ_global across islands at the end (0 means bit-identical) and whether every value is finite.
"""

from __future__ import annotations

import argparse
import random
import signal
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


def soak(islands: int, kill_every: int, seed: int, overrides: list[str]) -> int:
    """Run the soak; return 0 if every island ended in sync with finite parameters."""
    cfg = load(None, [x for k, v in SOAK_DEFAULTS.items() for x in (f"--{k}", str(v))] + overrides)
    cluster = Cluster(cfg, islands)
    rng = random.Random(seed)
    kills = {i: 0 for i in range(islands)}
    t0 = time.time()
    last_kill_round = 0
    stop_at = cfg.diloco.outer_steps - max(6, kill_every)  # leave rounds for the last victim to rejoin
    try:
        cluster.start_all()
        print(f"soak: {islands} islands, {cfg.diloco.outer_steps} rounds, a random SIGKILL + restart every "
              f"{kill_every} rounds until round {stop_at}", flush=True)
        while cluster.running():
            rounds = [current_round(d) for d in cluster.run_dirs]
            leader = max(rounds)
            if leader >= last_kill_round + kill_every and leader < stop_at:
                alive = [i for i in range(islands) if cluster.alive(i)]
                if len(alive) == islands:
                    victim = rng.choice(alive)
                    print(f"[{time.time() - t0:5.0f}s] round {leader}: SIGKILL island {victim}", flush=True)
                    cluster.kill(victim, signal.SIGKILL)
                    kills[victim] += 1
                    time.sleep(rng.uniform(0.5, 3.0))
                    cluster.restart(victim)
                    last_kill_round = leader
            failed = cluster.failed()
            if failed:
                print(f"island {failed[0]} exited with an error; see {cluster.logs[failed[0]]}", flush=True)
                return 1
            time.sleep(0.5)
        summaries = cluster.summaries()
        spread = cluster.theta_spread()
        finite = all(torch.isfinite(t).all() for d in cluster.run_dirs
                     for t in torch.load(d / "theta_global.pt", weights_only=True).values())
    finally:
        cluster.stop_all()
    print()
    print(f"{'island':8} {'committed':>9} {'rolled back':>11} {'SIGKILLs':>8} {'final eval loss':>15}")
    for i, s in enumerate(summaries):
        print(f"{i:<8} {s['rounds_ok']:>9} {s['rounds_failed']:>11} {kills[i]:>8} {s['eval_loss_end']:>15.3f}")
    total = sum(kills.values())
    print(f"\nfaults injected: {total} SIGKILLs, survived: {total} restarts rejoined (all islands finished "
          f"round {cfg.diloco.outer_steps})")
    print(f"θ_global spread across islands at the end: {spread:.3g} (all finite: {finite})")
    print(f"wall-clock: {time.time() - t0:.0f} s")
    return 0 if finite and spread < 1e-4 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--islands", type=int, default=4)
    parser.add_argument("--kill-every", type=int, default=3, help="rounds between two kills")
    parser.add_argument("--soak-seed", type=int, default=0, help="seed of the choice of victims")
    args, rest = parser.parse_known_args(argv)
    return soak(args.islands, args.kill_every, args.soak_seed, rest)


if __name__ == "__main__":
    sys.exit(main())
