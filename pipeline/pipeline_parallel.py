"""Pipeline parallelism for the Llama-style ``Transformer`` with ``torch.distributed.pipelining``.

A stage is the model with parts removed (torchtitan's approach): blocks it does not own are
deleted from the ``layers`` ``ModuleDict`` and ``tok_embeddings``/``norm``/``output`` are set to
``None`` where it is not the first/last stage, so parameter names are those of the whole model.
With ``v`` virtual stages per rank (interleaved 1F1B) the ``pp * v`` stages are placed in a loop:
rank ``r`` owns stages ``r, r + pp, r + 2 pp, ...``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from pipeline.mesh import group_timeout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineSchedule

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def model_layer_costs(model: nn.Module) -> tuple[list[int], int, int]:
    """Parameter count of each block (in ``layers`` order), of the embedding and of norm + output."""
    costs = [sum(p.numel() for p in block.parameters()) for block in model.layers.values()]
    first = sum(p.numel() for p in model.tok_embeddings.parameters()) if model.tok_embeddings is not None else 0
    last = sum(p.numel() for m in (model.norm, model.output) if m is not None for p in m.parameters())
    return costs, first, last


def stage_layer_split(layer_costs: list[float], n_stages: int, layers_per_stage: list[int] | None = None,
                      first_cost: float = 0, last_cost: float = 0) -> list[list[int]]:
    """Split layers ``0..L-1`` into ``n_stages`` contiguous, non-empty runs; return their indices.

    With ``layers_per_stage`` the runs have exactly those lengths.  Otherwise the split minimises the
    largest stage cost (exactly, by dynamic programming over the contiguous splits; costs in any unit:
    parameters, seconds), where a stage costs the sum of its ``layer_costs`` plus ``first_cost`` (the
    embedding) on the first stage and ``last_cost`` (norm and output) on the last; among such splits
    it takes the most even one (least sum of squared stage costs).  Raises ValueError when no split
    exists.
    """
    n_layers = len(layer_costs)
    if n_stages < 1:
        raise ValueError(f"the number of pipeline stages must be at least 1, got {n_stages}")
    if n_stages > n_layers:
        raise ValueError(f"the pipeline has {n_stages} stages (--parallel.pp times virtual stages) but the model "
                         f"has only {n_layers} layers; every stage needs at least one layer")
    if layers_per_stage is not None and len(layers_per_stage) > 0:
        if len(layers_per_stage) != n_stages:
            raise ValueError(f"--parallel.layers_per_stage lists {len(layers_per_stage)} stages but the pipeline has "
                             f"{n_stages} (--parallel.pp times virtual stages)")
        if any(n < 1 for n in layers_per_stage):
            raise ValueError(f"--parallel.layers_per_stage {list(layers_per_stage)} must give every stage at least one layer")
        if sum(layers_per_stage) != n_layers:
            raise ValueError(f"--parallel.layers_per_stage {list(layers_per_stage)} sums to {sum(layers_per_stage)} "
                             f"but the model has {n_layers} layers")
        sizes = list(layers_per_stage)
    else:
        sizes = _balanced_sizes(layer_costs, n_stages, first_cost, last_cost)
    out, start = [], 0
    for size in sizes:
        out.append(list(range(start, start + size)))
        start += size
    return out


def _balanced_sizes(costs: list[float], n_stages: int, first_cost: float, last_cost: float) -> list[int]:
    """Stage sizes minimising the most expensive stage and, among those, the sum of squared stage
    costs (so equal layers spread evenly).  Two dynamic programmes over the split points."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, i: int, j: int) -> float:  # stage s holds layers i..j-1
        extra = (first_cost if s == 0 else 0) + (last_cost if s == n_stages - 1 else 0)
        return prefix[j] - prefix[i] + extra

    def solve(score, combine) -> tuple[float, list[int]]:
        # best[s][j]: best score placing layers 0..j-1 on stages 0..s (stage s non-empty)
        inf = float("inf")
        best = [[inf] * (n + 1) for _ in range(n_stages)]
        cut = [[0] * (n + 1) for _ in range(n_stages)]
        for j in range(1, n + 1):
            best[0][j] = score(cost(0, 0, j))
        for s in range(1, n_stages):
            for j in range(s + 1, n + 1):
                for i in range(s, j):
                    value = combine(best[s - 1][i], score(cost(s, i, j)))
                    if value < best[s][j]:
                        best[s][j], cut[s][j] = value, i
        sizes, j = [], n
        for s in range(n_stages - 1, 0, -1):
            sizes.append(j - cut[s][j])
            j = cut[s][j]
        sizes.append(j)
        return best[n_stages - 1][n], sizes[::-1]

    limit, _ = solve(lambda c: c, max)
    _, sizes = solve(lambda c: c * c if c <= limit else float("inf"), lambda a, b: a + b)
    return sizes


def stage_ids_of_rank(pp_rank: int, pp_size: int, n_local: int) -> list[int]:
    """Stages owned by ``pp_rank`` under loop placement: ``pp_rank + k * pp_size``."""
    return [pp_rank + k * pp_size for k in range(n_local)]


