"""What the devices of an island (or of a baseline) deliver: tokens/s per device, model FLOPs utilization (MFU)
and peak memory, as torchtitan reports them."""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import torch

# Dense peak TFLOP/s of one GPU, by a part of its name, in the order they are matched (more specific names
# first): (bf16 with fp32 accumulation, tf32).  From the vendors' data sheets, without sparsity.
PEAK_TFLOPS: tuple[tuple[str, tuple[float, float]], ...] = (
    ("GB200", (2500.0, 1250.0)),
    ("B200", (2250.0, 1100.0)),
    ("H200", (989.0, 494.0)),
    ("H100 PCIe", (756.0, 378.0)),
    ("H100", (989.0, 494.0)),
    ("H800", (989.0, 494.0)),
    ("A100", (312.0, 156.0)),
    ("A800", (312.0, 156.0)),
    ("L40S", (362.0, 183.0)),
    ("L4", (121.0, 60.0)),
    ("RTX 4090", (165.0, 83.0)),
)


def peak_flops(device: torch.device, compute_dtype: torch.dtype, override_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s of one ``device`` at ``compute_dtype`` (bf16, else tf32, which the trainer enables for fp32
    matrix products on CUDA): ``override_tflops`` when positive, else from :data:`PEAK_TFLOPS` by the GPU's
    name; None when unknown (a CPU, a GPU not in the table)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    return sheet_peak(torch.cuda.get_device_name(device), bf16=compute_dtype == torch.bfloat16)


def sheet_peak(name: str, bf16: bool = True) -> float | None:
    """The data sheet's dense peak FLOP/s of the GPU called ``name`` (any part of it, in any case: ``"H100"``,
    ``"NVIDIA H200"``), at bf16 or else tf32; None for a GPU not in :data:`PEAK_TFLOPS`."""
    for part, (bf16_tflops, tf32_tflops) in PEAK_TFLOPS:
        if part.lower() in name.lower():
            return (bf16_tflops if bf16 else tf32_tflops) * 1e12
    return None


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory so far in GB (1e9 bytes): what torch allocated on a CUDA device, else this process's peak
    resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return peak_host_memory_gb()


def peak_host_memory_gb() -> float:
    """This process's peak resident set so far, in GB (1e9 bytes)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * (1 if sys.platform == "darwin" else 1024) / 1e9


@dataclass
class Throughput:
    """Turns tokens over seconds into the per-device metrics of one island or baseline."""

    flops_per_token: float
    """Training FLOPs of one token (:func:`diloco.model.transformer.flops_per_token`)."""
    devices: int
    """Devices sharing the tokens (the island's ``dp * pp * tp`` processes, or the baseline's workers)."""
    device: torch.device
    peak: float | None
    """Peak FLOP/s of one device (:func:`peak_flops`); None: no ``mfu``."""

    def record(self, tokens_per_second: float) -> dict[str, float]:
        """``tokens_per_second_per_device``, ``peak_memory_gb`` and, when the peak is known, ``mfu``."""
        per_device = tokens_per_second / max(self.devices, 1)
        out = {"tokens_per_second_per_device": per_device, "peak_memory_gb": peak_memory_gb(self.device)}
        if self.peak:
            out["mfu"] = per_device * self.flops_per_token / self.peak
        return out
