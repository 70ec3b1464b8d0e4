"""The inner optimizer (AdamW with linear warm-up and cosine decay) and the one inner step."""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from diloco.config import InnerOptimConfig
from diloco.data.batches import ShardedBatches
from pipeline import ModelParts


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float,
              progress: float | None = None) -> float:
    """Multiplier of the peak learning rate at ``step`` (0-based); the cosine follows ``progress`` (the
    fraction of the run done) when given, else the steps after warm-up out of ``total_steps``."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if progress is None:
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_inner_optimizer(params: Iterable[tuple[str, torch.nn.Parameter]], cfg: InnerOptimConfig,
                          total_steps: int, progress: Callable[[], float] | None = None
                          ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (no weight decay on norms and other 1-D weights) and its warm-up + cosine schedule (over
    ``total_steps``, or over ``progress()``, the fraction of the run done, when the steps are not known
    in advance)."""
    decay, no_decay = [], []
    for _, p in params:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # one fused kernel per step on CUDA (torchtitan's default); CPU keeps the foreach implementation
    fused = all(p.is_cuda for p in decay + no_decay) and bool(decay + no_decay)
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, fused=fused or None)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.warmup_steps, total_steps, cfg.min_lr_ratio,
                                 progress() if progress is not None else None))
    return opt, sched


def take_inner_step(model: ModelParts, batches: ShardedBatches, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, cfg: InnerOptimConfig,
               sync_grads: Callable[[float], float] | None = None) -> float:
    """One inner AdamW step of an island or a baseline worker: ``grad_accum`` micro-batches forward
    and backward, ``sync_grads(loss)`` (the baseline's all-reduce; returns the loss to report),
    clipping over the whole model, optimizer and schedule step.  Returns the step's mean loss."""
    total = 0.0
    for _ in range(cfg.grad_accum):
        x, y = batches.next_batch()
        total += model.train_step(x, y, loss_scale=1.0 / cfg.grad_accum) / cfg.grad_accum
    if sync_grads is not None:
        total = sync_grads(total)
    if cfg.grad_clip > 0:
        model.clip_grad_norm_(cfg.grad_clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return total
