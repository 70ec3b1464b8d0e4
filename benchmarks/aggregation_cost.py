"""What each rule of :func:`peers.aggregation.aggregate` costs against ``mean``, side by side in one run.  Not a
test.

    python benchmarks/aggregation_cost.py                      # 8 members × 10M fp32, the machine's threads
    python benchmarks/aggregation_cost.py --threads 1 --numel 1000000

One honest group (Gaussian Δs around a common direction, equal weights, nobody clipped) and the same group with
one member's Δ ×1000 (clipped by the clipped rules), so that both the free path of an honest round and the
clipped path are timed.  The rules take turns, ``--rounds`` times, so a machine that slows down mid-run slows
them alike; the figure is each rule's fastest turn, and its ratio to ``mean``'s.  Also timed: the member norms
(:func:`peers.aggregation.member_norms`, what :func:`~peers.aggregation.member_norm_check` needs), the members'
distances to the aggregate (:func:`peers.aggregation.outliers`, paid by a robust round unless ``centered-clip``
measured them at its fixed point), a whole robust round's aggregation (the member check, ``centered-clip`` and the
outlier check: :func:`peers.wire.encoded.aggregate_checked`), and a
torch ``x.norm()`` per member for comparison (a reduction that splits its sum by thread, which the norms here
avoid).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from peers.aggregation import AGGREGATES, aggregate, member_norms, outliers  # noqa: E402
from peers.wire.encoded import aggregate_checked  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--numel", type=int, default=10_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    common = torch.randn(args.numel, generator=g)
    honest = {f"m{i}": common + torch.randn(args.numel, generator=g) for i in range(args.members)}
    attacked = dict(honest, m0=honest["m0"] * 1000)
    weights = {p: 1.0 for p in honest}
    out = torch.empty(args.numel)
    arms = [(f"{rule}, {name}", lambda v=values, r=rule: aggregate(v, weights, r, out=out))
            for name, values in (("honest", honest), ("one ×1000", attacked)) for rule in AGGREGATES]
    center = aggregate(honest, weights, "mean")
    arms += [("member_norms", lambda: member_norms(honest)),
             ("outliers (distances to the aggregate)", lambda: outliers(honest, center)),
             ("centered-clip + check + outliers, honest", lambda: aggregate_checked(
                 honest, weights, "centered-clip", 10.0, out, outlier=4.0)),
             ("torch x.norm() per member", lambda: [float(v.norm()) for v in honest.values()])]
    best = {name: float("inf") for name, _ in arms}
    for _ in range(args.rounds):
        for name, call in arms:
            t0 = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - t0)
    print(f"{args.members} members × {args.numel:,} fp32, {torch.get_num_threads()} torch thread(s), "
          f"fastest of {args.rounds}")
    for name, _ in arms:
        base = best[f"mean, {name.split(', ')[1]}"] if ", " in name else best["mean, honest"]
        print(f"  {name:34s} {best[name] * 1e3:9.1f} ms   {best[name] / base:6.2f}× mean")


if __name__ == "__main__":
    main()
