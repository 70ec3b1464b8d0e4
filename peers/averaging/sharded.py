"""Shard-wise averaging across islands: every rank of an island averages the buckets it owns.

An island is tp×pp processes.  Its pseudo-gradient is laid out canonically (see :mod:`peers.island.layout`) and
cut into buckets; bucket ``b`` belongs to island rank ``b mod island size`` (round-robin), which averages
it with the owners of bucket ``b`` on the other islands, straight over the ranks' transports
(:mod:`peers.wire.transport`; hivemind's p2p daemon with ``--averaging.transport p2p``).  Slow-link traffic is
thus spread over the island's ranks, nothing is gathered onto rank 0, and islands of any shape average
together.  A round of :meth:`ShardedAverager.average`:

a. *gather* (inside the island, point-to-point): each rank sends the pieces of each bucket it contributes
   straight to the bucket's owner, which assembles the whole bucket;
b. *group* (rank 0, in the background): the island's one hivemind averager forms the round's group with the
   other islands (:meth:`peers.group.averager.VerifiedAverager.run_round`; every island's metadata lists its
   ranks' peer ids and transport endpoints) and tells its other ranks;
c. *exchange* (every rank, in the background): each owned bucket is averaged with its owners on the other
   islands, by reduce-scatter or all-gather of its codec's parts (:func:`peers.wire.encoded.average_encoded`);
   each rank tells rank 0 the fingerprints of its averaged buckets (or why it has none);
d. *vote* (rank 0): the island votes with the others on the fingerprint of all the round's buckets in
   canonical order (the same list on every island, whatever its shape) and tells its ranks the verdict;
e. *verdict and scatter* (collective, :meth:`ShardedAverager.finish`): the round counts on every rank or on
   none, so an island never applies half a round; owners send each rank the averaged values it holds.

A part whose connection fails is sent again alone (:class:`peers.wire.transport.Transport`); a member lost
mid-round fails the round with the members left known (``retryable``), and they average again.  An island
rank runs one transport (threads) and rank 0 one hivemind averager process, whatever the model size.

Replicated shards (RMSNorm weights on every TP rank, or anything two ranks hold with the same spec) are
contributed by the lowest island rank holding them only (TP keeps replicas equal); every holder gets the
result, so replicas are re-synchronised by each round.  An island whose shards leave any element uncovered
is refused at construction.

Process-group requirements: ``group``'s timeout must exceed a round (matchmaking + exchange + vote
timeouts), since ranks wait in the island's collectives meanwhile.  ``on_stage`` (fault injection,
progress) is called from rank 0's round thread.

With ``backend="torch"`` the cross-island step is a torch.distributed all-reduce among the owners
(:class:`peers.averaging.fallback.HierarchicalAllReduce`); with ``backend="auto"`` hivemind is tried first and the
round falls back to torch when hivemind could not form a group (never when a group formed and rejected the
result, e.g. a NaN).  Every island of the torch world takes part in that decision each round (one small
all-reduce, :meth:`HierarchicalAllReduce.agree`), and when any island needs the fallback and none saw a
rejection, *all* of them use the torch result, so they stay identical.  Hence all islands of a torch world
must run ``auto`` (or all ``torch``).  This package takes plain data only: names, shapes, specs and process
groups.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import hivemind
import torch
import torch.distributed as dist

from outer_optim.compression import (
    AUTO,
    Codec,
    ErrorFeedback,
    choose_codec,
    is_dense,
    make_codec,
    may_drop,
)
from peers.averaging.bucket_round import (
    PendingRound,
    from_shared,
    island_verdict,
    shared_fields,
)
from peers.discovery.membership import MemberCheck, Membership
from peers.fingerprints import CHUNKS_PER_BUCKET, fingerprint
from peers.group.averager import Exchange, VerifiedAverager, round_of
from peers.group.roster import split_groups
from peers.result import RoundResult, as_float
from peers.settings import AveragerSettings, Scope, codec_backend_problem
from peers.wire.encoded import (
    DirectChannel,
    EncodedChannel,
    average_encoded,
    part_owners,
)
from peers.island.exchange import BucketExchange, shape_of
from peers.island.layout import CanonicalLayout, spec_tuple
from peers.wire.link_fit import LinkFit, explore, group_seconds
from peers.wire.round_keys import parts_key
from peers.identity import identity_of
from peers.wire.transport import Transport, TransportError, message_limit

log = logging.getLogger(__name__)

BACKENDS = ("hivemind", "torch", "auto")
BUCKET_THREADS = 4
"""Buckets one rank exchanges at once: enough to keep a link busy while another bucket is encoded."""


@dataclass
class FeedbackBuffers:
    """What a lossy codec left unsent, kept on this rank across rounds (checkpointed; cleared when the
    island adopts another island's state: it belongs to its own past)."""

    feedback: dict[int, torch.Tensor] = field(default_factory=dict)
    """Error feedback of the buckets this rank averages (a lossy codec's dropped part, see
    :class:`ShardedAverager`); kept across reconnects."""
    carry: dict[int, torch.Tensor] = field(default_factory=dict)
    """With a dense lossy codec and ``averaging.owner_feedback``: what re-encoding the averaged parts this
    rank owned left out, added to them next round (:attr:`ShardedAverager.carry`)."""

    def clear(self) -> bool:
        """Forget both; returns whether anything was kept."""
        kept = bool(self.feedback or self.carry)
        self.feedback.clear()
        self.carry.clear()
        return kept


class ShardedAverager:
    """Cross-island averaging of one island rank's shards; build and call it on every rank alike.

    ``layout``: the run's :class:`CanonicalLayout`; ``local_tensors``: ``{name: tensor}`` (only the shapes
    are used) and ``specs``: ``{name: (dim, offset, length) or ShardSpec}`` of this rank's shards; ``group``:
    the island's process group (None for a single-process island); ``dht``: this rank's hivemind DHT (None
    with ``backend="torch"``); ``settings``: the run's averager settings; ``scope``: the run's DHT prefix and
    who may take part; ``transport``: this rank's
    :class:`~peers.wire.transport.Transport` (one is made on loopback when none is given); ``fallback``: a
    :class:`peers.averaging.fallback.HierarchicalAllReduce` whose island ranks are ``group``'s (required for
    ``backend="torch"``, optional for ``"auto"``); ``exchange``: the island's :class:`BucketExchange` if the
    caller built one already; ``feedback``: the error-feedback buffers by owned bucket (see :attr:`buffers`);
    ``membership``: the island's registration in the run (rank 0 forms its rounds' rosters from it; without one
    its averager registers itself);
    ``carry``: the owner feedback (see :attr:`carry`); ``matcher``: rank 0's island averager if the caller
    started it already (it is this averager's from then on).  Construction is collective over ``group``.
    """

    def __init__(self, layout: CanonicalLayout, local_tensors: Mapping[str, Any], specs: Mapping[str, Any],
                 group: dist.ProcessGroup | None, dht: hivemind.DHT | None, settings: AveragerSettings,
                 scope: Scope = Scope(), *, backend: str = "hivemind", fallback: Any = None, transport: Transport | None = None,
                 island_id: str | None = None, device: torch.device | str | None = None,
                 exchange: BucketExchange | None = None, feedback: dict[int, torch.Tensor] | None = None,
                 carry: dict[int, torch.Tensor] | None = None, matcher: VerifiedAverager | None = None,
                 membership: Membership | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"unknown averaging backend {backend!r}; use one of {', '.join(BACKENDS)}")
        if backend == "torch" and fallback is None:
            raise ValueError("backend 'torch' needs a HierarchicalAllReduce (fallback=...)")
        if backend_problem := codec_backend_problem(settings.compression, backend):
            raise ValueError(backend_problem)
        if backend != "torch" and dht is None:
            raise ValueError(f"backend {backend!r} needs this rank's hivemind DHT")
        self.auto = settings.compression == AUTO
        """``--averaging.compression auto``: the group picks each round's codec (:meth:`_pick`)."""
        names = list(settings.auto_codecs) if self.auto else [settings.compression]
        self.codecs: dict[str, Codec] = {n: make_codec(n, topk_density=settings.topk_density,
                                                       topk_bits=settings.topk_bits) for n in names}
        """The codecs a round may travel in, by name: the one of ``settings.compression``, or ``auto``'s choices."""
        self.decay = settings.error_feedback_decay if settings.error_feedback and may_drop(settings.compression) \
            else None
        """β of the error feedback (None without one); under ``auto`` even a lossless round goes through it, which
        sends what earlier rounds dropped and empties the buffers."""
        self.link = LinkFit()
        """``auto``: this island's link as its exchanges measured it (rank 0's; published with each round)."""
        self.buffers: dict[int, torch.Tensor] = feedback if feedback is not None else {}
        """Error feedback of this rank's owned buckets (what the codec dropped, carried into the next round):
        the caller's dict, updated in place, so that it outlives this averager (checkpoints, reconnects)."""
        self._sends_nan: set[int] = set()
        """Fault injection (``nan@send``): the outer steps whose rounds this island sends NaN in."""
        self.carry: dict[int, torch.Tensor] | None = None
        """With a dense lossy codec (reduce-scatter), error feedback and ``settings.owner_feedback``: by owned
        bucket, what the re-encoding of the averaged parts this island owned left out, added to its parts next
        round (owner feedback: see :func:`peers.wire.encoded.average_encoded`); the caller's dict ``carry``, like
        :attr:`buffers`."""
        fixed = next(iter(self.codecs.values()))
        if self.decay is not None and settings.owner_feedback and not self.auto and is_dense(fixed) and fixed.lossy:
            self.carry = carry if carry is not None else {}
        self.layout, self.settings, self.backend, self.fallback = layout, settings, backend, fallback
        self._committed: tuple[str, ...] = ()
        self._strikes: dict[str, int] = {}
        self.drop: Callable[[int], bool] | None = None
        """Tests: buckets whose parts this rank does not send (a member lost in the middle of a bucket)."""
        self.exchange = self._island_exchange(local_tensors, specs, group, device, exchange)
        self.layout_fingerprint = layout.fingerprint()
        self._own_transport = None
        self.transport = transport
        if transport is None and backend != "torch":
            self.transport = self._own_transport = Transport(
                identity_of(dht), max_message=message_limit(max((b.numel for b in layout.buckets), default=1)))
        self.peer_id = str(dht.peer_id) if dht is not None else uuid.uuid4().hex
        me = (self.peer_id, self.transport.endpoint if self.transport is not None else "")
        ident = island_id or me[0]
        everyone = self.exchange.all_gather_object((ident, me))
        self.island_id = str(everyone[0][0])  # rank 0's id names the island
        self.ranks: list[list[str]] = [list(e[1]) for e in everyone]
        """Every rank of this island: [peer id, transport endpoint], by island rank."""
        self.channel: Any = None
        self.matcher: VerifiedAverager | None = matcher
        if backend != "torch":
            try:
                numel = max((b.numel for b in layout.buckets), default=1)
                largest = max(c.nbytes(numel) for c in self.codecs.values())
                coding = settings.entropy_coding and fixed.skewed
                if settings.transport == "p2p":
                    members = MemberCheck(dht, scope.registry) if scope.private else None
                    self.channel = EncodedChannel(dht, scope.prefix, largest, members,
                                                  ttl=max(60.0, 4 * settings.allreduce_timeout), entropy_coding=coding)
                else:
                    self.channel = DirectChannel(self.transport, largest, entropy_coding=coding)
                if self.rank == 0:
                    self.matcher = self.matcher or VerifiedAverager(dht, [], settings, scope, self.transport,
                                                                    membership)
                    self.matcher.parts = self.channel  # parts of a group that listed us arrive here
            except BaseException:
                self.shutdown()
                raise

    def _island_exchange(self, local_tensors: Mapping[str, Any], specs: Mapping[str, Any],
                         group: dist.ProcessGroup | None, device: Any, exchange: BucketExchange | None
                         ) -> BucketExchange:
        """The island's :class:`BucketExchange`: the fallback's or the caller's when they are this island's
        (skips recomputing the plan), else a new one; refuses on every rank alike a fallback of other shards."""
        fallback, problem = self.fallback, ""
        shared = False
        if fallback is not None:
            fx = fallback.exchange
            mine = {n: spec_tuple(specs[n]) for n in specs}
            shapes = {n: tuple(shape_of(t)) for n, t in local_tensors.items()}
            if fx.specs != mine or fx.local_shapes != shapes:
                problem = "the fallback was built with other shards than this averager"
            elif fallback.layout.fingerprint() != self.layout.fingerprint():
                problem = "the fallback uses another canonical layout"
            shared = not problem and group is fallback.island_group and device is None
        if exchange is not None and not shared:
            if not (exchange.group is group and exchange.layout.fingerprint() == self.layout.fingerprint()):
                raise ValueError("the exchange passed belongs to another island group or layout")
            ex = exchange
        elif shared:
            ex = fallback.exchange
        else:
            ex = BucketExchange(self.layout, local_tensors, specs, group, device)
        if fallback is not None and not problem and (fallback.exchange.size, fallback.exchange.rank) != (ex.size, ex.rank):
            problem = "the fallback's island does not match this averager's group (same ranks in the same order)"
        problems = [p for p in ex.all_gather_object(problem) if p]  # raise on every rank alike, never hang
        if problems:
            raise ValueError(problems[0])
        return ex

    @property
    def rank(self) -> int:
        return self.exchange.rank

    @property
    def owned_buckets(self) -> list[int]:
        return list(self.exchange.owned)

    # -------------------------------------------------------------------------------------- a round
    def average(self, local_deltas: Mapping[str, torch.Tensor], weight: float, metadata: dict, round_id: str,
                on_stage: Callable[[str], None] | None = None, matchmaking_timeout: float | None = None,
                buckets: Collection[int] | None = None, expected_group_size: int | None = None
                ) -> tuple[RoundResult, dict[str, torch.Tensor] | None]:
        """One round on every rank of the island (collective): returns the island's result and, only when
        the whole round succeeded, ``{name: averaged Δ}`` shaped like this rank's shards.

        ``metadata`` goes to the group (``config_fingerprint`` gets the layout fingerprint appended so islands
        with different layouts refuse each other; ``island_id``, ``layout_fingerprint`` and the island's
        ranks are added).  ``on_stage``, ``matchmaking_timeout`` and ``expected_group_size`` go to the round
        (see :meth:`peers.group.averager.VerifiedAverager.run_round`); ``buckets`` limits the round to those buckets
        (a Streaming DiLoCo fragment: ``local_deltas`` then needs only their parameters).  The same as
        :meth:`finish` of :meth:`start`."""
        return self.finish(self.start(local_deltas, weight, metadata, round_id, on_stage, matchmaking_timeout,
                                      buckets, expected_group_size))

    def start(self, local_deltas: Mapping[str, torch.Tensor], weight: float, metadata: dict, round_id: str,
              on_stage: Callable[[str], None] | None = None, matchmaking_timeout: float | None = None,
              buckets: Collection[int] | None = None, expected_group_size: int | None = None) -> PendingRound:
        """Collective: check and gather the island's Δ onto the bucket owners, then start this rank's part of
        the round in the background and return at once.  The island may go on training (its own collectives
        included: the background part talks to other islands and, over the transports, to the island's other
        ranks only) until :meth:`finish`.  With ``backend="torch"`` nothing runs in the background: the torch
        world averages in lockstep, inside :meth:`finish`."""
        t0 = time.perf_counter()
        meta = dict(metadata)
        meta["config_fingerprint"] = f"{metadata.get('config_fingerprint', '')}|layout:{self.layout_fingerprint}"
        meta["layout_fingerprint"] = self.layout_fingerprint
        meta["island_id"] = self.island_id
        meta["ranks"] = self.ranks
        if self.transport is not None and self.transport.punch_failed():
            meta["unpunched"] = True  # as rank 0 finds it: the island's ranks sit behind the same NAT
        if self.auto and self.rank == 0:
            meta["link"] = self.link.published()
        refusal = self.exchange.precheck(local_deltas, weight, buckets)
        owned = self.exchange.gather(local_deltas, buckets) if not refusal else {}
        mine = [b for b in self.exchange.owned if buckets is None or b in buckets]
        pending = PendingRound(owned, float(weight), meta, round_id, refusal, t0, buckets, mine,
                               codec="" if self.auto else self.settings.compression)
        if self.backend != "torch" and not refusal:
            pending.thread = threading.Thread(target=self._run, args=(pending, on_stage, matchmaking_timeout,
                                                                      expected_group_size),
                                              name=f"round-{round_id}", daemon=True)
            pending.thread.start()
        return pending

    def finish(self, pending: PendingRound) -> tuple[RoundResult, dict[str, torch.Tensor] | None]:
        """Collective: wait for the round :meth:`start` began, agree on the island's verdict (falling back
        to torch where configured) and scatter the averaged values back to every rank."""
        participate = not pending.refusal
        t_finish = time.perf_counter()
        result = RoundResult(False, pending.refusal)
        averaged: dict[int, torch.Tensor] | None = None
        needs_fallback = veto = False
        if self.backend != "torch":
            if participate:
                pending.wait(self.settings)
            result, needs_fallback, veto = island_verdict(self.exchange, pending, self.settings.min_group_size)
            if result.ok:
                averaged = pending.averaged
        run_torch = False
        if self.backend == "torch":
            run_torch = True
        elif self.backend == "auto" and self.fallback is not None:
            run_torch = self.fallback.agree(needs_fallback, veto)  # collective over every island
        if run_torch:
            hm = result
            pending.carry.clear()  # the torch average re-encodes nothing: the owners' feedback stays as it was
            result, averaged = self.fallback.reduce_owned(pending.owned, pending.weight if participate else 0.0,
                                                          pending.meta, pending.round_id, participate,
                                                          pending.buckets)
            if self.backend == "auto":
                result.fallback_reason = hm.reason or "another island could not form a hivemind group"
                result.bytes_sent += hm.bytes_sent
                result.bytes_received += hm.bytes_received
            if not participate:
                result.ok, result.reason = False, pending.refusal
        if result.ok and averaged is not None:
            local = self.exchange.scatter(averaged, pending.buckets)
        else:
            local = None
            result.ok = False
        # a round in flight counts from its start to its end, not the inner steps after that
        busy = min(pending.ended or t_finish, t_finish)
        result.seconds = (busy - pending.t0) + (time.perf_counter() - t_finish)
        return result, local

    # ------------------------------------------------------------------------ the background part
    def _run(self, pending: PendingRound, on_stage: Callable[[str], None] | None,
             matchmaking_timeout: float | None, expected_group_size: int | None) -> None:
        try:
            if self.rank == 0:
                self._lead(pending, on_stage, matchmaking_timeout, expected_group_size)
            else:
                self._follow(pending)
        except Exception as e:  # never let the thread take the island's round down silently
            log.exception("the round's background part raised")
            pending.result = RoundResult(False, f"averaging raised {type(e).__name__}: {e}")
            pending.averaged = {}
        pending.ended = time.perf_counter()

    def _key(self, kind: str, round_id: str) -> str:
        return f"{self.island_id}.{kind}.{round_id}"

    def _lead(self, pending: PendingRound, on_stage: Callable[[str], None] | None,
              matchmaking_timeout: float | None, expected_group_size: int | None) -> None:
        """Rank 0: form the group, have every rank exchange its buckets, vote, tell the ranks the verdict."""
        rid = pending.round_id
        told = []

        def exchange(meta: dict[str, dict], peers: list[str], round_id: str) -> Exchange:
            group = {p: {"ranks": meta[p].get("ranks"), "weight": meta[p].get("weight"),
                         "unpunched": bool(meta[p].get("unpunched"))} for p in peers}
            if self.auto:
                pending.codec = self._pick(meta, peers, pending.buckets)
            self._tell_ranks("group", round_id, {"peers": peers, "group": group, "codec": pending.codec})
            told.append(True)
            mine = self._exchange_buckets(pending, group, peers, round_id)
            reports = [mine] + self._hear_ranks(round_id, time.monotonic() + self.settings.allreduce_timeout + 10.0)
            return self._combine(reports, pending)

        result, _ = self.matcher.run_round(pending.weight, pending.meta, rid, exchange, on_stage,
                                           matchmaking_timeout, expected_group_size)
        self._last = (result.matchmaking_seconds, result.exchange_seconds, result.vote_seconds, result.seconds)
        if not told:  # no exchange: the ranks waiting for the group learn there is none
            self._tell_ranks("group", rid, {"none": True})
        result.codec = pending.codec if told else ""
        if self.auto and result.ok:
            self.link.add(result.bytes_sent, result.exchange_seconds)
        self._tell_ranks("verdict", rid, shared_fields(result))
        pending.result = result
        if not result.ok:
            pending.averaged = {}
            if not told:
                self._decline_parts_of(rid)

    def _follow(self, pending: PendingRound) -> None:
        """A rank but 0: wait for the group rank 0 formed, exchange this rank's buckets, report, learn the
        verdict."""
        rid, s = pending.round_id, self.settings
        deadline = time.monotonic() + s.matchmaking_timeout + s.allreduce_timeout + s.vote_timeout + 30.0
        box = self.transport.box
        group_key, verdict_key = self._key("group", rid), self._key("verdict", rid)
        leader = self.ranks[0][0]
        seen = box.wait_for(group_key, lambda m: leader in m, deadline)
        told = json.loads(bytes(seen[leader])) if leader in seen else {"none": True}
        exchanged = not told.get("none")
        if exchanged:
            pending.codec = str(told.get("codec", pending.codec))
            report = self._exchange_buckets(pending, told["group"], told["peers"], rid)
            self._send_to(0, self._key("done", rid), report)
        verdict = box.wait_for(verdict_key, lambda m: leader in m, deadline)
        box.release(group_key, drop=True)
        box.release(verdict_key, drop=True)
        if leader not in verdict:
            pending.result = RoundResult(False, "this rank never heard the island's verdict on the round")
            return
        pending.result = from_shared(json.loads(bytes(verdict[leader])))
        if not pending.result.ok:
            pending.averaged = {}
            if not exchanged:
                self._decline_parts_of(rid)

    def _exchange_buckets(self, pending: PendingRound, group: dict[str, dict], peers: list[str], round_id: str
                          ) -> dict[str, Any]:
        """Average this rank's buckets of the round with their owners on the group's islands (``group``:
        each island's ranks and weight).  Fills ``pending`` (averages, feedback, bytes) and returns this
        rank's report to rank 0: the fingerprints of its averaged buckets, or why it has none."""
        t0 = time.perf_counter()
        codec = self.codecs[pending.codec]
        self.channel.entropy_coding = self.settings.entropy_coding and codec.skewed
        endpoints = {str(peer): str(endpoint) for p in peers for peer, endpoint in group[p]["ranks"]}
        unpunched = [str(peer) for p in peers if group[p].get("unpunched") for peer, _ in group[p]["ranks"]]
        if isinstance(self.channel, DirectChannel):
            self.channel.endpoints.update(endpoints)
            self.transport.reach(list(endpoints.values()))
        weights = {p: as_float(group[p]["weight"]) for p in peers}
        # a roster larger than max_group_size averages in groups, then across: the same groups on every member
        islands = split_groups(peers, round_id, self.settings.max_group_size)
        resent_before = self.transport.stats.resent if self.transport is not None else 0
        # one process holding the whole model: the averages land in one buffer in the layout's order, which
        # the island's scatter hands out as views of its parameters (no copy)
        flat = torch.empty(self.layout.total_numel) if self.exchange.whole else None

        def one(b: int) -> tuple[int, Any]:
            owners = {self._owner(group[p]["ranks"], b): weights[p] for p in peers}
            members = sorted(owners)
            groups = [[self._owner(group[p]["ranks"], b) for p in g] for g in islands] if len(islands) > 1 else None
            payload = self._encode(pending, b)
            if self.drop is not None and self.drop(b):
                return b, None
            carry = None
            if self.carry is not None:
                carry = self.carry[b] if b in self.carry else torch.zeros(self.layout.buckets[b].numel)
            bucket = self.layout.buckets[b]
            out = average_encoded(self.channel, codec, f"b{b}." + parts_key(members, round_id),
                                  self.peer_id, members, owners, payload, bucket.numel,
                                  self.settings.allreduce_timeout, carry,
                                  flat[bucket.start:bucket.end] if flat is not None else None,
                                  pending.owned[b] if codec.lossy else None,
                                  part_owners(members, endpoints, unpunched), groups, self.settings.aggregate,
                                  self.settings.member_check, self.settings.outlier_ratio)
            return b, out

        prints: dict[int, list[float]] = {}
        failures: list[tuple[int, str, int]] = []
        rejected: set[str] = set()
        island_of = {str(peer): p for p in peers for peer, _ in group[p]["ranks"]}
        finite = True
        with ThreadPoolExecutor(max_workers=max(1, min(BUCKET_THREADS, len(pending.mine)))) as pool:
            for b, out in pool.map(one, pending.mine):
                if out is None:
                    failures.append((b, "this island dropped the bucket (injected)", 0))
                    continue
                pending.bytes_sent += out.bytes_sent
                pending.bytes_received += out.bytes_received
                if out.mean is None:
                    reason, left = out.failure(len(peers))
                    failures.append((b, reason, left))
                    continue
                rejected |= {island_of.get(r, r) for r in out.rejected}
                if out.carry is not None:
                    pending.carry[b] = out.carry
                pending.averaged[b] = out.mean
                prints[b] = fingerprint([out.mean], CHUNKS_PER_BUCKET)
                finite = finite and all(math.isfinite(x) for x in prints[b])
        resent = (self.transport.stats.resent - resent_before) if self.transport is not None else 0
        pending.parts_resent += resent
        return {"prints": {str(b): v for b, v in prints.items()}, "failures": failures, "finite": finite,
                "rejected": sorted(rejected),
                "sent": pending.bytes_sent, "received": pending.bytes_received, "resent": resent,
                "seconds": time.perf_counter() - t0}

    def _combine(self, reports: list[dict[str, Any] | None], pending: PendingRound) -> Exchange:
        """Rank 0: the island's outcome of the exchange from every rank's report (None: a rank never reported)."""
        missing = [r for r, rep in enumerate(reports) if rep is None]
        sent = sum(rep["sent"] for rep in reports if rep is not None)
        received = sum(rep["received"] for rep in reports if rep is not None)
        resent = sum(rep["resent"] for rep in reports if rep is not None)
        if missing:
            return Exchange(None, None, sent, received, f"rank(s) {missing} of this island did not finish their "
                            f"buckets in time", 0, parts_resent=resent)
        failures = [tuple(f) for rep in reports for f in rep["failures"]]  # the other ranks' came as JSON lists
        if failures:
            b, reason, _ = min(failures)
            lefts = [left for _, _, left in failures]
            more = f" ({len(failures)} buckets failed)" if len(failures) > 1 else ""
            name = f"bucket {b}: " if len(self.layout.buckets) > 1 else ""
            return Exchange(None, None, sent, received, f"{name}{reason}{more}", min(lefts) if all(lefts) else 0,
                            parts_resent=resent)
        prints = {int(b): v for rep in reports for b, v in rep["prints"].items()}
        ordered = [x for b in sorted(prints) for x in prints[b]]
        return Exchange(ordered, None, sent, received, "", 0, None, finite=all(rep["finite"] for rep in reports),
                        parts_resent=resent, rejected=sorted({r for rep in reports for r in rep["rejected"]}))

    @staticmethod
    def _owner(ranks: list[list[str]], b: int) -> str:
        """The peer id of the rank that owns bucket ``b`` in an island whose ranks are ``ranks``."""
        return str(ranks[b % len(ranks)][0])

    def _encode(self, pending: PendingRound, b: int) -> Any:
        """Encode bucket ``b`` of ``pending`` (with the error feedback carried so far), leave what the codec
        keeps of it in ``pending.owned[b]`` (what a torch fallback averages) and the new feedback buffer in
        ``pending.feedback[b]`` (installed by :meth:`commit`).  Deterministic: a round averaged again encodes
        the same bytes."""
        delta, codec = pending.owned[b], self.codecs[pending.codec]
        if round_of(pending.round_id) in self._sends_nan:  # all bits set: NaN to every codec, past its own checks
            return memoryview(b"\xff" * memoryview(codec.encode(torch.zeros_like(delta))).nbytes)
        if self.decay is None:
            payload = codec.encode(delta)
            if codec.lossy:
                pending.owned[b] = codec.decode(payload, delta.numel())
            return payload
        carried = self.buffers.get(b) if self.settings.error_feedback_in == "buffer" else None
        payload, pending.owned[b], pending.feedback[b] = ErrorFeedback(codec, self.decay).prepare(delta, carried)
        return payload

    def _pick(self, meta: dict[str, dict], peers: list[str], buckets: Collection[int] | None) -> str:
        """``auto``: the codec of the round whose group is ``peers`` (their metadata ``meta``), from the links and
        budgets they published (:func:`outer_optim.compression.choose_codec`): the same on every member."""
        def told(p: str, key: str) -> Any:
            m = meta[p].get(key)
            return m if isinstance(m, dict) else {} if key == "link" else as_float(m)

        links = [told(p, "link") for p in peers]
        budget = min((b for b in (told(p, "hide_seconds") for p in peers) if b == b), default=float("nan"))
        numels = [self.layout.buckets[b].numel for b in (buckets if buckets is not None
                                                         else range(len(self.layout.buckets)))]
        return choose_codec(self.codecs, numels, len(peers), lambda sent: group_seconds(links, sent), budget,
                            explore=explore(links))

    # ------------------------------------------------------------------------- inside the island
    def _tell_ranks(self, kind: str, round_id: str, message: dict) -> None:
        """Rank 0: send ``message`` to every other rank of the island (over the transports)."""
        body = json.dumps(message).encode()
        deadline = time.monotonic() + self.settings.vote_timeout + 10.0
        for r in range(1, len(self.ranks)):
            self._send_to(r, self._key(kind, round_id), body, deadline)

    def _send_to(self, rank: int, key: str, message: dict | bytes, deadline: float | None = None) -> None:
        body = message if isinstance(message, bytes) else json.dumps(message).encode()
        try:
            self.transport.send(self.ranks[rank][1], key, body,
                                deadline or time.monotonic() + self.settings.vote_timeout + 10.0)
        except TransportError as e:
            log.warning("could not reach rank %d of this island: %s", rank, e)

    def _hear_ranks(self, round_id: str, deadline: float) -> list[dict | None]:
        """Rank 0: every other rank's report on the round (None for a rank that sent none by ``deadline``)."""
        key = self._key("done", round_id)
        others = [peer for peer, _ in self.ranks[1:]]
        got = self.transport.box.wait_for(key, lambda m: all(p in m for p in others), deadline) if others else {}
        self.transport.box.release(key, drop=True)
        return [json.loads(bytes(got[p])) if p in got else None for p in others]

    def _decline_parts_of(self, round_id: str) -> None:
        """This island averages no group on ``round_id``: decline the parts of it that reached this rank (from a
        group that listed the island anyway), so that their senders stop waiting for ours."""
        box = self.channel.box if self.channel is not None else None
        if box is None:
            return
        for key in box.keys_on_round(round_id):  # only parts keys end with their round
            peers = box.group(key, self.peer_id)
            self.channel.decline(key, [p for p in peers if p != self.peer_id], self.settings.request_timeout + 5.0)

    # ---------------------------------------------------------------------------------- the rest
    def commit(self, pending: PendingRound) -> None:
        """The island committed ``pending``'s round: what the codec dropped from it goes into the next one, and the
        round's members are the run's committed roster."""
        self.buffers.update(pending.feedback)
        if self.carry is not None:
            self.carry.update(pending.carry)
        if pending.result is not None and pending.result.peers:  # every rank learned the round's members
            self.committed = pending.result.peers
            # strikes need evidence every member saw alike: every member checked every member's whole Δ
            if self.settings.aggregate != "mean" and self.settings.strikes and pending.result.rejected:
                strikes = dict(self._strikes)
                for island in pending.result.rejected:
                    strikes[island] = strikes.get(island, 0) + 1
                    log.warning("island %s gets a strike (%d of %d): the round rejected its pseudo-gradient",
                                island[-8:], strikes[island], self.settings.strikes)
                self.strikes = strikes

    def state_fingerprint(self, local_tensors: Mapping[str, torch.Tensor], chunks_per_bucket: int = 4
                          ) -> list[float]:
        """Collective over the island: a fingerprint of ``local_tensors`` (e.g. this rank's θ_global
        shards) that is identical on every rank and on every island holding the same values, whatever
        its shape; see :meth:`BucketExchange.canonical_fingerprint`."""
        return self.exchange.canonical_fingerprint(local_tensors, chunks_per_bucket)

    def watch_rounds(self, moved_past: Callable[[str], bool], stopping: Callable[[], bool],
                     company: Callable[[], int] | None = None) -> None:
        """Let the island's group formation stop once ``moved_past(round_id)`` says the other islands are done
        with the round, or ``stopping()`` that this island is leaving, and wait without forming a group while
        ``company()`` counts no other live island (see :attr:`peers.group.averager.VerifiedAverager.moved_past`,
        ``stopping`` and ``company``)."""
        if self.matcher is not None:
            self.matcher.moved_past, self.matcher.stopping = moved_past, stopping
            self.matcher.company = company

    def attack(self, outer_step: int, how: str) -> None:
        """Fault injection: this island attacks the rounds of ``outer_step``: ``nan``, every rank sends NaN parts;
        else see :meth:`peers.group.averager.VerifiedAverager.attack` (rank 0 votes, and its parts are the ones
        forged)."""
        if how == "nan":
            self._sends_nan.add(outer_step)
        elif self.matcher is not None:
            self.matcher.attack(outer_step, how)

    def asked(self, round_id: str) -> dict[str, list[float] | None]:
        """The islands that asked this island to join ``round_id`` before it reached it, and the digest each enters it
        with (rank 0; none elsewhere)."""
        return self.matcher.asked(round_id) if self.matcher is not None else {}

    def decline(self, round_id: str) -> None:
        """The island takes no part in ``round_id`` (it leaves the round out, or is behind the run): islands that took
        it for the round's leader are sent on (rank 0; nothing elsewhere)."""
        if self.matcher is not None:
            self.matcher.decline(round_id)

    @property
    def committed(self) -> list[str]:
        """The run's committed roster as this island holds it (every rank alike): the islands that committed the
        last round it committed or adopted (see :attr:`peers.group.averager.VerifiedAverager.committed`)."""
        return list(self._committed)

    @committed.setter
    def committed(self, islands: Collection[str]) -> None:
        self._committed = tuple(sorted(str(i) for i in islands))
        if self.matcher is not None:
            self.matcher.committed = self._committed

    @property
    def strikes(self) -> dict[str, int]:
        """The strikes the run holds against members (island id → rounds whose committed result rejected its Δ),
        as this island holds them, every rank alike (see :attr:`peers.group.averager.VerifiedAverager.strikes`)."""
        return dict(self._strikes)

    @strikes.setter
    def strikes(self, strikes: Mapping[str, int]) -> None:
        self._strikes = {str(i): int(n) for i, n in strikes.items()}
        if self.matcher is not None:
            self.matcher.strikes = dict(self._strikes)

    def shutdown(self) -> None:
        """Stop the island's averager and the channel (the DHT, transport and process groups are the caller's,
        but a transport this averager made)."""
        for part in (self.matcher, self.channel):
            if part is None:
                continue
            try:
                (part.shutdown if hasattr(part, "shutdown") else part.close)()
            except Exception as e:  # keep stopping the others
                log.warning("could not stop the averager: %s", e)
        if self._own_transport is not None:
            self._own_transport.close()

