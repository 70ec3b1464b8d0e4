"""What one outer round costs on loopback: the canonical-bucket path every island uses now against the
whole-vector path single-process islands used before (one hivemind averager over the parameter list).

Two islands in this process, each with its own DHT node, average a pseudo-gradient shaped like a
model preset's parameters (random values: this measures the transport, not training), alternating
the two paths round by round so both see the same machine load.  Prints seconds per round (median
and mean, with the gather/scatter of the bucket path) and the ratio, side by side::

    python benchmarks/round_cost.py --preset small --rounds 6
    python benchmarks/round_cost.py --preset 150m --rounds 3 --path whole    # 150m: one path per process,
    python benchmarks/round_cost.py --preset 150m --rounds 3 --path buckets  # both do not fit in 24 GiB
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from diloco.config import ModelConfig, resolve_model  # noqa: E402
from peers.averager import AveragerSettings, VerifiedAverager  # noqa: E402
from peers.dht import NetworkSettings, start_dht, visible_maddrs  # noqa: E402
from peers.layout import CanonicalLayout  # noqa: E402
from peers.sharded import ShardedAverager  # noqa: E402
from pipeline import shard_spec_of  # noqa: E402


def model_shapes(preset: str, n_layers: int = 0) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes of a preset (``n_layers``: other than the preset's), without weights."""
    from diloco.model import build_model

    cfg = ModelConfig(preset=preset, n_layers=n_layers)
    resolve_model(cfg)
    with torch.device("meta"):
        model = build_model(cfg)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def run_round(averagers: list, deltas: list, round_id: str) -> float:
    """Both islands average concurrently; seconds until the slower one is done (asserts success)."""
    results: list = [None, None]

    def one(i: int) -> None:
        results[i] = averagers[i].average(deltas[i], 1.0, {"config_fingerprint": "bench"}, round_id)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    for result, _ in results:
        assert result.ok, result.reason
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n-layers", type=int, default=0, help="transformer blocks (0: the preset's)")
    parser.add_argument("--bucket-numel", type=int, default=4_000_000)
    parser.add_argument("--path", choices=("both", "whole", "buckets"), default="both",
                        help="measure one path only (a large preset may not fit both in memory at once)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes = model_shapes(args.preset, args.n_layers)
    numel = sum(torch.Size(s).numel() for _, s in shapes)
    layout = CanonicalLayout.build(shapes, args.bucket_numel)
    print(f"preset {args.preset}{f' with {args.n_layers} layers' if args.n_layers else ''}: {numel:,} parameters, {numel * 4 / 1e6:.1f} MB fp32, "
          f"{len(layout.buckets)} bucket(s) of at most {args.bucket_numel:,}")
    gen = torch.Generator().manual_seed(0)
    deltas = [{n: torch.randn(s, generator=gen) * 1e-3 for n, s in shapes} for _ in range(2)]
    settings = AveragerSettings(prefix="bench", min_group_size=2, target_group_size=2, matchmaking_time=2.0,
                                request_timeout=1.0, matchmaking_timeout=60.0, allreduce_timeout=300.0,
                                next_chunk_timeout=60.0, vote_timeout=30.0)
    first = start_dht(NetworkSettings())
    dhts = [first, start_dht(NetworkSettings(initial_peers=visible_maddrs(first)))]
    paths: dict[str, tuple[list, list]] = {}
    if args.path in ("both", "whole"):
        paths["whole vector (before)"] = ([VerifiedAverager(d, [torch.zeros(s) for _, s in shapes], settings)
                                           for d in dhts], [[d[n] for n, _ in shapes] for d in deltas])
    if args.path in ("both", "buckets"):
        bucket_settings = AveragerSettings(**{**settings.__dict__, "prefix": "bench-buckets"})
        paths["canonical buckets (now)"] = ([ShardedAverager(layout, deltas[i], {n: shard_spec_of(t) for n, t in
                                                                                 deltas[i].items()}, None, dhts[i],
                                                             bucket_settings) for i in range(2)], deltas)
    times: dict[str, list[float]] = {name: [] for name in paths}
    try:
        for r in range(args.rounds + 1):  # round 0 warms every path up and is not counted
            # alternate which path goes first, so neither always meets a just-busy machine
            order = list(paths) if r % 2 == 0 else list(reversed(paths))
            took = {name: run_round(paths[name][0], paths[name][1], f"{name[:1]}{r}") for name in order}
            if r:
                for name, t in took.items():
                    times[name].append(t)
            print(f"round {r}{' (warm-up)' if not r else ''}: "
                  + ", ".join(f"{name} {t:.2f} s" for name, t in took.items()), flush=True)
    finally:
        for averagers, _ in paths.values():
            for a in averagers:
                a.shutdown()
        for d in dhts:
            d.shutdown()
    print("\n| path | median s/round | mean s/round |\n| --- | ---: | ---: |")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} | {statistics.mean(ts):.2f} |")
    if len(times) == 2:
        before, now = (statistics.median(ts) for ts in times.values())
        print(f"\nbuckets / whole vector: {now / before:.2f}x ({args.preset}, {len(layout.buckets)} bucket(s), "
              f"{args.rounds} rounds, 2 islands on loopback)")


if __name__ == "__main__":
    main()
