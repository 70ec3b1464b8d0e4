"""``diloco train --dry-run``: the memory each rank of an island of N GPUs needs, found on one machine before the
GPUs are rented.

As torchtitan's fake backend does (``COMM_MODE=fake_backend``), one process joins a fake process group of the
island's ``dp * tp`` ranks (torch's ``FakeProcessGroup``: collectives do nothing) as its rank 0, and builds the
island's own shape with the trainer's own code: the mesh, tensor parallelism, FSDP, with the model on the meta
device.  Its inner steps then run under ``FakeTensorMode`` (tensors with shapes and devices but no memory and no
arithmetic) while torch's ``MemTracker`` counts every tensor the rank holds: parameters, gradients, optimizer
state, activations and temporaries, at their peak.  Nothing is allocated, so an 8B model's shape answers on a
laptop's CPU.

Every block of the model is alike, and every tensor of a step that grows with the batch grows in proportion, so
the step is measured with 1 and 2 blocks at batches of 1 and 2 sequences, and the peak of a step is the bilinear
fit in blocks and batch of those four (exact where the peak comes at the same point of the step in all four; the
model's first and last layers and the optimizer's own peak stay as measured).  The largest batch that fits a
memory budget follows from the fit.  Rank 0 holds the largest shard where a dimension does not split evenly.

Counted: what torch allocates for tensors.  Not counted: the CUDA context and kernels (about 0.5 GB), NCCL's
buffers, the caching allocator's fragmentation; leave room for them in the budget.  Compute runs in the precision
the GPUs would use (``--parallel.param_dtype auto``: bf16), attention as the CPU's kernels keep it (O(sequence)
memory, as flash attention).  Pipeline stages are not covered yet.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from diloco.config import Config
from diloco.config.schema import resolve_model
from diloco.errors import TrainingError
from diloco.model.inner import build_inner_optimizer
from diloco.model.transformer import lm_loss, model_skeleton
from outer_optim.compression import may_drop
from pipeline import ModelParts
from pipeline.mesh import init_island_mesh
from pipeline.shards import local_tensor

GB = 1e9
PHASES = ("forward and backward", "optimizer step")


@dataclass
class Measured:
    """One fake step of a model of ``blocks`` blocks at ``batch`` sequences: bytes at the peak of each phase, and
    the state held before it (parameters and optimizer state)."""

    blocks: int
    batch: int
    params: int
    optimizer: int
    gradients: int
    peak_fwd_bwd: int
    peak_opt: int


@dataclass
class DryRun:
    """An island's memory per rank (bytes) and the largest batch that fits a budget."""

    shape: str
    ranks: int
    parameters: int
    """Parameters of the whole model."""
    compute: str
    batch: int
    """The micro-batch (sequences) the figures below are for: ``--inner.batch_size``."""
    params: int
    """This rank's parameters (fp32)."""
    gradients: int
    optimizer: int
    activations: int
    """The rest of a step's peak at ``batch``, above the parameters and the optimizer state: activations and the
    gradients made so far."""
    peak: int
    """The peak of a step at ``batch``: what the GPU must hold."""
    per_sequence: int
    """What the peak grows by per sequence of the micro-batch."""
    outer: int
    """θ_global, the outer momentum and the codec's error feedback of this rank's shard."""
    outer_on: str
    outer_parts: str
    """What the outer state holds (θ_global, the outer momentum, the codec's error feedback)."""
    optimizer_note: str
    """How the optimizer state was measured, where not as configured."""
    budget: float
    largest_batch: int
    """The largest micro-batch whose peak fits ``budget`` (0: not even one sequence)."""
    seconds: float

    def lines(self) -> list[str]:
        """What the command prints."""
        g = lambda b: f"{b / GB:.2f} GB"  # noqa: E731
        fits = f"{self.largest_batch} sequence{'s' if self.largest_batch > 1 else ''} per micro-batch" \
            if self.largest_batch else "none: not even one sequence"
        return [
            f"dry run: an island of {self.shape} ({self.ranks} GPUs), {self.parameters / 1e9:.2f}B parameters, "
            f"{self.compute} compute; each rank as torch would allocate it (fake process group, fake tensors)",
            f"per rank: parameters {g(self.params)}, gradients {g(self.gradients)}, optimizer state "
            f"{g(self.optimizer)}; peak of a step {g(self.peak)} at {self.batch} sequence(s) per micro-batch, "
            f"{g(self.activations)} of it activations and gradients in flight (+{g(self.per_sequence)} per sequence)",
            *([f"optimizer state: {self.optimizer_note}"] if self.optimizer_note else []),
            f"outer state per rank on the {self.outer_on}: {g(self.outer)} ({self.outer_parts})",
            f"largest micro-batch within {self.budget:g} GB per GPU (--memory-gb): {fits}; leave room for the CUDA "
            f"context and NCCL's buffers (not counted)",
            f"answered in {self.seconds:.1f} s",
        ]

    def record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def dry_run(cfg: Config, memory_gb: float) -> DryRun:
    """The memory per rank of ``cfg``'s island (see the module doc); raises TrainingError in one sentence for a
    shape the dry run cannot take."""
    t0 = time.perf_counter()
    par = cfg.parallel
    if par.pp > 1:
        raise TrainingError("--dry-run covers islands of --parallel.dp x --parallel.tp ranks; pipeline stages "
                            "(--parallel.pp > 1) are not measured yet")
    if not memory_gb > 0:
        raise TrainingError(f"--memory-gb must be a positive number of GB per GPU, got {memory_gb}")
    if dist.is_initialized():
        raise TrainingError("--dry-run runs alone: start it without torchrun")
    m = dataclasses.replace(cfg.model)
    resolve_model(m)
    if not m.vocab_size:
        m.vocab_size = 256
    target = "cpu" if cfg.device == "cpu" else "cuda"
    compute = par.compute_dtype(target)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=par.processes)
    try:
        mesh = init_island_mesh(par.tp, 1, "cpu", dp=par.dp)
        settings = dataclasses.replace(par, param_dtype="bf16" if compute == torch.bfloat16 else "fp32")
        try:
            full = _parts(m, m.n_layers, mesh, settings)
        except ValueError as e:  # a split the model does not allow (heads, widths): the trainer's own sentence
            raise TrainingError(str(e)) from None
        local = sum(local_tensor(p).numel() for _, p in full.named_parameters())
        total = sum(p.numel() for p in model_skeleton(m).parameters())
        # Muon's step decides on values (norms) that fake tensors do not have: its state is measured as AdamW's
        inner = dataclasses.replace(cfg.inner, optimizer="adamw")
        runs = {(blocks, batch): _measure(inner, m, mesh, settings, blocks, batch)
                for blocks in (1, 2) for batch in (1, 2)}
    finally:
        dist.destroy_process_group()
    fit = _Bilinear(runs)
    L, B = m.n_layers, cfg.inner.batch_size
    static = fit.params(L) + fit.optimizer(L)
    fwd_bwd = lambda b: fit.fwd_bwd(L, b)  # noqa: E731
    peak = max(fwd_bwd(B), fit.opt(L))
    per_sequence = fwd_bwd(2) - fwd_bwd(1)
    budget = memory_gb * GB
    largest = 0
    if fwd_bwd(1) <= budget and fit.opt(L) <= budget:
        largest = int((budget - fwd_bwd(1)) // per_sequence) + 1 if per_sequence > 0 else 1 << 20
    d = cfg.diloco
    outer = ["θ_global"] + (["outer momentum"] if d.outer_momentum > 0 and d.outer_optimizer == "nesterov" else []) \
        + (["error feedback"] if cfg.averaging.error_feedback and may_drop(cfg.averaging.compression) else [])
    return DryRun(
        shape=f"dp={par.dp} x pp=1 x tp={par.tp}", ranks=par.processes, parameters=total,
        compute="bf16" if compute == torch.bfloat16 else "fp32", batch=B, params=4 * local,
        gradients=fit.gradients(L), optimizer=fit.optimizer(L),
        activations=max(0, fwd_bwd(B) - static), peak=int(peak), per_sequence=int(per_sequence),
        outer=4 * len(outer) * local, outer_on="GPU" if d.master_device == "cuda" else "host",
        outer_parts=", ".join(outer) + ", fp32",
        optimizer_note="Muon's measured as AdamW's, an upper bound: Muon keeps one buffer per block matrix, not two "
                       "(its step also gathers each whole matrix, one at a time)" if cfg.inner.optimizer == "muon" else "",
        budget=memory_gb, largest_batch=largest, seconds=time.perf_counter() - t0)


def _parts(m: Any, blocks: int, mesh: Any, settings: Any) -> ModelParts:
    """The island's parts of a model of ``blocks`` blocks for this rank, on the meta device."""
    skeleton = model_skeleton(dataclasses.replace(m, n_layers=blocks))
    init = {n: torch.empty(p.shape, device="meta") for n, p in skeleton.named_parameters()}
    return ModelParts(skeleton, mesh, settings, loss_fn=lm_loss, device="meta", init=init)


def _measure(inner: Any, m: Any, mesh: Any, settings: Any, blocks: int, batch: int) -> Measured:
    """One inner step of a ``blocks``-block model at ``batch`` sequences under fake tensors, after a first step
    that gave the optimizer its state."""
    import torch.distributed._tools.fake_collectives  # noqa: F401  (collectives of fake tensors)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    parts = _parts(m, blocks, mesh, settings)
    with FakeTensorMode(allow_non_fake_inputs=True):
        for module in parts.modules:
            module.to_empty(device="cpu")
        parts.device = torch.device("cpu")  # the fake tensors' device: autocast as on the GPU, no memory
        opt, _ = build_inner_optimizer(list(parts.named_parameters()), inner, total_steps=10)
        for p in parts.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()  # the optimizer's state, as every step after the first holds it
        opt.zero_grad(set_to_none=True)
        module = parts.modules[0]
        x = torch.zeros(batch, m.seq_len, dtype=torch.long)
        tracker = MemTracker()
        tracker.track_external(module, opt)
        with tracker:
            with parts.autocast():
                loss = parts.loss_fn(module(x), x)
            loss.backward()
        fwd_bwd = tracker.get_tracker_snapshot("peak")
        after = tracker.get_tracker_snapshot()
        stepper = MemTracker()
        stepper.track_external(module, opt)
        with stepper:
            opt.step()
            opt.zero_grad(set_to_none=True)
        step = stepper.get_tracker_snapshot("peak")
    cat = lambda snap, kind: sum(v.get(kind, 0) for v in snap.values())  # noqa: E731
    from torch.distributed._tools.mem_tracker import _MemRefType as Ref

    return Measured(blocks, batch, params=cat(after, Ref.PARAM), optimizer=cat(after, Ref.OPT),
                    gradients=cat(after, Ref.GRAD), peak_fwd_bwd=cat(fwd_bwd, "Total"), peak_opt=cat(step, "Total"))


class _Bilinear:
    """The four measurements as functions of blocks (L) and batch (B): a + b·L + c·B + d·L·B."""

    def __init__(self, runs: dict[tuple[int, int], Measured]):
        self.runs = runs

    def _at(self, field: str, L: float, B: float) -> float:
        v = {k: getattr(r, field) for k, r in self.runs.items()}
        d = v[2, 2] - v[2, 1] - v[1, 2] + v[1, 1]
        b = v[2, 1] - v[1, 1] - d
        c = v[1, 2] - v[1, 1] - d
        a = v[1, 1] - b - c - d
        return a + b * L + c * B + d * L * B

    def fwd_bwd(self, L: int, B: int) -> int:
        return int(math.ceil(self._at("peak_fwd_bwd", L, B)))

    def opt(self, L: int) -> int:
        return int(math.ceil(self._at("peak_opt", L, 1)))

    def params(self, L: int) -> int:
        return int(self._at("params", L, 1))

    def optimizer(self, L: int) -> int:
        return int(self._at("optimizer", L, 1))

    def gradients(self, L: int) -> int:
        return int(self._at("gradients", L, 1))


def allocated_peak(step: Callable[[], None], held: Iterable[torch.Tensor]) -> int:
    """What a real step peaks at on the CPU, in bytes: the storages of ``held`` (what is alive when it begins:
    parameters, optimizer state) plus the highest the running sum of the CPU allocator's allocations and frees during
    ``step()`` reaches (torch's profiler records both, with their sizes).  How the dry run is checked against a real
    island (benchmarks/dry_run_check.py)."""
    from torch.profiler import ProfilerActivity, profile

    storages = {}
    for t in held:
        storage = local_tensor(t).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    run = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):
        run += e.nbytes()
        peak = max(peak, run)
    return sum(storages.values()) + peak
