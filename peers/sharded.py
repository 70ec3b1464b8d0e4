"""Shard-wise averaging across islands: every rank of an island averages the buckets it owns.

An island is tp×pp processes.  Its pseudo-gradient is laid out canonically (see
:mod:`peers.layout`) and cut into buckets; bucket ``b`` belongs to island rank
``layout.owner_of(b, island_size)`` (round-robin), which averages it with the other islands' owners
of bucket ``b`` over hivemind: one verified :class:`~peers.averager.VerifiedAverager` per owned
bucket, with DHT prefix ``f"{prefix}_b{b}"`` (hivemind forbids dots in prefixes).  Slow-link
traffic is thus spread over the island's ranks and nothing is gathered onto rank 0.  A round of
:meth:`ShardedAverager.average`:

a. *gather* (inside the island, point-to-point): each rank sends the pieces of each bucket it
   contributes straight to the bucket's owner, which assembles the whole bucket;
b. the owners run the hivemind rounds of their buckets concurrently (one thread per bucket);
c. the island agrees (an ``all_gather_object`` of per-bucket outcomes): the round counts only if
   every bucket succeeded, with the same set of islands, otherwise *every* rank returns None, so an
   island never applies half a round;
d. *scatter* (point-to-point): owners send each rank the averaged values of the elements it holds.

Replicated shards (RMSNorm weights on every TP rank, or anything two ranks hold with the same
spec) are contributed by the lowest island rank holding them only (TP keeps replicas equal); every
holder gets the result, so replicas are re-synchronised by each round.  Partially overlapping
shards (not produced by our TP plan) are averaged over their holders (the owner divides by the
holder count).  An island whose shards leave any element uncovered is refused at construction.

Process-group requirements: ``group``'s timeout must exceed a hivemind round (matchmaking +
all-reduce + vote timeouts), since ranks that own no failing bucket wait in the island's
collectives meanwhile.  ``on_stage`` (fault injection, progress) is called from the owners' bucket
threads, once per owned bucket and stage.

With ``backend="torch"`` the cross-island step is a torch.distributed all-reduce among the owners
(:class:`peers.fallback.HierarchicalAllReduce`); with ``backend="auto"`` hivemind is tried first and
the round falls back to torch when hivemind could not form a group (never when a group formed and
rejected the result, e.g. a NaN).  Every island of the torch world takes part in that decision each
round (one small all-reduce, :meth:`HierarchicalAllReduce.agree`), and when any island needs the
fallback and none saw a rejection, *all* of them use the torch result, so they stay identical.
Hence all islands of a torch world must run ``auto`` (or all ``torch``).  This package takes plain
data only: names, shapes, specs and process groups.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import hivemind
import torch
import torch.distributed as dist

from outer_optim.codecs import LOSSY_CODECS, ErrorFeedback, make_codec
from peers.averager import (
    AveragerSettings,
    RoundResult,
    StateProvider,
    VerifiedAverager,
)
from peers.bucket_round import PendingRound, ShardedRoundResult, island_verdict
from peers.encoded import is_dense
from peers.exchange import BucketExchange, shape_of
from peers.layout import CanonicalLayout, spec_tuple

log = logging.getLogger(__name__)

BACKENDS = ("hivemind", "torch", "auto")


class ShardedAverager:
    """Cross-island averaging of one island rank's shards; build and call it on every rank alike.

    ``layout``: the run's :class:`CanonicalLayout`; ``local_tensors``: ``{name: tensor}`` (only the
    shapes are used) and ``specs``: ``{name: (dim, offset, length) or ShardSpec}`` of this rank's
    shards; ``group``: the island's process group (None for a single-process island); ``dht``: this
    rank's hivemind DHT (None with ``backend="torch"``); ``settings``: the run's averager settings
    (each owned bucket gets prefix ``f"{settings.prefix}_b{index}"``); ``fallback``: a
    :class:`peers.fallback.HierarchicalAllReduce` whose island ranks are ``group``'s (required for
    ``backend="torch"``, optional for ``"auto"``); ``state_provider_for(bucket_index)`` gives the
    state provider of an owned bucket's averager (for late joiners; wired by the trainer);
    ``exchange``: the island's :class:`BucketExchange` if the caller built one already; ``feedback``: the
    error-feedback buffers by owned bucket (see :attr:`buffers`); ``carry``: the owner feedback (see :attr:`carry`).
    Construction is collective over ``group``.
    """

    def __init__(self, layout: CanonicalLayout, local_tensors: Mapping[str, Any], specs: Mapping[str, Any],
                 group: dist.ProcessGroup | None, dht: hivemind.DHT | None, settings: AveragerSettings, *,
                 backend: str = "hivemind", fallback: Any = None,
                 state_provider_for: Callable[[int], StateProvider | None] | None = None,
                 island_id: str | None = None, device: torch.device | str | None = None,
                 exchange: BucketExchange | None = None, feedback: dict[int, torch.Tensor] | None = None,
                 carry: dict[int, torch.Tensor] | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"unknown averaging backend {backend!r}; use one of {', '.join(BACKENDS)}")
        if backend == "torch" and fallback is None:
            raise ValueError("backend 'torch' needs a HierarchicalAllReduce (fallback=...)")
        self.codec = None
        if settings.compression in LOSSY_CODECS:
            if backend == "torch":
                raise ValueError(f"compression {settings.compression!r} travels over hivemind; use backend hivemind "
                                 f"or auto")
            self.codec = make_codec(settings.compression, topk_density=settings.topk_density,
                                    topk_bits=settings.topk_bits)
        self.feedback = ErrorFeedback(self.codec, settings.error_feedback_decay) \
            if self.codec is not None and settings.error_feedback else None
        self.buffers: dict[int, torch.Tensor] = feedback if feedback is not None else {}
        """Error feedback of this rank's owned buckets (what the codec dropped, carried into the next round):
        the caller's dict, updated in place, so that it outlives this averager (checkpoints, reconnects)."""
        self.carry: dict[int, torch.Tensor] | None = None
        """With a dense codec (reduce-scatter), error feedback and ``settings.owner_feedback``: by owned bucket,
        what the re-encoding of the averaged parts this island owned left out, added to its parts next round
        (owner feedback: see :func:`peers.encoded.average_encoded`); the caller's dict ``carry``, like
        :attr:`buffers`."""
        if self.feedback is not None and settings.owner_feedback and is_dense(self.codec):
            self.carry = carry if carry is not None else {}
        if backend != "torch" and dht is None:
            raise ValueError(f"backend {backend!r} needs this rank's hivemind DHT")
        self.layout, self.settings, self.backend, self.fallback = layout, settings, backend, fallback
        problem, shared = "", False
        if fallback is not None:
            fx = fallback.exchange
            mine = {n: spec_tuple(specs[n]) for n in specs}
            shapes = {n: tuple(shape_of(t)) for n, t in local_tensors.items()}
            if fx.specs != mine or fx.local_shapes != shapes:
                problem = "the fallback was built with other shards than this averager"
            elif fallback.layout.fingerprint() != layout.fingerprint():
                problem = "the fallback uses another canonical layout"
            shared = not problem and group is fallback.island_group and device is None
        # sharing the fallback's (or the caller's) exchange of the same island skips recomputing the plan
        if exchange is not None and not shared:
            shared = exchange.group is group and exchange.layout.fingerprint() == layout.fingerprint()
            if not shared:
                raise ValueError("the exchange passed belongs to another island group or layout")
        else:
            exchange = fallback.exchange if shared else None
        self.exchange = exchange if shared else BucketExchange(layout, local_tensors, specs, group, device)
        if fallback is not None and not problem and \
                (fallback.exchange.size, fallback.exchange.rank) != (self.exchange.size, self.exchange.rank):
            problem = "the fallback's island does not match this averager's group (same ranks in the same order)"
        ident = island_id or (str(dht.peer_id) if dht is not None else uuid.uuid4().hex)
        everyone = self.exchange.all_gather_object((ident, problem))  # raise on every rank alike, never hang
        problems = [p for _, p in everyone if p]
        if problems:
            raise ValueError(problems[0])
        self.island_id = str(everyone[0][0])  # rank 0's id names the island
        self.layout_fingerprint = layout.fingerprint()
        self.averagers: dict[int, VerifiedAverager] = {}
        if backend != "torch":
            try:
                for b in self.exchange.owned:
                    bucket_settings = dataclasses.replace(settings, prefix=f"{settings.prefix}_b{b}")
                    provider = state_provider_for(b) if state_provider_for is not None else None
                    self.averagers[b] = VerifiedAverager(dht, [torch.zeros(layout.buckets[b].numel)], bucket_settings,
                                                       provider)
            except BaseException:
                self.shutdown()
                raise

    @property
    def rank(self) -> int:
        return self.exchange.rank

    @property
    def owned_buckets(self) -> list[int]:
        return list(self.exchange.owned)

    def average(self, local_deltas: Mapping[str, torch.Tensor], weight: float, metadata: dict, round_id: str,
                on_stage: Callable[[str], None] | None = None, matchmaking_timeout: float | None = None,
                buckets: Collection[int] | None = None, expected_group_size: int | None = None
                ) -> tuple[ShardedRoundResult, dict[str, torch.Tensor] | None]:
        """One round on every rank of the island (collective): returns the island's result and, only
        when the whole round succeeded, ``{name: averaged Δ}`` shaped like this rank's shards.

        ``metadata`` goes to every bucket's group (``config_fingerprint`` gets the layout fingerprint
        appended so islands with different layouts refuse each other; ``island_id`` and
        ``layout_fingerprint`` are added).  ``on_stage``, ``matchmaking_timeout`` and ``expected_group_size``
        are passed to every owned bucket's averager; ``buckets`` limits the round to those buckets (a
        Streaming DiLoCo fragment: ``local_deltas`` then needs only their parameters).  The same as
        :meth:`finish` of :meth:`start`.
        """
        return self.finish(self.start(local_deltas, weight, metadata, round_id, on_stage, matchmaking_timeout,
                                      buckets, expected_group_size))

    def start(self, local_deltas: Mapping[str, torch.Tensor], weight: float, metadata: dict, round_id: str,
              on_stage: Callable[[str], None] | None = None, matchmaking_timeout: float | None = None,
              buckets: Collection[int] | None = None, expected_group_size: int | None = None) -> PendingRound:
        """Collective: check and gather the island's Δ onto the bucket owners, then start the owned
        buckets' hivemind rounds in the background and return at once.  The island may go on training
        (its own collectives included: the background part talks to other islands only) until
        :meth:`finish`.  With ``backend="torch"`` nothing runs in the background: the torch world
        averages in lockstep, inside :meth:`finish`."""
        t0 = time.perf_counter()
        meta = dict(metadata)
        meta["config_fingerprint"] = f"{metadata.get('config_fingerprint', '')}|layout:{self.layout_fingerprint}"
        meta["layout_fingerprint"] = self.layout_fingerprint
        meta["island_id"] = self.island_id
        refusal = self.exchange.precheck(local_deltas, weight, buckets)
        owned = self.exchange.gather(local_deltas, buckets) if not refusal else {}
        mine = [b for b in self.averagers if buckets is None or b in buckets]
        pending = PendingRound(owned, float(weight), meta, round_id, refusal, t0, buckets, mine)
        if self.backend != "torch" and not refusal:
            pending.threads = self._hivemind_round(pending, on_stage, matchmaking_timeout, expected_group_size)
        return pending

    def finish(self, pending: PendingRound) -> tuple[ShardedRoundResult, dict[str, torch.Tensor] | None]:
        """Collective: wait for the round :meth:`start` began, agree on the island's verdict (falling back
        to torch where configured) and scatter the averaged values back to every rank."""
        owned, weight, meta, round_id, refusal = (pending.owned, pending.weight, pending.meta, pending.round_id,
                                                  pending.refusal)
        participate = not refusal
        t_finish = time.perf_counter()
        result = ShardedRoundResult(False, refusal)
        averaged: dict[int, torch.Tensor] | None = None
        needs_fallback = veto = False
        if self.backend != "torch":
            outcomes = pending.wait(self.settings) if participate else {}
            result, needs_fallback, veto = island_verdict(self.exchange, outcomes, refusal, self.rank,
                                                          self.settings.min_group_size, len(self.layout.buckets))
            if result.ok:
                averaged = {b: avg for b, (_, avg) in outcomes.items()}
        run_torch = False
        if self.backend == "torch":
            run_torch = True
        elif self.backend == "auto" and self.fallback is not None:
            run_torch = self.fallback.agree(needs_fallback, veto)  # collective over every island
        if run_torch:
            hm = result
            pending.carry.clear()  # the torch average re-encodes nothing: the owners' feedback stays as it was
            result, averaged = self.fallback.reduce_owned(owned, weight if participate else 0.0, meta,
                                                          round_id, participate, pending.buckets)
            if self.backend == "auto":
                result.fallback_reason = hm.reason or "another island could not form a hivemind group"
                result.buckets = hm.buckets
                result.bytes_sent += hm.bytes_sent
                result.bytes_received += hm.bytes_received
            if not participate:
                result.ok, result.reason = False, refusal
        if result.ok and averaged is not None:
            local = self.exchange.scatter(averaged, pending.buckets)
        else:
            local = None
            result.ok = False
        # a round in flight counts from its start to its last bucket's end, not the inner steps after that
        busy = min(pending.ended or t_finish, t_finish)
        result.seconds = (busy - pending.t0) + (time.perf_counter() - t_finish)
        return result, local

    def _hivemind_round(self, pending: PendingRound, on_stage: Callable[[str], None] | None,
                        matchmaking_timeout: float | None, expected_group_size: int | None
                        ) -> list[threading.Thread]:
        """Start the hivemind rounds of ``pending``'s buckets of this rank, one thread each, filling
        ``pending.outcomes[bucket]`` with ``(result, averaged)`` as they end."""
        def run(b: int) -> None:
            try:
                encoded = self._encode(pending, b) if self.codec is not None else None
                carry = None
                if self.carry is not None:
                    carry = self.carry[b] if b in self.carry else torch.zeros(self.layout.buckets[b].numel)
                res, avg = self.averagers[b].average([pending.owned[b]], pending.weight, pending.meta,
                                                     pending.round_id, on_stage, matchmaking_timeout,
                                                     expected_group_size, encoded, carry)
                if res.ok and res.carry is not None:
                    pending.carry[b] = res.carry
                pending.outcomes[b] = (res, avg[0] if avg is not None else None)
            except Exception as e:  # never let one bucket's thread take the island's round down silently
                log.exception("bucket %d: averaging raised", b)
                pending.outcomes[b] = (RoundResult(False, f"averaging raised {type(e).__name__}: {e}"), None)
            pending.ended = max(pending.ended, time.perf_counter())

        threads = [threading.Thread(target=run, args=(b,), name=f"bucket-{b}", daemon=True) for b in pending.mine]
        for t in threads:
            t.start()
        return threads

    def _encode(self, pending: PendingRound, b: int) -> bytes:
        """Encode bucket ``b`` of ``pending`` (with the error feedback carried so far), leave what the codec
        keeps of it in ``pending.owned[b]`` (what a torch fallback averages) and the new feedback buffer in
        ``pending.feedback[b]`` (installed by :meth:`commit`).  Deterministic: a round averaged again
        encodes the same bytes."""
        delta = pending.owned[b]
        if self.feedback is None:
            payload = self.codec.encode(delta)
            pending.owned[b] = self.codec.decode(payload, delta.numel())
            return payload
        carried = self.buffers.get(b) if self.settings.error_feedback_in == "buffer" else None
        payload, pending.owned[b], pending.feedback[b] = self.feedback.prepare(delta, carried)
        return payload

    def commit(self, pending: PendingRound) -> None:
        """The island committed ``pending``'s round: what the codec dropped from it goes into the next one."""
        self.buffers.update(pending.feedback)
        if self.carry is not None:
            self.carry.update(pending.carry)

    def state_fingerprint(self, local_tensors: Mapping[str, torch.Tensor], chunks_per_bucket: int = 4
                          ) -> list[float]:
        """Collective over the island: a fingerprint of ``local_tensors`` (e.g. this rank's θ_global
        shards) that is identical on every rank and on every island holding the same values, whatever
        its shape; see :meth:`BucketExchange.canonical_fingerprint`."""
        return self.exchange.canonical_fingerprint(local_tensors, chunks_per_bucket)

    def set_state_priority(self, outer_step: int) -> None:
        """Advertise the freshness of this rank's state on every owned bucket's averager."""
        for avg in self.averagers.values():
            avg.set_state_priority(outer_step)

    def download_states(self) -> Iterator[tuple[int, tuple[dict, list[torch.Tensor]] | None]]:
        """``(bucket, (metadata, tensors) or None)`` of every owned bucket, downloaded from the freshest island
        of the run that serves it (see :meth:`peers.averager.VerifiedAverager.download_state`)."""
        for b, avg in self.averagers.items():
            yield b, avg.download_state()

    def watch_rounds(self, moved_past: Callable[[str], bool], stopping: Callable[[], bool]) -> None:
        """Let every owned bucket's averager stop looking for a group once ``moved_past(round_id)`` says the
        other islands are done with the round, or ``stopping()`` that this island is leaving (see
        :attr:`peers.averager.VerifiedAverager.moved_past` and ``stopping``)."""
        for avg in self.averagers.values():
            avg.moved_past, avg.stopping = moved_past, stopping

    def shutdown(self) -> None:
        """Stop the bucket averagers (the DHT and process groups are the caller's)."""
        for avg in self.averagers.values():
            try:
                avg.shutdown()
            except Exception as e:  # keep stopping the others
                log.warning("could not stop a bucket averager: %s", e)
