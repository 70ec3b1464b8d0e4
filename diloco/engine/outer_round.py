"""The outer round as one transaction (as torchft's DiLoCo sync), begun and ended apart
(:func:`begin_round` sends, :func:`end_round` applies) so that it can be in flight while the island
trains on (:mod:`diloco.engine.overlap`):

pseudo-gradient → average with the group → validate (the averager's vote and finiteness checks, the
norm guard, a θ_global that stays finite) → commit the outer step, or roll back.  A group that lost a
member mid-round averages the same pseudo-gradients once more among the members left (the retry is a
round of its own in the DHT) before anyone rolls back.  Rolling back means
θ_global stays as it was and the island keeps training from its own parameters, so the next round
carries the pseudo-gradient of both rounds.  Catching up with a run that moved on happens before the
round (:meth:`diloco.engine.island.Island.outer_round`); an island whose θ_global the others outvote leaves
the round out and takes their result; fault injection and membership announcements hang off the
round as :class:`RoundHook` objects; what the round did is one :class:`RoundMetrics`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from diloco.engine.faults import FaultPlan
from diloco.engine.overlap import InFlight
from diloco.engine.peer_node import count_bytes, remember_peers, round_id

if TYPE_CHECKING:
    from diloco.engine.island import Island

log = logging.getLogger("diloco")
CAUGHT_UP = "caught-up"
"""The averaging backend of a round this island did not average: it took the run's state from a peer."""

Delta = dict[str, torch.Tensor]
"""A pseudo-gradient: parameter name → this rank's shard of Δ = θ_global − θ_local."""


@dataclass
class RoundMetrics:
    """What one outer round did (one record of ``metrics.jsonl``; byte counts are the island's totals)."""

    round_ok: int
    num_peers: int
    pseudo_grad_norm: float
    averaged_pseudo_grad_norm: float
    allreduce_seconds: float
    bytes_sent: int
    bytes_received: int
    payload_bytes_sent: int
    outer_lr: float
    round_failure: str
    averaging_backend: str
    used_fallback: int
    retried: int = 0
    """1 when the group lost a member mid-round and the members left averaged again among themselves."""
    overlap_seconds: float = 0.0
    """Seconds of the round's communication hidden under inner steps (0 for a blocking round)."""
    stall_seconds: float = 0.0
    """Seconds the island did not train because of this round (sending, waiting for it, applying it)."""
    send_seconds: float = 0.0
    """Of :attr:`stall_seconds`, those spent sending the round (the rest: waiting for its result, applying it)."""
    fragment: int = 0
    """The Streaming DiLoCo fragment the round averaged (0 with one fragment)."""
    inner_steps: int = 0
    """Inner steps this island trained for the round (H, or what fit in a ``--diloco.sync_every`` budget)."""
    weight: float = 0.0
    """Tokens this island's pseudo-gradient stands for (its weight in the average)."""
    group_weight: float = 0.0
    """Tokens of the whole group (the sum of the members' weights)."""
    unsent_norm: float = float("nan")
    """Norm of what a lossy codec has left unsent of this island's pseudo-gradients after the round (the
    error feedback e; NaN without one)."""

    @classmethod
    def skipped(cls, island: Island, reason: str) -> RoundMetrics:
        """A round this island did not take part in (it caught up with the run instead)."""
        s = island.stats
        return cls(0, 0, float("nan"), float("nan"), 0.0, s.bytes_sent, s.bytes_received, s.payload_bytes_sent,
                   island.outer.lr, reason, CAUGHT_UP, 0)

    def record(self) -> dict[str, Any]:
        """The metrics as a flat record."""
        return asdict(self)

    def progress_line(self, outer_step: int, outer_steps: int, loss: float) -> str:
        """``round 3/10 ok peers=2 loss=1.234`` (and the path, when it is not plain hivemind)."""
        status = "ok" if self.round_ok else f"FAILED ({self.round_failure})"
        if self.averaging_backend == CAUGHT_UP:
            status = f"left out ({self.round_failure})"
        via = f" via={self.averaging_backend}" if self.averaging_backend in ("torch", "auto") else ""
        return f"round {outer_step}/{outer_steps} {status} peers={self.num_peers} loss={loss:.3f}{via}"


