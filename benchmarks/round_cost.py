"""What one outer round costs on loopback, two ways side by side.

``--compare layout`` (default): the canonical-bucket path every island uses now against the
whole-vector path single-process islands used before (one hivemind averager over the parameter list).
``--compare protocol``: one averager over the parameter list with the round protocol of before (the
vote polled through the DHT; a group that waits out ``matchmaking_time``, as ``diloco train`` with
``--averaging.target_group_size 0`` did) against the one of now (verdicts sent member to member; the
group forms as soon as the expected islands joined).

Two islands in this process, each with its own DHT node, average a pseudo-gradient shaped like a
model preset's parameters (random values: this measures the transport, not training), alternating
the two paths round by round so both see the same machine load.  Prints seconds per round and its
parts (matchmaking, all-reduce, vote; median [min-max] over rounds and islands) and the ratio::

    python benchmarks/round_cost.py --preset small --rounds 6
    python benchmarks/round_cost.py --preset small --rounds 10 --compare protocol
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
from peers.averaging.sharded import ShardedAverager  # noqa: E402
from peers.discovery.dht import start_dht, visible_maddrs  # noqa: E402
from peers.group.averager import AveragerSettings, VerifiedAverager  # noqa: E402
from peers.settings import NetworkSettings, Scope  # noqa: E402
from peers.island.layout import CanonicalLayout  # noqa: E402
from pipeline import shard_spec_of  # noqa: E402


def model_shapes(preset: str, n_layers: int = 0) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes of a preset (``n_layers``: other than the preset's), without weights."""
    from diloco.model.transformer import build_model

    cfg = ModelConfig(preset=preset, n_layers=n_layers)
    resolve_model(cfg)
    with torch.device("meta"):
        model = build_model(cfg)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def run_round(averagers: list, deltas: list, round_id: str, expected: int | None) -> tuple[float, list]:
    """Both islands average concurrently; seconds until the slower one is done and their results.
    ``expected``: the group size to expect (None: not told)."""
    results: list = [None, None]

    def one(i: int) -> None:
        extra = {"expected_group_size": expected} if expected else {}
        results[i] = averagers[i].average(deltas[i], 1.0, {"config_fingerprint": "bench"}, round_id, **extra)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    return seconds, [r for r, _ in results]


def parts(result) -> dict[str, float]:
    """The round's protocol cost by phase, where the result tells them apart."""
    if not hasattr(result, "allreduce_seconds"):
        return {}
    return {"matchmaking": result.matchmaking_seconds - result.allreduce_seconds,
            "all-reduce": result.allreduce_seconds, "vote": result.vote_seconds}


