"""Pseudo-gradient codecs with error feedback (pure math: no networking, CPU float32 only): every wire format
of ``--averaging.compression``.

Every codec maps a 1-D float32 tensor of N values to a payload whose size depends only on N.  All
multi-byte numbers are little-endian; bit streams are LSB-first (bit j of the stream is bit j % 8 of
byte j // 8) and each stream is padded with zero bits to a whole byte.

none: the float32 values themselves (4N bytes), handed out as a view of the tensor, without a copy.

fp16: the values as IEEE half precision, clamped to ±65504 (2N bytes).

int8: blocks of B=256 values; per block a float32 scale s = absmax/127 (0 for an all-zero block) and
    codes q = round(x/s) clamped to [-127, 127], stored as two's-complement int8.
    Layout: all ceil(N/256) scales, then all N codes.  nbytes = 4*ceil(N/256) + N.

int4: blocks of B=128 values; scale s = absmax/7, codes q in [-7, 7] stored as the nibble q+8, two per
    byte, low nibble first (odd N is padded with one zero nibble).
    Layout: all ceil(N/128) scales, then the nibbles.  nbytes = 4*ceil(N/128) + ceil(N/2).

int2: blocks of B=256 values; per block two bfloat16 magnitudes lo <= hi fitted to the block's |x| by least
    squares (Lloyd iterations, as topk's grid below, with M=2), and per value a 2-bit code, its sign and the
    nearer magnitude: code 0 decodes to -hi, 1 to -lo, 2 to +lo, 3 to +hi (a shorter last block is fitted to
    its own values).  Layout: all ceil(N/256) (lo, hi) pairs, then the codes, four per byte.
    nbytes = 4*ceil(N/256) + ceil(N/4).

sign: blocks of B=256 values; per block a bfloat16 scale s = mean |x| over the block's values (the
    scale that minimises the squared error for these signs; a shorter last block averages its own
    values), and one bit per value: 1 for x >= 0, decoding to +s, and 0, decoding to -s.
    Layout: all ceil(N/256) scales, then the bits.  nbytes = 2*ceil(N/256) + ceil(N/8), 1.0625 bits a value.

topk (density d, bits b in {2, 4}): chunks of C=4096 values (the last one may be shorter, length L).
    Each chunk keeps k = max(1, min(L, floor(d*L + 0.5))) entries of largest |x|; ties at the
    threshold go to the lowest indices, so the choice never depends on torch.topk's tie order.
    Kept values go on V=2**b levels, a sign and M=V/2 magnitudes m_j = lo + (hi-lo)*j/(M-1) (j < M):
    code c < M decodes to -m_(M-1-c), code c >= M to +m_(c-M), so codes ascend with their values.
    lo and hi are fitted to the chunk's kept magnitudes by least squares (Lloyd iterations: each value
    to its nearest level, then lo and hi by linear regression), then rounded to bfloat16; each value
    takes its nearest level of the rounded grid.  (An absmax grid, levels at s*(2i+1-V)/(V-1), puts
    the kept values -- most of them just above the top-k threshold -- on a level up to 3x too large
    at 2 bits: 36% relative error on a real pseudo-gradient.)  An all-zero chunk has lo = hi = 0.
    Per chunk: lo and hi as bfloat16, then a stream of k records (12-bit index inside the chunk,
    b-bit code), indices ascending.  nbytes = sum over chunks of (4 + ceil(k_c*(12+b)/8)).

Decoding is elementwise (no reductions), so the same payload gives bit-identical tensors everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from outer_optim.bitpack import (
    _LITTLE_ENDIAN,
    from_bytes,
    from_le,
    pack_rows,
    to_bytes,
    to_le,
    unpack_rows,
)
from outer_optim.tensors import all_finite

TOPK_CHUNK = 4096
TOPK_INDEX_BITS = math.ceil(math.log2(TOPK_CHUNK))


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


# ---- codecs ----------------------------------------------------------------------------------------

def _check_values(values: torch.Tensor, check_finite: bool = True) -> None:
    if not isinstance(values, torch.Tensor) or values.dtype != torch.float32 or values.device.type != "cpu":
        raise ValueError("codecs encode CPU float32 tensors only")
    if values.dim() != 1 or values.numel() == 0:
        raise ValueError(f"codecs encode non-empty 1-D tensors, not shape {tuple(values.shape)}")
    if check_finite and not all_finite(values):
        raise ValueError("cannot encode a tensor holding NaN or infinite values")


def _check_payload(codec: Codec, payload: bytes, numel: int) -> None:
    if numel < 1:
        raise ValueError(f"cannot decode {numel} values; codecs carry at least one")
    if len(payload) != codec.nbytes(numel):
        raise ValueError(f"a {codec.name} payload of {numel} values has {codec.nbytes(numel)} bytes, "
                         f"not {len(payload)}")


def _safe_divisor(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``n`` codes of ``bits`` bits (1, 2, 4 or 8) -> ceil(n*bits/8) uint8, the first code in the lowest bits."""
    per_byte = 8 // bits
    codes = F.pad(codes, (0, -codes.numel() % per_byte)).view(-1, per_byte)
    return pack_rows([(codes[:, j].view(1, -1), bits) for j in range(per_byte)])


