"""How long each round holds the training thread, with the round on its own thread and on the training thread,
measured side by side in one run.  Not a test.

Each case runs ``diloco simulate --islands 2`` as a user would (real hivemind DHTs, averagers and transports on
loopback) with the 40M model of ``docs/averaging.md`` (seq 128, batch 4), H = 4, for a few rounds, with
``--diloco.round_thread`` true and false, ``--diloco.overlap`` delayed and none (blocking).  From each island's
``metrics.jsonl`` it reads every round's ``stall_seconds`` (seconds the training thread did not train because
of the round: handing it over, waiting for it, applying it) and the island's compute seconds per round, and
reports the median stall of rounds 2 on (the first round carries the islands' meeting) as a share of a
round's inner steps.

    python benchmarks/round_stall.py                         # 40M, delayed and blocking, both threads
    python benchmarks/round_stall.py --sizes 10m --rounds 4 --overlaps delayed
    python benchmarks/round_stall.py --parallel-dp 2         # islands of 2 FSDP processes each (torchrun)

Writes ``experiments/results/round-stall/`` (or ``--out``): ``results.json`` and ``results.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES: dict[str, dict[str, int]] = {
    "10m": dict(dim=384, n_layers=6, n_heads=6, ffn_dim=1024),
    "40m": dict(dim=640, n_layers=8, n_heads=10, ffn_dim=1728),
}


def run_case(size: str, overlap: str, round_thread: bool, rounds: int, dp: int, out: Path) -> dict[str, Any]:
    """Two islands of ``size`` for ``rounds`` rounds; the median stall and compute per round of each island."""
    from diloco.config.loader import load
    from diloco.launch.simulate import simulate

    name = f"{size}-{overlap}-{'thread' if round_thread else 'inline'}" + (f"-dp{dp}" if dp > 1 else "")
    run_dir = out / "runs" / name
    items = {"model.seq_len": 128, "inner.batch_size": 4, "diloco.inner_steps": 4, "diloco.outer_steps": rounds,
             "diloco.overlap": overlap, "diloco.round_thread": round_thread, "averaging.backend": "hivemind",
             "averaging.min_group_size": 2, "averaging.matchmaking_time": 2.0, "averaging.request_timeout": 1.0,
             "logging.run_dir": str(run_dir), "logging.eval_every": 1000, "logging.samples": 0,
             "logging.eval_batches": 1, "checkpoint.every": 0, "wandb.mode": "disabled", "parallel.dp": dp,
             "averaging.run_id": f"stall-{name}", "data.max_bytes": 4_000_000, "threads": 1}
    items.update({f"model.{k}": v for k, v in SIZES[size].items()})
    cfg = load(None, [x for k, v in items.items() for x in (f"--{k}", str(v))])
    result = simulate(cfg, 2, startup_timeout=180, quiet=True)
    islands = []
    for i, summary in enumerate(result["islands"]):
        records = [json.loads(line) for line in (run_dir / f"island{i}" / "metrics.jsonl").read_text().splitlines()]
        stalls = [r["stall_seconds"] for r in records if "round_ok" in r][1:]
        compute = summary["compute_seconds"] / max(summary["outer_step"], 1)
        islands.append({"stall_median_s": statistics.median(stalls), "stall_max_s": max(stalls),
                        "compute_per_round_s": compute, "share": statistics.median(stalls) / compute,
                        "rounds_ok": summary["rounds_ok"], "rounds": summary["outer_step"]})
    return {"case": name, "size": size, "overlap": overlap, "round_thread": round_thread, "dp": dp,
            "theta_spread": result["theta_global_max_abs_diff"], "islands": islands}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="40m")
    parser.add_argument("--overlaps", default="delayed,none")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--parallel-dp", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "experiments" / "results" / "round-stall")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in args.sizes.split(","):
        for overlap in args.overlaps.split(","):
            for round_thread in (True, False):
                row = run_case(size, overlap, round_thread, args.rounds, args.parallel_dp, args.out)
                rows.append(row)
                share = ", ".join(f"{isl['stall_median_s']:.3f} s ({100 * isl['share']:.1f}%)" for isl in row["islands"])
                print(f"{row['case']}: median stall per round {share}", flush=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = ["| size | overlap | round on | dp | median stall per round (island 0 / 1) | of a round's inner steps | "
             "compute per round | rounds ok | θ spread |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a, b = r["islands"]
        lines.append(f"| {r['size']} | {r['overlap']} | {'own thread' if r['round_thread'] else 'training thread'} | "
                     f"{r['dp']} | {a['stall_median_s']:.3f} / {b['stall_median_s']:.3f} s | "
                     f"{100 * a['share']:.1f}% / {100 * b['share']:.1f}% | {a['compute_per_round_s']:.2f} s | "
                     f"{a['rounds_ok']}/{a['rounds']}, {b['rounds_ok']}/{b['rounds']} | {r['theta_spread']:.1e} |")
    (args.out / "results.md").write_text("# The training thread's stall per round\n\n"
                                         f"`python benchmarks/round_stall.py --sizes {args.sizes} --overlaps "
                                         f"{args.overlaps} --rounds {args.rounds} --parallel-dp {args.parallel_dp}` "
                                         f"(2 islands on this 2-core machine)\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
