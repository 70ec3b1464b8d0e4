"""This rank's parts of an island's model, split over a ``("dp", "pp", "tp")`` mesh and trained as if it were
one process.

Every rank of the island builds the same full model (same seed), constructs its :class:`ModelParts`
and calls the same methods; the ranks of one data-parallel replica pass the same batch (only the first
pipeline stage reads the inputs and only the last reads the targets), each replica its own.  The inner
optimizer is an ordinary torch optimizer over :meth:`ModelParts.parameters` (DTensors when ``tp > 1`` or
``dp > 1``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule

from pipeline.balance import BALANCES, StagePlan, plan_stages
from pipeline.grad_clip import clip_grad_norm_
from pipeline.materialize import is_skeleton, materialize
from pipeline.mesh import fsdp_mesh, mesh_rank, mesh_size
from pipeline.pipeline_parallel import (
    SCHEDULES,
    build_pipeline_stages,
    build_schedule,
    build_stage_modules,
    check_schedule,
    stage_group,
)
from pipeline.settings import ParallelSettings, check_tensor_parallel
from pipeline.shards import (
    ShardSpec,
    is_dtensor,
    local_grad,
    local_tensor,
    shard_spec_of,
)
from pipeline.stage_clock import StageClock, measured_line

log = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (in fp32), the default loss of an island."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def apply_compile(model: nn.Module) -> None:
    """Compile each of ``model.layers`` in place (``Module.compile``: parameter names and state dicts stay as
    they are).  Per block rather than the whole model, as torchtitan does: the blocks share one graph, and a
    pipeline stage or a tensor-parallel shard compiles the same way."""
    for block in model.layers.values():
        block.compile()


def check_split(settings: ParallelSettings, n_layers: int, n_heads: int, dim: int, ffn_dim: int,
                 vocab_size: int) -> list[str]:
    """One sentence per reason the model cannot be split as ``settings`` asks (empty if it can)."""
    problems = check_tensor_parallel(n_heads, dim, ffn_dim, vocab_size, settings.tp)
    if settings.dp < 1:
        problems.append(f"--parallel.dp must be at least 1, got {settings.dp}")
    if settings.pp < 1:
        problems.append(f"--parallel.pp must be at least 1, got {settings.pp}")
        return problems
    if settings.virtual_stages < 1:
        problems.append(f"--parallel.virtual_stages must be at least 1, got {settings.virtual_stages}")
        return problems
    n_stages = settings.pp * settings.local_stages
    if settings.pp > n_layers:
        problems.append(f"--parallel.pp ({settings.pp}) must not exceed --model.n_layers ({n_layers})")
    elif n_stages > n_layers:
        problems.append(f"--parallel.pp * --parallel.virtual_stages ({n_stages}) must not exceed "
                        f"--model.n_layers ({n_layers}) for interleaved-1f1b")
    if settings.balance not in BALANCES:
        problems.append(f"--parallel.balance is {settings.balance!r} but must be one of {', '.join(BALANCES)}")
    if settings.layers_per_stage:
        if len(settings.layers_per_stage) != n_stages:
            problems.append(f"--parallel.layers_per_stage lists {len(settings.layers_per_stage)} stages but the "
                            f"pipeline has {n_stages}")
        elif sum(settings.layers_per_stage) != n_layers or min(settings.layers_per_stage) < 1:
            problems.append(f"--parallel.layers_per_stage {settings.layers_per_stage} must be positive and sum to "
                            f"--model.n_layers ({n_layers})")
    if settings.pp > 1:
        problems += check_schedule(settings.schedule, settings.pp, settings.microbatches, settings.local_stages)
    elif settings.schedule not in SCHEDULES:
        problems.append(f"--parallel.schedule is {settings.schedule!r} but must be one of {', '.join(SCHEDULES)}")
    return problems


class ModelParts:
    """This rank's part of an island's model, with a training step, evaluation and shard layout.

    ``model`` is the full ``Transformer``: with real weights (the same on every rank), or a skeleton on the
    meta device together with ``init``, the full initial value of each parameter by name (any mapping, e.g.
    one that computes a parameter when asked): the parts are then split, sharded and compiled as skeletons,
    and each rank materialises only its own pieces, one parameter at a time.  With ``pp == 1`` ``model`` is
    sharded in place and used directly; with ``pp > 1`` this rank's stages are copied out of it and
    ``model`` is left untouched (and can be freed).  ``mesh`` is the ``("dp", "pp", "tp")`` mesh from
    :func:`pipeline.mesh.init_island_mesh`, or None for a single-process island.  ``profile_shape``
    is one micro-batch ``(rows, seq)`` for ``balance="profile"`` (default: one sequence of the model's
    context).  With ``pp > 1`` the island's rank 0 logs the chosen split (:attr:`plan`) and, after a
    few training steps, the measured idle fraction (:attr:`clock`).  ``host_staged`` sends the stages'
    activations and gradients through host memory (:func:`pipeline.pipeline_parallel.stage_group`; None: where
    gloo carries a GPU's tensors).
    """

    def __init__(self, model: nn.Module, mesh: DeviceMesh | None, settings: ParallelSettings,
                 loss_fn: LossFn = cross_entropy_loss, device: torch.device | str | None = None,
                 profile_shape: tuple[int, int] | None = None, init: Mapping[str, torch.Tensor] | None = None,
                 host_staged: bool | None = None):
        dp, tp, pp = (mesh_size(mesh, d) for d in ("dp", "tp", "pp"))
        if (dp, tp, pp) != (settings.dp, settings.tp, settings.pp):
            raise ValueError(f"the mesh is dp={dp} x pp={pp} x tp={tp} but the settings ask for dp={settings.dp} x "
                             f"pp={settings.pp} x tp={settings.tp}")
        block = next(iter(model.layers.values()))
        head_dim = block.attention.head_dim
        problems = check_split(settings, len(model.layers), block.attention.wq.weight.shape[0] // head_dim,
                                block.attention.wq.weight.shape[1], block.feed_forward.w1.weight.shape[0],
                                model.tok_embeddings.weight.shape[0])
        if problems:
            raise ValueError("; ".join(problems))
        skeleton = is_skeleton(model)
        if skeleton and init is None:
            raise ValueError("a model on the meta device needs init, the initial value of each parameter")
        self.mesh, self.settings, self.loss_fn = mesh, settings, loss_fn
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if mesh is not None and \
                mesh.device_type == "cuda" else torch.device("cpu")
        self.device = torch.device(device)
        self.compute_dtype = settings.compute_dtype(self.device.type)
        self.dp = dp
        self.dp_rank, self.pp_rank, self.tp_rank = (mesh_rank(mesh, d) for d in ("dp", "pp", "tp"))
        self.n_stages = pp * settings.local_stages if pp > 1 else 1
        self.plan: StagePlan | None = None
        self.clock: StageClock | None = None
        if pp > 1:
            self.plan = plan_stages(model, settings, mesh, self.device, loss_fn,
                                    profile_shape or (1, model.rope_cos.shape[0]))
            self._say(self.plan.describe())
            owned = build_stage_modules(model, self.pp_rank, pp, settings.local_stages, self.plan.sizes)
        else:
            owned = [(0, model)]
        for _, module in owned:
            if not skeleton:
                module.to(self.device)  # TP scatters rank 0's real weights from the device
            if tp > 1:  # DTensor's machinery (1.2 s of imports) only where the model is split
                from pipeline.tensor_parallel import apply_tensor_parallel

                apply_tensor_parallel(module, mesh["tp"])
            module.activation_checkpointing = settings.activation_checkpointing
            if settings.compile:
                apply_compile(module)
            if dp > 1:
                from pipeline.data_parallel import apply_fsdp

                apply_fsdp(module, fsdp_mesh(mesh), self.compute_dtype, reshard_after_forward=pp == 1)
            if skeleton:
                materialize(module, self.device)
            module.train()
        self.stage_ids = [stage for stage, _ in owned]
        self.modules: list[nn.Module] = [module for _, module in owned]
        if skeleton:
            self.load_full_parameters(init)
        self._loss_scale = 1.0
        self._batch_shapes: dict[bool, torch.Size] = {}  # train / eval -> the pipeline's batch shape
        self.stages = []
        self.schedule = None
        self._eval_schedule: _PipelineSchedule | None = None
        if pp > 1:
            self.stages = build_pipeline_stages(owned, self.n_stages, self.device,
                                                stage_group(mesh, self.device, host_staged))
            self.clock = StageClock(self.device, mesh["pp"].get_group(), self.pp_rank, pp, self._report_measured)
            self.clock.wrap_stages(self.stages)
            self.schedule = build_schedule(settings.schedule, self.stages, settings.microbatches,
                                           self.clock.timed(self._scaled_loss), scale_grads=False)

    def _say(self, line: str) -> None:
        if self.dp_rank == 0 and self.pp_rank == 0 and self.tp_rank == 0:  # the island's rank 0 speaks for it
            log.info("%s", line)

    def _report_measured(self, busy: list[float], wall: float) -> None:
        self._say(measured_line(busy, wall, self.plan.predicted_idle))

    # ----------------------------------------------------------------------------------- parameters
    @property
    def has_first_stage(self) -> bool:
        """Whether this rank runs the embedding (stage 0)."""
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        """Whether this rank runs the output projection (the last stage)."""
        return self.n_stages - 1 in self.stage_ids

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters (DTensors under TP) with the unsplit model's names."""
        for module in self.modules:
            yield from module.named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters, for the inner optimizer."""
        for _, p in self.named_parameters():
            yield p

    def local_named_parameters(self) -> dict[str, torch.Tensor]:
        """``{name: local shard}``: detached tensors sharing storage with the parameters (writing
        into them updates the model); see :meth:`shard_spec` for where each sits in the full tensor."""
        return {name: local_tensor(p).detach() for name, p in self.named_parameters()}

    def shard_spec(self, name: str) -> ShardSpec:
        """Where the local tensor of parameter ``name`` sits in the full parameter."""
        return shard_spec_of(dict(self.named_parameters())[name])

    def shard_specs(self) -> dict[str, ShardSpec]:
        """:meth:`shard_spec` of every local parameter."""
        return {name: shard_spec_of(p) for name, p in self.named_parameters()}

    @torch.no_grad()
    def load_full_parameters(self, full: Mapping[str, torch.Tensor]) -> None:
        """Copy this rank's slices out of a full (unsplit) ``{name: tensor}`` into the parameters (asking ``full``
        for one parameter at a time)."""
        specs = self.shard_specs()
        for name, local in self.local_named_parameters().items():
            local.copy_(specs[name].slice_of(full[name]).to(local.dtype))

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters as CPU tensors, on every rank (collective; for checkpoints/tests)."""
        full = {}
        for name, p in self.named_parameters():
            full[name] = (p.full_tensor() if is_dtensor(p) else p).detach().to("cpu", copy=True)
        if self.mesh is not None and self.mesh["pp"].size() > 1:
            parts: list[dict[str, torch.Tensor] | None] = [None] * self.mesh["pp"].size()
            dist.all_gather_object(parts, full, group=self.mesh["pp"].get_group())
            full = {k: v for part in parts for k, v in part.items()}
        return full

    def zero_grad(self) -> None:
        """Drop the gradients of this rank's parameters."""
        for p in self.parameters():
            p.grad = None

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the island-wide gradient norm (over FSDP and TP shards, PP stages) to ``max_norm``; return
        the norm before clipping (the same on every rank).  ``max_norm <= 0`` only measures."""
        return clip_grad_norm_(list(self.parameters()), max_norm, self.mesh)

    # ------------------------------------------------------------------------------------ compute
    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) * self._loss_scale

    def _check_batch(self, inputs: torch.Tensor, targets: torch.Tensor, train: bool) -> None:
        """Refuse (on every rank alike, before any communication) a batch the pipeline cannot run."""
        if inputs.shape != targets.shape:
            raise ValueError(f"inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} must have the same shape")
        if self.schedule is None:
            return
        m = self.settings.microbatches
        if inputs.shape[0] % m:
            raise ValueError(f"the batch of {inputs.shape[0]} sequences does not split into "
                             f"--parallel.microbatches ({m}) equal micro-batches")
        first = self._batch_shapes.setdefault(train, inputs.shape)
        if inputs.shape != first:
            raise ValueError(f"pipeline {'training' if train else 'evaluation'} batches must keep the shape of the "
                             f"first one {tuple(first)}, got {tuple(inputs.shape)}")

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, loss_scale: float = 1.0) -> float:
        """Forward and backward of one batch; gradients (times ``loss_scale``) are *added* to ``.grad``.

        Returns the batch's mean loss (unscaled; with ``dp > 1`` the mean over the replicas' batches) on every
        rank.  With ``pp > 1`` the batch is split into ``microbatches`` and run by the pipeline schedule; every
        call must then use the same batch shape.  Use ``loss_scale = 1 / grad_accum`` to accumulate over
        several calls.  With ``dp > 1`` the gradients are the mean over the replicas (FSDP's reduce-scatter).
        """
        if not loss_scale > 0:
            raise ValueError(f"loss_scale must be positive, got {loss_scale}")
        self._check_batch(inputs, targets, train=True)
        if self.schedule is None:
            with self.autocast():
                loss = self.loss_fn(self.modules[0](inputs.to(self.device)), targets.to(self.device))
            (loss * loss_scale).backward()
            self._align_grads()
            return self._replica_mean(loss.detach().float())
        self._loss_scale = loss_scale / self.settings.microbatches
        with self.clock.step():
            losses = self._run_schedule(inputs, targets, train=True)
        self._align_grads()
        return self._replica_mean(self._broadcast_loss(losses, scale=1.0 / loss_scale))

    def _replica_mean(self, loss: torch.Tensor) -> float:
        """The mean of a scalar over the data-parallel replicas (itself when ``dp == 1``)."""
        if self.dp > 1:
            loss = loss.clone()
            dist.all_reduce(loss, group=self.mesh["dp"].get_group())
            loss /= self.dp
        return float(loss)

    def autocast(self) -> torch.autocast:
        """The context the forward passes run in: autocast to :attr:`compute_dtype` (a no-op in fp32).  The
        parameters, their gradients and the loss stay fp32."""
        return torch.autocast(self.device.type, dtype=self.compute_dtype,
                              enabled=self.compute_dtype != torch.float32)

    def _align_grads(self) -> None:
        """Give every DTensor gradient its parameter's placements (see :func:`local_grad`)."""
        for p in self.parameters():
            local_grad(p)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Mean loss of one batch without gradients (blocks in eval mode), on every rank.  Unlike
        :meth:`train_step` every rank passes the same (whole) batch: with ``dp > 1`` each replica evaluates its
        share of the rows and the island takes their mean (each replica the whole batch when the rows do not
        split evenly into replicas and, with ``pp > 1``, micro-batches).  With ``pp > 1`` every evaluation batch
        must have the shape of the first one (which may differ from the training batches' shape)."""
        rows = inputs.shape[0] // self.dp
        split = self.dp > 1 and inputs.shape[0] % self.dp == 0 and \
            (self.schedule is None or rows % self.settings.microbatches == 0)
        if split:
            inputs, targets = inputs.chunk(self.dp)[self.dp_rank], targets.chunk(self.dp)[self.dp_rank]
        self._check_batch(inputs, targets, train=False)
        for module in self.modules:
            module.eval()
        try:
            if self.schedule is None:
                with self.autocast():
                    loss = self.loss_fn(self.modules[0](inputs.to(self.device)), targets.to(self.device)).float()
            else:
                self._loss_scale = 1.0 / self.settings.microbatches
                loss = self._broadcast_loss(self._run_schedule(inputs, targets, train=False), scale=1.0)
            return self._replica_mean(loss) if split else float(loss)
        finally:
            for module in self.modules:
                module.train()

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The model's logits for ``tokens`` (blocks in eval mode), the same on every rank, which all call this
        with the same tokens (TP gathers the vocabulary, FSDP the weights).  Islands without pipeline stages
        only: a pipeline hands hidden states from stage to stage, never logits to every rank."""
        if self.schedule is not None:
            raise ValueError("logits() needs an island without pipeline stages (--parallel.pp 1)")
        module = self.modules[0]
        module.eval()
        try:
            with self.autocast():
                return module(tokens.to(self.device)).float()
        finally:
            module.train()

    def _run_schedule(self, inputs: torch.Tensor, targets: torch.Tensor, train: bool) -> list[torch.Tensor]:
        args = (inputs.to(self.device),) if self.has_first_stage else ()
        kwargs = {}
        if self.has_last_stage:
            kwargs = {"target": targets.to(self.device), "losses": []}
        run = self.schedule.step if train else self._evaluation_schedule().eval
        with self.autocast():  # around the whole schedule, as torchtitan does: the stages' forwards run inside it
            run(*args, return_outputs=False, **kwargs)  # keep no logits: the losses are all we need
        return kwargs.get("losses", [])

    def _evaluation_schedule(self) -> _PipelineSchedule:
        """The schedule evaluation runs, over stages of its own wrapping the same modules (made at the first
        evaluation, on every pipeline rank alike).  torch 2.11 sets a stage's receive buffers up once, at its
        first call, and makes them require gradients only if that call had a backward: an evaluation before the
        first training step (the run's first) left training without the gradients of the stages' inputs
        ("chunk 0 has gradients None", on the H200)."""
        if self._eval_schedule is None:
            stages = build_pipeline_stages(list(zip(self.stage_ids, self.modules)), self.n_stages, self.device,
                                           self.stages[0].group)
            self._eval_schedule = build_schedule(self.settings.schedule, stages, self.settings.microbatches,
                                                 self._scaled_loss, scale_grads=False)
        return self._eval_schedule

    def _broadcast_loss(self, losses: list[torch.Tensor], scale: float) -> torch.Tensor:
        """Sum of the last stage's (already 1/m-scaled) micro-batch losses, sent to every PP rank."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.has_last_stage:
            total += torch.stack([loss.detach().float() for loss in losses]).sum() * scale
        group = self.mesh["pp"].get_group()
        dist.broadcast(total, src=dist.get_global_rank(group, self.mesh["pp"].size() - 1), group=group)
        return total

