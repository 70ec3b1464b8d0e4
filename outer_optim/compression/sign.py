"""``sign``: one bit per value, its sign, times one scale per block.

sign: blocks of B=256 values; per block a bfloat16 scale s = mean |x| over the block's values (the
    scale that minimises the squared error for these signs; a shorter last block averages its own
    values), and one bit per value: 1 for x >= 0, decoding to +s, and 0, decoding to -s.
    Layout: all ceil(N/256) scales, then the bits.  nbytes = 2*ceil(N/256) + ceil(N/8), 1.0625 bits a value.

Byte order and bit streams: see :mod:`outer_optim.compression`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from outer_optim.compression.bitpack import from_bytes, from_le, pack_codes, to_bytes, to_le, unpack_codes
from outer_optim.compression.codec import check_payload, check_values


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
        check_values(values)
        n = values.numel()
        blocks = F.pad(values, (0, -n % self.block)).view(-1, self.block)
        counts = torch.full((blocks.shape[0],), float(self.block))
        counts[-1] = n - (blocks.shape[0] - 1) * self.block  # the padding of the last block is no value
        scales = (blocks.abs().sum(dim=1) / counts).clamp_(max=torch.finfo(torch.bfloat16).max).to(torch.bfloat16)
        return to_bytes(to_le(scales)) + to_bytes(pack_codes((values >= 0).to(torch.int32), 1))

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        """A new float32 tensor of ``numel`` values."""
        check_payload(self, payload, numel)
        data = from_bytes(payload)
        nblocks = -(-numel // self.block)
        scales = from_le(data[:2 * nblocks].view(-1, 2), torch.bfloat16).to(torch.float32)
        if not (bool(torch.isfinite(scales).all()) and bool((scales >= 0).all())):
            raise ValueError("corrupt sign payload: a block's scale must be finite and non-negative")
        signs = unpack_codes(data[2 * nblocks:], numel, 1).to(torch.float32).mul_(2).sub_(1)
        return signs.mul_(scales.repeat_interleave(self.block)[:numel])
