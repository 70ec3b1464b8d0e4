"""The dense codecs: every value travels, in blocks (``none``, ``fp16``, ``int8``, ``int4``, ``int2``).

none: the float32 values themselves (4N bytes), handed out as a view of the tensor, without a copy.

fp16: the values as IEEE half precision, clamped to ±65504 (2N bytes).

int8: blocks of B=256 values; per block a float32 scale s = absmax/127 (0 for an all-zero block) and
    codes q = round(x/s) clamped to [-127, 127], stored as two's-complement int8.
    Layout: all ceil(N/256) scales, then all N codes.  nbytes = 4*ceil(N/256) + N.

int4: blocks of B=128 values; scale s = absmax/7, codes q in [-7, 7] stored as the nibble q+8, two per
    byte, low nibble first (odd N is padded with one zero nibble).
    Layout: all ceil(N/128) scales, then the nibbles.  nbytes = 4*ceil(N/128) + ceil(N/2).

int2: blocks of B=256 values; per block two bfloat16 magnitudes lo <= hi fitted to the block's |x| by least
    squares (Lloyd iterations, as top-k's grid, :mod:`.levels`, with M=2), and per value a 2-bit code, its sign
    and the nearer magnitude: code 0 decodes to -hi, 1 to -lo, 2 to +lo, 3 to +hi (a shorter last block is fitted
    to its own values).  Layout: all ceil(N/256) (lo, hi) pairs, then the codes, four per byte.
    nbytes = 4*ceil(N/256) + ceil(N/4).

Byte order and bit streams: see :mod:`outer_optim.compression`.
"""

from __future__ import annotations

import torch

from outer_optim.compression.bitpack import (
    LITTLE_ENDIAN,
    from_bytes,
    from_le,
    pack_codes,
    to_bytes,
    to_le,
    unpack_codes,
)
from outer_optim.compression.codec import Payload, check_payload, check_values, row_groups, safe_divisor
from outer_optim.compression.levels import FittedLevels
from outer_optim.tensors import all_finite


