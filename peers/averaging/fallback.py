"""Hierarchical all-reduce over torch.distributed: the fallback when islands share a process group.

On a cluster with a fast fabric the islands can be launched as one torch.distributed world (every
rank of every island).  Averaging a round then needs no hivemind at all:

1. inside each island, every bucket's pieces are sent to the bucket's owner (the same
   point-to-point :class:`~peers.island.exchange.BucketExchange` the hivemind path uses);
2. across islands, the owners of each bucket all-reduce ``weight × bucket`` (SUM; ``ReduceOp.AVG``
   is NCCL-only) in a subgroup made of exactly those owners, and divide by the sum of the islands'
   weights (tokens), as hivemind weighs them;
3. inside each island the averaged bucket goes back to every rank holding part of it.

One subgroup per distinct *owner set* (the owners of a bucket, one per island) is created up front,
collectively, so islands of different sizes can mix.  Every island's metadata is all-gathered first
so the same checks as a hivemind group run (config/layout fingerprints, round ids, θ_global
fingerprints by majority); every island computes the same verdict from the same data.

An island that cannot send this round (its Δ is not finite) still takes part with weight 0, so the
collectives never wait for it; it rolls back while the others average without it.

Devices and groups, as NCCL needs them: each collective's tensors go where the group that carries it wants them
(:func:`~peers.island.exchange.collective_device`): the owners' buckets on the GPU for the world's backend (NCCL)
even when an island is a single process (it has no group of its own, and its exchange stays on the host); the
metadata and the round's agreement over ``control`` (a gloo group of the whole world on GPUs: small host
messages, and a failure there raises instead of aborting).  Every group made here takes the run's ``timeout``.
A bucket all-reduce that fails or times out on gloo raises and the round rolls back; on NCCL the wait blocks the
host for at most ``timeout`` too, but NCCL's watchdog ends the process when a collective times out (its default
``TORCH_NCCL_ASYNC_ERROR_HANDLING``): there a lost rank ends the torchrun world, not the round.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from outer_optim.tensors import all_finite
from peers.fingerprints import majority_by_state
from peers.group.averager import check_group
from peers.result import RoundResult
from peers.wire.counters import ring_allreduce_bytes
from peers.island.exchange import BucketExchange, collective_device
from peers.island.layout import CanonicalLayout

log = logging.getLogger(__name__)


class HierarchicalAllReduce:
    """Averages the islands of one torch.distributed world bucket by bucket (see the module doc).

    ``island_ranks[i]`` lists the global ranks of island ``i``; an island's local rank ``k`` is the
    ``k``-th smallest of them (torch orders a group's ranks that way), and must match the rank
    order of the island's own process group.  The default process group must contain exactly the
    ranks of all islands.  Construction is collective over the whole world: every rank calls it
    with its own local shapes and specs.  A round with fewer than ``min_group_size`` islands able to
    send (finite Δ, positive weight) is rejected by all.  ``control``: a group of the whole world for the
    metadata and the agreement (the default group when None; on GPUs, pass a gloo one); ``timeout``: the run's
    process-group timeout, given to every group made here (torch's default when None: 10 minutes on NCCL);
    ``device``: where the buckets travel (None: where the world's backend wants them).
    """

    def __init__(self, layout: CanonicalLayout, local_tensors: Mapping[str, Any], specs: Mapping[str, Any],
                 island_ranks: Sequence[Sequence[int]], *, min_group_size: int = 1,
                 device: torch.device | str | None = None, control: dist.ProcessGroup | None = None,
                 timeout: datetime.timedelta | None = None):
        if not dist.is_initialized():
            raise RuntimeError("HierarchicalAllReduce needs an initialised torch.distributed world")
        world, me = dist.get_world_size(), dist.get_rank()
        islands = [sorted(int(r) for r in ranks) for ranks in island_ranks]
        flat = sorted(r for ranks in islands for r in ranks)
        if flat != list(range(world)) or any(not ranks for ranks in islands):
            raise ValueError(f"island_ranks {island_ranks} must split the world's ranks 0..{world - 1} into "
                             "non-empty islands, each rank in exactly one")
        self.layout, self.islands, self.min_group_size = layout, islands, int(min_group_size)
        self.island_index = next(i for i, ranks in enumerate(islands) if me in ranks)
        self.n_islands = len(islands)
        self.control = control if control is not None else dist.group.WORLD
        self.timeout = timeout
        prints: list[Any] = [None] * world
        dist.all_gather_object(prints, layout.fingerprint(), group=self.control)
        if len(set(prints)) > 1:
            raise ValueError("the islands of this world use different canonical layouts (model or bucket size differ)")
        self.island_group: dist.ProcessGroup | None = None
        for ranks in islands:  # every rank creates every group, in the same order
            group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
            if me in ranks:
                self.island_group = group
        self.exchange = BucketExchange(layout, local_tensors, specs, self.island_group, device)
        # the bucket groups below are made with the world's backend: ask the world, never the island (an island of
        # one process has no group, and its exchange stays on the host)
        self.device = collective_device(dist.group.WORLD) if device is None else torch.device(device)
        self._bucket_group: dict[int, dist.ProcessGroup] = {}
        if self.n_islands > 1:
            sets: dict[tuple[int, ...], list[int]] = {}
            for b in layout.buckets:
                owners = tuple(sorted(ranks[layout.owner_of(b.index, len(ranks))] for ranks in islands))
                sets.setdefault(owners, []).append(b.index)
            for owners, buckets in sets.items():
                group = dist.new_group(list(owners), timeout=timeout)
                if me in owners:
                    for b in buckets:
                        self._bucket_group[b] = group

    @property
    def island_rank(self) -> int:
        """This rank's rank inside its island."""
        return self.exchange.rank

    def agree(self, needs_fallback: bool, veto: bool) -> bool:
        """Collective over the world: run the torch path this round?  Yes when some island needs it and
        no island saw a hivemind group reject the round (a NaN or a disagreement is never retried)."""
        t = torch.tensor([float(needs_fallback), float(veto)], dtype=torch.float32,
                         device=collective_device(self.control))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        needs, vetoed = t.cpu().tolist()
        return needs > 0 and vetoed == 0

    def average(self, local_deltas: Mapping[str, torch.Tensor], weight: float, metadata: dict, round_id: str,
                on_stage: Any = None) -> tuple[RoundResult, dict[str, torch.Tensor] | None]:
        """One round on every rank of every island (collective); same contract as
        :meth:`peers.averaging.sharded.ShardedAverager.average` (``on_stage`` is accepted and ignored)."""
        t0 = time.perf_counter()
        refusal = self.exchange.precheck(local_deltas, weight)
        participate = not refusal
        owned = self.exchange.gather(local_deltas) if participate else {}
        result, averaged = self.reduce_owned(owned, float(weight) if participate else 0.0, dict(metadata),
                                             round_id, participate)
        if not participate:
            result.ok, result.reason = False, refusal
        local = self.exchange.scatter(averaged) if result.ok and averaged is not None else None
        result.ok = local is not None
        result.seconds = time.perf_counter() - t0
        return result, local

    def reduce_owned(self, owned: Mapping[int, torch.Tensor], weight: float, metadata: dict, round_id: str,
                     participate: bool = True, buckets: Collection[int] | None = None
                     ) -> tuple[RoundResult, dict[int, torch.Tensor] | None]:
        """The cross-island step (collective over the world): average the buckets this rank owns with
        the other islands' owners.  ``owned`` is :meth:`BucketExchange.gather`'s output; an island
        that does not participate passes ``{}`` and weight 0; ``buckets`` limits the round to those
        buckets (None: all).  Returns the island-wide verdict (same
        on every rank of every island) and, when it succeeded, the averaged owned buckets."""
        t0 = time.perf_counter()
        result = RoundResult(False, backend="torch")
        me = self.island_rank
        meta = dict(metadata, round_id=round_id, weight=float(weight), participate=bool(participate))
        island_key = str(metadata.get("island_id", f"island{self.island_index}"))
        try:
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, (island_key, meta) if me == 0 else None, group=self.control)
            gathered = {k: m for item in every if item is not None for k, m in [item] if m.get("participate")}
            result.peers = sorted(gathered)
            result.gathered = gathered
            result.group_size = len(gathered)
            result.total_weight = float(sum(m["weight"] for m in gathered.values()))
            result.reason = check_group(gathered, round_id, self.min_group_size)
            if gathered:
                result.majority_peers, result.in_minority = majority_by_state(gathered, island_key)
                if not result.reason and len(result.majority_peers) < len(gathered):
                    result.reason = (f"θ_global differs between islands ({len(gathered) - len(result.majority_peers)} "
                                     f"of {len(gathered)} hold another one); the minority resynchronizes")
            if result.reason:  # every island reached the same verdict from the same data: nobody all-reduces
                result.seconds = time.perf_counter() - t0
                return result, None
            pending = []
            for b in sorted(b for b in self.exchange.owned if buckets is None or b in buckets):
                numel = self.layout.buckets[b].numel
                t = (owned[b] * weight if participate else torch.zeros(numel)).to(self.device, torch.float32)
                work = None
                if self.n_islands > 1:
                    work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._bucket_group[b], async_op=True)
                pending.append((b, t, work))
            averaged: dict[int, torch.Tensor] = {}
            nbytes = 0
            for b, t, work in pending:
                if work is not None:  # with a timeout, NCCL's wait blocks the host too (without, only the stream)
                    work.wait(self.timeout) if self.timeout is not None else work.wait()
                averaged[b] = t.cpu() / result.total_weight
                nbytes += ring_allreduce_bytes(t.numel() * 4, self.n_islands)
            finite = all(all_finite(v) for v in averaged.values())
            (island_finite,) = self.exchange.all_reduce([float(finite)])
        except Exception as e:  # a collective failed or timed out: the process group may be unusable now
            log.exception("torch fallback round failed")
            result.reason = f"torch all-reduce failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
            result.seconds = time.perf_counter() - t0
            return result, None
        result.bytes_sent = result.bytes_received = nbytes
        result.seconds = time.perf_counter() - t0
        if island_finite < 1:
            result.reason = "the averaged pseudo-gradient is not finite (an island sent NaN or Inf)"
            return result, None
        result.ok = True
        return result, averaged