def spread(values: list[float]) -> str:
    """Median [min-max] in milliseconds."""
    if not values:
        return "–"
    return f"{statistics.median(values) * 1e3:.0f} [{min(values) * 1e3:.0f}–{max(values) * 1e3:.0f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n-layers", type=int, default=0, help="transformer blocks (0: the preset's)")
    parser.add_argument("--bucket-numel", type=int, default=4_000_000)
    parser.add_argument("--path", choices=("both", "whole", "buckets"), default="both",
                        help="measure one path only (a large preset may not fit both in memory at once)")
    parser.add_argument("--compare", choices=("layout", "protocol"), default="layout",
                        help="buckets vs whole vector, or the round protocol of before vs now")
    parser.add_argument("--matchmaking-time", type=float, default=5.0,
                        help="--compare protocol: the matchmaking window (diloco train's default)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shapes = model_shapes(args.preset, args.n_layers)
    numel = sum(torch.Size(s).numel() for _, s in shapes)
    layout = CanonicalLayout.build(shapes, args.bucket_numel)
    print(f"preset {args.preset}{f' with {args.n_layers} layers' if args.n_layers else ''}: {numel:,} parameters, {numel * 4 / 1e6:.1f} MB fp32, "
          f"{len(layout.buckets)} bucket(s) of at most {args.bucket_numel:,}")
    gen = torch.Generator().manual_seed(0)
    deltas = [{n: torch.randn(s, generator=gen) * 1e-3 for n, s in shapes} for _ in range(2)]
    settings = AveragerSettings(min_group_size=2, target_group_size=2, matchmaking_time=2.0,
                                request_timeout=1.0, matchmaking_timeout=60.0, allreduce_timeout=300.0,
                                next_chunk_timeout=60.0, vote_timeout=30.0)
    first = start_dht(NetworkSettings())
    dhts = [first, start_dht(NetworkSettings(initial_peers=visible_maddrs(first)))]
    paths: dict[str, tuple[list, list, int | None]] = {}
    whole = [[d[n] for n, _ in shapes] for d in deltas]
    if args.compare == "protocol":
        for name, direct, expected in (("polled vote, full window (before)", False, None),
                                       ("direct vote, expected group (now)", True, 2)):
            protocol = AveragerSettings(**{**settings.__dict__, "target_group_size": 0,
                                           "matchmaking_time": args.matchmaking_time})
            scope = Scope(prefix=f"bench-{int(direct)}", direct_votes=direct)
            paths[name] = ([VerifiedAverager(d, [torch.zeros(shape) for _, shape in shapes], protocol, scope)
                            for d in dhts], whole, expected)
    if args.compare == "layout" and args.path in ("both", "whole"):
        paths["whole vector (before)"] = ([VerifiedAverager(d, [torch.zeros(s) for _, s in shapes], settings,
                                                            Scope(prefix="bench")) for d in dhts], whole, None)
    if args.compare == "layout" and args.path in ("both", "buckets"):
        paths["canonical buckets (now)"] = ([ShardedAverager(layout, deltas[i], {n: shard_spec_of(t) for n, t in
                                                                                 deltas[i].items()}, None, dhts[i],
                                                             settings, Scope(prefix="bench-buckets"))
                                             for i in range(2)], deltas, None)
    times: dict[str, list[float]] = {name: [] for name in paths}
    phases: dict[str, dict[str, list[float]]] = {name: {} for name in paths}
    try:
        for r in range(args.rounds + 1):  # round 0 warms every path up and is not counted
            # alternate which path goes first, so neither always meets a just-busy machine
            order = list(paths) if r % 2 == 0 else list(reversed(paths))
            took = {name: run_round(*paths[name][:2], f"{name[:1]}{r}", paths[name][2]) for name in order}
            failed = {name: res[0].reason for name, (_, res) in took.items() if not all(x.ok for x in res)}
            for name, reason in failed.items():  # hivemind loses a part now and then on a loaded machine
                print(f"round {r}: {name} failed ({reason}); not counted", flush=True)
                took.pop(name)
            if r:
                for name, (t, results) in took.items():
                    times[name].append(t)
                    for result in results:
                        for phase, seconds in parts(result).items():
                            phases[name].setdefault(phase, []).append(seconds)
            print(f"round {r}{' (warm-up)' if not r else ''}: "
                  + ", ".join(f"{name} {t:.2f} s" for name, (t, _) in took.items()), flush=True)
    finally:
        for averagers, _, _ in paths.values():
            for a in averagers:
                a.shutdown()
        for d in dhts:
            d.shutdown()
    print("\n| path | median s/round | mean s/round | round ms | matchmaking ms | all-reduce ms | vote ms |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, ts in times.items():
        if not ts:
            continue
        cells = [spread(phases[name].get(p, [])) for p in ("matchmaking", "all-reduce", "vote")]
        print(f"| {name} | {statistics.median(ts):.2f} | {statistics.mean(ts):.2f} | {spread(ts)} | {' | '.join(cells)} |")
    print("\n(ms: median [min–max]; round: the slower island; phases: every island's own)")
    if len(times) == 2 and all(times.values()):
        before, now = (statistics.median(ts) for ts in times.values())
        what = "buckets / whole vector" if args.compare == "layout" else "now / before"
        print(f"\n{what}: {now / before:.2f}x ({args.preset}, {len(layout.buckets)} bucket(s), "
              f"{args.rounds} rounds, 2 islands on loopback)")


if __name__ == "__main__":
    main()
