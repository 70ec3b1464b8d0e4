"""Where an island's pipeline stages are cut: by parameter count, by block count, or by time
measured on the island's own device (``--parallel.balance params|layers|profile``).

``profile`` times, on every rank, each block's forward + backward, the embedding's, and the norm +
output projection's together with the loss, on one micro-batch-shaped input.  The ranks then take
the largest time of each part over the whole island (an all-reduce max over both mesh dimensions),
so every rank holds bit-identical costs and computes the same split: the exact contiguous split
that minimises the slowest stage (:func:`pipeline.pipeline_parallel.stage_layer_split`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh

from pipeline.materialize import is_skeleton, materialize
from pipeline.pipeline_parallel import model_layer_costs, model_part, stage_layer_split
from pipeline.settings import ParallelSettings

log = logging.getLogger(__name__)

BALANCES = ("params", "layers", "profile")
PROFILE_WARMUP = 2
"""Untimed runs of each part before timing: the first runs pay one-off costs (allocator growth, kernel
selection and lazy CUDA/cuBLAS initialisation, the CPU thread pool waking up) that training does not."""
PROFILE_REPEATS = 5
"""Timed runs of each part; the fastest is the part's cost: other processes and clock hiccups only ever
add time, so the minimum of a few runs is the steadiest estimate, and the whole profile stays a few
forward-backward passes of the model."""
PROFILE_MIN_GAIN = 0.05
"""The profiled split replaces the ``params`` one only if its slowest stage is faster by more than this
share: timing noise of a few percent between equal blocks must not move layers around."""


def idle_fraction(times: list[float]) -> float:
    """Share of a step the pipeline ranks wait on the slowest one: ``1 - mean / max`` (0 if all are 0)."""
    top = max(times, default=0.0)
    return 1.0 - sum(times) / len(times) / top if top > 0 else 0.0


@dataclass(frozen=True)
class PartCosts:
    """Cost of each block (in ``layers`` order), of the embedding and of norm + output (+ loss)."""

    layers: list[float]
    first: float
    last: float
    unit: str
    """``params``, ``layers`` or ``s`` (seconds of forward + backward of one micro-batch)."""

    def stage_costs(self, sizes: list[int]) -> list[float]:
        """Cost of each stage when the stages hold ``sizes`` consecutive blocks."""
        out, start = [], 0
        for size in sizes:
            out.append(sum(self.layers[start:start + size]))
            start += size
        out[0] += self.first
        out[-1] += self.last
        return out

    def split(self, n_stages: int, layers_per_stage: list[int] | None = None) -> list[int]:
        """Blocks per stage: ``layers_per_stage`` when given, else the split minimising the slowest stage."""
        runs = stage_layer_split(self.layers, n_stages, layers_per_stage, self.first, self.last)
        return [len(run) for run in runs]


@dataclass(frozen=True)
class StagePlan:
    """The chosen split of an island's pipeline and what it predicts."""

    balance: str
    sizes: list[int]
    """Blocks per (virtual) stage, the same on every rank of the island."""
    costs: PartCosts
    pp: int
    by_params: list[int] | None = None
    """With ``profile``: the split ``params`` would have chosen, to compare with."""

    def rank_costs(self, sizes: list[int] | None = None) -> list[float]:
        """Cost of each pipeline rank (the stages it holds under loop placement summed)."""
        stages = self.costs.stage_costs(sizes or self.sizes)
        return [sum(stages[r::self.pp]) for r in range(self.pp)]

    @property
    def predicted_idle(self) -> float:
        """``1 - mean / max`` of the ranks' costs: the idle share imbalance alone adds to the bubble."""
        return idle_fraction(self.rank_costs())

    def describe(self) -> str:
        """One log line: the split, the stage costs and the predicted idle fraction."""
        scale, unit = (1e3, "ms") if self.costs.unit == "s" else (1.0, self.costs.unit)
        costs = "/".join(f"{c * scale:.4g}" for c in self.rank_costs())
        line = (f"pipeline stages balanced by {self.balance}: layers per stage {_csv(self.sizes)}, "
                f"cost per rank {costs} {unit}, predicted idle {self.predicted_idle:.1%}")
        if self.by_params is not None:
            other = self.rank_costs(self.by_params)
            line += (f" (the params split {_csv(self.by_params)} would cost {max(other) * scale:.4g} {unit} on its "
                     f"slowest rank, idle {idle_fraction(other):.1%})")
        return line