class RoundHook:
    """Something that happens around a round without being part of the transaction (no-op defaults)."""

    def before(self, island: Island, rnd: int) -> None:
        """Before the round starts (θ_global as it enters the round is not taken yet)."""

    def starting(self, island: Island, rnd: int, state: list[float]) -> None:
        """The island enters round ``rnd`` from the θ_global whose fingerprint is ``state``."""

    def outgoing(self, rnd: int, delta: Delta) -> Delta:
        """The pseudo-gradient about to be sent (a hook may replace it)."""
        return delta

    def stage(self, rnd: int, phase: str) -> None:
        """The averager entered ``phase`` (matchmaking, allreduce, vote)."""

    def after(self, island: Island) -> None:
        """After the round was committed or rolled back."""


class FaultHook(RoundHook):
    """Scripted faults (``DILOCO_FAULTS``): drifted θ_global, rogue Δ, kills and stalls in a phase.
    Hooks see the 0-based outer step; faults, like every message, count rounds from 1."""

    def __init__(self, plan: FaultPlan):
        self.plan = plan

    def before(self, island: Island, rnd: int) -> None:
        if self.plan.has("late", "send", rnd + 1):
            time.sleep(island.cfg.averaging.matchmaking_time + 3.0)
        if self.plan.has("drift", "theta", rnd + 1):
            with island.state_lock, torch.no_grad():
                for m in island.outer.master.values():
                    m.add_(1e-3)

    def outgoing(self, rnd: int, delta: Delta) -> Delta:
        if self.plan.has("scale", "send", rnd + 1):
            return {n: d * 1e6 for n, d in delta.items()}
        return delta

    def stage(self, rnd: int, phase: str) -> None:
        self.plan.at(phase, rnd + 1)


class MembershipHook(RoundHook):
    """Tells the run's member registry when this island averages and which outer step it holds."""

    def __init__(self, membership: Any):
        self.membership = membership

    def starting(self, island: Island, rnd: int, state: list[float]) -> None:
        self.membership.announce(rnd, averaging=True, state=state)

    def after(self, island: Island) -> None:
        self.membership.announce(island.outer_step, averaging=False)
        remember_peers(island)


def begin_round(island: Island) -> InFlight | RoundMetrics:
    """Collective: send this island's pseudo-gradient of the round's fragment to the group and return the
    round in flight (or, when the island leaves the round out, what it did instead)."""
    t0 = time.perf_counter()
    rnd, hooks, ov = island.outer_step, island.hooks, island.overlap
    for h in hooks:
        h.before(island, rnd)
    state = island.state_fingerprint()
    for h in hooks:
        h.starting(island, rnd, state)
    if island.transfer.outvoted(rnd, state):
        return _leave_out(island, rnd)
    fragment = ov.fragment_of(rnd)
    names = ov.names(fragment)
    delta = island.outer.pseudo_gradient(island.params, names)
    for h in hooks:
        delta = h.outgoing(rnd, delta)
    weight = float(island.stats.tokens - ov.tokens_at_sync[fragment])
    meta = {"outer_step": rnd, "config_fingerprint": island.fingerprint, "state_fingerprint": state,
            **ov.report()}
    scale = ov.send_scale(weight)
    # a group forms as soon as every island the registry expects in this round has joined, not after the
    # whole matchmaking window
    expected = island.transfer.main_decides(lambda: island.membership.round_size(rnd)) \
        if island.membership is not None and not island.rt.lockstep else None
    flight = InFlight(rnd, fragment, names, delta, weight, meta, None, island.inner_step, island.stats.tokens,
                      time.perf_counter(), scale=scale)
    flight.pending = island.averager.start(_outgoing(flight), weight, meta, round_id=round_id(rnd),
                                           on_stage=_on_stage(island, flight), buckets=ov.buckets(fragment),
                                           expected_group_size=expected)
    ov.sent(flight)
    flight.send_seconds = time.perf_counter() - t0
    return flight


