"""A canonical layout of the pseudo-gradient that does not depend on how an island is split.

Islands of different shapes (tp=2 next to pp=2 next to a single process) hold different pieces of
each parameter, but they can only average what they agree on.  The canonical layout is the whole
model's parameters, in model order, each flattened row-major and concatenated into one index space
``[0, total_numel)``, cut into buckets of at most ``bucket_numel`` elements (a bucket may span several
parameters and a large parameter spans several buckets).  Buckets are the unit of cross-island
averaging: every island averages bucket ``i`` with every other island's bucket ``i``, whichever of its
ranks holds the pieces.

A rank's local shard of a parameter is a spec ``(dim, offset, length)``, and where it lands in a bucket
a list of :class:`peers.island.layout.Segment` (see :mod:`peers.island.layout`).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LAYOUT_VERSION", "Bucket", "CanonicalLayout", "ParamEntry", "Segment", "Spec", "spec_tuple"]

LAYOUT_VERSION = 1


@dataclass(frozen=True)
class Bucket:
    """The canonical elements ``[start, end)``; ``index`` orders the buckets."""

    index: int
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ParamEntry:
    """One parameter of the layout: its full shape and where it starts in the canonical space."""

    name: str
    shape: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.start + self.numel


class CanonicalLayout:
    """The canonical index space of a model's parameters, cut into buckets.

    Build it from the *full* parameter shapes in model order (the same list on every rank of every
    island): ``CanonicalLayout.build([(name, shape), ...], bucket_numel)``.
    """

    def __init__(self, params: Sequence[tuple[str, Sequence[int]]], bucket_numel: int,
                 groups: Sequence[Sequence[str]] = ()):
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be positive, got {bucket_numel}")
        self.bucket_numel = int(bucket_numel)
        self.params: list[ParamEntry] = []
        self._by_name: dict[str, ParamEntry] = {}
        start = 0
        for name, shape in params:
            if name in self._by_name:
                raise ValueError(f"parameter {name!r} appears twice in the layout")
            entry = ParamEntry(str(name), tuple(int(s) for s in shape), start)
            self.params.append(entry)
            self._by_name[entry.name] = entry
            start = entry.end
        self.total_numel = start
        self.groups = [list(g) for g in groups]
        """Parameter groups (e.g. Streaming DiLoCo's fragments) no bucket may span: each a run of
        consecutive parameters in model order, together covering the model (empty: one group)."""
        breaks = self._group_starts()
        b = self.bucket_numel
        self.buckets: list[Bucket] = []
        for lo, hi in zip(breaks, breaks[1:] + [start]):
            for s in range(lo, hi, b):
                self.buckets.append(Bucket(len(self.buckets), s, min(s + b, hi)))
        self._bucket_starts = [bk.start for bk in self.buckets]
        self._segments: dict[tuple[str, Spec], dict[int, list[Segment]]] = {}

    @classmethod
    def build(cls, params: Iterable[tuple[str, Sequence[int]]], bucket_numel: int,
              groups: Sequence[Sequence[str]] = ()) -> CanonicalLayout:
        """The layout of ``params`` (``(name, full shape)`` in model order) in buckets of ``bucket_numel``,
        none of them spanning two of ``groups``."""
        return cls(list(params), bucket_numel, groups)

    def _group_starts(self) -> list[int]:
        """Canonical start of every group (``[0]`` without groups); checks the groups tile the model."""
        if not self.groups:
            return [0]
        order = [n for g in self.groups for n in g]
        if order != self.names:
            raise ValueError("parameter groups must list every parameter once, as consecutive runs in model order")
        return [self._by_name[g[0]].start for g in self.groups if g]

    def group_buckets(self, group: int) -> list[int]:
        """Indices of the buckets holding group ``group``'s parameters (all buckets without groups)."""
        if not self.groups:
            return [bk.index for bk in self.buckets]
        names = self.groups[group]
        lo, hi = self._by_name[names[0]].start, self._by_name[names[-1]].end
        return [bk.index for bk in self.buckets if lo <= bk.start < hi]

    # -------------------------------------------------------------------------------- describing
    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def entry(self, name: str) -> ParamEntry:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"parameter {name!r} is not part of the canonical layout") from None

    def fingerprint(self) -> str:
        """Hash of the names, full shapes, order and bucket size: islands whose layouts differ
        (another model, another bucket size) must not average with each other."""
        doc: dict[str, Any] = {"version": LAYOUT_VERSION, "bucket_numel": self.bucket_numel,
                               "params": [[p.name, list(p.shape)] for p in self.params]}
        if len(self.groups) > 1:
            doc["groups"] = [len(g) for g in self.groups]
        return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()[:16]

    def local_shape(self, name: str, spec: Any) -> tuple[int, ...]:
        """Shape of the local tensor of ``name`` under ``spec``."""
        entry = self.entry(name)
        dim, _, length = spec_tuple(spec, entry.shape)
        if not entry.shape:
            return ()
        shape = list(entry.shape)
        shape[dim] = length
        return tuple(shape)

    def check_local(self, name: str, spec: Any, local_shape: Sequence[int]) -> None:
        """Raise ValueError unless a local tensor of ``local_shape`` fits ``spec`` of ``name``."""
        expected = self.local_shape(name, spec)
        if tuple(local_shape) != expected and not (expected == () and tuple(local_shape) in ((), (1,))):
            raise ValueError(f"local shard of {name!r} has shape {tuple(local_shape)} but spec {spec_tuple(spec)} of "
                             f"the full shape {self.entry(name).shape} implies {expected}")

    def _geometry(self, name: str, spec: Any) -> tuple[ParamEntry, Spec, int, int, int, int]:
        """(entry, spec, outer rows, full row length R, local row length r, canonical start of row 0)."""
        entry = self.entry(name)
        spec = spec_tuple(spec, entry.shape)
        dim, offset, length = spec
        shape = entry.shape or (1,)
        outer = math.prod(shape[:dim])
        inner = math.prod(shape[dim + 1:])
        return entry, spec, outer, shape[dim] * inner, length * inner, entry.start + offset * inner

    def local_ranges(self, name: str, spec: Any,
                     local_shape: Sequence[int] | None = None) -> list[tuple[int, int, int]]:
        """``[(canonical_start, local_flat_start, n), ...]`` covering a local shard, in local order.

        A shard narrowed on dim 0 (or a whole tensor) is one range; narrowed on dim ``d > 0`` it is
        one range per row of the leading ``d`` dims (adjacent ranges merged).  Computed in closed form
        with a tensor ``arange``; the packing helpers use :meth:`segments` instead.
        """
        if local_shape is not None:
            self.check_local(name, spec, local_shape)
        _, _, outer, R, r, base = self._geometry(name, spec)
        if r == 0 or outer == 0:
            return []
        if R == r:
            return [(base, 0, outer * r)]
        k = torch.arange(outer, dtype=torch.int64)
        starts = (base + k * R).tolist()
        locals_ = (k * r).tolist()
        return [(c, l, r) for c, l in zip(starts, locals_)]

    # ---------------------------------------------------------------------------------- segments
    def segments(self, name: str, spec: Any) -> dict[int, list[Segment]]:
        """``{bucket index: [Segment, ...]}`` for every bucket a shard touches (cached per (name, spec))."""
        key = (name, spec_tuple(spec))
        found = self._segments.get(key)
        if found is None:
            found = self._compute_segments(name, spec)
            self._segments[key] = found
        return found

    def _compute_segments(self, name: str, spec: Any) -> dict[int, list[Segment]]:
        entry, _, outer, R, r, base = self._geometry(name, spec)
        out: dict[int, list[Segment]] = {}
        if r == 0 or outer == 0:
            return out
        first, last = base, base + (outer - 1) * R + r  # canonical extent [first, last)
        for b in range(self.bucket_at(first), self.bucket_at(last - 1) + 1):
            bucket = self.buckets[b]
            segs = segments_in(name, bucket.start, bucket.end, outer, R, r, base)
            if segs:
                out[b] = segs
        return out

    def bucket_at(self, index: int) -> int:
        """Index of the bucket holding canonical element ``index``."""
        return bisect.bisect_right(self._bucket_starts, index) - 1

    def bucket_segments(self, bucket: Bucket | int, specs: Mapping[str, Any]) -> list[Segment]:
        """All segments of the shards ``specs`` (``{name: spec}``) inside one bucket, in model order."""
        index = bucket if isinstance(bucket, int) else bucket.index
        out: list[Segment] = []
        for name in self._ordered(specs):
            out += self.segments(name, specs[name]).get(index, [])
        return out

    def buckets_of(self, name: str, spec: Any) -> list[int]:
        """Indices of the buckets a shard touches."""
        return sorted(self.segments(name, spec))

    def _ordered(self, names: Iterable[str]) -> list[str]:
        names = list(names)
        for n in names:
            self.entry(n)
        return sorted(names, key=lambda n: self._by_name[n].start)

    # ----------------------------------------------------------------------------- pack / unpack
    def pack(self, bucket: Bucket | int, local_tensors: Mapping[str, torch.Tensor],
             specs: Mapping[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's contribution to a bucket: ``(values, mask)``, both of the bucket's size.

        ``values`` (fp32) holds this rank's elements at their canonical positions and zero elsewhere;
        ``mask`` (bool) marks the elements this rank holds.  ``specs`` defaults to whole tensors.
        Summing ``values`` over the ranks of an island and dividing by the summed ``mask`` gives the
        bucket whatever the island's split (replicated shards counted once).
        """
        bucket = self.buckets[bucket] if isinstance(bucket, int) else bucket
        specs = specs if specs is not None else {n: self.full_spec(n) for n in local_tensors}
        values = torch.zeros(bucket.numel, dtype=torch.float32)
        mask = torch.zeros(bucket.numel, dtype=torch.bool)
        for seg in self.bucket_segments(bucket, {n: specs[n] for n in local_tensors}):
            flat = local_tensors[seg.name].detach().reshape(-1)
            seg.bucket_view(values).copy_(seg.local_view(flat))
            seg.bucket_view(mask).fill_(True)
        return values, mask

    def unpack(self, bucket: Bucket | int, bucket_values: torch.Tensor, local_tensors: Mapping[str, torch.Tensor],
               specs: Mapping[str, Any] | None = None) -> None:
        """Write a bucket's values into the local shards that hold part of it (in place; the local
        tensors must be contiguous)."""
        bucket = self.buckets[bucket] if isinstance(bucket, int) else bucket
        specs = specs if specs is not None else {n: self.full_spec(n) for n in local_tensors}
        values = bucket_values.reshape(-1)
        if values.numel() != bucket.numel:
            raise ValueError(f"bucket {bucket.index} has {bucket.numel} elements, got {values.numel()}")
        for seg in self.bucket_segments(bucket, {n: specs[n] for n in local_tensors}):
            local = local_tensors[seg.name]
            if not local.is_contiguous():
                raise ValueError(f"cannot unpack into the non-contiguous local tensor {seg.name!r}")
            seg.local_view(local.view(-1)).copy_(seg.bucket_view(values))

    def full_spec(self, name: str) -> Spec:
        """The spec of the whole tensor."""
        shape = self.entry(name).shape or (1,)
        return 0, 0, shape[0]

    def is_full(self, name: str, spec: Any) -> bool:
        """Whether ``spec`` covers the whole of ``name``."""
        shape = self.entry(name).shape or (1,)
        dim, offset, length = spec_tuple(spec, shape)
        return offset == 0 and length == shape[dim]

    # --------------------------------------------------------------------------------- ownership
    @staticmethod
    def owner_of(bucket_index: int, island_size: int) -> int:
        """Island rank that averages bucket ``bucket_index`` across islands: round-robin.

        Buckets all have ``bucket_numel`` elements except the last, so round-robin spreads the
        slow-link traffic evenly over the island's ranks.
        """
        if island_size < 1:
            raise ValueError(f"island_size must be positive, got {island_size}")
        return bucket_index % island_size

    def owned_buckets(self, rank: int, island_size: int) -> list[int]:
        """Indices of the buckets island rank ``rank`` owns."""
        return [b.index for b in self.buckets if self.owner_of(b.index, island_size) == rank]

    def __repr__(self) -> str:
        return (f"CanonicalLayout({len(self.params)} params, {self.total_numel} elements, "
                f"{len(self.buckets)} buckets of <= {self.bucket_numel})")


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
