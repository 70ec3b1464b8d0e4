"""Where a rank's local piece of a parameter sits in the full (unsharded) parameter.

A cross-island averaging layer maps local shards to a canonical layout with these specs: the local
tensor of parameter ``name`` equals ``full.narrow(spec.dim, spec.offset, spec.length)`` of the full
parameter of the same name in the unsplit model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard


@dataclass(frozen=True)
class ShardSpec:
    """A contiguous slice ``[offset, offset + length)`` along ``dim`` of a tensor of ``full_shape``.

    ``replicated`` is True when every TP rank holds this same slice (the whole tensor), so only one
    of them needs to contribute it to an average.
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
    """The :class:`ShardSpec` of a plain tensor (the whole of it) or of a DTensor on a 1-D mesh."""
    full_shape = tuple(param.shape)
    if not isinstance(param, DTensor):
        return ShardSpec(full_shape, 0, 0, full_shape[0] if full_shape else 1, True)
    if param.device_mesh.ndim != 1:
        raise ValueError(f"shard_spec_of expects a DTensor on a 1-D mesh, got a {param.device_mesh.ndim}-D mesh")
    placement = param.placements[0]
    if isinstance(placement, Replicate):
        return ShardSpec(full_shape, 0, 0, full_shape[0] if full_shape else 1, True)
    if isinstance(placement, Shard):
        dim = placement.dim % len(full_shape)
        local = param.to_local()
        chunk = -(-full_shape[dim] // param.device_mesh.size())  # torch.chunk sizing (ceil)
        offset = min(param.device_mesh.get_local_rank() * chunk, full_shape[dim])
        return ShardSpec(full_shape, dim, offset, local.shape[dim], False)
    raise ValueError(f"unsupported DTensor placement {placement} for a parameter")


def local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The local part of ``param.grad`` laid out like the local parameter (None without a grad).

    DTensor's embedding backward yields a *replicated* gradient for a vocabulary-sharded weight;
    such a gradient is first redistributed to the parameter's placements (a local slice, no
    communication) and stored back, so shard and gradient always line up.
    """
    grad = param.grad
    if grad is None:
        return None
    if isinstance(grad, DTensor):
        if isinstance(param, DTensor) and tuple(grad.placements) != tuple(param.placements):
            grad = grad.redistribute(param.device_mesh, param.placements)
            param.grad = grad
        return grad.to_local()
    return grad


def local_state(obj: Any) -> Any:
    """A state dict with every DTensor replaced by its local tensor (checkpoints load weights-only)."""
    if isinstance(obj, DTensor):
        return obj.to_local().detach().cpu()
    if isinstance(obj, dict):
        return {k: local_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [local_state(v) for v in obj]
    return obj


def restore_dtensor_state(optimizer: torch.optim.Optimizer) -> None:
    """After loading a :func:`local_state` optimizer state: give DTensor parameters DTensor states again."""
    for p, st in optimizer.state.items():
        if not isinstance(p, DTensor):
            continue
        local_shape = tuple(p.to_local().shape)
        for k, v in list(st.items()):
            if torch.is_tensor(v) and not isinstance(v, DTensor) and k != "step" and tuple(v.shape) == local_shape:
                st[k] = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, run_check=False)
