"""What a round of 2 islands costs at 10M to 150M parameters, in time and memory, against a gloo all-reduce
of the same tensor measured in the same run.  Not a test.

Each case runs ``diloco simulate --islands 2`` as a user would (real islands: hivemind DHTs, the averager,
transports, checkpoints off), at a model size and a wire format, for a few rounds of a few inner steps, and
reads what the islands wrote: every round's seconds (whole, and the exchange of the bytes alone), the
payload bytes, the parts sent again.  A sampler reads, every 0.2 s, the proportional set size (PSS) of each
island's whole process tree (the training process, its DHT process and p2p daemon, hivemind's averager) and
counts its processes; the peak is reported as a multiple of the fp32 parameter bytes, with and without the
fixed cost of Python, torch and hivemind (the peak of a ``tiny`` island, measured first in the same run).

    python benchmarks/averaging_scale.py                      # 10M, 40M, 85M in fp32, int8, int4; 150m int4
    python benchmarks/averaging_scale.py --sizes 40m --codecs none --rounds 4
    python benchmarks/averaging_scale.py --link 50mbit --sizes 9m --codecs none,int8   # emulated link (root)

Writes ``experiments/results/averaging-scale/`` (or ``--out``): ``results.json``, ``results.md`` and
``round_vs_gloo.png``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(preset="tiny"),
    "9m": dict(dim=384, n_layers=5, n_heads=6, ffn_dim=1024),
    "10m": dict(dim=384, n_layers=6, n_heads=6, ffn_dim=1024),
    "40m": dict(dim=640, n_layers=8, n_heads=10, ffn_dim=1728),
    "85m": dict(dim=768, n_layers=12, n_heads=12, ffn_dim=2048),
    "150m": dict(preset="150m"),
}


# --------------------------------------------------------------------------------------- gloo reference
def _gloo_worker(rank: int, port: int, numel: int, reps: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.randn(numel)
    dist.all_reduce(t)
    best = float("inf")
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        best = min(best, time.perf_counter() - t0)
    if rank == 0:
        out.put(best)
    dist.destroy_process_group()


def gloo_seconds(numel: int, reps: int = 3) -> float:
    """The fastest of ``reps`` gloo all-reduces of ``numel`` floats between 2 processes on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_gloo_worker, args=(r, port, numel, reps, q)) for r in range(2)]
    for p in procs:
        p.start()
    best = q.get(timeout=600)
    for p in procs:
        p.join(60)
    return best