class Fp32Codec:
    """The values as they are (``none``): the payload is the tensor's own bytes, without a copy."""

    name = "none"
    lossy = False
    skewed = False
    block = 1

    def nbytes(self, numel: int) -> int:
        return 4 * numel

    def encode(self, values: torch.Tensor) -> memoryview:
        """A view of ``values``' bytes (little-endian float32)."""
        check_values(values)
        if not LITTLE_ENDIAN:
            values = to_le(values).reshape(-1)
        return memoryview(values.contiguous().numpy()).cast("B")

    def decode(self, payload: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        """The values, sharing the payload's memory when it is writable (a received buffer)."""
        check_payload(self, payload, numel)
        return _floats(payload, torch.float32)


class Fp16Codec:
    """Half precision (``fp16``): values beyond its range are clamped to ±65504."""

    name = "fp16"
    lossy = True
    skewed = False
    block = 1

    def nbytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, values: torch.Tensor) -> memoryview:
        check_values(values)
        half = values.clamp(-65504.0, 65504.0).to(torch.float16)
        if not LITTLE_ENDIAN:
            half = to_le(half).reshape(-1)
        return memoryview(half.numpy()).cast("B")

    def decode(self, payload: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        check_payload(self, payload, numel)
        return _floats(payload, torch.float16).to(torch.float32)


def _bytes_view(payload: Payload) -> torch.Tensor:
    """The payload as a uint8 tensor, without a copy when the payload is writable (a received buffer, or what
    an encoder of this module returned)."""
    view = memoryview(payload).cast("B")
    if view.readonly:
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.zeros(0, dtype=torch.uint8)


def _floats(payload: bytes | bytearray | memoryview, dtype: torch.dtype) -> torch.Tensor:
    """The payload's values as ``dtype``, without a copy when the payload is writable."""
    view = memoryview(payload)
    if view.readonly:
        view = memoryview(bytearray(view))
    raw = torch.frombuffer(view, dtype=torch.uint8)
    if not LITTLE_ENDIAN:
        return from_le(raw.view(-1, torch.finfo(dtype).bits // 8), dtype)
    return raw.view(dtype)


class BlockAbsmaxCodec:
    """Symmetric blockwise absmax quantization to ``bits``-bit codes in [-qmax, qmax] (int8, int4)."""

    lossy = True
    skewed = True  # one large value sets a block's step: most codes are small

    def __init__(self, name: str, bits: int, block: int):
        self.name, self.bits, self.block = name, bits, block
        self.qmax = (1 << (bits - 1)) - 1
        # int8 stores q in two's complement, int4 as q+8; both decode as ((u - offset + half) & mask) - half
        self.offset = 0 if bits == 8 else 1 << (bits - 1)

    def nbytes(self, numel: int) -> int:
        """Exact payload size for ``numel`` values."""
        return 4 * -(-numel // self.block) + -(-numel * self.bits // 8)

    def encode(self, values: torch.Tensor) -> memoryview:
        """Scales then codes; see the module docstring.  Written pass by pass into the payload itself (no
        full-size temporary but one float32 buffer of codes): about 4x faster than padding, taking the
        absolute value and packing bit fields."""
        return self.encode_and_decode(values)[0]

    def encode_and_decode(self, values: torch.Tensor) -> tuple[memoryview, torch.Tensor]:
        """The payload, and what it decodes to (the codes times their scales, computed in place from the codes
        the encoding rounded: no second pass over the payload)."""
        check_values(values, check_finite=False)
        n, block = values.numel(), self.block
        nblocks = -(-n // block)
        full = n // block * block
        payload = torch.empty(self.nbytes(n), dtype=torch.uint8)
        scales = payload[:4 * nblocks].view(torch.float32)
        if full:  # amax and amin along rows are vectorized; abs().amax() or aminmax() are 5-10x slower
            blocks = values[:full].view(-1, block)
            torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_(), out=scales[:full // block])
        if full < n:
            scales[-1] = values[full:].abs().amax()
        if not all_finite(scales):  # amax and amin propagate NaN: a non-finite value shows in its block's scale
            raise ValueError("cannot encode a tensor holding NaN or infinite values")
        scales.div_(self.qmax)
        q = torch.empty(nblocks * block, dtype=torch.float32)
        if full:
            torch.div(values[:full].view(-1, block), safe_divisor(scales[:full // block])[:, None],
                      out=q[:full].view(-1, block))
        if full < n:
            torch.div(values[full:], safe_divisor(scales[-1:]), out=q[full:n])
            q[n:] = 0
        q.round_().clamp_(-self.qmax, self.qmax)
        codes = payload[4 * nblocks:]
        if self.bits == 8:
            codes.view(torch.int8).copy_(q[:n])
        else:  # q + 8 as nibbles, low nibble first
            nibbles = (q[:n + n % 2] + self.offset)
            nibbles[n:] = 0  # the pad nibble of an odd count
            nibbles = nibbles.to(torch.uint8).view(-1, 2)
            torch.bitwise_or(nibbles[:, 0], nibbles[:, 1].bitwise_left_shift(4), out=codes)
        sent = q.view(-1, block).mul_(scales[:, None]).view(-1)[:n]
        if not LITTLE_ENDIAN:
            payload[:4 * nblocks] = to_le(scales.clone()).reshape(-1)
        return memoryview(payload.numpy()).cast("B"), sent

    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        """A new float32 tensor of ``numel`` values, computed in one pass over the codes."""
        check_payload(self, payload, numel)
        data = _bytes_view(payload)
        block, nblocks = self.block, -(-numel // self.block)
        scales = from_le(data[:4 * nblocks].view(-1, 4), torch.float32)
        codes = data[4 * nblocks:]
        if self.bits == 8:
            q = codes.view(torch.int8)
        else:
            q = torch.stack([codes.bitwise_and(15), codes.bitwise_right_shift(4)], dim=1).view(-1)[:numel]
            q = q.view(torch.int8).sub_(self.offset)
        out = torch.empty(numel, dtype=torch.float32)
        full = numel // block * block
        if full:
            torch.mul(q[:full].view(-1, block), scales[:full // block, None], out=out[:full].view(-1, block))
        if full < numel:
            torch.mul(q[full:], scales[-1], out=out[full:])
        return out


class FittedBlockCodec:
    """``int2``: blocks of ``block`` values, each a sign and one of two magnitudes fitted to its block
    (:class:`FittedLevels`); see the module docstring."""

    name = "int2"
    lossy = True
    skewed = False  # two bits that split every block's values about evenly are close to random bits

    def __init__(self, block: int = 256, bits: int = 2):
        self.block, self.fitted = block, FittedLevels(bits)

    def nbytes(self, numel: int) -> int:
        """Exact payload size for ``numel`` values."""
        return 4 * -(-numel // self.block) + -(-numel * self.fitted.bits // 8)

    def encode(self, values: torch.Tensor) -> bytes:
        """Every block's grid, then every value's code; see the module docstring."""
        check_values(values)
        grids, codes = [], []
        for start, rows, length in row_groups(values.numel(), self.block):
            grid, code = self.fitted.quantize(values[start:start + rows * length].view(rows, length))
            grids.append(to_bytes(to_le(grid)))
            codes.append(code.reshape(-1))
        return b"".join(grids) + to_bytes(pack_codes(torch.cat(codes), self.fitted.bits))

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        """A new float32 tensor of ``numel`` values."""
        check_payload(self, payload, numel)
        data = from_bytes(payload)
        nblocks = -(-numel // self.block)
        codes = unpack_codes(data[4 * nblocks:], numel, self.fitted.bits)
        out, block = [], 0
        for start, rows, length in row_groups(numel, self.block):
            grids = data[4 * block:4 * (block + rows)].view(rows, 4)
            out.append(self.fitted.dequantize(grids, codes[start:start + rows * length].view(rows, length),
                                              self.name).view(-1))
            block += rows
        return torch.cat(out)