def model_part(model: nn.Module, layer_keys: set[str], first: bool, last: bool) -> nn.Module:
    """A deep copy of ``model`` holding only the blocks named in ``layer_keys``, the embedding if
    ``first`` and ``norm``/``output`` if ``last`` (the rest is ``None``), with the whole model's
    parameter names.  The parts it drops are never copied (they are pre-seeded as ``None`` in the
    deep-copy memo), so a part costs only its own memory; ``model`` itself is left untouched."""
    dropped: list[nn.Module | None] = [block for key, block in model.layers.items() if key not in layer_keys]
    if not first:
        dropped.append(model.tok_embeddings)
    if not last:
        dropped += [model.norm, model.output]
    module = copy.deepcopy(model, {id(m): None for m in dropped if m is not None})
    for key in list(module.layers.keys()):
        if key not in layer_keys:
            del module.layers[key]
    return module


def build_stage_modules(model: nn.Module, pp_rank: int, pp_size: int, virtual_stages: int = 1,
                        layers_per_stage: list[int] | None = None) -> list[tuple[int, nn.Module]]:
    """Return ``(stage_index, module)`` for each stage this rank owns (loop placement).

    Each module is a :func:`model_part` of ``model``: its own blocks, ``tok_embeddings`` on stage 0
    only and ``norm``/``output`` on the last stage only.  Without ``layers_per_stage`` the split
    balances parameter counts (:func:`stage_layer_split`).
    """
    n_stages = pp_size * virtual_stages
    costs, first, last = model_layer_costs(model)
    split = stage_layer_split(costs, n_stages, layers_per_stage, first, last)
    keys = list(model.layers.keys())
    return [(stage, model_part(model, {keys[i] for i in split[stage]}, stage == 0, stage == n_stages - 1))
            for stage in stage_ids_of_rank(pp_rank, pp_size, virtual_stages)]


def stage_group(mesh: DeviceMesh, device: torch.device, host_staged: bool | None = None) -> ProcessGroup:
    """The group this rank's pipeline stages send and receive on: the mesh's ``pp`` group, or a group of the same
    ranks whose sends and receives go through host memory (:mod:`pipeline.host_staged`).  ``host_staged`` None
    takes the second where gloo would carry a GPU's tensors point to point, which it cannot (ranks sharing GPUs)."""
    pp_group = mesh["pp"].get_group()
    if host_staged is None:
        host_staged = device.type != "cpu" and dist.get_backend(pp_group) == "gloo"
    if not host_staged:
        return pp_group
    from pipeline.host_staged import host_staged_group

    names = list(mesh.mesh_dim_names or ())
    ranks = mesh.mesh.movedim(names.index("pp"), -1).reshape(-1, mesh["pp"].size()).tolist()
    group = host_staged_group(ranks, group_timeout(pp_group) or group_timeout())
    assert group is not None  # noqa: S101 (this rank is in its own pp group)
    return group


def build_pipeline_stages(modules: list[tuple[int, nn.Module]], n_stages: int, device: torch.device,
                          pp_group: ProcessGroup) -> list[PipelineStage]:
    """Wrap each ``(stage_index, module)`` in a :class:`PipelineStage` communicating over ``pp_group``."""
    # torch's pipelining imports its compiler stack: only islands with stages pay for it
    from torch.distributed.pipelining import PipelineStage

    return [PipelineStage(module, stage, n_stages, device, group=pp_group) for stage, module in modules]


def check_schedule(name: str, pp: int, n_microbatches: int, n_local: int = 1) -> list[str]:
    """One sentence per reason ``name`` cannot run ``n_microbatches`` micro-batches on ``pp`` ranks."""
    problems = []
    if name not in SCHEDULES:
        return [f"--parallel.schedule is {name!r} but must be one of {', '.join(SCHEDULES)}"]
    if n_microbatches < 1:
        return [f"--parallel.microbatches must be at least 1, got {n_microbatches}"]
    if name == "1f1b" and n_microbatches < pp:
        problems.append(f"the 1f1b schedule needs --parallel.microbatches ({n_microbatches}) to be at least "
                        f"--parallel.pp ({pp})")
    if name == "interleaved-1f1b":
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            problems.append(f"the interleaved-1f1b schedule needs --parallel.microbatches ({n_microbatches}) to be a "
                            f"multiple of {rounds} (microbatches // pp); use a multiple of --parallel.pp ({pp})")
    elif n_local != 1:
        problems.append(f"the {name} schedule runs one stage per rank, got {n_local}")
    return problems


def build_schedule(name: str, stages: list[PipelineStage], n_microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   scale_grads: bool = True) -> _PipelineSchedule:
    """The torch schedule ``gpipe``, ``1f1b`` or ``interleaved-1f1b`` over this rank's ``stages``.

    ``scale_grads=True`` divides the gradients by ``n_microbatches`` after the step (for a mean
    loss); pass False when ``loss_fn`` already includes that factor.
    """
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    problems = check_schedule(name, stages[0].group_size, n_microbatches, len(stages))
    if problems:
        raise ValueError("; ".join(problems))
    if name == "gpipe":
        return ScheduleGPipe(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    if name == "1f1b":
        return Schedule1F1B(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    return ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