def end_round(island: Island, flight: InFlight) -> RoundMetrics:
    """Collective: wait for the round in flight, validate it, commit it or roll it back."""
    t0 = time.perf_counter()
    in_flight = t0 - flight.t_sent
    result, averaged = island.averager.finish(flight.pending)
    result, averaged, retried = _average_again(island, flight, result, averaged)
    u = 1.0
    if averaged is not None and flight.scale != 1.0:
        u = island.overlap.applied_scale(flight, result)
        averaged = {n: a * u for n, a in averaged.items()}
    norm = island.global_norm(flight.delta)
    avg_norm = island.global_norm(averaged) if averaged is not None else float("nan")
    # rounds of a budget other than steps differ in length (auto: H steps, then maybe 50x more): the guard
    # compares their averages per million tokens, as they travelled, not the longer round's larger Δ
    guarded, what = (avg_norm, "") if u == 1.0 or u <= 0 else (avg_norm / u, " per million tokens")
    reason = result.reason or island.guard.check(guarded, what) or _overflow(island, averaged)
    if reason:
        _roll_back(island, flight, reason, result)
    else:
        _commit(island, flight, averaged, guarded)
    for h in island.hooks:
        h.after(island)
    backend = getattr(result, "backend", "") or ("local" if island.cfg.averaging.backend == "local" else "none")
    count_bytes(island, result.bytes_sent, result.bytes_received, through_torch=backend == "torch")
    s = island.stats
    s.comm_seconds += result.seconds
    stall = flight.send_seconds + time.perf_counter() - t0
    island.overlap.finished(result, stall)
    island.overlap.aligned(flight)
    s.stall_seconds += stall
    return RoundMetrics(int(not reason), result.group_size, norm, avg_norm, result.seconds, s.bytes_sent,
                        s.bytes_received, s.payload_bytes_sent, island.outer.lr, reason, backend,
                        int(bool(getattr(result, "fallback_reason", ""))), int(retried),
                        overlap_seconds=max(0.0, min(in_flight, result.seconds)), stall_seconds=stall,
                        send_seconds=flight.send_seconds,
                        fragment=flight.fragment, inner_steps=flight.steps, weight=flight.weight,
                        group_weight=float(getattr(result, "total_weight", 0.0)), unsent_norm=_unsent_norm(island))


def _unsent_norm(island: Island) -> float:
    """Collective: the norm of the island's error feedback over all its ranks (NaN when it keeps none)."""
    if not island.keeps_unsent:
        return float("nan")
    sq = sum(float(e.double().pow(2).sum()) for e in island.feedback.values())
    return math.sqrt(island.rt.reduce([sq])[0])


def _outgoing(flight: InFlight) -> Delta:
    """What the round sends: Δ, per million tokens under a budget other than steps."""
    if flight.scale == 1.0:
        return flight.delta
    return {n: d * flight.scale for n, d in flight.delta.items()}


def _on_stage(island: Island, flight: InFlight) -> Callable[[str], None]:
    """What the averager's bucket threads call as the round moves on: the hooks' ``stage``, and the
    island's compute seconds when the round's group formed (where a budget of seconds counts from)."""
    def stage(phase: str) -> None:
        if phase == "allreduce" and flight.compute_at_formed is None:
            flight.compute_at_formed = island.stats.compute_seconds
        for h in island.hooks:
            h.stage(flight.rnd, phase)
    return stage


