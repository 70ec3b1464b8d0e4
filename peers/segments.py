"""Where a rank's shard of a parameter lies in the canonical layout's buckets (:mod:`peers.layout`).

A rank's local shard of parameter ``name`` is described by a spec ``(dim, offset, length)``: the local
tensor equals ``full.narrow(dim, offset, length)``.  Any object with ``dim``/``offset``/``length``
attributes (such as ``pipeline.shards.ShardSpec``) is accepted too; this package never imports the
pipeline.

Where a shard lands in a bucket is described by :class:`Segment`s: a block of ``rows`` rows of
``row_len`` elements, contiguous in the local tensor and ``row_stride`` apart in the bucket.  A shard
narrowed on dim 0 (or a whole tensor) is one contiguous segment per bucket; a shard narrowed on
dim 1 is at most three segments per bucket (a partial first row, a block of full rows, a partial
last row), copied with strided views, so packing a big tensor costs a few memcpy-like kernels and no
index tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

Spec = tuple[int, int, int]
"""``(dim, offset, length)``: the local tensor is ``full.narrow(dim, offset, length)``."""


@dataclass(frozen=True)
class Segment:
    """``rows`` rows of ``row_len`` elements of parameter ``name``: contiguous in the (flattened)
    local shard from ``local_offset``, and ``row_stride`` apart in the bucket from ``bucket_offset``."""

    name: str
    bucket_offset: int
    local_offset: int
    rows: int
    row_len: int
    row_stride: int

    @property
    def numel(self) -> int:
        return self.rows * self.row_len

    def bucket_view(self, values: torch.Tensor) -> torch.Tensor:
        """A ``(rows, row_len)`` view of this segment inside a 1-D contiguous bucket tensor."""
        if self.rows == 1:
            return values.narrow(0, self.bucket_offset, self.row_len).view(1, self.row_len)
        if not values.is_contiguous() or values.dim() != 1:
            raise ValueError("bucket values must be a contiguous 1-D tensor")
        last = self.bucket_offset + (self.rows - 1) * self.row_stride + self.row_len
        if last > values.numel():
            raise ValueError(f"segment of {self.name} runs past the bucket ({last} > {values.numel()})")
        return values.as_strided((self.rows, self.row_len), (self.row_stride, 1),
                                 values.storage_offset() + self.bucket_offset)

    def local_view(self, flat_local: torch.Tensor) -> torch.Tensor:
        """A ``(rows, row_len)`` view of this segment inside a flattened local shard."""
        return flat_local.narrow(0, self.local_offset, self.numel).view(self.rows, self.row_len)


def spec_tuple(spec: Any, full_shape: Sequence[int] | None = None) -> Spec:
    """``(dim, offset, length)`` from a tuple or an object with those attributes (a ``ShardSpec``).

    With ``full_shape`` the spec is checked against it; a 0-dim parameter is ``(0, 0, 1)``.
    """
    if isinstance(spec, (tuple, list)):
        if len(spec) != 3:
            raise ValueError(f"a shard spec is (dim, offset, length), got {spec!r}")
        dim, offset, length = (int(x) for x in spec)
    else:
        dim, offset, length = int(spec.dim), int(spec.offset), int(spec.length)
    if full_shape is not None:
        shape = tuple(full_shape) or (1,)
        if not 0 <= dim < len(shape):
            raise ValueError(f"shard dim {dim} is outside a tensor of shape {tuple(full_shape)}")
        if offset < 0 or length < 0 or offset + length > shape[dim]:
            raise ValueError(f"shard [{offset}, {offset + length}) on dim {dim} does not fit in shape "
                             f"{tuple(full_shape)}")
    return dim, offset, length


def segments_in(name: str, bs: int, be: int, outer: int, R: int, r: int, base: int) -> list[Segment]:
    """Segments of a shard whose row ``k`` is canonical ``[base + k*R, base + k*R + r)`` (local
    ``[k*r, (k+1)*r)``), restricted to the bucket ``[bs, be)``."""
    if R == r:  # whole rows: the shard is one contiguous canonical range
        a, e = max(base, bs), min(base + outer * r, be)
        return [Segment(name, a - bs, a - base, 1, e - a, e - a)] if e > a else []
    k_lo = max(0, (bs - base - r) // R + 1)       # first row ending after bs
    k_hi = min(outer, -((base - be) // R))         # rows starting before be: k < ceil((be - base) / R)
    if k_lo >= k_hi:
        return []

    def row(k: int) -> Segment | None:
        cs = base + k * R
        a, e = max(cs, bs), min(cs + r, be)
        return Segment(name, a - bs, k * r + (a - cs), 1, e - a, R) if e > a else None

    def partial(k: int) -> bool:
        cs = base + k * R
        return cs < bs or cs + r > be

    out: list[Segment] = []
    k, end = k_lo, k_hi
    if partial(k):
        seg = row(k)
        if seg:
            out.append(seg)
        k += 1
    tail = None
    if end - 1 >= k and partial(end - 1):
        tail = row(end - 1)
        end -= 1
    if end > k:
        out.append(Segment(name, base + k * R - bs, k * r, end - k, r, R))
    if tail:
        out.append(tail)
    return out
