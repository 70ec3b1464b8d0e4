"""What the keyed check of a download costs beside the download itself, at a model's size, on loopback.

One island of one rank serves θ_global and the outer momentum (:class:`peers.wire.state_share.StateServer`, real
transports, the canonical layout of one flat parameter of ``--params`` elements in ``--bucket-numel`` buckets).  A
joiner downloads every bucket (:func:`peers.wire.state_share.download`), then has it witnessed by the same island
(:func:`peers.wire.state_share.witness`: keyed prints under a fresh seed).  Both are timed ``--repeats`` times, one
after the other, in one process: the ratio is what the check adds to a catch-up.

    python -m benchmarks.witness_cost --params 40000000 --out experiments/results/witness-cost
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from experiments.report import markdown_table, save_results
from peers.identity import Identity
from peers.island.exchange import by_bucket
from peers.island.layout import CanonicalLayout
from peers.wire.state_share import StateServer, download, witness
from peers.wire.transport import Transport


def measure(params: int, bucket_numel: int, repeats: int) -> dict:
    """Median seconds of a whole download and of its witness check, with the check's verdict."""
    layout = CanonicalLayout.build([("theta", (params,))], bucket_numel)
    theta = {"theta": torch.randn(params)}
    momentum = {"theta": torch.randn(params)}
    pieces = by_bucket(layout, {"theta": (0, 0, params)})
    donor, joiner = Transport(Identity.generate()), Transport(Identity.generate())
    try:
        exchange = SimpleNamespace(layout=layout, contribution=lambda b: list(pieces.get(b, [])))
        StateServer(donor, exchange, lambda: ({"outer_step": 1}, theta, momentum), threading.Lock())
        buckets = {b.index: b.numel for b in layout.buckets}
        downloads, checks, verdicts = [], [], []
        for i in range(repeats):
            t0 = time.perf_counter()
            got, why = download(joiner, [donor.endpoint], buckets, 300.0, f"d{i}")
            downloads.append(time.perf_counter() - t0)
            if why:
                raise RuntimeError(why)
            t0 = time.perf_counter()
            answer = witness(joiner, [[donor.endpoint]], {b: d.theta for b, d in got.items()}, 300.0, f"w{i}")
            checks.append(time.perf_counter() - t0)
            verdicts.append(answer[0] is not None and answer[0][1])
        return {"params": params, "buckets": len(layout.buckets), "download_s": statistics.median(downloads),
                "check_s": statistics.median(checks), "confirmed": all(verdicts),
                "ratio": statistics.median(checks) / statistics.median(downloads)}
    finally:
        donor.close()
        joiner.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", default="9000000,40000000", help="comma-separated parameter counts")
    p.add_argument("--bucket-numel", type=int, default=2 ** 22)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (an island's serving threads share cores)")
    p.add_argument("--out", default="experiments/results/witness-cost")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    for n in (int(x) for x in args.params.split(",")):
        r = measure(n, args.bucket_numel, args.repeats)
        print(f"{n:,} parameters: download {r['download_s']:.2f} s, keyed check {r['check_s']:.2f} s "
              f"({r['ratio']:.2f}x), confirmed {r['confirmed']}", flush=True)
        results.append(r)
    rows = [[f"{r['params']:,}", r["buckets"], f"{r['download_s']:.2f} s", f"{r['check_s']:.2f} s",
             f"{r['ratio']:.2f}", r["confirmed"]] for r in results]
    table = markdown_table(["parameters", "buckets", "download (θ + momentum)", "keyed check", "check / download",
                            "confirmed"], rows)
    save_results(Path(args.out), f"# The keyed check of a download, beside the download\n\n{table}", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
