"""One island's verified rounds with the other islands: a roster forms from the run's registry, an exchange moves
the bytes, every member votes on what it got, and the round counts only for a majority of the run.

The group of a round is its roster (:mod:`peers.group.roster`: one leader every island can name, one round trip
to it); the pseudo-gradient goes by an *exchange*: the island's own (:class:`peers.averaging.sharded.ShardedAverager`:
every rank averages the buckets it owns with their owners on the other islands, over :mod:`peers.wire.transport`),
or, for one tensor, :meth:`VerifiedAverager.average`'s.  Every timeout here is explicit, and each round ends with a
vote (:mod:`peers.group.vote`) in which every group member sends a fingerprint of what it received to the others.
A round counts only if the group is large enough and holds a majority of the run (the islands that committed the
round before), every member voted, and all fingerprints agree and are finite; otherwise the caller gets a failed
:class:`RoundResult` and the averaged values are thrown away.  Members whose θ_global (or the lineage of rounds it
descends from) differs from the group's majority take no part in the exchange: they resynchronize, the others go on.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import hivemind
import torch
from hivemind.utils import get_dht_time

from outer_optim.compression import make_codec
from outer_optim.tensors import all_finite
from peers.discovery.membership import MemberCheck, Membership
from peers.aggregation import bound_weights, low_median
from peers.fingerprints import (
    FINGERPRINT_CHUNKS,
    fingerprint,
    fingerprints_agree,
    majority_by_state,
)
from peers.group.missed_group import PARTS_GRACE, MissedGroups
from peers.group.roster import RosterForming, RoundView, lineage, quorum_problem, split_groups
from peers.group.vote import VoteChannel
from peers.result import RoundResult, as_float, short_error
from peers.settings import AveragerSettings, Scope
from peers.wire.encoded import (
    DirectChannel,
    EncodedChannel,
    average_encoded,
    part_owners,
)
from peers.identity import identity_of
from peers.wire.round_keys import parts_key, round_in, vote_key
from peers.wire.transport import Transport, message_limit

__all__ = ["AveragerSettings", "Exchange", "FINGERPRINT_CHUNKS", "RoundResult",
           "VerifiedAverager", "fingerprint", "fingerprints_agree", "majority_by_state"]

log = logging.getLogger(__name__)

VOTE_RTOL = 1e-5
"""Members hold the same bits (every part's owner sends its average to all, or each decodes the same bytes
in the same order), so the vote's tolerance only absorbs the fingerprint's float32 sums taken in another
order; a part left unaveraged moves a chunk's sums by far more."""


@dataclass
class Exchange:
    """What an exchange of a round's pseudo-gradient gave (see :meth:`peers.group.averager.VerifiedAverager.run_round`)."""

    fingerprint: list[float] | None
    """Of the result, in the order every member uses (None: no result)."""
    averaged: Any
    """The result, for the caller (None: none)."""
    bytes_sent: int = 0
    bytes_received: int = 0
    reason: str = ""
    """Why there is no result ('' when there is)."""
    members_left: int = 0
    """Without a result: how many members are known alive (those whose parts came, and those that declined)."""
    carry: torch.Tensor | None = None
    finite: bool = True
    parts_resent: int = 0
    """Parts sent again alone after their connection failed (the round went on)."""
    rejected: list[str] = field(default_factory=list)
    """Members (island ids) whose Δ, or a part of it, failed the member check and counted for nothing."""


def check_group(meta: dict[str, dict], round_id: str, min_group_size: int) -> str:
    """Reasons to reject a group of islands from the metadata each sent (``meta``: peer → metadata), or '':
    every member computes the same verdict from the same data."""
    if not meta:
        return "no island could send a pseudo-gradient this round"
    if len(meta) < min_group_size:
        return f"group of {len(meta)} island(s) is below --averaging.min_group_size {min_group_size}"
    rounds = {str(m.get("round_id")) for m in meta.values()}
    if rounds != {round_id}:
        return f"islands were at different rounds {sorted(rounds)}"
    if len({m.get("config_fingerprint") for m in meta.values()}) > 1:
        return "islands in the group run different model or training configs (config fingerprints differ)"
    weights = [as_float(m.get("weight")) for m in meta.values()]
    if not all(math.isfinite(w) and w >= 0 for w in weights) or not any(w > 0 for w in weights):
        return f"a peer declared an invalid weight ({weights}); weights must be token counts, some positive"
    return ""