def _unpack_codes(data: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`_pack_codes`: the first ``numel`` codes (int32) of the uint8 ``data``."""
    per_byte = 8 // bits
    fields = unpack_rows(data.view(1, -1), -(-numel // per_byte), [bits] * per_byte)
    return torch.stack(fields, dim=-1).view(-1)[:numel]


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
        _check_values(values)
        if not _LITTLE_ENDIAN:
            values = to_le(values).reshape(-1)
        return memoryview(values.contiguous().numpy()).cast("B")

    def decode(self, payload: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        """The values, sharing the payload's memory when it is writable (a received buffer)."""
        _check_payload(self, payload, numel)
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
        _check_values(values)
        half = values.clamp(-65504.0, 65504.0).to(torch.float16)
        if not _LITTLE_ENDIAN:
            half = to_le(half).reshape(-1)
        return memoryview(half.numpy()).cast("B")

    def decode(self, payload: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        _check_payload(self, payload, numel)
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
    if not _LITTLE_ENDIAN:
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
        _check_values(values, check_finite=False)
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
            torch.div(values[:full].view(-1, block), _safe_divisor(scales[:full // block])[:, None],
                      out=q[:full].view(-1, block))
        if full < n:
            torch.div(values[full:], _safe_divisor(scales[-1:]), out=q[full:n])
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
        if not _LITTLE_ENDIAN:
            payload[:4 * nblocks] = to_le(scales.clone()).reshape(-1)
        return memoryview(payload.numpy()).cast("B"), sent

    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        """A new float32 tensor of ``numel`` values, computed in one pass over the codes."""
        _check_payload(self, payload, numel)
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


class BlockSignCodec:
    """1 bit per value, its sign, times a bfloat16 scale per block: the block's mean magnitude (sign)."""

    name = "sign"
    lossy = True
    skewed = False  # signs are close to random bits

    def __init__(self, block: int = 256):
        self.block = block

    def nbytes(self, numel: int) -> int:
        """Exact payload size for ``numel`` values."""
        return 2 * -(-numel // self.block) + -(-numel // 8)

    def encode(self, values: torch.Tensor) -> bytes:
        """Scales then sign bits; see the module docstring."""
        _check_values(values)
        n = values.numel()
        blocks = F.pad(values, (0, -n % self.block)).view(-1, self.block)
        counts = torch.full((blocks.shape[0],), float(self.block))
        counts[-1] = n - (blocks.shape[0] - 1) * self.block  # the padding of the last block is no value
        scales = (blocks.abs().sum(dim=1) / counts).clamp_(max=torch.finfo(torch.bfloat16).max).to(torch.bfloat16)
        return to_bytes(to_le(scales)) + to_bytes(_pack_codes((values >= 0).to(torch.int32), 1))

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        """A new float32 tensor of ``numel`` values."""
        _check_payload(self, payload, numel)
        data = from_bytes(payload)
        nblocks = -(-numel // self.block)
        scales = from_le(data[:2 * nblocks].view(-1, 2), torch.bfloat16).to(torch.float32)
        if not (bool(torch.isfinite(scales).all()) and bool((scales >= 0).all())):
            raise ValueError("corrupt sign payload: a block's scale must be finite and non-negative")
        signs = _unpack_codes(data[2 * nblocks:], numel, 1).to(torch.float32).mul_(2).sub_(1)
        return signs.mul_(scales.repeat_interleave(self.block)[:numel])


def _grid_index(mag: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, m: int) -> torch.Tensor:
    """Index j < m of the level of the grid lo + (hi-lo)*j/(m-1) nearest each of ``mag`` (rows, k)."""
    step = _safe_divisor(hi - lo)[:, None] / (m - 1)
    return torch.round((mag - lo[:, None]) / step).clamp_(0, m - 1)


def fit_grid(mag: torch.Tensor, m: int, iterations: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) per row of ``mag`` (rows, k >= 1, non-negative): the grid of ``m`` >= 2 equally spaced
    levels from lo to hi that locally minimises the squared error of each row put on its nearest level.

    Lloyd iterations, each of which never raises the error: assign every value to its nearest level,
    then refit lo and hi by least squares on those assignments (a = lo*(1-u) + hi*u, u = j/(m-1)).
    """
    if m == 2:
        return _fit_two_levels(mag, iterations)
    mag = mag.to(torch.float64)
    lo, hi = mag.amin(dim=1), mag.amax(dim=1)
    mean = mag.mean(dim=1)
    for _ in range(iterations):
        u = _grid_index(mag, lo, hi, m) / (m - 1)
        s00, s01, s11 = ((1 - u) ** 2).sum(1), ((1 - u) * u).sum(1), (u * u).sum(1)
        b0, b1 = ((1 - u) * mag).sum(1), (u * mag).sum(1)
        det = s00 * s11 - s01 * s01
        # every value on one level (or k = 1): the grid collapses to their mean
        solvable = det > 1e-9 * (s00 + s11) ** 2
        safe = torch.where(solvable, det, torch.ones_like(det))
        lo = torch.where(solvable, (s11 * b0 - s01 * b1) / safe, mean).clamp_(min=0)
        hi = torch.maximum(torch.where(solvable, (s00 * b1 - s01 * b0) / safe, mean), lo)
    return lo.to(torch.float32), hi.to(torch.float32)


def _fit_two_levels(mag: torch.Tensor, iterations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fit_grid` of two levels (``int2``, two-bit ``topk``): the same Lloyd iterations, whose least squares
    with every value on lo or on hi are the means of each side (2-means), in float32 sums of each row: three
    passes an iteration, where the general fit's float64 passes made ``int2`` encode 50x slower than ``int4``."""
    mag = mag.to(torch.float32)
    k = mag.shape[1]
    total = mag.sum(dim=1)
    lo, hi = mag.amin(dim=1), mag.amax(dim=1)
    mean = total / k
    for _ in range(iterations):
        # 1 where nearer hi (a tie goes to lo, as rounding half to even does); a float mask sums fastest
        upper = (mag > ((lo + hi) / 2)[:, None]).to(torch.float32)
        n_hi = upper.sum(dim=1)
        sum_hi = (mag * upper).sum(dim=1)
        both = (n_hi > 0) & (n_hi < k)  # else every value on one level: the grid collapses to their mean
        lo = torch.where(both, (total - sum_hi) / (k - n_hi).clamp(min=1), mean).clamp_(min=0)
        hi = torch.maximum(torch.where(both, sum_hi / n_hi.clamp(min=1), mean), lo)
    return lo, hi


def _row_groups(numel: int, size: int) -> list[tuple[int, int, int]]:
    """(start, rows, length) groups of ``numel`` values cut into rows of ``size``: the full rows, then the
    shorter last row if any (a block or chunk fitted to its own values)."""
    full = numel // size
    return [g for g in ((0, full, size), (full * size, 1, numel % size)) if g[1] and g[2]]


class FittedLevels:
    """``bits``-bit codes of a sign and one of M = 2**bits/2 magnitudes equally spaced from lo to hi, lo and hi
    fitted to each row of values by least squares (:func:`fit_grid`) and rounded to bfloat16; code c < M decodes
    to -m_(M-1-c), code c >= M to +m_(c-M), so codes ascend with their values (``topk``'s kept values, ``int2``)."""

    def __init__(self, bits: int):
        self.bits = bits
        self.levels = 1 << bits
        self.magnitudes = self.levels // 2
        j = torch.arange(self.magnitudes, dtype=torch.float32)
        self._grid = torch.cat([j.flip(0), j]) / (self.magnitudes - 1)  # u of code c, c = 0 .. V-1
        self._sign = torch.cat([-torch.ones(self.magnitudes), torch.ones(self.magnitudes)])

    def level_values(self, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """(rows, V) float32: the value each code decodes to, for grids (lo, hi) of shape (rows,)."""
        return self._sign * (lo[:, None] + (hi - lo)[:, None] * self._grid)

    def quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, 2) bfloat16 grids (lo, hi) and (rows, k) int32 codes of ``values`` (rows, k)."""
        grid = torch.stack(fit_grid(values.abs(), self.magnitudes), dim=1)
        grid = grid.clamp_(max=torch.finfo(torch.bfloat16).max).to(torch.bfloat16)
        lo, hi = grid.to(torch.float32).unbind(1)
        j = _grid_index(values.abs(), lo, hi, self.magnitudes).to(torch.int32)
        return grid, torch.where(values >= 0, self.magnitudes + j, self.magnitudes - 1 - j)

    def dequantize(self, grids: torch.Tensor, codes: torch.Tensor, what: str) -> torch.Tensor:
        """(rows, k) float32 values of ``codes`` (rows, k) on the little-endian bfloat16 ``grids`` (rows, 4 bytes);
        a grid that is not finite with 0 <= lo <= hi is refused, naming ``what`` was corrupt."""
        lo, hi = from_le(grids.reshape(-1, 2), torch.bfloat16).view(-1, 2).to(torch.float32).unbind(1)
        if not (bool(torch.isfinite(hi).all()) and bool((lo >= 0).all()) and bool((hi >= lo).all())):
            raise ValueError(f"corrupt {what} payload: a {'chunk' if what == 'topk' else 'block'}'s magnitudes "
                             f"must be finite with 0 <= lo <= hi")
        return self.level_values(lo, hi).gather(1, codes.long())


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
        _check_values(values)
        grids, codes = [], []
        for start, rows, length in _row_groups(values.numel(), self.block):
            grid, code = self.fitted.quantize(values[start:start + rows * length].view(rows, length))
            grids.append(to_bytes(to_le(grid)))
            codes.append(code.reshape(-1))
        return b"".join(grids) + to_bytes(_pack_codes(torch.cat(codes), self.fitted.bits))

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        """A new float32 tensor of ``numel`` values."""
        _check_payload(self, payload, numel)
        data = from_bytes(payload)
        nblocks = -(-numel // self.block)
        codes = _unpack_codes(data[4 * nblocks:], numel, self.fitted.bits)
        out, block = [], 0
        for start, rows, length in _row_groups(numel, self.block):
            grids = data[4 * block:4 * (block + rows)].view(rows, 4)
            out.append(self.fitted.dequantize(grids, codes[start:start + rows * length].view(rows, length),
                                              self.name).view(-1))
            block += rows
        return torch.cat(out)


class TopKCodec:
    """Per-chunk top-k by magnitude, values on a fitted sign-and-magnitude grid; see the module docstring."""

    name = "topk"
    lossy = True
    skewed = False  # indices and 2-bit codes are close to random bits

    def __init__(self, density: float, bits: int):
        self.density, self.bits = density, bits
        self.fitted = FittedLevels(bits)

    def _k(self, length: int) -> int:
        return max(1, min(length, math.floor(self.density * length + 0.5)))

    def _chunk_bytes(self, length: int) -> int:
        return 4 + (self._k(length) * (TOPK_INDEX_BITS + self.bits) + 7) // 8

    def nbytes(self, numel: int) -> int:
        """Exact payload size for ``numel`` values."""
        return sum(rows * self._chunk_bytes(length) for _, rows, length in _row_groups(numel, TOPK_CHUNK))

    def _encode_chunks(self, chunks: torch.Tensor) -> torch.Tensor:
        rows, length = chunks.shape
        k = self._k(length)
        mag = chunks.abs()
        # keep everything above the k-th magnitude, then the lowest-indexed ties up to k in all
        threshold = torch.topk(mag, k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
        above, tied = mag > threshold, mag == threshold
        need = k - above.sum(dim=1, keepdim=True)
        keep = above | (tied & (tied.cumsum(dim=1) <= need))
        index = keep.nonzero()[:, 1].view(rows, k)  # row-major, so ascending inside each chunk
        grid, code = self.fitted.quantize(chunks.gather(1, index))
        stream = pack_rows([(index, TOPK_INDEX_BITS), (code, self.bits)])
        return torch.cat([to_le(grid).view(rows, 4), stream], dim=1)

    def _decode_chunks(self, data: torch.Tensor, length: int) -> torch.Tensor:
        index, code = unpack_rows(data[:, 4:], self._k(length), (TOPK_INDEX_BITS, self.bits))
        kept = self.fitted.dequantize(data[:, :4], code, self.name)
        if int(index.max()) >= length or not bool((index[:, 1:] > index[:, :-1]).all()):
            raise ValueError("corrupt topk payload: chunk indices must ascend and stay inside the chunk")
        return torch.zeros(data.shape[0], length, dtype=torch.float32).scatter_(1, index, kept)

    def encode(self, values: torch.Tensor) -> bytes:
        """Chunk by chunk: scale, then (index, level) records; see the module docstring."""
        _check_values(values)
        return b"".join(to_bytes(self._encode_chunks(values[start:start + rows * length].view(rows, length)))
                        for start, rows, length in _row_groups(values.numel(), TOPK_CHUNK))

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        """A new float32 tensor of ``numel`` values, zero where nothing was kept."""
        _check_payload(self, payload, numel)
        data = from_bytes(payload)
        parts, start = [], 0
        for _, rows, length in _row_groups(numel, TOPK_CHUNK):
            size = rows * self._chunk_bytes(length)
            parts.append(self._decode_chunks(data[start:start + size].view(rows, -1), length).view(-1))
            start += size
        return torch.cat(parts)


# ---- the registry ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class CodecEntry:
    """One wire format of ``--averaging.compression``: the config's choices, its checks, the docs' table and
    the experiments all read :data:`REGISTRY`."""

    name: str
    travels: str
    """What goes on the wire, in a few words (the docs' table)."""
    build: Callable[[float, int], Codec]
    """``build(topk_density, topk_bits)``: the codec (only ``topk`` reads the two)."""


REGISTRY: dict[str, CodecEntry] = {e.name: e for e in (
    CodecEntry("none", "fp32, the tensor's own bytes", lambda d, b: Fp32Codec()),
    CodecEntry("fp16", "IEEE half precision, clamped to ±65504", lambda d, b: Fp16Codec()),
    CodecEntry("int8", "blocks of 256 values: one fp32 absmax scale, int8 codes",
               lambda d, b: BlockAbsmaxCodec("int8", bits=8, block=256)),
    CodecEntry("int4", "blocks of 128 values: one fp32 absmax scale, 4-bit codes in [−7, 7] (symmetric "
                       "blockwise absmax, not E3M0)", lambda d, b: BlockAbsmaxCodec("int4", bits=4, block=128)),
    CodecEntry("int2", "blocks of 256 values: two bf16 magnitudes fitted to the block by least squares, and 2 bits "
                       "per value: its sign and the nearer magnitude", lambda d, b: FittedBlockCodec(block=256, bits=2)),
    CodecEntry("sign", "blocks of 256 values: one bf16 scale, the block's mean magnitude (the scale with the least "
                       "squared error for those signs), and 1 bit per value, its sign",
               lambda d, b: BlockSignCodec(block=256)),
    CodecEntry("topk", "per chunk of 4096 values: the `--averaging.topk_density` largest entries, each a 12-bit "
                       "index plus `--averaging.topk_bits` (2 or 4) bits: a sign and one of 2^bits/2 magnitudes "
                       "equally spaced from lo to hi, two bf16 per chunk fitted to the kept values by least squares",
               lambda d, b: TopKCodec(float(d), b)),
)}
"""Every wire format of pseudo-gradients, by name."""
CODECS = tuple(REGISTRY)
"""Every wire format's name (``--averaging.compression``)."""
LOSSY_CODECS = tuple(n for n, e in REGISTRY.items() if e.build(0.02, 2).lossy)
"""The formats that drop part of Δ (what they drop can be carried into later rounds: error feedback)."""


AUTO = "auto"
"""``--averaging.compression auto``: each round, the group picks one of ``--averaging.auto_codecs`` from the link
it measured (:func:`choose_codec`)."""
AUTO_CODECS = ("none", "fp16", "int8", "int4", "int2", "sign")
"""What ``auto`` picks from by default, the most faithful first (the order of :data:`REGISTRY`; ``topk``, whose
error depends on its density, is left out unless named)."""
COMPRESSIONS = CODECS + (AUTO,)
"""Every value ``--averaging.compression`` takes: a codec, or ``auto``."""


def unknown_codec(name: str) -> str:
    """Why ``name`` is no value of ``--averaging.compression``, in one sentence naming those that exist ('' when it
    is one)."""
    if name in COMPRESSIONS:
        return ""
    return f"--averaging.compression {name} is not a codec; use one of {', '.join(COMPRESSIONS)}"


def may_drop(compression: str) -> bool:
    """Whether ``--averaging.compression compression`` may drop part of Δ in a round (a lossy codec, or ``auto``,
    which may pick one): what it drops can then be carried into later rounds (error feedback)."""
    return compression in LOSSY_CODECS or compression == AUTO


def make_codec(name: str, *, topk_density: float = 0.02, topk_bits: int = 2) -> Codec:
    """The codec called ``name`` (one of :data:`CODECS`); the topk settings are validated for every name."""
    if name not in REGISTRY:
        raise ValueError(unknown_codec(name) or f"--averaging.compression {name} picks one of the codecs each round "
                                                f"(choose_codec); make_codec takes one of {', '.join(CODECS)}")
    if (isinstance(topk_density, bool) or not isinstance(topk_density, (int, float))
            or not math.isfinite(topk_density) or not 0 < topk_density <= 1):
        raise ValueError(f"--averaging.topk_density must be a finite number in (0, 1], not {topk_density!r}")
    if isinstance(topk_bits, bool) or not isinstance(topk_bits, int) or topk_bits not in (2, 4):
        raise ValueError(f"--averaging.topk_bits must be 2 or 4, not {topk_bits!r}")
    return REGISTRY[name].build(topk_density, topk_bits)


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


def choose_codec(codecs: Mapping[str, Codec], numels: Sequence[int], group_size: int,
                 seconds_for: Callable[[float], float | None], budget: float, *, explore: bool = False) -> str:
    """``auto``'s pick for one round: the name of the first (most faithful) of ``codecs`` (by name, in order) whose
    bytes the link moves within ``budget`` seconds, ``seconds_for(bytes each member sends)`` telling how long the
    group's slowest member takes (None when some member has not measured its link yet).  The last (the fewest
    bytes) when none fits, the budget is unknown (NaN) or the link is.  ``explore``: the links' figures are pessimistic
    (they could not tell latency from rate yet), so take the next codec up from what they allow, whose exchange
    tells the two apart.  ``numels``: the round's buckets; a function of its arguments only, so every member
    given the same figures picks the same codec."""
    names = list(codecs)
    if not names:
        raise ValueError("auto needs at least one codec to pick from")
    if not budget == budget:
        return names[-1]
    fits = len(names) - 1
    for i, codec in enumerate(codecs.values()):
        seconds = seconds_for(sum(codec.nbytes(n) for n in numels) * exchange_factor(codec, group_size))
        if seconds is None:
            return names[-1]
        if seconds <= budget:
            fits = i
            break
    return names[max(0, fits - 1) if explore else fits]


def codec_table(numel: int = 1 << 20) -> str:
    """The docs' markdown table of every codec: what travels, bytes per value (at the default topk settings,
    measured on ``numel`` values) and how a group exchanges it."""
    rows = ["| codec | what travels | bytes per value | exchange |", "| --- | --- | ---: | --- |"]
    for name, entry in REGISTRY.items():
        codec = entry.build(0.02, 2)
        if not reduce_scatters(codec, 3):
            exchange = "all-gather"
        elif reduce_scatters(codec, 2):
            exchange = "reduce-scatter"
        else:
            exchange = "all-gather at 2 members, reduce-scatter from 3"
        per_value = f"{codec.nbytes(numel) / numel:.3f}" + (" at 2%, 2 bits" if name == "topk" else "")
        rows.append(f"| `{name}`{' (default)' if name == 'none' else ''} | {entry.travels} | {per_value} | {exchange} |")
    return "\n".join(rows) + "\n"


def wire_ratio(codec: Codec, numel: int) -> float:
    """Payload size relative to sending the ``numel`` values as raw float32."""
    return codec.nbytes(numel) / (4 * numel)


class ErrorFeedback:
    """Per-bucket error-feedback buffer e (SparseLoCo / EF21-style).

    Each round: e <- decay*e + delta; send q = codec(e); e <- e - decode(q).  What the codec drops is
    kept in e and sent in later rounds instead of being lost.
    """

    def __init__(self, codec: Codec, decay: float = 1.0):
        if not (isinstance(decay, (int, float)) and math.isfinite(decay) and 0 < decay <= 1):
            raise ValueError(f"the error-feedback decay must be in (0, 1], not {decay!r}")
        self.codec, self.decay = codec, float(decay)

    def prepare(self, delta: torch.Tensor, buffer: torch.Tensor | None
                ) -> tuple[bytes, torch.Tensor, torch.Tensor]:
        """(payload, sent, new_buffer) for one round; leaves ``delta`` and ``buffer`` untouched.

        The caller commits ``new_buffer`` only if the round commits, so a failed round loses nothing.
        """
        if buffer is None:
            residual = delta  # read only: encoded, then subtracted from
        elif buffer.shape != delta.shape:
            raise ValueError(f"error-feedback buffer of shape {tuple(buffer.shape)} does not match "
                             f"the delta's {tuple(delta.shape)}")
        else:
            residual = buffer * self.decay + delta
        if hasattr(self.codec, "encode_and_decode"):
            payload, sent = self.codec.encode_and_decode(residual)
        else:
            payload = self.codec.encode(residual)
            sent = self.codec.decode(payload, residual.numel())
        return payload, sent, residual - sent