def _csv(sizes: list[int]) -> str:
    return ",".join(map(str, sizes))


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so a wall-clock reading covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fastest_seconds(run: Callable[[], None], device: torch.device, warmup: int = PROFILE_WARMUP,
                    repeats: int = PROFILE_REPEATS) -> float:
    """Least wall time of ``run()`` over ``repeats`` timed calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        sync_device(device)
        start = time.perf_counter()
        run()
        sync_device(device)
        samples.append(time.perf_counter() - start)
    return min(samples)


def profile_part_costs(model: nn.Module, sample_shape: tuple[int, int], device: torch.device,
                       loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                       activation_checkpointing: bool = False, tp_mesh: DeviceMesh | None = None,
                       compute_dtype: torch.dtype = torch.float32) -> PartCosts:
    """Seconds of forward + backward of each block, of the embedding and of norm + output + ``loss_fn``
    on a ``(rows, seq)`` micro-batch, each part copied alone onto ``device`` and, with ``tp_mesh``,
    sharded over it as in training, so the TP collectives are timed too (collective over ``tp_mesh``).
    Under autocast to ``compute_dtype``, as the island trains.  Uses its own random generator, so the caller's
    random state is untouched."""
    rows, seq = sample_shape
    dim, vocab = model.tok_embeddings.weight.shape[1], model.output.weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (rows, seq), generator=gen).to(device)
    hidden = torch.randn(rows, seq, dim, generator=gen).to(device)
    grad = torch.randn(rows, seq, dim, generator=gen).to(device)

    def part_seconds(layer_keys: set[str], first: bool, last: bool) -> float:
        part = model_part(model, layer_keys, first, last)
        if is_skeleton(part):  # the timing needs finite values, not the run's
            materialize(part, device)
            with torch.no_grad():
                for p in part.parameters():
                    p.normal_(0.0, 0.02)
        else:
            part.to(device)
        if tp_mesh is not None:
            from pipeline.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(part, tp_mesh)
        part.activation_checkpointing = activation_checkpointing
        part.train()
        x = tokens if first else hidden.clone().requires_grad_()  # later stages send input grads back

        def run() -> None:
            part.zero_grad(set_to_none=True)
            x.grad = None
            with torch.autocast(device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
                out = part(x)
                if isinstance(out, AsyncCollectiveTensor):  # the TP embedding's all-reduce: the next stage
                    out.trigger_wait()  # would wait on it, and unwaited it would only be reported at exit
                loss = loss_fn(out, tokens) if last else None
            if loss is not None:
                loss.backward()
            else:
                out.backward(grad.to(out.dtype))

        return fastest_seconds(run, device)

    layers = [part_seconds({key}, False, False) for key in model.layers.keys()]
    return PartCosts(layers, part_seconds(set(), True, False), part_seconds(set(), False, True), "s")


def island_max(values: list[float], mesh: DeviceMesh | None, device: torch.device) -> list[float]:
    """The element-wise maximum of ``values`` over every rank of the island (collective)."""
    if mesh is None:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    for name in mesh.mesh_dim_names:
        if mesh[name].size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh[name].get_group())
    return t.tolist()


def plan_stages(model: nn.Module, settings: ParallelSettings, mesh: DeviceMesh | None, device: torch.device,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                sample_shape: tuple[int, int]) -> StagePlan:
    """Choose the blocks of every pipeline stage as ``settings.balance`` asks (collective with ``profile``).

    An explicit ``settings.layers_per_stage`` wins over the balance; the costs are then only used to
    predict the idle fraction.  ``sample_shape`` is one micro-batch ``(rows, seq)`` for ``profile``.
    """
    n_stages = settings.pp * settings.local_stages
    params = PartCosts(*model_layer_costs(model), unit="params")
    if settings.balance == "layers":
        costs = PartCosts([1.0] * len(model.layers), 0.0, 0.0, "layers")
    elif settings.balance == "profile":
        mine = profile_part_costs(model, sample_shape, device, loss_fn, settings.activation_checkpointing,
                                  mesh["tp"] if mesh is not None else None, settings.compute_dtype(device.type))
        agreed = island_max([*mine.layers, mine.first, mine.last], mesh, device)
        costs = PartCosts(agreed[:-2], agreed[-2], agreed[-1], "s")
    else:
        costs = params
    explicit = settings.layers_per_stage or None
    if settings.balance != "profile" or explicit:
        return StagePlan(settings.balance, costs.split(n_stages, explicit), costs, settings.pp)
    return profiled_plan(costs, params, n_stages, settings.pp)


def profiled_plan(times: PartCosts, params: PartCosts, n_stages: int, pp: int) -> StagePlan:
    """The split minimising the slowest stage by ``times``, unless it beats the ``params`` split by no
    more than :data:`PROFILE_MIN_GAIN` (then the ``params`` split, which noise cannot move)."""
    by_params = params.split(n_stages)
    plan = StagePlan("profile", times.split(n_stages), times, pp, by_params)
    if max(plan.rank_costs()) < (1 - PROFILE_MIN_GAIN) * max(plan.rank_costs(by_params)):
        return plan
    return StagePlan("profile", by_params, times, pp, by_params)
