"""How an island splits its model over its processes: the settings of :mod:`pipeline`.

Plain data without torch, so that the trainer's config section ``parallel`` *is* this class
(:data:`diloco.config.ParallelConfig`) rather than a copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class ParallelSettings:
    """How an island splits its model over its ``dp * pp * tp`` processes."""

    dp: int = 1
    """Data-parallel degree inside an island (outermost mesh dimension): each of `dp` groups of `pp * tp` processes
    takes its own batches, and the parameters, gradients and AdamW state are sharded over them with FSDP2
    (`fully_shard` per block), as are θ_global, the outer momentum and what each rank averages over the slow link.
    A step of the island then takes `dp * batch_size * grad_accum` sequences."""
    tp: int = 1
    """Tensor-parallel degree inside an island (innermost mesh dimension, one process per GPU)."""
    pp: int = 1
    """Pipeline-parallel stages inside an island."""
    gpus: int = 0
    """GPUs the island's ranks take in turn, rank `r` taking GPU `r mod gpus` (0: one GPU per rank, the NCCL
    island of a server).  Fewer GPUs than ranks puts several ranks on one GPU, which NCCL refuses: the island's
    process groups then run gloo on the GPU's tensors, staged through host memory.  For trying an island's
    shape and its CUDA paths on fewer GPUs than a server has, never for speed."""
    schedule: str = "1f1b"
    """Pipeline schedule: `gpipe`, `1f1b` or `interleaved-1f1b`."""
    microbatches: int = 4
    """Micro-batches per pipeline step (the batch is split into this many)."""
    virtual_stages: int = 2
    """Model chunks per pipeline rank for `interleaved-1f1b`."""
    layers_per_stage: list[int] = field(default_factory=list)
    """Explicit number of layers per (virtual) stage, e.g. 3,1; wins over `balance`."""
    balance: str = "params"
    """Where pipeline stages are cut when `layers_per_stage` is empty: `params` (equal parameter counts),
    `layers` (equal block counts) or `profile`: before training every rank times each block's forward and
    backward, the embedding's and the output projection's with the loss on one micro-batch on its own
    device (2 untimed warm-up runs, which pay one-off allocator, kernel-selection and thread-pool costs,
    then the fastest of 5 timed runs, since other processes only ever add time), the island takes each
    part's largest time over its ranks and cuts where the slowest stage is fastest (keeping the `params`
    split unless that gains over 5%, so timing noise does not move equal blocks).  Rank 0 logs the split,
    the predicted idle fraction (1 - mean / max stage time) and, after a few steps, the measured one."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass to save memory."""
    param_dtype: str = "auto"
    """Precision of the forward and backward compute: `bf16` (autocast: bf16 matrix products over fp32 master
    weights, fp32 gradients, optimizer state and loss), `fp32`, or `auto` (bf16 on CUDA, fp32 on CPU, where
    bf16 is slower).  θ_global, the outer step and what islands exchange stay fp32 either way."""
    compile: bool = False
    """Compile each transformer block with `torch.compile` (the first steps pay the compilation; blocks of
    the same shape share one compiled graph)."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one device, the denominator of the `mfu` metric (0: from the GPU's name for
    known GPUs, at the compute precision; no `mfu` on CPU unless set)."""

    def compute_dtype(self, device_type: str) -> torch.dtype:
        """The dtype matrix products run in on a ``device_type`` device (see :attr:`param_dtype`)."""
        import torch

        if self.param_dtype == "bf16" or (self.param_dtype == "auto" and device_type == "cuda"):
            return torch.bfloat16
        return torch.float32

    @property
    def processes(self) -> int:
        """Processes of one island: ``dp * pp * tp``."""
        return self.dp * self.pp * self.tp

    @property
    def shares_gpus(self) -> bool:
        """Whether several of the island's ranks share a GPU (:attr:`gpus` fewer than its processes)."""
        return shares_gpus(self.gpus, self.processes)

    @property
    def local_stages(self) -> int:
        """Model chunks each pipeline rank holds: ``virtual_stages`` for interleaved 1F1B, else 1."""
        return self.virtual_stages if self.schedule == "interleaved-1f1b" else 1


def shares_gpus(gpus: int, ranks: int) -> bool:
    """Whether ``ranks`` ranks that take ``gpus`` GPUs in turn (0: one each) put several on one GPU."""
    return 0 < gpus < ranks


def check_tensor_parallel(n_heads: int, dim: int, ffn_dim: int, vocab_size: int, tp: int) -> list[str]:
    """Return one sentence per model width that cannot be split evenly over ``tp`` ranks."""
    if tp < 1:
        return [f"--parallel.tp must be at least 1, got {tp}"]
    problems = []
    for key, value in (("n_heads", n_heads), ("ffn_dim", ffn_dim), ("vocab_size", vocab_size)):
        if value % tp:
            problems.append(f"--model.{key} ({value}) must be divisible by --parallel.tp ({tp})")
    if n_heads % tp == 0 and dim % tp:  # implied by n_heads | dim, reported only when it adds information
        problems.append(f"--model.dim ({dim}) must be divisible by --parallel.tp ({tp})")
    return problems
