"""What one GPU of an island delivers, through the island's own code: inner steps (precision, compiled blocks,
fused AdamW) as tokens/s, MFU and peak memory; the outer state's copies between the GPU and the host; FSDP2's
mixed precision on the card.  Not a test; needs CUDA (``--smoke`` runs the same code on CPU with a tiny model).

    python benchmarks/gpu_island.py                       # 150m and 1b, every row, on cuda
    python benchmarks/gpu_island.py --presets 150m --steps 5
    python benchmarks/gpu_island.py --smoke               # the code paths on CPU, tiny model, in seconds

1. The card: its name, and the bf16 ceiling (an 8192^3 matrix product, the mean of 10 after 3 warm-ups).
2. Inner steps on real text (the embedded corpus), as an island takes them (``ModelParts`` + the inner AdamW +
   ``take_inner_step``), per preset: fp32 (TF32 tensor cores), bf16 autocast with foreach AdamW, with fused
   AdamW, with Muon on the blocks' matrices (``--inner.optimizer muon``), and with compiled blocks.  MFU = tokens/s x FLOPs/token (6N + 6Ld·seq) / the data sheet's dense
   peak at the compute precision; also against the measured ceiling.
3. The outer state of the largest preset: Δ from the GPU parameters into host buffers (a blocking
   ``.to("cpu")`` per parameter, against pinned buffers filled by asynchronous copies on a side stream), the
   outer Nesterov step on the host, θ_global back to the GPU.
4. FSDP2 (``fully_shard`` per block, MixedPrecisionPolicy bf16 params / fp32 reduction) over a one-process
   NCCL group on the 150m model, against bf16 autocast: what the data-parallel dimension's wrapping costs
   on one card (the sharding itself needs several GPUs).

Writes ``--out`` (default experiments/results/gpu-island/): ``results.json`` (a line per row as it is measured,
so a run cut short keeps what it had) and ``results.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from diloco.config import DataConfig, InnerOptimConfig, ModelConfig, resolve_model  # noqa: E402
from diloco.data.batches import ShardedBatches  # noqa: E402
from diloco.data.corpus import load_corpus  # noqa: E402
from diloco.engine.runtime import use_device  # noqa: E402
from diloco.engine.throughput import peak_flops, peak_memory_gb  # noqa: E402
from diloco.model.inner import build_inner_optimizer, take_inner_step  # noqa: E402
from diloco.model.transformer import (  # noqa: E402
    build_model,
    count_parameters,
    flops_per_token,
    lm_loss,
)
from outer_optim import OuterOptimizer  # noqa: E402
from pipeline import ModelParts, ParallelSettings  # noqa: E402
from pipeline.balance import sync_device  # noqa: E402

# (label, param_dtype, compile, fused AdamW, inner optimizer)
ROWS = (("fp32 (tf32), fused AdamW", "fp32", False, True, "adamw"),
        ("bf16 autocast, foreach AdamW", "bf16", False, False, "adamw"),
        ("bf16 autocast, fused AdamW", "bf16", False, True, "adamw"),
        ("bf16 autocast, Muon + fused AdamW", "bf16", False, True, "muon"),
        ("bf16 autocast + compile, fused", "bf16", True, True, "adamw"))
BATCH = {"tiny": 4, "small": 8, "150m": 16, "1b": 4}


class Results:
    """Rows as they are measured: printed, and appended to results.json at once."""

    def __init__(self, out: Path):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "results.json"
        self.path.write_text("")
        self.rows: list[dict[str, Any]] = []

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)


def timed(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int) -> float:
    """Mean seconds of ``fn`` over ``reps`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    sync_device(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync_device(device)
    return (time.perf_counter() - t0) / reps


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def ceiling(device: torch.device, smoke: bool) -> float:
    """Measured bf16 matrix-product FLOP/s (the card's practical ceiling)."""
    n = 512 if smoke else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    seconds = timed(lambda: a @ b, device, reps=2 if smoke else 10, warmup=1 if smoke else 3)
    return 2 * n ** 3 / seconds


def inner_row(preset: str, label: str, dtype: str, compiled: bool, fused: bool, optimizer: str,
              device: torch.device, corpus: Any, steps: int, warmup: int, measured_peak: float) -> dict[str, Any]:
    """tokens/s, MFU and peak memory of an island's inner steps at one setting."""
    free(device)
    cfg = ModelConfig(preset=preset)
    resolve_model(cfg)
    batch = BATCH[preset]
    model = ModelParts(build_model(cfg), None, ParallelSettings(param_dtype=dtype, compile=compiled),
                       loss_fn=lm_loss, device=device)
    inner = InnerOptimConfig(optimizer=optimizer, batch_size=batch, warmup_steps=1)
    opt, sched = build_inner_optimizer(list(model.named_parameters()), inner, steps + warmup)
    if not fused:  # the same AdamW, one kernel per operation and parameter list (torch's default on CPU)
        opt = torch.optim.AdamW(opt.param_groups, lr=inner.lr, betas=(inner.beta1, inner.beta2), foreach=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    batches = ShardedBatches(corpus.train, cfg.seq_len, batch, 0, 1, 0)
    t_first = time.perf_counter()
    take_inner_step(model, batches, opt, sched, inner)
    sync_device(device)
    first = time.perf_counter() - t_first
    seconds = timed(lambda: take_inner_step(model, batches, opt, sched, inner), device, steps, warmup)
    tokens_per_s = batch * cfg.seq_len / seconds
    fpt = flops_per_token(cfg)
    peak = peak_flops(device, model.compute_dtype)
    row = {"section": "inner", "preset": preset, "params": count_parameters(model.modules[0]), "row": label,
           "batch": f"{batch}x{cfg.seq_len}", "step_s": seconds, "first_step_s": first, "tokens_per_s": tokens_per_s,
           "tflops": tokens_per_s * fpt / 1e12, "mfu": tokens_per_s * fpt / peak if peak else None,
           "of_ceiling": tokens_per_s * fpt / measured_peak, "peak_memory_gb": peak_memory_gb(device)}
    return row


def outer_rows(preset: str, device: torch.device, reps: int) -> list[dict[str, Any]]:
    """Δ device → host (blocking per parameter vs pinned + asynchronous), the outer step, θ_global back."""
    free(device)
    cfg = ModelConfig(preset=preset)
    resolve_model(cfg)
    model = build_model(cfg).to(device)
    params = {n: p for n, p in model.named_parameters()}
    outer = OuterOptimizer(params, lr=0.7, momentum=0.9, device="cpu")
    numel = outer.flat.numel()
    gb = numel * 4 / 1e9
    pinned = torch.empty(numel, pin_memory=device.type == "cuda")
    views = outer._views(pinned)
    with torch.no_grad():
        for p in params.values():
            p.add_(1e-3)
    rows = []

    def add(what: str, seconds: float) -> None:
        rows.append({"section": "outer", "preset": preset, "params": numel, "row": what, "seconds": seconds,
                     "gb_per_s": gb / seconds})

    add("Δ to host: blocking .to('cpu') per parameter", timed(lambda: outer.pseudo_gradient(params), device, reps, 1))
    add("Δ to host: pinned, async copies on a side stream",
        timed(lambda: outer.pseudo_gradient(params, out=views), device, reps, 1))
    delta = outer.pseudo_gradient(params, out=views)
    add(f"outer Nesterov step on the host ({torch.get_num_threads()} threads)",
        timed(lambda: outer.step(delta), device, reps, 1))
    add("θ_global to the GPU (pinned, asynchronous)", timed(lambda: outer.copy_to(params), device, reps, 1))
    return rows


def fsdp_row(device: torch.device, corpus: Any, steps: int, warmup: int, preset: str) -> dict[str, Any]:
    """FSDP2 with bf16 parameters and fp32 reduction over a one-process group, on ``preset``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    free(device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    try:
        cfg = ModelConfig(preset=preset)
        resolve_model(cfg)
        batch = BATCH[preset]
        model = build_model(cfg).to(device)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers.values():
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
        batches = ShardedBatches(corpus.train, cfg.seq_len, batch, 0, 1, 0)

        def step() -> None:
            x, y = batches.next_batch()
            lm_loss(model(x.to(device)), y.to(device)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        seconds = timed(step, device, steps, warmup)
        tokens_per_s = batch * cfg.seq_len / seconds
        peak = peak_flops(device, torch.bfloat16)
        row = {"section": "fsdp", "preset": preset, "row": "FSDP2, bf16 params, fp32 reduce, 1 rank",
               "step_s": seconds, "tokens_per_s": tokens_per_s,
               "mfu": tokens_per_s * flops_per_token(cfg) / peak if peak else None,
               "peak_memory_gb": peak_memory_gb(device)}
        return row
    finally:
        dist.destroy_process_group()


def markdown(rows: list[dict[str, Any]], card: dict[str, Any]) -> str:
    lines = [f"# One GPU of an island: {card['device']}", "",
             f"torch {card['torch']}; measured bf16 ceiling {card['ceiling_tflops']:.0f} TFLOP/s "
             f"(data sheet: {card['sheet_bf16_tflops'] or '?'}).  `python benchmarks/gpu_island.py`", "",
             "| model | setting | batch | step | first step | tokens/s | TFLOP/s | MFU | of ceiling | peak GB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["section"] == "inner"):
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        lines.append(f"| {r['preset']} ({r['params'] / 1e6:.0f}M) | {r['row']} | {r['batch']} | {r['step_s'] * 1e3:.0f} ms "
                     f"| {r['first_step_s']:.1f} s | {r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | {mfu} "
                     f"| {r['of_ceiling']:.1%} | {r['peak_memory_gb']:.1f} |")
    outer = [r for r in rows if r["section"] == "outer"]
    if outer:
        lines += ["", f"Outer state of the {outer[0]['preset']} model ({outer[0]['params'] / 1e6:.0f}M fp32 "
                  f"parameters, {outer[0]['params'] * 4 / 1e9:.2f} GB):", "", "| what | seconds | GB/s |", "|---|---|---|"]
        lines += [f"| {r['row']} | {r['seconds']:.3f} | {r['gb_per_s']:.1f} |" for r in outer]
    for r in (r for r in rows if r["section"] == "fsdp"):
        mfu = f", MFU {r['mfu']:.1%}" if r["mfu"] is not None else ""
        lines += ["", f"{r['row']} on {r['preset']}: {r['tokens_per_s']:,.0f} tokens/s{mfu}, "
                  f"peak {r['peak_memory_gb']:.1f} GB"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="150m,1b")
    ap.add_argument("--steps", type=int, default=10, help="timed inner steps per row")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before (compilation happens there)")
    ap.add_argument("--out", default=str(REPO / "experiments" / "results" / "gpu-island"))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, 2 steps: check the code paths")
    args = ap.parse_args(argv)
    if args.smoke:
        device, presets, args.steps, args.warmup = torch.device("cpu"), ["tiny"], 2, 1
    elif not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU (or --smoke for the code paths on CPU)", file=sys.stderr)
        return 2
    else:
        device, presets = torch.device("cuda", 0), args.presets.split(",")
    use_device(device)
    results = Results(Path(args.out))
    corpus = load_corpus(DataConfig(max_bytes=8_000_000))
    measured = ceiling(device, args.smoke)
    sheet = peak_flops(device, torch.bfloat16)
    card = {"section": "card", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "ceiling_tflops": measured / 1e12,
            "sheet_bf16_tflops": sheet / 1e12 if sheet else None, "cpu_threads": torch.get_num_threads()}
    results.add(card)
    for preset in presets:
        for label, dtype, compiled, fused, optimizer in ROWS:
            try:
                results.add(inner_row(preset, label, dtype, compiled, fused, optimizer, device, corpus, args.steps,
                                      args.warmup, measured))
            except torch.OutOfMemoryError as e:
                results.add({"section": "error", "preset": preset, "row": label, "error": str(e).splitlines()[0]})
            (Path(args.out) / "results.md").write_text(markdown(results.rows, card))
    for r in outer_rows(presets[-1], device, reps=2 if args.smoke else 3):
        results.add(r)
    results.add(fsdp_row(device, corpus, args.steps, args.warmup, presets[0]))
    (Path(args.out) / "results.md").write_text(markdown(results.rows, card))
    print(markdown(results.rows, card))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
