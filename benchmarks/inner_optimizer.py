"""What Muon costs per inner step against AdamW, through the island's own code (``ModelParts`` +
``build_inner_optimizer`` + ``take_inner_step``) on real text (the embedded corpus).  Not a test.

    python benchmarks/inner_optimizer.py                          # a 40M model on this machine's CPU
    python benchmarks/inner_optimizer.py --device cuda --preset 150m --batch 16
    python benchmarks/inner_optimizer.py --smoke                  # the code paths, tiny model, seconds
    torchrun --nproc-per-node 2 benchmarks/inner_optimizer.py     # an FSDP island of 2 ranks (dp = 2)

Under torchrun the island is FSDP over the ranks (``--batch`` sequences per rank), and Muon runs twice: with each
rank orthogonalising its share of the matrices (``--inner.muon_split``, the default) and with every rank
orthogonalising all of them.  Where ``--inner.muon_dtype auto`` takes bf16 products (CUDA, or a CPU with AMX or
AVX-512 BF16), Muon also runs with fp32 products (``muon-fp32``), to show what bf16 saves.

The two optimizers take turns, ``--rounds`` blocks of ``--steps`` timed steps each (after ``--warmup``), so a
machine that slows down mid-run slows both alike; the figure is each one's fastest block.  Also timed: the
optimizer's step alone.  Muon's extra work is Newton–Schulz on every block matrix (5 iterations of three
matrix products), independent of the batch, so its share falls as the batch grows.  Writes ``--out``
(default experiments/results/inner-optimizer/): ``results.json`` and ``results.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from diloco.config import DataConfig, InnerOptimConfig, ModelConfig, resolve_model  # noqa: E402
from diloco.data.batches import ShardedBatches  # noqa: E402
from diloco.data.corpus import load_corpus  # noqa: E402
from diloco.engine.runtime import use_device  # noqa: E402
from diloco.model.inner import (  # noqa: E402
    build_inner_optimizer,
    newton_schulz_dtype,
    take_inner_step,
)
from diloco.model.transformer import build_model, count_parameters, lm_loss  # noqa: E402
from experiments.report import markdown_table  # noqa: E402
from pipeline import ModelParts, ParallelSettings  # noqa: E402
from pipeline.balance import sync_device  # noqa: E402

MODEL_40M = dict(dim=640, n_layers=8, n_heads=10, ffn_dim=1728, seq_len=256)
"""The 40M-parameter model of the CPU measurements (byte tokens)."""


class Arm:
    """One optimizer's island: its own model (same seed), optimizer and batches; ``name`` ``adamw``, ``muon``,
    ``muon-unsplit`` (every rank orthogonalises every matrix) or ``muon-fp32`` (Newton–Schulz in fp32 whatever the
    device); ``mesh``: an FSDP island's, or None."""

    def __init__(self, name: str, cfg: ModelConfig, batch: int, device: torch.device, corpus: Any, dtype: str,
                 mesh: Any = None):
        self.kind = name
        dp = mesh.size() if mesh is not None else 1
        self.model = ModelParts(build_model(cfg), mesh, ParallelSettings(dp=dp, param_dtype=dtype), loss_fn=lm_loss,
                                device=device)
        self.inner = InnerOptimConfig(optimizer=name.split("-")[0], batch_size=batch, warmup_steps=1,
                                      muon_split=not name.endswith("-unsplit"),
                                      muon_dtype="fp32" if name.endswith("-fp32") else "auto")
        self.opt, self.sched = build_inner_optimizer(list(self.model.named_parameters()), self.inner, 10 ** 6)
        self.batches = ShardedBatches(corpus.train, cfg.seq_len, batch, 0, 1, 0, replica=self.model.dp_rank,
                                      replicas=dp)
        self.device = device
        self.blocks: list[float] = []
        self.opt_steps: list[float] = []

    def step(self) -> None:
        take_inner_step(self.model, self.batches, self.opt, self.sched, self.inner)

    def block(self, steps: int) -> None:
        """Time ``steps`` inner steps, then the optimizer's step alone (on the last gradients, kept)."""
        sync_device(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        sync_device(self.device)
        self.blocks.append((time.perf_counter() - t0) / steps)
        x, y = self.batches.next_batch()
        self.model.train_step(x, y)
        sync_device(self.device)
        t0 = time.perf_counter()
        self.opt.step()
        sync_device(self.device)
        self.opt_steps.append(time.perf_counter() - t0)
        self.opt.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="", help="a model preset (default: the 40M model of MODEL_40M)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="--parallel.param_dtype of the island (auto: bf16 on CUDA)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per block")
    ap.add_argument("--rounds", type=int, default=3, help="blocks per optimizer, taking turns")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "experiments" / "results" / "inner-optimizer"))
    ap.add_argument("--smoke", action="store_true", help="tiny model, one block of one step: the code paths")
    args = ap.parse_args(argv)
    cfg = ModelConfig(preset=args.preset or "small")
    if not args.preset and not args.smoke:
        for k, v in MODEL_40M.items():
            setattr(cfg, k, v)
    if args.smoke:
        cfg, args.steps, args.rounds, args.warmup = ModelConfig(preset="tiny"), 1, 1, 1
    resolve_model(cfg)
    device = torch.device(args.device)
    use_device(device)
    corpus = load_corpus(DataConfig(max_bytes=4_000_000))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = None
    if world > 1:
        from pipeline.mesh import init_island_mesh

        mesh = init_island_mesh(1, 1, device.type, dp=world)
    names = ["adamw", "muon"] + (["muon-unsplit"] if world > 1 else []) \
        + (["muon-fp32"] if newton_schulz_dtype("auto", device.type) == torch.bfloat16 else [])
    arms = [Arm(name, cfg, args.batch, device, corpus, args.dtype, mesh) for name in names]
    for arm in arms:
        for _ in range(args.warmup):
            arm.step()
    for _ in range(args.rounds):
        for arm in arms:
            arm.block(args.steps)
    adamw = arms[0]
    params = count_parameters(adamw.model.modules[0])
    rows = [{"optimizer": a.kind, "step_s": min(a.blocks), "optimizer_step_s": min(a.opt_steps),
             "tokens_per_s": args.batch * cfg.seq_len * world / min(a.blocks),
             "blocks_step_s": a.blocks, "blocks_optimizer_step_s": a.opt_steps} for a in arms]
    extra = {a.kind: min(a.blocks) / min(adamw.blocks) - 1 for a in arms[1:]}
    summary = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "threads": torch.get_num_threads(), "ranks": world, "params": params,
               "batch": f"{args.batch}x{cfg.seq_len}" + (f" per rank, {world} ranks (FSDP)" if world > 1 else ""),
               "model": {k: getattr(cfg, k) for k in ("dim", "n_layers", "n_heads", "ffn_dim", "seq_len")},
               "newton_schulz_dtype": str(newton_schulz_dtype("auto", device.type)).removeprefix("torch."),
               "rows": rows, "extra_step_fraction": extra}
    if world > 1:
        summary["orthogonalized_per_step"] = {a.kind: a.opt.orthogonalized / (args.warmup + args.rounds * (args.steps + 1))
                                              for a in arms[1:]}
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    table = markdown_table(["optimizer", "inner step (s)", "optimizer step alone (s)", "tokens/s"],
                           [[r["optimizer"], f"{r['step_s']:.3f}", f"{r['optimizer_step_s']:.3f}",
                             f"{r['tokens_per_s']:.0f}"] for r in rows])
    text = (f"# Muon against AdamW per inner step\n\n{params / 1e6:.1f}M parameters, batch {summary['batch']}, "
            f"{summary['device']} ({summary['threads']} threads); fastest of {args.rounds} blocks of "
            f"{args.steps} steps each, the arms taking turns; `muon`'s Newton–Schulz products in "
            f"{summary['newton_schulz_dtype']}.\n\n{table}\n\nThe inner step against AdamW's: "
            + ", ".join(f"{kind} {x * 100:+.1f}%" for kind, x in extra.items())
            + (f" (matrices orthogonalised per step on rank 0: {summary['orthogonalized_per_step']})" if world > 1 else "")
            + ".\n")
    (out / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
