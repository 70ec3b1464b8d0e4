"""What a codec is: the :class:`Codec` protocol every wire format of pseudo-gradients follows, the checks every
encoder and decoder makes of what it is handed, and how a group exchanges a codec's payloads (a dense codec's by
reduce-scatter or all-gather, a sparse one's by all-gather: see :mod:`peers.wire.encoded` for the byte counts)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from outer_optim.tensors import all_finite

Payload = bytes | bytearray | memoryview
"""An encoded pseudo-gradient (``none`` and ``fp16`` hand out views of tensors rather than copies)."""


@runtime_checkable
class Codec(Protocol):
    """Encodes a 1-D float32 tensor into a payload of a size fixed by its length, and back."""

    name: str
    lossy: bool
    skewed: bool
    """Whether its payload bytes are skewed enough for entropy coding on the wire to pay for its CPU time
    (measured on a real Δ, wire ÷ codec size: int4 0.846, int8 0.926; sign 0.988, topk 0.999)."""

    def encode(self, values: torch.Tensor) -> Payload: ...

    def decode(self, payload: Payload, numel: int) -> torch.Tensor: ...

    def nbytes(self, numel: int) -> int: ...


def check_values(values: torch.Tensor, check_finite: bool = True) -> None:
    """Refuses what no codec encodes: anything but a non-empty 1-D CPU float32 tensor, or (``check_finite``) one
    holding NaN or infinite values."""
    if not isinstance(values, torch.Tensor) or values.dtype != torch.float32 or values.device.type != "cpu":
        raise ValueError("codecs encode CPU float32 tensors only")
    if values.dim() != 1 or values.numel() == 0:
        raise ValueError(f"codecs encode non-empty 1-D tensors, not shape {tuple(values.shape)}")
    if check_finite and not all_finite(values):
        raise ValueError("cannot encode a tensor holding NaN or infinite values")


def check_payload(codec: Codec, payload: bytes, numel: int) -> None:
    """Refuses a payload that cannot be ``codec``'s for ``numel`` values: its size is fixed by ``numel``."""
    if numel < 1:
        raise ValueError(f"cannot decode {numel} values; codecs carry at least one")
    if len(payload) != codec.nbytes(numel):
        raise ValueError(f"a {codec.name} payload of {numel} values has {codec.nbytes(numel)} bytes, "
                         f"not {len(payload)}")


def safe_divisor(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` with 1 where it is 0 (an all-zero block or grid), so that dividing by it leaves zeros."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def row_groups(numel: int, size: int) -> list[tuple[int, int, int]]:
    """(start, rows, length) groups of ``numel`` values cut into rows of ``size``: the full rows, then the
    shorter last row if any (a block or chunk fitted to its own values)."""
    full = numel // size
    return [g for g in ((0, full, size), (full * size, 1, numel % size)) if g[1] and g[2]]


def is_dense(codec: Codec) -> bool:
    """Whether ``codec`` sends every value in blocks (none, fp16, int8, int4, int2, sign), rather than a sparse choice
    (topk)."""
    return getattr(codec, "block", 0) > 0


def reduce_scatters(codec: Codec, group_size: int) -> bool:
    """Whether a group of ``group_size`` averages ``codec``'s payloads by reduce-scatter rather than all-gather
    (see :mod:`peers.wire.encoded` for the byte counts): lossless fp32 always (half the adding of an all-gather at
    2 members, for the same bytes), lossy dense codecs from 3 members on (at 2 the all-gather spares the
    owner's second quantization), top-k never."""
    return is_dense(codec) and (group_size > 2 or not codec.lossy)


def exchange_factor(codec: Codec, group_size: int) -> float:
    """Bytes each member of a group of ``group_size`` sends in a round, per byte of its own payload (and as many
    received): ``2·(n − 1)/n`` by reduce-scatter, ``n − 1`` by all-gather (see :mod:`peers.wire.encoded`)."""
    n = max(1, group_size)
    return 2 * (n - 1) / n if reduce_scatters(codec, n) else float(n - 1)


def wire_ratio(codec: Codec, numel: int) -> float:
    """Payload size relative to sending the ``numel`` values as raw float32."""
    return codec.nbytes(numel) / (4 * numel)
