"""Megatron-style tensor parallelism for the Llama-style ``Transformer``, applied with DTensor.

The plan (as torchtitan applies it, without sequence parallelism):

* attention ``wq``/``wk``/``wv`` and MLP ``w1``/``w3``: :class:`ColwiseParallel` (weight ``Shard(0)``),
  so each rank computes a subset of heads / hidden units.  The attention reshapes with ``-1`` heads,
  so it runs unchanged on the local heads.
* attention ``wo`` and MLP ``w2``: :class:`RowwiseParallel` (weight ``Shard(1)``), whose partial
  sums are all-reduced into a replicated residual stream.
* ``tok_embeddings``: :class:`RowwiseParallel` over the vocabulary (weight ``Shard(0)``, token ids
  replicated); each rank looks up its slice of the vocabulary and the partial results are summed.
* ``output``: :class:`ColwiseParallel` over the vocabulary whose local logits are all-gathered
  (:func:`gather_logits`), so the ordinary cross-entropy runs unchanged on every TP rank.  We chose
  this over loss-parallel because the pipeline schedules hand plain tensors to the loss function,
  the loss stays bit-for-bit the single-process one, and the all-gather costs
  ``batch*seq*vocab/tp`` floats per step, small next to the weight traffic of a 32k-vocab model.
  The gather is one plain ``all_gather_into_tensor``, not DTensor's Shard-to-Replicate: that one takes
  c10d's coalesced all-gather, which gloo lacks for GPU tensors (ranks sharing a GPU, ``--parallel.gpus``).
* RMSNorm weights: :class:`ReplicateParallel`, i.e. replicated DTensors computing on replicated
  inputs.  Their inputs and output-gradients are already replicated (the colwise layers all-reduce
  the input gradient), so their gradients agree on all TP ranks without communication.  Making them
  DTensors too (rather than plain tensors) keeps every parameter of a TP model a DTensor, which
  ``foreach``/fused optimizers (the CUDA default) require: they refuse mixed Tensor/DTensor lists.

Hidden states between blocks (and between pipeline stages) are plain, replicated tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from pipeline.settings import check_tensor_parallel


class ReplicateParallel(ParallelStyle):
    """Replicate a module's parameters as DTensors; it takes and returns plain (replicated) tensors."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=_replicated_inputs, output_fn=_local_outputs)


def _replicated_inputs(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                 if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)


def _local_outputs(module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


def tensor_parallel_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The Megatron plan for the parts of ``model`` that are present (a pipeline stage may lack some)."""
    plan: dict[str, ParallelStyle] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if getattr(model, "output", None) is not None:
        plan["output"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=True)
    if getattr(model, "norm", None) is not None:
        plan["norm"] = ReplicateParallel()
    for key in model.layers:
        prefix = f"layers.{key}"
        plan[f"{prefix}.attention_norm"] = ReplicateParallel()
        plan[f"{prefix}.ffn_norm"] = ReplicateParallel()
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"{prefix}.{name}"] = RowwiseParallel()
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard ``model`` (in place) over the 1-D ``tp_mesh`` with the Megatron plan; return it.

    Parameter names do not change; sharded weights become DTensors whose ``to_local()`` is this
    rank's slice.  Every rank must hold the same full weights before the call (rank 0 of the mesh
    is the source the shards are scattered from).  Raises ValueError when the widths do not divide.
    """
    tp = tp_mesh.size()
    if tp == 1:
        return model
    attn = next(iter(model.layers.values())).attention if len(model.layers) else None
    if attn is not None:
        n_heads = attn.wq.weight.shape[0] // attn.head_dim
        dim = attn.wq.weight.shape[1]
        ffn_dim = next(iter(model.layers.values())).feed_forward.w1.weight.shape[0]
        vocab = _vocab_size(model) or tp
        problems = check_tensor_parallel(n_heads, dim, ffn_dim, vocab, tp)
        if problems:
            raise ValueError("; ".join(problems))
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model))
    if getattr(model, "output", None) is not None:
        group = tp_mesh.get_group()
        model.output.register_forward_hook(lambda module, inputs, logits: gather_logits(logits, group))
    return model


class _GatherLastDim(torch.autograd.Function):
    """All-gather of the last dimension over a group; backward keeps this rank's slice of the gradient (every rank
    computes the same loss from the gathered tensor, so every rank holds the same whole gradient)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.rank, ctx.width, world = dist.get_rank(group), local.shape[-1], dist.get_world_size(group)
        parts = local.new_empty((world * local.shape[0], *local.shape[1:]))  # the ranks' slices, stacked on dim 0
        dist.all_gather_into_tensor(parts, local.contiguous(), group=group)
        return torch.cat(parts.chunk(world, dim=0), dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[..., ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width].contiguous(), None


def gather_logits(local: torch.Tensor, group: Any) -> torch.Tensor:
    """The whole vocabulary's logits from each TP rank's slice (its columns of the output projection)."""
    return _GatherLastDim.apply(local, group)


def _vocab_size(model: nn.Module) -> int | None:
    if getattr(model, "tok_embeddings", None) is not None:
        return model.tok_embeddings.weight.shape[0]
    if getattr(model, "output", None) is not None:
        return model.output.weight.shape[0]
    return None