def _average_again(island: Island, flight: InFlight, result: Any, averaged: Delta | None
                   ) -> tuple[Any, Delta | None, bool]:
    """Average the same Δ once more instead of rolling the round back, in two cases:

    - the group lost a member mid-round (killed, cut off): the members left go round again under a
      round id of their own, so that a death costs the others a few seconds instead of a round;
    - no group formed although the registry lists a live island at this round that has not joined yet
      (it restarted or caught up and is still training towards it): wait for it once more under the
      same round id, instead of moving on to the next round just as it arrives, one round apart.

    Returns (result, averaged Δ or None, whether it averaged again)."""
    a = island.cfg.averaging
    # islands of one torch world decide every round together: one of them cannot go round again alone
    if result.ok or not a.retry_lost_member or island.rt.lockstep or island.membership is None:
        return result, averaged, False
    rnd = flight.rnd
    if getattr(result, "retryable", False):
        rid, why = round_id(rnd, retry=True), "averaging again with the islands left"
        # the members left failed within moments of each other: a short wait for them is enough
        timeout = min(a.matchmaking_timeout, a.matchmaking_time + a.vote_timeout)
    elif result.group_size < a.min_group_size and island.transfer.main_decides(
            lambda: island.membership.round_size(rnd) >= a.min_group_size):
        rid, why, timeout = round_id(rnd), "waiting once more for the islands still training towards it", None
    else:
        return result, averaged, False
    log.warning("round %d: %s; %s", rnd + 1, result.reason, why)
    first = result
    # the members left are known when the lost one simply never confirmed: their group forms at once
    result, averaged = island.averager.average(_outgoing(flight), flight.weight, flight.meta, round_id=rid,
                                               on_stage=_on_stage(island, flight), matchmaking_timeout=timeout,
                                               buckets=island.overlap.buckets(flight.fragment),
                                               expected_group_size=getattr(result, "members_left", 0) or None)
    result.seconds += first.seconds
    result.bytes_sent += first.bytes_sent
    result.bytes_received += first.bytes_received
    if not result.ok:
        result.reason = f"{first.reason}; averaging again failed too ({result.reason})"
    return result, averaged, True


def _leave_out(island: Island, rnd: int) -> RoundMetrics:
    """A stale member is left out, not the round: the others average without us; we take their result."""
    reason = "θ_global differed from the other islands'; left the round out and resynchronized"
    log.warning("round %d: %s", rnd + 1, reason)
    resynced = island.transfer.catch_up(force_download=True, wait_for_round=True, counted=1)
    island.stats.rounds_failed += 1
    reason = reason if resynced else f"{reason} (not yet)"
    island.stats.failures.append(f"round {rnd + 1}: {reason}")
    for h in island.hooks:
        h.after(island)
    return RoundMetrics.skipped(island, reason)


def _overflow(island: Island, averaged: Delta) -> str:
    """Collective: why the outer step must not be applied although Δ is fine ('' if it may)."""
    finite = island.outer.step_is_finite(averaged)
    if island.rt.reduce([float(not finite)], op="max")[0]:
        return "the outer step would make θ_global non-finite (lower --diloco.outer_lr)"
    return ""


def _commit(island: Island, flight: InFlight, averaged: Delta, guarded_norm: float) -> None:
    with island.state_lock:
        island.outer.step(averaged)
        island.outer_step += 1
    island.averager.commit(flight.pending)
    island.overlap.committed(flight)
    island.guard.record(guarded_norm)
    island.transfer.after_commit()
    island.stats.rounds_ok += 1
    island.stats.behind = False


def _roll_back(island: Island, flight: InFlight, reason: str, result: Any) -> None:
    rnd = flight.rnd
    island.overlap.rolled_back(flight)
    island.stats.rounds_failed += 1
    island.stats.failures.append(f"round {rnd + 1}: {reason}")
    if getattr(result, "left_behind", False):
        island.stats.behind = True
        # the others finished the round without us: counting it as done would leave us a round apart from
        # them with the same outer step; take their θ_global now, while they are still there to serve it
        # (staying at this round if none does, so that the next round's catch-up tries again)
        log.warning("round %d: %s; catching up with the run", rnd + 1, reason)
        island.transfer.catch_up(counted=1)
        return
    island.outer_step += 1  # stay aligned with the others' round numbering
    island.transfer.after_rollback()
    log.warning("round %d rolled back (%s); continuing from this island's own parameters", rnd + 1, reason)
    if result.in_minority:
        island.transfer.resync(result.gathered, result.majority_peers)