TOKEN_CAP = 8.0
"""Under ``--averaging.weighting tokens``: a member counts with at most this many times the group's median claim of
tokens.  Islands of unequal speed under a budget of time train unequal tokens (6× apart in tests/test_round_budget.py),
so the cap is generous: it stops a claim of 1e30 from owning the average, not a liar from weighing 8 islands; a run
among strangers weighs members equally (``weighting equal``, what ``auto`` gives rounds by steps).  Under a robust
rule the cap is :data:`ROBUST_TOKEN_CAP` instead."""
ROBUST_TOKEN_CAP = 1.0
"""Under a robust ``--averaging.aggregate`` and ``weighting tokens``: a member counts with at most the group's median
claim.  The clipped rules bound a member's pull by its share of the weights (``peers.aggregation``): at 8× the
median, one liar of four holds 8/11 of them, a weighted majority that CenteredClip centres on (measured by
``diloco experiment hostile``: a claim with a flipped Δ raised the honest islands' loss 25×).  At the median,
no member counts more than the median member; honest islands that trained more tokens than the median count as if
they trained the median."""
MOVED_PAST_POLL = 1.0
ALONE_LOOKS = 3
"""Looks in a row (about a second apart) that find no other island live before a roster that is forming gives
up: one look can come back empty on a loaded machine or a slow DHT; a killed island's address refuses every
look, so giving up on it costs a few seconds, not ``matchmaking_timeout``."""
"""Seconds between two looks at whether the other islands moved past the round being matched."""


