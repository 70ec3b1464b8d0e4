"""What one rank of an island holds in host memory, before and after the island builds its model as a skeleton
(meta-device init) and shards it with FSDP over ``--parallel.dp`` (CPU, gloo).  Not a test.

    python benchmarks/island_memory.py                     # 150m preset, dp 1 and 2, full build and skeleton
    python benchmarks/island_memory.py --preset small --dp 1,2,4

Each row is one torchrun job of ``dp`` processes that builds ``ModelParts`` (from a full model built on every
rank, the way the island started before, or from a skeleton with each rank drawing its own pieces), the inner
AdamW and the outer state (θ_global and the outer momentum of its pieces), then takes 2 inner steps on real
text.  Per rank: the peak resident set (``VmHWM``) above what the process held once torch was imported and the text loaded, in
multiples of the model's fp32 parameter bytes (measured once the text is loaded); for the job: the PSS of all its processes together at the end.
Writes ``--out`` (default experiments/results/island-memory/): results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def pss_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def worker(preset: str, skeleton: bool, out: str) -> None:
    """One rank: build, step twice, report (run under torchrun)."""
    import torch
    import torch.distributed as dist

    from diloco.config import DataConfig, InnerOptimConfig, ModelConfig, resolve_model
    from diloco.data.batches import ShardedBatches
    from diloco.data.corpus import load_corpus
    from diloco.model.inner import build_inner_optimizer, take_inner_step
    from diloco.model.transformer import build_model, initial_model, lm_loss
    from outer_optim import OuterOptimizer
    from pipeline import ModelParts, ParallelSettings
    from pipeline.mesh import init_island_mesh

    torch.set_num_threads(1)
    dp = int(os.environ["WORLD_SIZE"])
    cfg = ModelConfig(preset=preset, seq_len=128)
    resolve_model(cfg)
    mesh = init_island_mesh(1, 1, "cpu", dp=dp) if dp > 1 else None
    rank = dist.get_rank() if dp > 1 else 0
    corpus = load_corpus(DataConfig())
    base = status_kb("VmRSS")  # imports, process group and text: what the model adds comes after
    settings = ParallelSettings(dp=dp)
    if skeleton:
        model, init = initial_model(cfg, seed=0)
        parts = ModelParts(model, mesh, settings, loss_fn=lm_loss, device="cpu", init=init)
    else:
        parts = ModelParts(build_model(cfg, seed=0), mesh, settings, loss_fn=lm_loss, device="cpu")
    batches = ShardedBatches(corpus.train, cfg.seq_len, 2, 0, 1, 0, replica=rank, replicas=dp)
    inner = InnerOptimConfig()
    opt, sched = build_inner_optimizer(list(parts.named_parameters()), inner, 10)
    outer = OuterOptimizer(parts.local_named_parameters())
    for _ in range(2):
        take_inner_step(parts, batches, opt, sched, inner)
    outer.pseudo_gradient(parts.local_named_parameters())
    n_params = sum(p.numel() for p in build_model(cfg).parameters()) if rank == 0 else 0
    row = {"rank": rank, "peak_above_import_kb": status_kb("VmHWM") - base, "pss_kb": pss_kb(),
           "local_numel": sum(t.numel() for t in parts.local_named_parameters().values()), "params": n_params}
    rows = [None] * dp
    if dp > 1:
        dist.all_gather_object(rows, row)
    else:
        rows = [row]
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    if dp > 1:
        dist.destroy_process_group()


def run(preset: str, dp: int, skeleton: bool, where: Path) -> dict:
    out = where / f"{preset}-dp{dp}-{'skeleton' if skeleton else 'full'}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(dp),
           __file__, "--worker", preset, "1" if skeleton else "0", str(out)]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rows = json.loads(out.read_text())
    param_kb = rows[0]["params"] * 4 / 1024
    peak = max(r["peak_above_import_kb"] for r in rows)
    return {"preset": preset, "dp": dp, "build": "skeleton" if skeleton else "full model on every rank",
            "params": rows[0]["params"], "local_share": max(r["local_numel"] for r in rows) / rows[0]["params"],
            "peak_rank_gb": peak / 1e6 * 1.024, "peak_rank_x": peak / param_kb,
            "job_pss_gb": sum(r["pss_kb"] for r in rows) / 1e6 * 1.024}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3] == "1", sys.argv[4])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="150m")
    ap.add_argument("--dp", default="1,2")
    ap.add_argument("--out", default=str(REPO / "experiments" / "results" / "island-memory"))
    args = ap.parse_args()
    where = Path(args.out)
    where.mkdir(parents=True, exist_ok=True)
    rows = []
    for dp in (int(x) for x in args.dp.split(",")):
        for skeleton in (False, True):
            rows.append(run(args.preset, dp, skeleton, where))
            print(json.dumps(rows[-1]), flush=True)
    (where / "results.json").write_text(json.dumps(rows, indent=1))
    lines = [f"# One island rank's host memory: {args.preset} ({rows[0]['params'] / 1e6:.0f}M parameters, "
             f"{rows[0]['params'] * 4 / 1e9:.2f} GB in fp32)", "",
             "`python benchmarks/island_memory.py` on CPU/gloo, 2 inner steps, seq 128, batch 2 per replica.", "",
             "| dp | build | pieces per rank | peak per rank (above imports + text) | x param bytes | all ranks' PSS |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dp']} | {r['build']} | {r['local_share']:.0%} | {r['peak_rank_gb']:.2f} GB | "
                     f"{r['peak_rank_x']:.1f}x | {r['job_pss_gb']:.2f} GB |")
    (where / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
