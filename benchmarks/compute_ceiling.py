"""How fast can DiLoCo beat DDP on this machine, whatever the link does?  Not a test.

The compare (``diloco experiment compare --islands 4 --rate 20mbit``) runs 4 islands on the machine's cores.
However well rounds hide under the inner steps, an island's wall-clock is at least its own compute, so
DDP's wall-clock ÷ DiLoCo's compute bounds the speed-up the compare can show.  This measures that compute
side by side, in one run: the compare's inner step (``small``, 16×128 tokens of the embedded corpus, AdamW,
one thread) in one process alone, in ``k`` processes at once, and in ``k`` processes pinned round-robin
to the cores (``os.sched_setaffinity``), then prints the ceiling for the compare's steps per island
against a DDP wall-clock (by default the one in ``experiments/results/compare-timed-sign/results.json``).

Run:  python benchmarks/compute_ceiling.py [--islands 4] [--steps 40] [--ddp-wall SECONDS]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULTS = REPO / "experiments" / "results" / "compare-timed-sign" / "results.json"


def worker(steps: int, cpu: int | None) -> None:
    """Time ``steps`` inner steps of the compare's island and print the median seconds as JSON."""

    import torch

    from diloco.config import loader as config_load
    from diloco.engine.trainer import TrainerCore
    from experiments.compare import COMPARE_DEFAULTS

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    cfg = config_load.load(None, [], defaults=COMPARE_DEFAULTS)
    core = TrainerCore(cfg, mesh=None, parallel=cfg.parallel, device=torch.device("cpu"), shard=0, shards=1,
                       evaluates=False)
    core.start_inner(steps)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
    times = sorted(times[len(times) // 5:])  # the first steps warm the allocator and caches
    print(json.dumps({"median_s": times[len(times) // 2]}), flush=True)


def run_together(n: int, steps: int, pinned: bool) -> float:
    """Median seconds a step of ``n`` processes run at once (the slowest process's median)."""
    cores = sorted(os.sched_getaffinity(0))
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--steps", str(steps),
                               *(["--cpu", str(cores[i % len(cores)])] if pinned else [])],
                              stdout=subprocess.PIPE, text=True) for i in range(n)]
    medians = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"a worker failed (exit {p.returncode}); run it alone with --worker to see why")
        medians.append(json.loads(out.strip().splitlines()[-1])["median_s"])
    return max(medians)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--islands", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per process")
    parser.add_argument("--island-steps", type=int, default=300, help="inner steps per island in the compare")
    parser.add_argument("--ddp-wall", type=float, default=None, help="DDP's wall-clock in seconds "
                        f"(default: the baseline's in {RESULTS.relative_to(REPO)})")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.cpu)
        return 0
    ddp = args.ddp_wall
    if ddp is None:
        runs = json.loads(RESULTS.read_text())["runs"]
        ddp = next(r["wall_seconds"] for r in runs if r["kind"] == "ddp")
    cores = len(os.sched_getaffinity(0))
    rows = [("1 process alone", run_together(1, args.steps, False)),
            (f"{args.islands} at once", run_together(args.islands, args.steps, False)),
            (f"{args.islands} at once, pinned round-robin to {cores} cores", run_together(args.islands, args.steps, True))]
    alone, together = rows[0][1], min(rows[1][1], rows[2][1])
    print(f"\n{'inner step of the compare (small, 16x128 tokens, 1 thread)':62s} {'s/step':>7s} {'vs alone':>9s}")
    for name, s in rows:
        print(f"{name:62s} {s:7.3f} {s / alone:8.2f}×")
    shared = args.islands * args.island_steps * alone / cores
    print(f"\nDDP's wall-clock: {ddp:.0f} s.  The most DiLoCo can beat it by here, with {args.islands} islands of "
          f"{args.island_steps} steps on {cores} cores and no time lost to communication:")
    print(f"- islands computing all at once: {args.island_steps} × {together:.3f} s = {args.island_steps * together:.0f} s "
          f"of compute each → {ddp / (args.island_steps * together):.1f}×")
    print(f"- the cores shared without any loss: {args.islands} × {args.island_steps} × {alone:.3f} s ÷ {cores} = "
          f"{shared:.0f} s → {ddp / shared:.1f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
