"""``topk``: the largest entries of each chunk, each an index and a code on a fitted grid (SparseLoCo's codec),
and the bounds of its two settings, which the config's checks read too.

topk (density d, bits b in :data:`TOPK_BITS`): chunks of C=4096 values (the last one may be shorter, length L).
    Each chunk keeps k = max(1, min(L, floor(d*L + 0.5))) entries of largest |x|; ties at the
    threshold go to the lowest indices, so the choice never depends on torch.topk's tie order.
    Kept values go on V=2**b levels, a sign and M=V/2 magnitudes m_j = lo + (hi-lo)*j/(M-1) (j < M):
    code c < M decodes to -m_(M-1-c), code c >= M to +m_(c-M), so codes ascend with their values.
    lo and hi are fitted to the chunk's kept magnitudes by least squares (Lloyd iterations: each value
    to its nearest level, then lo and hi by linear regression), then rounded to bfloat16; each value
    takes its nearest level of the rounded grid (:mod:`.levels`).  An all-zero chunk has lo = hi = 0.
    Per chunk: lo and hi as bfloat16, then a stream of k records (12-bit index inside the chunk,
    b-bit code), indices ascending.  nbytes = sum over chunks of (4 + ceil(k_c*(12+b)/8)).

Byte order and bit streams: see :mod:`outer_optim.compression`.
"""

from __future__ import annotations

import math

import torch

from outer_optim.compression.bitpack import from_bytes, pack_rows, to_bytes, to_le, unpack_rows
from outer_optim.compression.codec import check_payload, check_values, row_groups
from outer_optim.compression.levels import FittedLevels

TOPK_CHUNK = 4096
"""Values per chunk: each chunk keeps its own largest entries and fits its own grid to them."""
TOPK_INDEX_BITS = math.ceil(math.log2(TOPK_CHUNK))
"""Bits of a kept entry's index inside its chunk."""
TOPK_BITS = (2, 4)
"""What ``--averaging.topk_bits`` may be: the bits of a kept entry's code, its sign and one of 2**bits/2
magnitudes."""
TOPK_DEFAULT_DENSITY = 0.02
"""``--averaging.topk_density`` unless set: the fraction of each chunk kept."""
TOPK_DEFAULT_BITS = 2
"""``--averaging.topk_bits`` unless set."""


def topk_problems(density: float, bits: int) -> list[str]:
    """What is wrong with ``--averaging.topk_density`` (a fraction in (0, 1]) and ``--averaging.topk_bits`` (one of
    :data:`TOPK_BITS`), one sentence each; empty when both are fine.  The config's checks and
    :func:`~outer_optim.compression.registry.make_codec` both ask here, so the bounds are stated once."""
    p = []
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
        p.append(f"--averaging.topk_density must be in (0, 1], got {density!r}")
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in TOPK_BITS:
        p.append(f"--averaging.topk_bits must be {' or '.join(map(str, TOPK_BITS))}, got {bits!r}")
    return p


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
        return sum(rows * self._chunk_bytes(length) for _, rows, length in row_groups(numel, TOPK_CHUNK))

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
        check_values(values)
        return b"".join(to_bytes(self._encode_chunks(values[start:start + rows * length].view(rows, length)))
                        for start, rows, length in row_groups(values.numel(), TOPK_CHUNK))

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        """A new float32 tensor of ``numel`` values, zero where nothing was kept."""
        check_payload(self, payload, numel)
        data = from_bytes(payload)
        parts, start = [], 0
        for _, rows, length in row_groups(numel, TOPK_CHUNK):
            size = rows * self._chunk_bytes(length)
            parts.append(self._decode_chunks(data[start:start + size].view(rows, -1), length).view(-1))
            start += size
        return torch.cat(parts)
