"""Benchmark of tensor/pipeline-parallel islands (package ``pipeline``); not a test.

1. Pipeline bubble: for ``p`` stages and ``m`` micro-batches, each schedule's measured idle
   fraction per rank (1 - time inside stage forward/backward / wall time of the step) next to
   the theory, (p-1)/(m+p-1) for GPipe and 1F1B and (p-1)/(v*m+p-1) for interleaved 1F1B.
2. Throughput (tokens/s) of tp/pp islands relative to a single process, all in this run.
(MFU of one GPU, with bf16 and compiled blocks: benchmarks/gpu_island.py.)

Run:  python benchmarks/pipeline_bench.py [--pp 2] [--microbatches 2,4,8] [--steps 4]
Multi-process parts run on CPU/gloo in subprocesses, one thread per rank; on a machine with fewer
cores than ranks the numbers mix parallelism with time-sharing (the table says so).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from diloco.config import ModelConfig  # noqa: E402
from diloco.model.transformer import build_model, count_parameters  # noqa: E402
from pipeline.mesh import destroy_island, free_port, init_island_mesh  # noqa: E402
from pipeline.model_parts import ModelParts  # noqa: E402
from pipeline.settings import ParallelSettings  # noqa: E402


def bench_model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(preset="custom", dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                       ffn_dim=args.ffn_dim, seq_len=args.seq, vocab_size=256)


def theory_idle(schedule: str, p: int, m: int, v: int) -> float:
    """Bubble share of a step (Narayanan et al. 2021): idle / (idle + busy)."""
    if p <= 1:
        return 0.0
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (m + p - 1)


# ---------------------------------------------------------------------------------- one rank's job
def _time_stage_methods(island: ModelParts, busy: list[float]) -> None:
    """Wrap each stage's forward/backward so the time spent computing is added to ``busy[0]``."""
    for stage in island.stages:
        for attr in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            inner = getattr(stage, attr)

            def timed(*a, _inner=inner, **kw):
                t0 = time.perf_counter()
                try:
                    return _inner(*a, **kw)
                finally:
                    busy[0] += time.perf_counter() - t0

            setattr(stage, attr, timed)


def run_job(job: dict, args: argparse.Namespace) -> dict:
    """Train an island for a few steps; return tokens/s and (with pp > 1) the measured idle fraction."""
    settings = ParallelSettings(tp=job["tp"], pp=job["pp"], schedule=job.get("schedule", "1f1b"),
                              microbatches=job.get("m", 1), virtual_stages=job.get("v", 1))
    cfg = bench_model_config(args)
    world = job["tp"] * job["pp"]
    mesh = init_island_mesh(settings.tp, settings.pp, "cpu", timeout_s=300) if world > 1 else None
    island = ModelParts(build_model(cfg), mesh, settings)
    opt = torch.optim.AdamW(island.parameters(), lr=1e-3)
    busy = [0.0]
    _time_stage_methods(island, busy)
    batch = job["batch"]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (batch, cfg.seq_len + 1), generator=g)
    walls, idles = [], []
    for step in range(args.warmup + args.steps):
        if mesh is not None:
            dist.barrier()
        busy[0] = 0.0
        t0 = time.perf_counter()
        island.train_step(x[:, :-1], x[:, 1:])
        wall = time.perf_counter() - t0
        island.clip_grad_norm_(1.0)
        opt.step()
        island.zero_grad()
        if step >= args.warmup:
            walls.append(wall)
            idles.append(1.0 - busy[0] / wall)
    wall = sum(walls) / len(walls)
    return dict(wall=wall, idle=sum(idles) / len(idles), tokens_per_s=batch * cfg.seq_len / wall)


