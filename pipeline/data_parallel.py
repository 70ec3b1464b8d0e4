"""Data parallelism inside an island: FSDP2 over the mesh's ``"dp"`` dimension, composed with tensor and
pipeline parallelism, as torchtitan applies it (after TP and compile, per block, then on the whole module).

Each parameter is sharded over ``dp`` along the dimension TP already shards it on (dim 0 otherwise), so this
rank's piece of every parameter stays one slice along one dimension of the full tensor: the outer state, the
averaging layout and the checkpoints describe it with the same ``(dim, offset, length)`` as a TP shard.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard


def fsdp_placement(param: nn.Parameter) -> Shard:
    """Shard a parameter over ``dp`` on the dimension its TP placement shards (a slice of a slice on the same
    dimension is one slice), else on dim 0."""
    if isinstance(param, DTensor):
        for placement in param.placements:
            if isinstance(placement, Shard):
                return Shard(placement.dim)
    return Shard(0)


def apply_fsdp(module: nn.Module, dp_mesh: DeviceMesh, compute_dtype: torch.dtype,
               reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``module`` (in place) over the 1-D ``dp_mesh``: each of ``module.layers`` on its own (its
    parameters are gathered just before it runs and freed after), then the rest at the root; return it.  A 2-D
    ``("replicate", "dp")`` mesh makes it HSDP: sharded over ``dp``, replicated (gradients all-reduced) over
    ``replicate``.

    With a bf16 ``compute_dtype`` the parameters are gathered in bf16 and gradients reduced in fp32 (the
    sharded master weights and AdamW's state stay fp32).  A pipeline stage keeps its blocks gathered between
    forward and backward (``reshard_after_forward=False``): its micro-batches would gather them again each.
    """
    if dp_mesh.size() == 1:
        return module
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) \
        if compute_dtype != torch.float32 else MixedPrecisionPolicy()
    for block in module.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=fsdp_placement, mp_policy=policy)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                shard_placement_fn=fsdp_placement, mp_policy=policy)
    return module
