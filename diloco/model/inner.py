"""The inner optimizer (AdamW, or Muon on the hidden matrices with AdamW on the rest; linear warm-up and
cosine decay) and the one inner step."""

from __future__ import annotations

import functools
import math
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from diloco.config import InnerOptimConfig
from diloco.data.batches import ShardedBatches
from pipeline import ModelParts
from pipeline.mesh import group_timeout
from pipeline.shards import is_dtensor, local_tensor, shard_spec_of

NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)
"""The quintic Newton–Schulz coefficients of Muon (Jordan et al., 2024), as in ``torch.optim.Muon``."""


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float,
              progress: float | None = None) -> float:
    """Multiplier of the peak learning rate at ``step`` (0-based); the cosine follows ``progress`` (the
    fraction of the run done) when given, else the steps after warm-up out of ``total_steps``."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if progress is None:
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@functools.cache
def multiplies_bf16_natively(device_type: str) -> bool:
    """Whether bf16 matrix products are faster than fp32 on a ``device_type`` device: CUDA, or a CPU with AMX or
    AVX-512 BF16 (elsewhere torch emulates them, slower than fp32)."""
    if device_type == "cuda":
        return True
    cpu = torch.cpu
    return device_type == "cpu" and any(getattr(cpu, probe, lambda: False)()
                                        for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))


def newton_schulz_dtype(setting: str, device_type: str) -> torch.dtype:
    """The dtype of the Newton–Schulz products for ``--inner.muon_dtype`` ``setting`` on a ``device_type`` device."""
    if setting == "bf16" or (setting == "auto" and multiplies_bf16_natively(device_type)):
        return torch.bfloat16
    return torch.float32


def orthogonalize(g: torch.Tensor, steps: int = 5, eps: float = 1e-7, precision: str = "auto") -> torch.Tensor:
    """Muon's Newton–Schulz iteration: ``g`` (a whole 2-D matrix) made nearly semi-orthogonal (U S' V^T with S'
    near 1, where U S V^T = g), its products in the dtype ``precision`` names (see :func:`newton_schulz_dtype`)."""
    a, b, c = NEWTON_SCHULZ
    x = g.to(newton_schulz_dtype(precision, g.device.type))
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).to(g.dtype)


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """Whether Muon takes this parameter: a 2-D weight inside a block (the embeddings, the output head, the norms
    and biases stay with AdamW, as in the Muon and MuLoCo papers)."""
    return param.dim() == 2 and (name.startswith("layers.") or ".layers." in name)


class MuonAdamW(torch.optim.AdamW):
    """Muon on the param groups marked ``muon`` and torch's own AdamW (fused on CUDA) on the others.

    Muon: Nesterov momentum, orthogonalised by :func:`orthogonalize`, scaled to AdamW's update RMS
    (``0.2 * sqrt(max(rows, cols))``, Moonlight's rule, so both share ``lr``, its schedule and the weight decay).
    Newton–Schulz needs the whole matrix: a TP or FSDP shard is gathered inside the island, and each matrix is
    orthogonalised by one rank of the ranks that share it, in turn (``split``; :func:`orthogonalized`), which
    sends the result to the others; each keeps its own slice, so a split island steps exactly as one process
    does (one all-gather of each hidden matrix per step, as FSDP's forward does, one broadcast of its
    orthogonalised update, and 1/N of the Newton–Schulz FLOPs on each of the N ranks).  Without ``split``,
    every rank orthogonalises every whole matrix itself.  The state of a Muon parameter is its
    ``momentum_buffer`` and ``step``; :attr:`orthogonalized` counts the matrices this rank orthogonalised;
    :attr:`precision` is ``--inner.muon_dtype``.
    """

    split: bool = True
    precision: str = "auto"
    orthogonalized: int = 0

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        groups = self.param_groups
        try:  # AdamW.step walks self.param_groups: show it its own groups only
            self.param_groups = [g for g in groups if not g["muon"]]
            super().step()
        finally:
            self.param_groups = groups
        for group in groups:
            if group["muon"]:
                params = [p for p in group["params"] if p.grad is not None]
                updates = [self._nesterov(p, group) for p in params]
                for p, ortho in zip(params, orthogonalized(updates, self.split, self, self.precision)):
                    rows, cols = p.shape
                    local = local_tensor(p)
                    local.mul_(1 - group["lr"] * group["weight_decay"])
                    local.add_(shard_spec_of(p).slice_of(ortho), alpha=-group["lr"] * 0.2 * math.sqrt(max(rows, cols)))

    def _nesterov(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """``p``'s momentum-corrected gradient (sharded as ``p`` is), its momentum buffer moved on."""
        state = self.state[p]
        if "momentum_buffer" not in state:  # a step count too: AdamW's loader expects one in every state
            state["step"], state["momentum_buffer"] = torch.tensor(0.0), torch.zeros_like(p)
        state["step"] += 1
        buf, grad, momentum = state["momentum_buffer"], p.grad, group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum)