class VerifiedAverager(MissedGroups):
    """Verified rounds of one island with the other islands.

    ``template`` fixes the shapes of the tensors :meth:`average` averages (fp32, CPU; the same on every
    island of a run); an island whose exchange moves its bytes itself (:meth:`run_round`) passes none.
    ``transport``: where this island's rosters, votes and (``settings.transport`` ``direct``) parts go (one of its
    own on loopback when none is given).  ``membership``: the island's registration in the run's member registry,
    which each round's roster is formed from; without one, the averager registers itself (under ``scope.prefix``,
    with its own heartbeat) and announces each round it averages.  Call :meth:`shutdown` at the end.
    """

    def __init__(self, dht: hivemind.DHT, template: Sequence[torch.Tensor], settings: AveragerSettings,
                 scope: Scope = Scope(), transport: Transport | None = None, membership: Membership | None = None):
        self._numel = sum(t.numel() for t in template)
        self.codec = make_codec(settings.compression, topk_density=settings.topk_density,
                                topk_bits=settings.topk_bits) if self._numel else None
        """What :meth:`average` encodes with (None without a template: the caller's exchange encodes, e.g. with the
        codec ``--averaging.compression auto`` picks for the round)."""
        self.settings, self.scope = settings, scope
        self.dht = dht
        self._lock = threading.Lock()
        self.moved_past: Callable[[str], bool] | None = None
        """Whether every other island has moved past round ``round_id`` (averaged it without us, or gave
        it up): asked about once a second while this island looks for a group, which it then stops
        doing instead of waiting out ``matchmaking_timeout`` in a round nobody will join any more."""
        self.stopping: Callable[[], bool] | None = None
        """Whether this island is leaving (Ctrl-C, SIGTERM): a step still looking for a group is then
        given up at once; an exchange under way is finished."""
        self.company: Callable[[], int] | None = None
        """How many other islands are live in the run (the registry's count, less those found gone).  While none
        is and a group needs two, the island does not ask hivemind for one: its matchmaking asks the DHT for
        averagers again as soon as an answer comes back, about 150 KB/s of DHT traffic for an island alone (what
        an island that came to a finished run sent).  It looks at the registry once a second instead, and starts
        matchmaking, with the time left, once another island is live.  Asked once a second while it looks for a
        group too: once every other island is gone (all of them SIGKILLed), it stops looking instead of waiting
        out ``matchmaking_timeout``."""
        self._alone_looks: dict[str, int] = {}
        """The round whose roster is forming, and how many looks in a row found no other island (:data:`ALONE_LOOKS`)."""
        self.outvoted: list[str] = []
        """The members the last vote outvoted (the group's majority stood against their verdicts)."""
        self.attacks: dict[int, set[str]] = {}
        """Fault injection (:mod:`diloco.engine.faults`): outer step → how this member attacks that step's rounds
        (see :meth:`attack`)."""
        self.strikes: dict[str, int] = {}
        """Island id → the committed rounds whose result rejected its pseudo-gradient (see :attr:`banned`); kept with
        θ_global like :attr:`committed`."""
        self.committed: tuple[str, ...] = ()
        """The islands that committed the last round this island committed or adopted (empty: none yet): a round
        counts only for a group holding a majority of them (:func:`peers.group.roster.quorum_problem`).  Kept with
        θ_global: checkpointed, served to joiners, replaced by what they adopt."""
        members = MemberCheck(dht, scope.registry) if scope.private else None
        self.peer_id = str(dht.peer_id)
        self._votes = self._parts = self.roster = self._own_membership = None
        self._own_transport = None
        try:
            self._votes = VoteChannel(dht, scope.prefix, members, direct=scope.direct_votes,
                                      ttl=max(60.0, 4 * settings.vote_timeout), reachable=not scope.client_mode)
            if transport is None:
                transport = self._own_transport = Transport(identity_of(dht), max_message=message_limit(self._numel))
            if self._numel:
                max_bytes = self.codec.nbytes(self._numel)
                coding = settings.entropy_coding and self.codec.skewed
                if settings.transport == "p2p":
                    self._parts = EncodedChannel(dht, scope.prefix, max_bytes, members,
                                                 ttl=max(60.0, 4 * settings.allreduce_timeout), entropy_coding=coding)
                else:
                    self._parts = DirectChannel(transport, max_bytes, entropy_coding=coding)
                    self._votes.use_lanes(self._parts)
            self.endpoint = transport.endpoint
            self.transport = transport
            self.roster = RosterForming(transport, self.peer_id, settings.matchmaking_time, settings.request_timeout,
                                        target=settings.target_group_size, min_group_size=settings.min_group_size,
                                        wait_for=settings.wait_for_islands)
            if membership is None:
                membership = self._own_membership = Membership(dht, scope.prefix, island=self.peer_id)
                membership.endpoint = transport.endpoint
                membership.start_heartbeat()
            self.membership = membership
        except BaseException:
            self.shutdown()
            raise

    @property
    def parts(self) -> Any:
        """The channel this rank's parts travel by (its inbox tells of groups that listed us)."""
        return self._parts

    @parts.setter
    def parts(self, channel: Any) -> None:
        self._parts = channel
        if isinstance(channel, DirectChannel):
            self._votes.use_lanes(channel)

    def average(self, deltas: Sequence[torch.Tensor], weight: float, metadata: dict, round_id: str,
                on_stage: Callable[[str], None] | None = None, matchmaking_timeout: float | None = None,
                expected_group_size: int | None = None, encoded: bytes | None = None,
                carry: torch.Tensor | None = None) -> tuple[RoundResult, list[torch.Tensor] | None]:
        """Run one verified round averaging ``deltas`` (shaped like the template) with the group's.

        ``weight`` is this island's share (tokens processed), ``metadata`` small facts sent to every member
        (config fingerprint, ``state_fingerprint`` of θ_global, ...), ``round_id`` a label all islands of
        the round agree on (the outer step); see :meth:`run_round` for the rest.  ``encoded``: the payload
        to send (default: ``deltas`` encoded by the codec, without error feedback), and ``carry`` the error
        feedback this member keeps as the owner of averaged parts (:func:`peers.wire.encoded.average_encoded`;
        the new one comes back in the result's ``carry``).  Returns the result and, only when it succeeded,
        the weighted average of the group's deltas."""
        if not self._numel or self._parts is None:
            raise ValueError("this averager was made without a template: pass an exchange to run_round")
        if weight <= 0 or not all(all_finite(d) for d in deltas):
            return RoundResult(False, "this island's pseudo-gradient is not finite or its weight is not positive; "
                               "not sending it"), None
        flat = torch.cat([d.detach().reshape(-1).float() for d in deltas]) if len(deltas) > 1 \
            else deltas[0].detach().reshape(-1).float()
        payload = encoded if encoded is not None else self.codec.encode(flat.contiguous())
        shapes = [d.shape for d in deltas]

        def exchange(meta: dict[str, dict], peers: list[str], rid: str) -> Exchange:
            endpoints = {p: str(meta[p].get("endpoint", "")) for p in peers}
            if isinstance(self._parts, DirectChannel):
                self._parts.endpoints.update(endpoints)
            owners = part_owners(peers, endpoints, [p for p in peers if meta[p].get("unpunched")])
            groups = split_groups(peers, rid, self.settings.max_group_size)
            out = average_encoded(self._parts, self.codec, parts_key(peers, rid), self.peer_id, peers,
                                  {p: as_float(meta[p].get("weight")) for p in peers}, payload, self._numel,
                                  self.settings.allreduce_timeout, carry, owners=owners,
                                  groups=groups if len(groups) > 1 else None, rule=self.settings.aggregate,
                                  check=self.settings.member_check, outlier=self.settings.outlier_ratio)
            if out.mean is None:
                reason, left = out.failure(len(peers))
                return Exchange(None, None, out.bytes_sent, out.bytes_received, reason, left, out.carry)
            averaged = [a.view(s) for a, s in zip(out.mean.split([math.prod(s) for s in shapes]), shapes)]
            return Exchange(fingerprint(averaged), averaged, out.bytes_sent, out.bytes_received, "", 0, out.carry,
                            finite=all(all_finite(a) for a in averaged), rejected=out.rejected)

        meta = dict(metadata, endpoint=self.endpoint) if self.endpoint else metadata
        if self.transport is not None and self.transport.punch_failed():
            meta = dict(meta, unpunched=True)
        result, averaged = self.run_round(weight, meta, round_id, exchange, on_stage, matchmaking_timeout,
                                          expected_group_size)
        return result, averaged

    def run_round(self, weight: float, metadata: dict, round_id: str,
                  exchange: Callable[[dict[str, dict], list[str], str], Exchange],
                  on_stage: Callable[[str], None] | None = None, matchmaking_timeout: float | None = None,
                  expected_group_size: int | None = None) -> tuple[RoundResult, Any]:
        """One verified round: form the roster, check it, ``exchange(metadata by member, members, round_id)`` the
        pseudo-gradient among the members in the group's majority, check that they hold a majority of the run, vote
        on the fingerprint of the result.

        ``on_stage`` is called with "matchmaking", "allreduce" and "vote" as the round moves on (fault
        injection, progress); ``matchmaking_timeout`` overrides the settings' (a retry among the members left
        waits less).  ``expected_group_size``: how many islands (this one included) a leader may close the roster
        at (a retry: the members known to be left); by default it waits for every island the registry expects.
        Returns the result and, when it succeeded, what the exchange averaged."""
        t0 = time.perf_counter()
        stage = on_stage or (lambda _: None)
        started = time.monotonic()
        timeout = matchmaking_timeout or self.settings.matchmaking_timeout
        try:
            stage("matchmaking")
            alone = self._wait_for_company(started + timeout)
            if alone is not None:
                alone.seconds = time.perf_counter() - t0
                return alone, None
            view = self._round_view(round_id)
            meta = dict(metadata, round_id=round_id, weight=float(weight),
                        lineage=lineage(self.committed, self.strikes), out=sorted(view.out), seen=view.seen)
            if expected_group_size:
                self.roster.target = expected_group_size
            formed = self.roster.form(round_id, meta, view, started + timeout, lambda: self._give_up(round_id, started),
                                      lambda: self._round_view(round_id))
            self.roster.target = self.settings.target_group_size
        except Exception as e:  # the registry or the transport failed us: fail the round, never the island
            missed = self._listed_meanwhile(round_id, started)
            result = missed or RoundResult(False, f"averaging failed: {type(e).__name__}: {short_error(e)}")
            result.seconds = time.perf_counter() - t0
            return result, None
        if isinstance(formed, RoundResult) or len(formed) < self.settings.min_group_size:
            # no group: one that listed us anyway (we missed its roster) shows itself within moments, by its parts
            # or its verdicts
            failed = formed if isinstance(formed, RoundResult) else RoundResult(False, check_group(
                formed, round_id, self.settings.min_group_size), group_size=len(formed), peers=sorted(formed))
            missed = None if failed.left_behind or "stopping" in failed.reason else \
                self._listed_meanwhile(round_id, started)
            failed = missed or failed
            failed.seconds = failed.matchmaking_seconds = time.perf_counter() - t0
            return failed, None
        t1 = time.perf_counter()
        stage("allreduce")
        t_allreduce = time.perf_counter()
        gathered = {str(p): (m if isinstance(m, dict) else {}) for p, m in formed.items()}
        result = RoundResult(False, matchmaking_seconds=t1 - t0, gathered=gathered)
        if self.peer_id in self.banned:
            result.reason = (f"this island is left out of the run's rounds: the run rejected its pseudo-gradient in "
                             f"{self.strikes[self.peer_id]} committed rounds (--averaging.strikes)")
            result.seconds = time.perf_counter() - t0
            return result, None
        result.majority_peers, result.in_minority = majority_by_state(
            {p: m for p, m in gathered.items() if p not in self.banned}, self.peer_id)
        peers = result.majority_peers
        meta = self._weighed({p: gathered[p] for p in peers}, result)
        result.peers, result.group_size = peers, len(peers)
        if result.in_minority:
            result.reason = (f"θ_global differs from the group's majority ({len(peers)} of {len(gathered)} hold "
                             f"another one, or descend from other rounds); this island resynchronizes")
        else:
            if len(peers) < len(gathered):
                log.warning("round %s: %d island(s) hold another θ_global; averaging without them (they "
                            "resynchronize)", round_id, len(gathered) - len(peers))
            # the live islands the members' registries list: their median, so that one member claiming thousands
            # cannot veto every round
            seen = [int(as_float(m.get("seen"))) for m in meta.values() if as_float(m.get("seen")) >= 1]
            result.reason = check_group(meta, round_id, self.settings.min_group_size) or quorum_problem(
                peers, self.committed, {o for m in meta.values() for o in _strings(m.get("out"))},
                int(statistics.median_low(seen)) if seen else 1, self.settings.wait_for_islands)
        out = None
        if not result.reason:
            t_exchange = time.perf_counter()
            result.groups = len(split_groups(peers, round_id, self.settings.max_group_size))
            try:
                out = exchange(meta, peers, round_id)
            except Exception as e:  # a payload or a transport that breaks the exchange fails the round, as data
                log.exception("round %s: the exchange raised", round_id)
                result.reason = f"the exchange raised {type(e).__name__}: {short_error(e)}"
            result.exchange_seconds = time.perf_counter() - t_exchange
            if out is not None:
                result.bytes_sent, result.bytes_received, result.carry = out.bytes_sent, out.bytes_received, out.carry
                result.parts_resent, result.rejected = out.parts_resent, out.rejected
                if out.reason:
                    result.reason, result.members_left = out.reason, out.members_left
                    result.retryable = result.members_left >= self.settings.min_group_size
        result.allreduce_seconds = time.perf_counter() - t_allreduce
        if not result.reason and not out.finite:
            result.reason = "the averaged pseudo-gradient is not finite (a peer sent NaN or Inf)"
        t2 = time.perf_counter()
        stage("vote")
        if not result.reason:
            self.outvoted = []
            result.reason, result.voters, result.members_left = self._vote(out.fingerprint, peers, round_id)
            result.rejected = sorted({*result.rejected, *self.outvoted})
            result.retryable = (bool(result.reason) and
                                max(result.voters, result.members_left) >= self.settings.min_group_size)
        result.vote_seconds = time.perf_counter() - t2
        result.seconds = time.perf_counter() - t0
        result.ok = not result.reason
        return result, (out.averaged if result.ok else None)

    def _weighed(self, meta: dict[str, dict], result: RoundResult) -> dict[str, dict]:
        """The members' metadata with the weight each counts with in the exchange: 1 each (``weighting equal``),
        or the tokens each declared, capped at :data:`TOKEN_CAP` × the group's median claim (:data:`ROBUST_TOKEN_CAP`
        × under a robust rule) (``tokens``; ``auto``:
        tokens when the members send Δ per million tokens, their metadata's ``per_tokens``); the
        group's token count, capped so, goes to ``result.total_weight`` (what scales a Δ sent per million tokens
        back).  A declared weight is a claim nobody can check: uncapped, a member declaring 1e30 owned the
        average."""
        declared = {p: as_float(m.get("weight")) for p, m in meta.items()}
        claims = [w for w in declared.values() if math.isfinite(w) and w > 0]
        cap = (TOKEN_CAP if self.settings.aggregate == "mean" else ROBUST_TOKEN_CAP) * low_median(claims) if claims \
            else 1.0
        tokens = bound_weights(declared, "tokens", cap)
        result.total_weight = float(sum(tokens.values()))
        mode = self.settings.weighting
        if mode == "auto":  # islands that send Δ per million tokens trained unequal tokens (a budget of time)
            mode = "tokens" if any(m.get("per_tokens") for m in meta.values()) else "equal"
        counted = tokens if mode == "tokens" else bound_weights(declared, "equal", cap)
        return {p: dict(m, weight=counted[p]) for p, m in meta.items()}

    @property
    def banned(self) -> set[str]:
        """Islands left out of the run's rounds: the committed results of ``settings.strikes`` rounds rejected their
        pseudo-gradients (robust aggregation only: every member then checks every member's whole Δ, so all reach
        the same strikes)."""
        limit = self.settings.strikes
        return {i for i, n in self.strikes.items() if limit and n >= limit}

    def _round_view(self, round_id: str) -> RoundView:
        """What this island knows of the run as it enters ``round_id`` (one read of the registry; an averager that
        registered itself announces the round first)."""
        if self._own_membership is not None:
            self._own_membership.announce(round_of(round_id), averaging=True)
        # a registry that does not answer soon leaves this island alone in the round, never stuck in it
        return RoundView.of(self.membership.snapshot(round_of(round_id), timeout=self.settings.matchmaking_time),
                            self.committed).without(self.banned)

    def asked(self, round_id: str) -> dict[str, list[float] | None]:
        """The islands that asked to join ``round_id`` before this island reached it, and the digest each enters it
        with (see :meth:`peers.group.roster.RosterForming.asked`)."""
        return self.roster.asked(round_id) if self.roster is not None else {}

    def decline(self, round_id: str) -> None:
        """This island takes no part in ``round_id`` nor in its retry: islands that take it for their leader are sent
        on to the next one."""
        for rid in (round_id, f"{round_id}.retry"):
            self.roster.decline(rid)

    def _give_up(self, round_id: str, started: float) -> RoundResult | None:
        """Asked about once a second while the roster forms: a result when the wait is pointless (a group listed
        us that we missed, the island is stopping, the others moved past the round or are all gone)."""
        missed = self._missed(round_id, started, PARTS_GRACE)
        if missed is not None:
            return missed
        if self.stopping is not None and self.stopping():
            return RoundResult(False, "this island is stopping: it gave up looking for a group")
        if self.moved_past is not None and self.moved_past(round_id):
            return RoundResult(False, "the other islands moved past this round without this island (it was late for "
                               "their group)", left_behind=True)
        if self.company is None or self.settings.min_group_size < 2:
            return None
        looks = self._alone_looks.get(round_id, 0) + 1 if self._others_live() == 0 else 0
        self._alone_looks = {round_id: looks}
        if looks >= ALONE_LOOKS:
            return RoundResult(False, "no other island is live in the run: the others are gone (nothing listens at "
                               "their addresses); stopped looking for a group")
        return None

    def _wait_for_company(self, deadline: float) -> RoundResult | None:
        """Wait (looking at the registry once a second) until another island is live: None then, or at once
        when a group of one is allowed or nobody tells; else the failed result once ``deadline`` passes or
        the island is stopping, or after :data:`ALONE_LOOKS` looks when it committed its last round with others.
        See :attr:`company`."""
        if self.company is None or self.settings.min_group_size < 2:
            return None
        waited, looks = time.monotonic(), 0
        knew = [i for i in self.committed if i != self.peer_id]
        while self._others_live() == 0:
            looks += 1
            # an island that committed rounds with others is cut off from them (its DHT lost them), not early:
            # the peer node looks for them between rounds (peers.node.AloneWatch), never while a round waits here
            # (of 48 islands on 2 cores, one counted no company for the whole 300 s of matchmaking_timeout)
            if knew and looks >= ALONE_LOOKS:
                return RoundResult(False, f"no other island is live in the run as this island's registry sees it, "
                                   f"though it committed the last round with {len(knew)} other(s): cut off from "
                                   f"them; it looks for them between rounds")
            if self.stopping is not None and self.stopping():
                return RoundResult(False, "this island is stopping: it gave up waiting for another island")
            if time.monotonic() >= deadline:
                return RoundResult(False, f"no other island is live in the run: waited "
                                   f"{time.monotonic() - waited:.0f} s for one (without looking for a group)")
            time.sleep(MOVED_PAST_POLL)
        return None

    def _others_live(self) -> int:
        try:
            return self.company()
        except Exception:  # the registry cannot tell (DHT down): look for a group the usual way
            return 1

    def _vote(self, mine: list[float] | None, peers: list[str], round_id: str, key: str | None = None
              ) -> tuple[str, int, int]:
        """Send our fingerprint of the result to the group (``mine`` None: abstain, we have none) and wait
        for every member's; returns ('' if all agree, else why not; how many members voted; how many are
        left when only missing verdicts are wrong: the voters and the members alive without a result, 0 when
        unknown).  A verdict that differs from ours ends the wait at once: the round is lost whatever the
        missing members say."""
        if not self.dht.is_alive():
            return "the vote on the result could not be held: the DHT process exited", 0, 0
        key = key or vote_key(self.scope.prefix, peers, round_id)
        expiration = get_dht_time() + max(60.0, 4 * self.settings.vote_timeout)
        if mine and "lie" in self.attacks.get(round_of(round_id), ()):
            mine = _another_result(mine)
        if mine and "forge-verdicts" in self.attacks.get(round_of(round_id), ()):
            self._forge_record(key, peers, mine, expiration)
        # the members agreeing with us received the same bytes (every frame is authenticated, and a member that
        # computed the result itself, under a robust rule, from the same Δs): a member voting otherwise is wrong or
        # lying, and is outvoted (struck, under a robust rule) instead of failing the round for everyone (under
        # `mean`, one member voting anything rolled back every round of the run)
        majority = bool(mine)
        tally = self._votes.hold(key, self.peer_id, peers, list(mine or []),
                                 lambda a, b: fingerprints_agree(a, b, VOTE_RTOL), self.settings.vote_timeout,
                                 expiration, majority=majority)
        if tally.missing and not self.dht.is_alive():
            return "the vote on the result could not be held: the DHT process exited", 0, 0
        verdict = tally.verdict(len(peers), majority)
        if majority and not verdict[0] and tally.differ:
            log.warning("round %s: %d member(s) voted for another result than the majority's (%s): outvoted",
                        round_id, len(tally.differ), ", ".join(p[-8:] for p in tally.differ))
            self.outvoted = list(tally.differ)
        return verdict

    def attack(self, outer_step: int, how: str) -> None:
        """Fault injection: attack the rounds of ``outer_step``.  ``how``: ``lie``, vote for a result other than the
        one computed (``lie@vote``); ``forge-parts`` / ``forge-verdicts``, send each part / verdict once more in
        another member's name, with a payload that would harm it (``forge@send`` / ``forge@vote``: junk parts, a
        verdict for another result, and that verdict in the DHT record under the other member's name)."""
        self.attacks.setdefault(outer_step, set()).add(how)
        if how.startswith("forge") and self.transport is not None:
            self.transport.forge = self._forgery

    def _victim(self, among: Sequence[str]) -> str | None:
        """The member an attacker speaks as: the first other island of ``among``."""
        return next((p for p in sorted(among) if p != self.peer_id), None)

    def _forgery(self, key: str, payload: Any) -> tuple[str, bytes] | None:
        """What :attr:`peers.wire.transport.Transport.forge` sends in another member's name, for the attacks of the
        round ``key`` is on (None: nothing)."""
        round_id = round_in(key)
        verdict = self._votes is not None and key.startswith(self._votes.name + "/")
        how = "forge-verdicts" if verdict else "forge-parts"
        victim = self._victim(self.committed)
        if not round_id or how not in self.attacks.get(round_of(round_id), ()) or victim is None:
            return None
        if not verdict:
            return victim, b"\xff" * len(memoryview(payload).cast("B"))  # NaN as floats, junk as codes
        try:
            body = json.loads(bytes(payload))
            body["fingerprint"] = _another_result(body["fingerprint"])
        except (ValueError, KeyError, TypeError):
            return None
        return victim, json.dumps(body).encode()

    def _forge_record(self, key: str, peers: Sequence[str], mine: list[float], expiration: float) -> None:
        """``forge-verdicts``: a verdict for another result in the vote's DHT record, under another member's name
        (signed with this member's key: every DHT node refuses it)."""
        victim = self._victim(peers)
        if victim is not None and self._votes is not None:
            self._votes.store_as(key, victim, _another_result(mine), expiration)

    def shutdown(self) -> None:
        """Stop the channels and a transport of its own (the DHT is the caller's)."""
        for channel in (self._votes, self._parts, self.roster):
            if channel is not None:
                channel.close()
        if self._own_membership is not None:
            self._own_membership.leave()
        if self._own_transport is not None:
            self._own_transport.close()


def _another_result(fingerprint: Sequence[Any]) -> list[float]:
    """Fault injection: the fingerprint of a result other than ``fingerprint``'s (what a lying or forged verdict
    votes for)."""
    return [2.0 * float(x) + 1.0 for x in fingerprint]


def round_of(round_id: str) -> int:
    """The outer step of a round id (``"<step>"`` or ``"<step>.retry"``; 0 for a label without one)."""
    digits = round_id.split(".")[0]
    return int(digits) if digits.isdigit() else 0


def _strings(value: Any) -> list[str]:
    """A member's list of island ids (anything else: none; a peer's metadata is untrusted)."""
    return [str(v) for v in value] if isinstance(value, list) else []
