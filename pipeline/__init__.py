"""Tensor and pipeline parallelism inside one DiLoCo island, with torch's DeviceMesh, DTensor and
``torch.distributed.pipelining``.

Functions here take the Llama-style ``Transformer`` (``tok_embeddings``, ``layers`` as a ModuleDict,
``norm``, ``output``) as a plain ``nn.Module`` and never import the trainer package.

- :mod:`pipeline.settings`: :class:`ParallelSettings`, how an island is split (plain data, no torch).
- :mod:`pipeline.mesh`: the ``("dp", "pp", "tp")`` device mesh of an island.
- :mod:`pipeline.data_parallel`: FSDP2 over the ``dp`` dimension, composed with TP and PP.
- :mod:`pipeline.materialize`: a model built on the meta device made real, one rank's part only.
- :mod:`pipeline.tensor_parallel`: the Megatron TP plan and its divisibility checks.
- :mod:`pipeline.pipeline_parallel`: layer split, stage modules and schedules.
- :mod:`pipeline.balance`: where the stages are cut (by parameters, blocks or measured time).
- :mod:`pipeline.stage_clock`: the idle fraction a pipeline shows in its first steps.
- :mod:`pipeline.shards`: where a local shard sits in the full parameter, and resharding between splits.
- :mod:`pipeline.grad_clip`: island-wide gradient-norm clipping.
- :mod:`pipeline.model_parts`: :class:`ModelParts`, which puts it all together for a training loop.

The names below are imported on first use, so that reading the settings (the trainer's config does) does
not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ParallelSettings": "settings",
    "BALANCES": "balance", "PartCosts": "balance", "StagePlan": "balance", "plan_stages": "balance",
    "profile_part_costs": "balance",
    "clip_grad_norm_": "grad_clip", "island_grad_norm": "grad_clip",
    "ModelParts": "model_parts", "check_split": "model_parts", "cross_entropy_loss": "model_parts",
    "destroy_island": "mesh", "init_island_mesh": "mesh", "island_coords": "mesh", "island_ranks": "mesh",
    "SCHEDULES": "pipeline_parallel", "build_pipeline_stages": "pipeline_parallel",
    "build_schedule": "pipeline_parallel", "build_stage_modules": "pipeline_parallel",
    "check_schedule": "pipeline_parallel", "model_layer_costs": "pipeline_parallel", "model_part": "pipeline_parallel",
    "stage_layer_split": "pipeline_parallel",
    "is_skeleton": "materialize", "materialize": "materialize", "apply_fsdp": "data_parallel", "fsdp_placement": "data_parallel", "MESH_DIMS": "mesh",
    "ShardSpec": "shards", "copy_overlap": "shards", "local_grad": "shards", "local_tensor": "shards", "local_state": "shards", "restore_dtensor_state": "shards",
    "shard_spec_of": "shards",
    "apply_tensor_parallel": "tensor_parallel", "check_tensor_parallel": "settings",
    "tensor_parallel_plan": "tensor_parallel",
}
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pipeline.{module}"), name)
