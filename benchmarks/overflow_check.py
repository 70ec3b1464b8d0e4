"""What the outer step's overflow check (:meth:`outer_optim.outer.OuterOptimizer.step_is_finite`) holds a blocking
round, with θ_global and the momentum measured beside training after the last commit
(:meth:`~outer_optim.outer.OuterOptimizer.measure`) and without.  Not a test.

    python benchmarks/overflow_check.py                  # 40M fp32 parameters in 10 tensors
    python benchmarks/overflow_check.py --numel 9000000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from outer_optim.outer import OuterOptimizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=40_000_000)
    ap.add_argument("--tensors", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    each = args.numel // args.tensors
    params = {f"p{i}": torch.randn(each, generator=g) for i in range(args.tensors)}
    opt = OuterOptimizer(params, lr=0.7, momentum=0.9)
    delta = {n: torch.randn(each, generator=g) * 1e-3 for n in params}
    opt.step(delta)
    arms = {"unmeasured (before)": lambda: None, "measured after the commit": opt.measure}
    best = {name: float("inf") for name in arms}
    for _ in range(args.rounds):  # the arms take turns: a machine that slows down slows both
        for name, prepare in arms.items():
            opt._magnitudes = None
            prepare()
            t0 = time.perf_counter()
            opt.step_is_finite(delta)
            best[name] = min(best[name], time.perf_counter() - t0)
    print(f"{args.numel:,} fp32 parameters in {args.tensors} tensors, {torch.get_num_threads()} torch thread(s), "
          f"fastest of {args.rounds}")
    base = best["unmeasured (before)"]
    for name, seconds in best.items():
        print(f"  {name:28s} {seconds * 1e3:7.1f} ms   {seconds / base:5.2f}× before")


if __name__ == "__main__":
    main()
