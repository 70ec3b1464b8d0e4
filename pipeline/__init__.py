"""Tensor and pipeline parallelism inside one DiLoCo island, with torch's DeviceMesh, DTensor and
``torch.distributed.pipelining``.

Functions here take the Llama-style ``Transformer`` (``tok_embeddings``, ``layers`` as a ModuleDict,
``norm``, ``output``) as a plain ``nn.Module`` and never import the trainer package.

- :mod:`pipeline.mesh`: the ``("pp", "tp")`` device mesh of an island.
- :mod:`pipeline.tensor_parallel`: the Megatron TP plan and its divisibility checks.
- :mod:`pipeline.pipeline_parallel`: layer split, stage modules and schedules.
- :mod:`pipeline.balance`: where the stages are cut (by parameters, blocks or measured time).
- :mod:`pipeline.stage_clock`: the idle fraction a pipeline shows in its first steps.
- :mod:`pipeline.shards`: where a local shard sits in the full parameter.
- :mod:`pipeline.grad_clip`: island-wide gradient-norm clipping.
- :mod:`pipeline.model_parts`: :class:`ModelParts`, which puts it all together for a training loop.
"""

from pipeline.balance import BALANCES, PartCosts, StagePlan, plan_stages, profile_part_costs
from pipeline.grad_clip import clip_grad_norm_, island_grad_norm
from pipeline.model_parts import ModelParts, SplitSettings, check_split, cross_entropy_loss
from pipeline.mesh import destroy_island, init_island_mesh, island_coords, island_ranks
from pipeline.pipeline_parallel import (
    SCHEDULES,
    build_pipeline_stages,
    build_schedule,
    build_stage_modules,
    check_schedule,
    model_layer_costs,
    model_part,
    stage_layer_split,
)
from pipeline.shards import ShardSpec, local_grad, local_state, restore_dtensor_state, shard_spec_of
from pipeline.tensor_parallel import apply_tensor_parallel, check_tensor_parallel, tensor_parallel_plan

__all__ = [
    "ModelParts", "SplitSettings", "check_split", "cross_entropy_loss",
    "init_island_mesh", "destroy_island", "island_coords", "island_ranks",
    "apply_tensor_parallel", "check_tensor_parallel", "tensor_parallel_plan",
    "BALANCES", "PartCosts", "StagePlan", "plan_stages", "profile_part_costs", "model_part",
    "stage_layer_split", "model_layer_costs", "build_stage_modules", "build_pipeline_stages", "build_schedule",
    "check_schedule", "SCHEDULES",
    "ShardSpec", "shard_spec_of", "local_grad", "local_state", "restore_dtensor_state", "clip_grad_norm_", "island_grad_norm",
]
