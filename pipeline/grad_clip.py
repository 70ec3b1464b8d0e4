"""Gradient-norm clipping over all the ranks of an island (FSDP and TP shards, PP stages)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from pipeline.mesh import MESH_DIMS, mesh_rank, mesh_size
from pipeline.shards import local_grad, shard_spec_of


def island_grad_norm(params: Iterable[torch.Tensor], mesh: DeviceMesh | None) -> torch.Tensor:
    """L2 norm of the gradient of the whole model, the same (fp32 scalar) on every rank of the island.

    Each rank sums the squares of its local gradient shards, counting replicated tensors only on TP
    rank 0, then the sums are all-reduced over the ``dp``, ``tp`` and ``pp`` mesh dimensions.
    """
    params = list(params)
    tp_rank = mesh_rank(mesh, "tp")
    device = params[0].device if params else torch.device("cpu")
    grads = [g.detach() for p in params if (g := local_grad(p)) is not None
             and not (shard_spec_of(p).replicated and tp_rank != 0)]
    # this rank's part as torch.nn.utils.clip_grad_norm_ computes it, so one process clips exactly like it
    local = torch.nn.utils.get_total_norm(grads).float() if grads else torch.zeros((), device=device)
    if mesh is None:
        return local
    total = local.pow(2)
    for dim in MESH_DIMS:
        if mesh_size(mesh, dim) > 1:
            dist.all_reduce(total, group=mesh[dim].get_group())
    return total.sqrt()


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float, mesh: DeviceMesh | None) -> float:
    """Scale gradients in place so the island-wide norm is at most ``max_norm``; return the norm
    before clipping.  Same rule as ``torch.nn.utils.clip_grad_norm_`` (``max_norm / (norm + 1e-6)``,
    capped at 1); ``max_norm <= 0`` only measures."""
    params = list(params)
    norm = island_grad_norm(params, mesh)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in params:
            g = local_grad(p)
            if g is not None:
                g.mul_(coef.to(g.dtype))
    return float(norm)
