"""Moving bucket pieces inside one island (steps a and d of :mod:`peers.averaging.sharded`): each rank sends the
pieces of every bucket it contributes straight to the bucket's owner, and owners send each rank the
averaged values of the elements it holds (point-to-point, any backend)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch
import torch.distributed as dist

from outer_optim.tensors import all_finite
from peers.fingerprints import CHUNKS_PER_BUCKET, fingerprints
from peers.island.layout import CanonicalLayout, Segment, spec_tuple

HOST = torch.device("cpu")


def backend_of(group: dist.ProcessGroup) -> str:
    """The backend of ``group`` as torch names it (``gloo``, ``nccl``, ``cpu:gloo,cuda:nccl``); the collective audit
    of the tests answers with the backend the group would have on a CUDA island (tests/collective_audit.py)."""
    return dist.get_backend(group)


def accelerator() -> torch.device:
    """This process's GPU (the collective audit of the tests answers with a stand-in device)."""
    return torch.device("cuda", torch.cuda.current_device())


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the tensors of a collective on ``group`` must be: on this process's GPU for a group NCCL serves (it takes
    no host tensor), on the host for a gloo group, and on the host without a group (a process alone sends nothing).
    Ask the group that carries the collective: the island's group says nothing about the world's."""
    if group is None or "nccl" not in backend_of(group):
        return HOST
    return accelerator()


class BucketExchange:
    """Moves bucket pieces between the ranks of one island (point-to-point, any backend).

    Collective over ``group`` at construction: every rank must build it with its own local shapes
    and specs.  ``group=None`` is a single-process island.
    """

    def __init__(self, layout: CanonicalLayout, local_tensors: Mapping[str, Any], specs: Mapping[str, Any],
                 group: dist.ProcessGroup | None, device: torch.device | str | None = None):
        self.layout, self.group = layout, group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self._global = [0] if group is None else [dist.get_global_rank(group, r) for r in range(self.size)]
        self.device = collective_device(group) if device is None else torch.device(device)
        self.local_shapes = {n: tuple(shape_of(t)) for n, t in local_tensors.items()}
        missing = sorted(set(self.local_shapes) ^ set(specs))
        if missing:
            raise ValueError(f"local tensors and specs name different parameters: {missing[:5]}")
        mine = {n: (spec_tuple(specs[n]), self.local_shapes[n]) for n in self.local_shapes}
        everyone = self.all_gather_object(mine)
        problems = []
        for r, holdings in enumerate(everyone):
            for name, (spec, shape) in holdings.items():
                try:
                    layout.check_local(name, spec, shape)
                except (KeyError, ValueError) as e:
                    problems.append(f"island rank {r}: {e.args[0]}")
        if problems:
            raise ValueError("shards do not fit the canonical layout: " + "; ".join(problems[:5]))
        self.specs: dict[str, tuple[int, int, int]] = {n: s for n, (s, _) in mine.items()}
        holder_specs = [{n: s for n, (s, _) in h.items()} for h in everyone]
        # replicated shards: the lowest rank with a given (name, spec) contributes, the others only receive
        first: dict[tuple, int] = {}
        contrib_specs: list[dict] = [{} for _ in range(self.size)]
        for r, held in enumerate(holder_specs):
            for name, spec in held.items():
                key = (name, "full" if layout.is_full(name, spec) else spec)
                if key not in first:
                    first[key] = r
                    contrib_specs[r][name] = spec
        self.owner = [layout.owner_of(b.index, self.size) for b in layout.buckets]
        self.owned = layout.owned_buckets(self.rank, self.size)
        self._my_contrib = by_bucket(layout, contrib_specs[self.rank])
        self._my_hold = by_bucket(layout, holder_specs[self.rank])
        self._in: dict[int, dict[int, list[Segment]]] = {b: {} for b in self.owned}
        self._out: dict[int, dict[int, list[Segment]]] = {b: {} for b in self.owned}
        owned = set(self.owned)
        for r in range(self.size):
            for b, segs in by_bucket(layout, contrib_specs[r], owned).items():
                self._in[b][r] = segs
            for b, segs in by_bucket(layout, holder_specs[r], owned).items():
                self._out[b][r] = segs
        self._inv: dict[int, torch.Tensor | None] = {}
        problems = []
        for b in self.owned:
            count = torch.zeros(layout.buckets[b].numel, dtype=torch.int32)
            for segs in self._in[b].values():
                for s in segs:
                    s.bucket_view(count).add_(1)
            holes = int((count == 0).sum())
            if holes:
                at = layout.buckets[b].start + int((count == 0).nonzero()[0])
                problems.append(f"bucket {b}: {holes} element(s) held by no rank of the island "
                                f"(first at canonical index {at}, in {self.param_at(at)!r})")
            self._inv[b] = None if holes or bool((count == 1).all()) else 1.0 / count.float()
        problems = [p for ps in self.all_gather_object(problems) for p in ps]
        if problems:
            raise ValueError("the island's shards do not cover the model: " + "; ".join(problems[:5]))
        self.whole = self.size == 1 and all(layout.is_full(n, s) for n, s in self.specs.items()) and \
            sum(numel_of(s) for s in self.local_shapes.values()) == layout.total_numel
        """One process holding every parameter whole: its canonical layout is its parameters flattened in model
        order, so a flat buffer in that order serves as every bucket and every parameter without a copy
        (:meth:`flat_views`, :meth:`gather`, :meth:`scatter`)."""

    def contribution(self, bucket: int) -> list[Segment]:
        """Where the elements of ``bucket`` this rank contributes sit in its shards and in the bucket (every
        element of a bucket is contributed by exactly one rank of the island)."""
        return list(self._my_contrib.get(bucket, []))

    def names_in(self, buckets: Collection[int] | None) -> list[str]:
        """This rank's parameters with elements in ``buckets`` (all of them for None)."""
        if buckets is None:
            return list(self.local_shapes)
        wanted = set(buckets)
        return [n for n in self.local_shapes if wanted.intersection(self.layout.segments(n, self.specs[n]))]

    def param_at(self, index: int) -> str:
        """Name of the parameter holding canonical element ``index``."""
        for p in self.layout.params:
            if p.start <= index < p.end:
                return p.name
        return "?"

    # -------------------------------------------------------------------------------- collectives
    def _p2p(self, ops: list[tuple[str, torch.Tensor, int, int]]) -> None:
        """Run ``(kind "send"/"recv", tensor, island rank, tag)`` operations and wait for all of them.

        Every operation is posted before any is waited on, so the order across peers cannot
        deadlock.  A group on a GPU (NCCL) gets one ``batch_isend_irecv`` (grouped, as its point-to-point
        needs; NCCL ignores the tags and matches the operations between two ranks in the order they are
        posted: both sides post them in bucket order); a host group (gloo) gets plain ``isend``/``irecv`` with tags.
        """
        if not ops:
            return
        if self.device != HOST:
            p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, self._global[peer], self.group, tag)
                   for kind, t, peer, tag in ops]
            reqs = dist.batch_isend_irecv(p2p)
        else:
            reqs = [(dist.isend if kind == "send" else dist.irecv)(t, self._global[peer], group=self.group, tag=tag)
                    for kind, t, peer, tag in ops]
        for q in reqs:
            q.wait()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """``obj`` of every rank of the island, in rank order."""
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_reduce(self, values: list[float], op: dist.ReduceOp = dist.ReduceOp.MIN) -> list[float]:
        """Element-wise reduction of a few floats over the island."""
        t = torch.tensor(values, dtype=torch.float64)
        if self.group is not None:
            t = t.to(self.device)
            dist.all_reduce(t, op=op, group=self.group)
        return t.cpu().tolist()

    def precheck(self, local_deltas: Mapping[str, torch.Tensor], weight: float,
                 buckets: Collection[int] | None = None) -> str:
        """Agree (collective) whether this island may take part in averaging ``buckets`` (None: all):
        every rank's Δ of them complete and finite and the same positive weight on every rank;
        returns '' or the reason (same on all ranks)."""
        names = self.names_in(buckets)
        complete = set(local_deltas) >= set(names) and all(
            local_deltas[n].numel() == numel_of(self.local_shapes[n]) for n in names)
        finite = complete and all(all_finite(local_deltas[n]) for n in names)
        w = float(weight)
        if w != w:  # NaN weight: make the MIN see it
            w = float("-inf")
        ok, wmin, neg_wmax, whole = self.all_reduce([float(finite), w, -w, float(complete)])
        if whole < 1:
            return "a rank of the island passed pseudo-gradients that do not match its shards"
        if ok < 1:
            return "this island's pseudo-gradient is not finite; not sending it"
        if not wmin > 0:
            return "this island's weight is not positive; not sending it"
        if wmin != -neg_wmax:
            return f"the island's ranks passed different weights ({wmin} to {-neg_wmax})"
        return ""

    def canonical_fingerprint(self, local_tensors: Mapping[str, torch.Tensor],
                              chunks_per_bucket: int = CHUNKS_PER_BUCKET) -> list[float]:
        """Collective: :func:`~peers.fingerprints.fingerprint` of the island's tensors in canonical bucket order.

        Every owner fingerprints its assembled buckets, so two islands holding the same values get
        the same list whatever their shapes (use it as the ``state_fingerprint`` of θ_global).
        """
        # tensors laid out as the canonical flat buffer (θ_global of a whole island) are fingerprinted where they
        # are: on a GPU, gathering them meant a blocking copy of the whole model to the host each round
        whole = self._flat_of(local_tensors, list(self.local_shapes), any_device=True)
        owned = {b: whole[self.layout.buckets[b].start:self.layout.buckets[b].end] for b in self.owned} \
            if whole is not None else self.gather(local_tensors)
        mine = dict(zip(owned, fingerprints([[t] for t in owned.values()], chunks_per_bucket)))
        merged: dict[int, list[float]] = {}
        for part in self.all_gather_object(mine):
            merged.update(part)
        return [x for b in sorted(merged) for x in merged[b]]

    # ----------------------------------------------------------------------------- gather/scatter
    def flat_views(self, flat: torch.Tensor, names: Collection[str] | None = None) -> dict[str, torch.Tensor] | None:
        """``{name: view of flat}`` shaped like the parameters (of ``names``, None: all), for a flat fp32 buffer
        in canonical order (None unless this island is :attr:`whole`): tensors written there are gathered and
        scattered without a copy."""
        if not self.whole:
            return None
        out = {}
        for n in (self.local_shapes if names is None else names):
            e, shape = self.layout.entry(n), self.local_shapes[n]
            out[n] = flat[e.start:e.start + numel_of(shape)].view(shape)
        return out

    def _flat_of(self, tensors: Mapping[str, torch.Tensor], names: list[str], any_device: bool = False
                 ) -> torch.Tensor | None:
        """The canonical flat buffer ``tensors`` are views of (see :meth:`flat_views`), or None; on the host
        only, unless ``any_device``."""
        if not self.whole or not names:
            return None
        first = tensors[names[0]]
        if first.dtype != torch.float32 or (first.device.type != "cpu" and not any_device):
            return None
        base = first.data_ptr() - 4 * self.layout.entry(names[0]).start
        if any(tensors[n].data_ptr() != base + 4 * self.layout.entry(n).start or not tensors[n].is_contiguous()
               or tensors[n].dtype != torch.float32 for n in names):
            return None
        storage = first.untyped_storage()
        if storage.data_ptr() > base or storage.data_ptr() + storage.nbytes() < base + 4 * self.layout.total_numel:
            return None
        return torch.empty(0, device=first.device).set_(storage, (base - storage.data_ptr()) // 4,
                                                        (self.layout.total_numel,), (1,))

    def gather(self, local_deltas: Mapping[str, torch.Tensor], buckets: Collection[int] | None = None
               ) -> dict[int, torch.Tensor]:
        """Collective: every owner receives its buckets (of ``buckets``, None: all), assembled from the
        island's pieces (fp32 CPU, one 1-D tensor per owned bucket; views of ``local_deltas`` when they are
        views of one canonical flat buffer, see :meth:`flat_views`)."""
        names = self.names_in(buckets)
        whole = self._flat_of(local_deltas, names) if buckets is None or len(names) == len(self.local_shapes) \
            else None
        if whole is not None:
            return {b: whole[self.layout.buckets[b].start:self.layout.buckets[b].end]
                    for b in (self.owned if buckets is None else sorted(buckets))}
        flat = {n: local_deltas[n].detach().to("cpu", torch.float32).reshape(-1) for n in names}
        chosen = range(len(self.layout.buckets)) if buckets is None else sorted(buckets)
        ops, recv = [], {}
        for b in chosen:
            o = self.owner[b]
            if o == self.rank:
                for r, segs in self._in[b].items():
                    if r != self.rank:
                        buf = torch.empty(sum(s.numel for s in segs), dtype=torch.float32, device=self.device)
                        ops.append(("recv", buf, r, b))
                        recv[(b, r)] = buf
            elif b in self._my_contrib:
                buf = torch.cat([s.local_view(flat[s.name]).reshape(-1) for s in self._my_contrib[b]]).to(self.device)
                ops.append(("send", buf, o, b))
        self._p2p(ops)
        out = {}
        for b in (self.owned if buckets is None else [b for b in self.owned if b in buckets]):
            values = torch.zeros(self.layout.buckets[b].numel, dtype=torch.float32)
            for r, segs in self._in[b].items():
                if r == self.rank:
                    for s in segs:
                        s.bucket_view(values).add_(s.local_view(flat[s.name]))
                else:
                    add_pieces(values, segs, recv[(b, r)].cpu())
            if self._inv[b] is not None:
                values.mul_(self._inv[b])
            out[b] = values
        return out

    def scatter(self, averaged: Mapping[int, torch.Tensor] | None, buckets: Collection[int] | None = None
                ) -> dict[str, torch.Tensor]:
        """Collective: owners send each rank the averaged values of the elements it holds (of
        ``buckets``, None: all); returns ``{name: tensor}`` shaped like this rank's local shards of the
        parameters in those buckets (fp32 CPU; views of ``averaged`` when its buckets are views of one
        canonical flat buffer)."""
        names = self.names_in(buckets)
        if self.whole and averaged:
            bs = sorted(averaged)
            first = averaged[bs[0]]
            start = first.data_ptr() - 4 * self.layout.buckets[bs[0]].start
            if all(averaged[b].data_ptr() == start + 4 * self.layout.buckets[b].start and averaged[b].is_contiguous()
                   and averaged[b].dtype == torch.float32 for b in bs) and first.device.type == "cpu":
                storage = first.untyped_storage()
                if storage.data_ptr() <= start + 4 * min(self.layout.entry(n).start for n in names) and \
                        start + 4 * max(self.layout.entry(n).start + numel_of(self.local_shapes[n]) for n in names) \
                        <= storage.data_ptr() + storage.nbytes():
                    flat = torch.empty(0).set_(storage, (start - storage.data_ptr()) // 4,
                                               ((storage.data_ptr() + storage.nbytes() - start) // 4,), (1,))
                    return self.flat_views(flat, names)
        out = {n: torch.zeros(self.local_shapes[n], dtype=torch.float32) for n in names}
        flat_out = {n: t.view(-1) for n, t in out.items()}
        nb = len(self.layout.buckets)
        ops, recv = [], {}
        for b in (range(nb) if buckets is None else sorted(buckets)):
            o = self.owner[b]
            if o == self.rank:
                values = averaged[b].reshape(-1).to("cpu", torch.float32)
                for r, segs in self._out[b].items():
                    if r == self.rank:
                        for s in segs:
                            s.local_view(flat_out[s.name]).copy_(s.bucket_view(values))
                    else:
                        buf = torch.cat([s.bucket_view(values).reshape(-1) for s in segs]).to(self.device)
                        ops.append(("send", buf, r, nb + b))
            elif b in self._my_hold:
                buf = torch.empty(sum(s.numel for s in self._my_hold[b]), dtype=torch.float32, device=self.device)
                ops.append(("recv", buf, o, nb + b))
                recv[b] = buf
        self._p2p(ops)
        for b, buf in recv.items():
            buf, pos = buf.cpu(), 0
            for s in self._my_hold[b]:
                s.local_view(flat_out[s.name]).copy_(buf[pos:pos + s.numel].view(s.rows, s.row_len))
                pos += s.numel
        return out


def by_bucket(layout: CanonicalLayout, specs: Mapping[str, Any], only: set[int] | None = None
               ) -> dict[int, list[Segment]]:
    """``{bucket: segments}`` of some shards, in model order within each bucket."""
    out: dict[int, list[Segment]] = {}
    for name in sorted(specs, key=lambda n: layout.entry(n).start):
        for b, segs in layout.segments(name, specs[name]).items():
            if only is None or b in only:
                out.setdefault(b, []).extend(segs)
    return out


def add_pieces(values: torch.Tensor, segs: list[Segment], buf: torch.Tensor) -> None:
    pos = 0
    for s in segs:
        s.bucket_view(values).add_(buf[pos:pos + s.numel].view(s.rows, s.row_len))
        pos += s.numel


def shape_of(t: Any) -> tuple[int, ...]:
    return tuple(t.shape) if hasattr(t, "shape") else tuple(t)


def numel_of(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