def _worker(jobs: list[dict], args: argparse.Namespace, out_dir: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    results = []
    try:
        for job in jobs:
            results.append(run_job(job, args))
    finally:
        destroy_island()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def launch(jobs: list[dict], world: int, args: argparse.Namespace) -> list[list[dict]]:
    """Run ``jobs`` (all of world size ``world``) in one gloo group; return per-rank results."""
    out = tempfile.mkdtemp(prefix="pipeline_bench_")
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                   RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        cmd = [sys.executable, __file__, "--worker", json.dumps(jobs), "--out", out] + _forward_args(args)
        procs.append(subprocess.Popen(cmd, env=env))
    try:
        codes = [p.wait(timeout=args.timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        raise SystemExit(f"benchmark ranks failed with exit codes {codes}")
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def _forward_args(args: argparse.Namespace) -> list[str]:
    keys = ("dim", "layers", "heads", "ffn_dim", "seq", "steps", "warmup", "mb_size")
    return [x for k in keys for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]


# ------------------------------------------------------------------------------------------ tables
def bubble_table(args: argparse.Namespace) -> None:
    p, v = args.pp, args.virtual_stages
    jobs = []
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        for m in args.microbatches:
            jobs.append(dict(tp=1, pp=p, schedule=schedule, m=m, v=v if schedule == "interleaved-1f1b" else 1,
                             batch=m * args.mb_size))
    per_rank = launch(jobs, p, args)
    oversub = " (more ranks than cores: time-shared)" if p > (os.cpu_count() or 1) else ""
    print(f"\nPipeline bubble: p={p} stages, v={v} chunks/rank for interleaved, {args.mb_size} sequences x "
          f"{args.seq} tokens per micro-batch, {args.layers} layers of width {args.dim}{oversub}")
    print(f"{'schedule':<18}{'m':>4}{'step s':>9}{'idle measured':>15}{'idle theory':>13}   per-rank idle")
    for i, job in enumerate(jobs):
        idles = [per_rank[r][i]["idle"] for r in range(p)]
        wall = max(per_rank[r][i]["wall"] for r in range(p))
        print(f"{job['schedule']:<18}{job['m']:>4}{wall:>9.3f}{sum(idles) / p:>15.3f}"
              f"{theory_idle(job['schedule'], p, job['m'], job['v']):>13.3f}   "
              + " ".join(f"{x:.2f}" for x in idles))


def throughput_table(args: argparse.Namespace) -> None:
    batch, m = args.throughput_batch, args.throughput_microbatches
    cfg = bench_model_config(args)
    rows = []
    # Single process, in this process (1 thread, then as many threads as the 2-rank islands use).
    for threads in (1, 2):
        torch.set_num_threads(threads)
        r = run_job(dict(tp=1, pp=1, batch=batch), args)
        rows.append((f"1 process, {threads} thread{'s' if threads > 1 else ''}", 1, r["tokens_per_s"], None))
    torch.set_num_threads(1)
    groups = [
        (2, [dict(tp=2, pp=1, batch=batch), dict(tp=1, pp=2, schedule="1f1b", m=m, batch=batch),
             dict(tp=1, pp=2, schedule="interleaved-1f1b", m=m, v=args.virtual_stages, batch=batch)]),
        (4, [dict(tp=2, pp=2, schedule="1f1b", m=m, batch=batch)]),
    ]
    for world, jobs in groups:
        per_rank = launch(jobs, world, args)
        for i, job in enumerate(jobs):
            name = f"tp={job['tp']} pp={job['pp']}" + (f" {job['schedule']} m={job['m']}" if job["pp"] > 1 else "")
            rows.append((name, world, per_rank[0][i]["tokens_per_s"],
                         per_rank[0][i]["idle"] if job["pp"] > 1 else None))
    base = rows[0][2]
    cores = os.cpu_count() or 1
    print(f"\nThroughput: batch {batch} x {cfg.seq_len} tokens, {cfg.n_layers} layers, width {cfg.dim}, "
          f"{count_parameters(build_model(cfg)) / 1e6:.1f}M parameters, fp32 on CPU ({cores} cores), 1 thread per rank")
    print(f"{'island':<34}{'procs':>6}{'tokens/s':>11}{'vs 1 process':>14}{'idle':>7}")
    for name, procs, tps, idle in rows:
        note = "  (time-shared)" if procs > cores else ""
        idle_s = f"{idle:>7.2f}" if idle is not None else f"{'':>7}"
        print(f"{name:<34}{procs:>6}{tps:>11.0f}{tps / base:>13.2f}x{idle_s}{note}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages for the bubble table")
    ap.add_argument("--virtual-stages", type=int, default=2, help="chunks per rank for interleaved 1F1B")
    ap.add_argument("--microbatches", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8])
    ap.add_argument("--mb-size", type=int, default=2, help="sequences per micro-batch (bubble table)")
    ap.add_argument("--throughput-batch", type=int, default=8)
    ap.add_argument("--throughput-microbatches", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn-dim", type=int, default=768)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: bubble,throughput")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.worker:
        _worker(json.loads(args.worker), args, args.out)
        return
    skip = set(filter(None, args.skip.split(",")))
    torch.set_num_threads(1)
    if "bubble" not in skip:
        bubble_table(args)
    if "throughput" not in skip:
        throughput_table(args)


if __name__ == "__main__":
    main()
