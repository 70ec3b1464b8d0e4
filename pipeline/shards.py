"""Where a rank's local piece of a parameter sits in the full (unsharded) parameter.

A cross-island averaging layer maps local shards to a canonical layout with these specs: the local
tensor of parameter ``name`` equals ``full.narrow(spec.dim, spec.offset, spec.length)`` of the full
parameter of the same name in the unsplit model.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor, without importing DTensor's machinery (1.2 s of imports, sympy among them)
    in a process that never made one: nothing can be a DTensor before its module is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


@dataclass(frozen=True)
class ShardSpec:
    """A contiguous slice ``[offset, offset + length)`` along ``dim`` of a tensor of ``full_shape``.

    ``replicated`` is True when other ranks of the island hold this same slice (a TP-replicated norm
    weight), so only one of them needs to contribute it to an average.
    """

    full_shape: tuple[int, ...]
    dim: int
    offset: int
    length: int
    replicated: bool

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the local tensor."""
        shape = list(self.full_shape)
        if shape:
            shape[self.dim] = self.length
        return tuple(shape)

    def slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """This shard's view of a full tensor (a view, so it can also be written through)."""
        if full.dim() == 0:
            return full
        return full.narrow(self.dim, self.offset, self.length)


def shard_spec_of(param: torch.Tensor) -> ShardSpec:
    """The :class:`ShardSpec` of a plain tensor (the whole of it) or of a DTensor on a mesh of any rank
    (TP, FSDP's data-parallel sharding, or both on one parameter), whose local piece must be one slice
    along one dimension."""
    full_shape = tuple(param.shape)
    if not is_dtensor(param):
        return ShardSpec(full_shape, 0, 0, full_shape[0] if full_shape else 1, True)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    sharding = (Shard, _StridedShard)  # FSDP2 shards a TP-sharded dimension further with a _StridedShard
    mesh, placements = param.device_mesh, param.placements
    for placement in placements:
        if not isinstance(placement, (*sharding, Replicate)):
            raise ValueError(f"unsupported DTensor placement {placement} for a parameter")
    replicated = any(isinstance(p, Replicate) and mesh.size(i) > 1 for i, p in enumerate(placements))
    if not full_shape:
        return ShardSpec(full_shape, 0, 0, 1, replicated)
    local_shape, offset = compute_local_shape_and_global_offset(full_shape, mesh, placements)
    narrowed = [d for d in range(len(full_shape)) if local_shape[d] != full_shape[d]]
    if len(narrowed) > 1:
        raise ValueError(f"the local piece {tuple(local_shape)} of a {full_shape} parameter ({placements}) is "
                         f"narrowed on dims {narrowed}; shard every mesh dimension of a parameter on one dim")
    sharded = [p.dim % len(full_shape) for p in placements if isinstance(p, sharding)]
    dim = narrowed[0] if narrowed else (sharded[0] if sharded else 0)
    return ShardSpec(full_shape, dim, min(offset[dim], full_shape[dim]), local_shape[dim],
                     replicated or not sharded)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``t``: the local tensor of a DTensor, a plain tensor itself (the same storage)."""
    return t.to_local() if is_dtensor(t) else t


def local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The local part of ``param.grad`` laid out like the local parameter (None without a grad).

    DTensor's embedding backward yields a *replicated* gradient for a vocabulary-sharded weight;
    such a gradient is first redistributed to the parameter's placements (a local slice, no
    communication) and stored back, so shard and gradient always line up.
    """
    grad = param.grad
    if grad is None:
        return None
    if is_dtensor(grad):
        if is_dtensor(param) and tuple(grad.placements) != tuple(param.placements):
            grad = grad.redistribute(param.device_mesh, param.placements)
            param.grad = grad
        return grad.to_local()
    return grad


def local_state(obj: Any) -> Any:
    """A state dict with every DTensor replaced by its local tensor (checkpoints load weights-only)."""
    if is_dtensor(obj):
        return obj.to_local().detach().cpu()
    if isinstance(obj, dict):
        return {k: local_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [local_state(v) for v in obj]
    return obj


def restore_dtensor_state(optimizer: torch.optim.Optimizer) -> None:
    """After loading a :func:`local_state` optimizer state: give DTensor parameters DTensor states again."""
    for p, st in optimizer.state.items():
        if not is_dtensor(p):
            continue
        from torch.distributed.tensor import DTensor

        local_shape = tuple(p.to_local().shape)
        for k, v in list(st.items()):
            if torch.is_tensor(v) and not is_dtensor(v) and k != "step" and tuple(v.shape) == local_shape:
                st[k] = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, run_check=False)


def copy_overlap(dst: torch.Tensor, dst_spec: ShardSpec, src: torch.Tensor, src_spec: ShardSpec) -> int:
    """Copy into ``dst`` (a local piece laid out by ``dst_spec``) the part of the full tensor it shares with
    ``src`` (another piece of it, laid out by ``src_spec``, maybe cut along another dimension); returns the
    elements copied.  Resharding a checkpoint is this over every piece the old ranks wrote."""
    if dst_spec.full_shape != src_spec.full_shape:
        raise ValueError(f"pieces of tensors of different shapes: {dst_spec.full_shape} and {src_spec.full_shape}")
    if not dst_spec.full_shape:
        dst.copy_(src.reshape(dst.shape))
        return 1
    d_view, s_view = dst, src
    for dim in {dst_spec.dim, src_spec.dim}:
        ranges = [(s.offset, s.offset + s.length) if s.dim == dim else (0, dst_spec.full_shape[dim])
                  for s in (dst_spec, src_spec)]
        lo, hi = max(r[0] for r in ranges), min(r[1] for r in ranges)
        if hi <= lo:
            return 0
        d_view = d_view.narrow(dim, lo - ranges[0][0], hi - lo)
        s_view = s_view.narrow(dim, lo - ranges[1][0], hi - lo)
    d_view.copy_(s_view)
    return d_view.numel()