# -------------------------------------------------------------------------------------- memory sampler
def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class TreeSampler:
    """Samples, for every child process of this one (an island under ``simulate``), the PSS of its whole
    process tree and its process count; keeps the peaks."""

    def __init__(self, every: float = 0.2):
        from peers.proctable import descendants

        self.descendants = descendants
        self.peak_kb: dict[int, int] = {}
        self.peak_procs: dict[int, int] = {}
        self.parts: dict[int, dict[str, int]] = {}
        """At each tree's peak: PSS (kB) by process."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        me = os.getpid()
        while not self._stop.wait(every):
            procs = self.descendants(me)
            tops = {pid for pid, st in procs.items() if st.parent == me}
            trees: dict[int, list[int]] = {t: [t] for t in tops}
            for pid, st in procs.items():
                top, parent = pid, st.parent
                while parent != me and parent in procs:
                    top, parent = parent, procs[parent].parent
                if top in trees and pid != top:
                    trees[top].append(pid)
            for top, pids in trees.items():
                if len(pids) < 2:  # not started yet, or a helper without children
                    continue
                each = {p: _pss_kb(p) for p in pids}
                kb = sum(each.values())
                if kb > self.peak_kb.get(top, 0):
                    self.parts[top] = {f"{procs[p].name if p in procs else p}:{p}": v for p, v in each.items()}
                self.peak_kb[top] = max(self.peak_kb.get(top, 0), kb)
                self.peak_procs[top] = max(self.peak_procs.get(top, 0), len(pids))

    def stop(self) -> tuple[list[int], list[int]]:
        self._stop.set()
        self._thread.join(5)
        tops = sorted(self.peak_kb, key=lambda t: -self.peak_kb[t])[:2]
        self.at_peak = [self.parts.get(t, {}) for t in tops]
        return [self.peak_kb[t] for t in tops], [self.peak_procs[t] for t in tops]


# -------------------------------------------------------------------------------------------- one case
def run_case(size: str, codec: str, rounds: int, inner_steps: int, out: Path, network: Any = None,
             entropy_coding: bool = True) -> dict:
    from diloco.config import loader as config_load
    from diloco.engine.metrics import read_metrics
    from diloco.launch.simulate import simulate
    from diloco.model.transformer import build_model

    run_dir = out / "runs" / f"{size}-{codec}"
    items = {"diloco.inner_steps": inner_steps, "diloco.outer_steps": rounds, "inner.batch_size": 2,
             "model.seq_len": 128, "logging.run_dir": str(run_dir), "logging.eval_batches": 1,
             "logging.samples": 0, "checkpoint.every": 0, "wandb.mode": "disabled",
             "averaging.compression": codec, "averaging.run_id": f"scale-{size}-{codec}",
             "inner.warmup_steps": 1, "averaging.matchmaking_time": 2.0, "averaging.request_timeout": 1.0,
             "averaging.entropy_coding": entropy_coding}
    items.update({f"model.{k}": v for k, v in SIZES[size].items()})
    cfg = config_load.load(None, {k: v for k, v in items.items()}, defaults={"averaging.min_group_size": 2})
    numel = sum(p.numel() for p in build_model(cfg.model).parameters())
    sampler = TreeSampler()
    t0 = time.time()
    hosts = [h.local_address for h in network.hosts[:2]] if network is not None else None
    summary = simulate(cfg, 2, 600.0, wrap=network.wrap if network is not None else None, host_addresses=hosts,
                       quiet=True)
    wall = time.time() - t0
    peaks_kb, procs = sampler.stop()
    rows = [[r for r in read_metrics(run_dir / f"island{i}") if "round_ok" in r] for i in range(2)]
    # a round as the island that arrived last saw it (it waited for nobody): the protocol's cost, not the skew
    # of the islands' compute
    pairs = list(zip(*rows))
    steady = [min(pair, key=lambda r: r["allreduce_seconds"]) for pair in pairs[1:]] or \
        [min(pair, key=lambda r: r["allreduce_seconds"]) for pair in pairs]
    ok = all(r["round_ok"] for island in rows for r in island)
    theta = [s.get("theta_checksum") for s in summary["islands"]]
    return {
        "size": size, "codec": codec, "params": numel, "param_bytes": 4 * numel, "rounds": rounds,
        "ok": ok and len(set(theta)) == 1, "in_sync": len(set(theta)) == 1, "wall_seconds": wall,
        "round_seconds": _median([r["allreduce_seconds"] for r in steady]),
        "exchange_seconds": _median([r.get("exchange_seconds", float("nan")) for r in steady]),
        "payload_bytes_per_round": _median([r.get("round_payload_bytes", float("nan")) for r in steady]),
        "parts_resent": sum(int(r.get("parts_resent", 0)) for island in rows for r in island),
        "failed_rounds": sum(1 for island in rows for r in island if not r["round_ok"]),
        "peak_pss_gb": [kb / 1e6 for kb in peaks_kb], "processes": procs,
        "peak_pss_by_process_mb": [{k: v / 1e3 for k, v in parts.items()} for parts in sampler.at_peak],
    }


def _median(xs: list[float]) -> float:
    xs = sorted(x for x in xs if x == x)
    return xs[len(xs) // 2] if xs else float("nan")


# ------------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10m,40m,85m")
    parser.add_argument("--codecs", default="none,int8,int4")
    parser.add_argument("--big", default="150m:int4", help="SIZE:CODEC runs beside the grid (empty: none)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=2)
    parser.add_argument("--link", default="", help="emulated link rate between the 2 islands (needs root)")
    parser.add_argument("--entropy-coding", default="false", choices=("true", "false"),
                        help="Huffman-code int8/int4 payloads (off by default here: on loopback it costs more CPU "
                             "than the bytes it saves)")
    parser.add_argument("--out", default=str(REPO / "experiments" / "results" / "averaging-scale"))
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    network = None
    if args.link:
        from experiments.netns import EmulatedNetwork

        network = EmulatedNetwork(2, rate=args.link, run_id="scale").__enter__()
    try:
        cases = [(s, c) for s in args.sizes.split(",") if s for c in args.codecs.split(",") if c]
        cases += [tuple(x.split(":")) for x in args.big.split(",") if x]
        fixed = run_case("tiny", "none", 2, 2, out, network)
        print(f"fixed cost (tiny island tree): {max(fixed['peak_pss_gb']):.2f} GB PSS, "
              f"{max(fixed['processes'])} processes", flush=True)
        results = []
        gloo: dict[int, float] = {}
        for size, codec in cases:
            r = run_case(size, codec, args.rounds, args.inner_steps, out, network, args.entropy_coding == "true")
            r["entropy_coding"] = args.entropy_coding == "true" and codec in ("int8", "int4")
            if r["params"] not in gloo:
                gloo[r["params"]] = gloo_seconds(r["params"])
            r["gloo_seconds"] = gloo[r["params"]]
            r["round_vs_gloo"] = r["round_seconds"] / r["gloo_seconds"]
            r["exchange_vs_gloo"] = r["exchange_seconds"] / r["gloo_seconds"]
            fixed_gb = max(fixed["peak_pss_gb"])
            r["peak_x_params"] = max(r["peak_pss_gb"]) * 1e9 / r["param_bytes"]
            r["peak_over_fixed_x_params"] = (max(r["peak_pss_gb"]) - fixed_gb) * 1e9 / r["param_bytes"]
            if network is not None:
                rate = network.rate_bits_per_s if hasattr(network, "rate_bits_per_s") else float("nan")
                r["link_seconds"] = r["payload_bytes_per_round"] * 8 / rate if rate == rate else float("nan")
            results.append(r)
            print(_line(r), flush=True)
        (out / "results.json").write_text(json.dumps({"fixed": fixed, "results": results, "link": args.link},
                                                     indent=2))
        (out / "results.md").write_text(_table(fixed, results, args.link))
        _plot(results, out / "round_vs_gloo.png")
        print((out / "results.md").read_text())
    finally:
        if network is not None:
            network.__exit__(None, None, None)
    return 0


def _line(r: dict) -> str:
    return (f"{r['size']:>5} {r['codec']:>4}: {r['params'] / 1e6:6.1f}M params, round {r['round_seconds']:.3f} s "
            f"(exchange {r['exchange_seconds']:.3f} s) vs gloo {r['gloo_seconds']:.3f} s = {r['round_vs_gloo']:.1f}x, "
            f"peak {max(r['peak_pss_gb']):.2f} GB = {r['peak_x_params']:.1f}x params "
            f"({r['peak_over_fixed_x_params']:.1f}x over the fixed cost), {max(r['processes'])} processes, "
            f"{r['parts_resent']} parts resent, {'in sync' if r['in_sync'] else 'OUT OF SYNC'}")


def _table(fixed: dict, results: list[dict], link: str) -> str:
    head = ("| params | wire | round s | exchange s | gloo s | round ÷ gloo | exchange ÷ gloo | payload MB/round "
            "| peak PSS GB (each island) | ÷ fp32 params | over fixed ÷ params | processes | parts resent | in sync |")
    lines = [f"Fixed cost (a `tiny` island's tree, same run): {max(fixed['peak_pss_gb']):.2f} GB PSS.",
             f"Link: {link or 'loopback'}.", "", head, "|" + "---|" * 14]
    for r in results:
        lines.append(f"| {r['params'] / 1e6:.1f}M | {r['codec']} | {r['round_seconds']:.3f} | {r['exchange_seconds']:.3f} | "
                     f"{r['gloo_seconds']:.3f} | {r['round_vs_gloo']:.1f} | {r['exchange_vs_gloo']:.1f} | "
                     f"{r['payload_bytes_per_round'] / 1e6:.1f} | {' / '.join(f'{g:.2f}' for g in r['peak_pss_gb'])} | "
                     f"{r['peak_x_params']:.1f} | {r['peak_over_fixed_x_params']:.1f} | "
                     f"{max(r['processes'])} | {r['parts_resent']} | {'yes' if r['in_sync'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def _plot(results: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for codec in sorted({r["codec"] for r in results}):
        rs = sorted((r for r in results if r["codec"] == codec), key=lambda r: r["params"])
        ax.plot([r["params"] / 1e6 for r in rs], [r["round_seconds"] for r in rs], "o-", label=f"round, {codec}")
    rs = sorted({r["params"]: r for r in results}.values(), key=lambda r: r["params"])
    ax.plot([r["params"] / 1e6 for r in rs], [r["gloo_seconds"] for r in rs], "k--", label="gloo all_reduce")
    ax.plot([r["params"] / 1e6 for r in rs], [3 * r["gloo_seconds"] + 0.3 for r in rs], "k:", label="goal: 3x gloo + 0.3 s")
    ax.set_xlabel("parameters (millions)")
    ax.set_ylabel("seconds per round")
    ax.set_title("2 islands on loopback: a round against a gloo all-reduce of the same tensor")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