def orthogonalized(updates: list[torch.Tensor], split: bool = True, counter: MuonAdamW | None = None,
                   precision: str = "auto") -> Iterator[torch.Tensor]:
    """The whole orthogonalised matrix of each of ``updates`` (plain tensors, or DTensors sharded inside the
    island), in order.  A DTensor is gathered whole on every rank of its mesh; with ``split``, a run of up to N
    consecutive updates on one mesh of N ranks is orthogonalised one matrix per rank, at once, and each result
    broadcast from the rank that made it (Moonlight's distributed Muon), instead of every rank making them all.
    Collective over each mesh: every rank passes the same sequence of shapes and meshes."""
    i = 0
    while i < len(updates):
        mesh = updates[i].device_mesh if is_dtensor(updates[i]) else None
        ranks = sorted(mesh.mesh.flatten().tolist()) if mesh is not None else []
        width = len(ranks) if split else 1
        run = 1
        while run < width and i + run < len(updates) and is_dtensor(updates[i + run]) \
                and updates[i + run].device_mesh == mesh:
            run += 1
        wholes = [u.full_tensor() if is_dtensor(u) else u for u in updates[i:i + run]]
        i += run
        if width <= 1:
            for whole in wholes:
                if counter is not None:
                    counter.orthogonalized += 1
                yield orthogonalize(whole, precision=precision)
            continue
        me, group = ranks.index(dist.get_rank()), _group_of(ranks)
        out = [torch.empty_like(w) for w in wholes]
        if me < run:
            # a tall matrix's comes transposed: gloo would garble it
            out[me] = orthogonalize(wholes[me], precision=precision).contiguous()
            if counter is not None:
                counter.orthogonalized += 1
        works = [dist.broadcast(o, src=ranks[j], group=group, async_op=True) for j, o in enumerate(out)]
        for work in works:
            work.wait()
        yield from out


_GROUPS: dict[tuple[object, tuple[int, ...]], dist.ProcessGroup] = {}


def _group_of(ranks: list[int]) -> dist.ProcessGroup:
    """One process group of all ``ranks`` (a mesh of any shape, flattened), made once per world by its members
    alone, with the run's timeout (the default group's)."""
    key = (dist.group.WORLD, tuple(ranks))
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(ranks, timeout=group_timeout(), use_local_synchronization=True)
    return _GROUPS[key]


def build_inner_optimizer(params: Iterable[tuple[str, torch.nn.Parameter]], cfg: InnerOptimConfig,
                          total_steps: int, progress: Callable[[], float] | None = None
                          ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """The inner optimizer of ``cfg.optimizer`` (AdamW; or Muon on the hidden matrices, see :class:`MuonAdamW`),
    no weight decay on norms and other 1-D weights, and its warm-up + cosine schedule (over ``total_steps``, or
    over ``progress()``, the fraction of the run done, when the steps are not known in advance)."""
    muon = cfg.optimizer == "muon"
    hidden, decay, no_decay = [], [], []
    for name, p in params:
        if p.requires_grad:
            (hidden if muon and is_hidden_matrix(name, p) else decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay, "muon": False},
              {"params": no_decay, "weight_decay": 0.0, "muon": False}]
    if muon:
        groups.append({"params": hidden, "weight_decay": cfg.weight_decay, "muon": True,
                       "momentum": cfg.muon_momentum})
    everything = hidden + decay + no_decay
    # one fused kernel per step on CUDA (torchtitan's default); CPU keeps the foreach implementation
    fused = all(p.is_cuda for p in everything) and bool(everything)
    kind = MuonAdamW if muon else torch.optim.AdamW
    opt = kind(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, fused=fused or None)
    if muon:
        opt.split, opt.precision = cfg.muon_split, cfg.muon_dtype
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.warmup_steps, total_steps, cfg.min_lr_ratio,
                                 progress() if progress is not None else None))
    return opt, sched


def take_inner_step(model: ModelParts, batches: ShardedBatches, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, cfg: InnerOptimConfig,
               sync_grads: Callable[[float], float] | None = None,
               gradient_sync: Callable[[bool], None] | None = None) -> float:
    """One inner step of an island or a baseline worker: ``grad_accum`` micro-batches forward
    and backward, ``sync_grads(loss)`` (the baseline's; returns the loss to report), clipping over the
    whole model, optimizer and schedule step.  ``gradient_sync(last)`` is told before each micro-batch
    whether it is the step's last (DDP reduces the gradients of that one only).  Returns the step's mean loss."""
    total = 0.0
    for i in range(cfg.grad_accum):
        if gradient_sync is not None:
            gradient_sync(i == cfg.grad_accum - 1)
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
