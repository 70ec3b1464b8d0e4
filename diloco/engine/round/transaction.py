"""One round as a transaction, as torchft's DiLoCo sync: pseudo-gradient → average → check → commit or roll back.

:meth:`RoundTransaction.open` catches up if the run moved on without the island (its inner steps are dropped,
never sent as a stale Δ) or leaves the round out when the others outvote its θ_global (it takes their result);
otherwise it takes Δ = θ_global − θ_local of the round's fragment and starts the averager.
:meth:`RoundTransaction.close` waits for the averager; a group that lost a member averages once more among the
members left; the result is checked (the averager's vote and finiteness checks, the norm guard, a θ_global that
stays finite); then the outer step is **committed** (θ_global moves) or the round **rolled back** (θ_global stays,
and the island's next Δ carries both rounds).  θ_global only ever moves by committed averages, identically on
every island.  The island's parameters follow the outcome afterwards, on the training thread
(:meth:`~diloco.engine.round.flight.InFlight.follow`).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from diloco.engine.round.context import RoundContext
from diloco.engine.round.flight import Delta, InFlight, Params
from diloco.engine.round.record import RoundMetrics
from diloco.engine.round.schedule import RoundSchedule
from diloco.engine.state_transfer import Adoption
from peers import RoundResult, round_id

log = logging.getLogger("diloco")


@dataclass
class Settled:
    """What a round ended with, before the island's parameters follow it."""

    metrics: RoundMetrics
    """The round's record as the transaction leaves it (the training thread adds its stall and overlap)."""
    unsent: Params = field(default_factory=dict)
    """A committed round: β·e of the fragment's parameters, when a codec's unsent part waits in them."""
    adopted: Adoption | None = None
    """Whether (and where in the run's cycle) the island adopted another island's θ_global meanwhile."""


class RoundTransaction:
    """The transaction of each round of one island rank (collective over the round's groups: every rank of the
    island calls it alike, on the training thread or on the round's own)."""

    def __init__(self, ctx: RoundContext):
        self.ctx = ctx
        self.a, self.rt, self.round_rt, self.stats, self.schedule = ctx.a, ctx.rt, ctx.round_rt, ctx.stats, ctx.schedule
        self.outer, self.params, self.exchange, self.norm, self.guard = (ctx.outer, ctx.params, ctx.exchange, ctx.norm,
                                                                         ctx.guard)
        self.peers, self.transfer, self.unsent, self.hooks = ctx.peers, ctx.transfer, ctx.unsent, ctx.hooks
        self._delta_views: dict[str, torch.Tensor] | None = None
        """Where Δ is written each round, allocated once, at start (pinned on a GPU host, so that the copies of
        the parameters into it run asynchronously; pinning gigabytes in the first round held a 1b island's GPU
        for seconds): one flat buffer in the canonical layout's order when the island is one process holding
        every parameter whole (the averager sends its buckets without a copy), else this rank's shards one
        after the other.  None when the outer state is on a GPU: Δ is computed there."""
        if self.outer.device.type == "cpu":
            ex = self.exchange
            flat = torch.empty(ex.layout.total_numel if ex.whole else self.outer.flat.numel(),
                               pin_memory=torch.cuda.is_available())
            self._delta_views = ex.flat_views(flat) if ex.whole else self.outer.views(flat)

    def theta_fingerprint(self) -> list[float]:
        """Collective: fingerprint of the whole θ_global in canonical bucket order, the same on every rank
        and on every island holding the same θ_global, whatever its shape."""
        return self.exchange.canonical_fingerprint(self.outer.theta_global)

    # ----------------------------------------------------------------------------------------- open
    def open(self, f: InFlight, source: Params) -> RoundMetrics | None:
        """Catch up if the run moved on without us, or leave the round out when outvoted (the round's metrics),
        else take Δ of ``f``'s fragment from ``source`` and start averaging it (None)."""
        if self._numbered_alone():
            self.transfer.wait_for_the_run(f.rnd)
        self._meet(f)
        if self.transfer.catch_up(counted=1):
            # the others moved on without us: our inner steps are dropped, never sent as a stale Δ
            self.peers.averager.decline(round_id(f.rnd))
            return RoundMetrics.left_out(f.rnd, self.outer.lr, "behind the run, caught up from a peer")
        rnd = f.rnd
        for h in self.hooks:
            h.before(rnd)
        state = self.theta_fingerprint()
        for h in self.hooks:
            h.starting(rnd, state)
        if self.transfer.outvoted(rnd, state, wait=self.ctx.blocking):
            return self._leave_out(rnd)
        f.delta = self.outer.pseudo_gradient(source, f.names, out=self._delta_views)
        weight = f.weight
        for h in self.hooks:
            f.delta, weight = h.outgoing(rnd, f.delta), h.claimed(rnd, weight)
        f.meta["state_fingerprint"] = state
        # no count of the islands expected: the leader's view names them (a count of the records at this round
        # missed a committed island whose record still showed the round before, and closed the roster without it)
        f.pending = self.peers.averager.start(f.outgoing(), weight, f.meta, round_id=round_id(rnd),
                                              on_stage=self._on_stage(f), buckets=self.schedule.buckets(f.fragment))
        f.opened(self.outer)
        return None

    def _meet(self, f: InFlight) -> None:
        """Collective: number the round ``f`` at the step the islands of our lineage ahead of us number theirs
        (:func:`peers.discovery.membership.meeting_step`), so that islands whose failed rounds moved their numbering
        apart average together again.  Not for fragments (Streaming DiLoCo: a round's number says which fragment it
        averages) nor islands of one torch world (they number every round together)."""
        membership = self.peers.membership
        if not self._numbered_alone():
            return
        step = self.transfer.main_decides(lambda: min(self.schedule.total_rounds - 1, membership.meeting_step(
            self.outer.step_count, f.rnd)))
        if step <= f.rnd:
            return
        log.info("round %d: the islands of this θ_global number their rounds further; averaging this one with theirs, "
                 "as round %d", f.rnd + 1, step + 1)
        with self.outer.lock:
            self.stats.outer_step = step
        f.rnd = f.meta["outer_step"] = step

    def _numbered_alone(self) -> bool:
        """Whether this island numbers its rounds apart from the others' (not so for fragments, whose round's number
        says which fragment it averages, nor for islands of one torch world, which number every round together)."""
        return self.peers.membership is not None and not self.rt.lockstep and self.schedule.n == 1

    def _on_stage(self, f: InFlight) -> Callable[[str], None]:
        """What the averager's bucket threads call as the round moves on: the hooks' ``stage``, and the
        island's compute seconds when the round's group formed (where a budget of seconds counts from)."""
        def stage(phase: str) -> None:
            if phase == "allreduce" and f.compute_at_formed is None:
                f.compute_at_formed = self.stats.compute_seconds
            for h in self.hooks:
                h.stage(f.rnd, phase)
        return stage

    def _leave_out(self, rnd: int) -> RoundMetrics:
        """A stale member is left out, not the round: the others average without us; we take their result."""
        reason = "θ_global differed from the other islands'; left the round out and resynchronized"
        log.warning("round %d: %s", rnd + 1, reason)
        self.peers.averager.decline(round_id(rnd))  # an island that takes it for the round's leader tries the next
        resynced = self.transfer.catch_up(force_download=True, wait_for_round=True, counted=1)
        reason = reason if resynced else f"{reason} (not yet)"
        for h in self.hooks:
            h.after(self.stats.outer_step)
        return RoundMetrics.left_out(rnd, self.outer.lr, reason)

    # ---------------------------------------------------------------------------------------- close
    def close(self, f: InFlight) -> Settled:
        """Wait for the averager, validate its result, commit the outer step or roll the round back (θ_global, the
        counters, the registry; the parameters follow on the training thread)."""
        result, averaged = self.peers.averager.finish(f.pending)
        result, averaged, retried = self._average_again(f, result, averaged)
        u = 1.0
        if averaged is not None and f.scale != 1.0:
            u = RoundSchedule.applied_scale(f.scale, result)
            averaged = {n: a.mul_(u) for n, a in averaged.items()}  # the round's own result: scaled in place
        norm = self.norm(f.delta)
        avg_norm = self.norm(averaged) if averaged is not None else float("nan")
        # rounds of a budget other than steps differ in length (auto: H steps, then maybe 50x more): the guard
        # compares their averages per million tokens, as they travelled, not the longer round's larger Δ
        guarded, what = (avg_norm, "") if u == 1.0 or u <= 0 else (avg_norm / u, " per million tokens")
        reason = result.reason or self.guard.check(guarded, what) or self._overflow(averaged)
        settled = Settled(RoundMetrics(rnd=f.rnd, result=result, failure=reason, pseudo_grad_norm=norm,
                                       averaged_pseudo_grad_norm=avg_norm, retried=retried))
        if reason:
            self._roll_back(f, reason, result)
        else:
            self._commit(f, averaged, guarded)
            self._unscale_feedback(f)
            settled.unsent = self._unsent(f.fragment)
        for h in self.hooks:
            h.after(self.stats.outer_step)
        self.peers.count_bytes(result.bytes_sent, result.bytes_received, through_torch=result.backend == "torch")
        return settled

    def _average_again(self, f: InFlight, result: RoundResult, averaged: Delta | None
                       ) -> tuple[RoundResult, Delta | None, bool]:
        """Average the same Δ once more instead of rolling the round back, in two cases:

        - the group lost a member mid-round (killed, cut off): the members left go round again under a
          round id of their own, so that a death costs the others a few seconds instead of a round;
        - no group formed although the registry lists a live island at this round that has not joined yet
          (it restarted or caught up and is still training towards it): wait for it once more under the
          same round id, instead of moving on to the next round just as it arrives, one round apart (not when the
          others moved past the round: the island catches up instead).

        Returns (result, averaged Δ or None, whether it averaged again)."""
        a, membership = self.a, self.peers.membership
        # islands of one torch world decide every round together: one of them cannot go round again alone
        if result.ok or not a.retry_lost_member or self.rt.lockstep or membership is None:
            return result, averaged, False
        rnd = f.rnd
        if result.retryable:
            rid, why = round_id(rnd, retry=True), "averaging again with the islands left"
            # the members left failed within moments of each other: a short wait for them is enough
            timeout = min(a.matchmaking_timeout, a.matchmaking_time + a.vote_timeout)
        # the others moved past the round (its roster left without us): waiting for the islands the registry still
        # shows at it waits for the other stragglers, round after round (6 of 48 islands looped so for 8 minutes);
        # catching up is what takes this island back into the run
        elif not result.left_behind and result.group_size < a.min_group_size and self.transfer.main_decides(
                lambda: membership.round_size(rnd) >= a.min_group_size):
            rid, why, timeout = round_id(rnd), "waiting once more for the islands still training towards it", None
        else:
            return result, averaged, False
        log.warning("round %d: %s; %s", rnd + 1, result.reason, why)
        first = result
        # the members left are known when the lost one simply never confirmed: their group forms at once
        # the round's pending handle becomes the retry's: a commit keeps what it left unsent and its members
        f.pending = self.peers.averager.start(
            f.outgoing(), f.weight, f.meta, round_id=rid, on_stage=self._on_stage(f), matchmaking_timeout=timeout,
            buckets=self.schedule.buckets(f.fragment), expected_group_size=result.members_left or None)
        result, averaged = self.peers.averager.finish(f.pending)
        for counted in ("seconds", "bytes_sent", "bytes_received", "island_bytes_sent", "parts_resent"):
            setattr(result, counted, getattr(result, counted) + getattr(first, counted))
        if not result.ok:
            result.reason = f"{first.reason}; averaging again failed too ({result.reason})"
        return result, averaged, True

    def _overflow(self, averaged: Delta) -> str:
        """Collective: why the outer step must not be applied although Δ is fine ('' if it may)."""
        finite = self.outer.step_is_finite(averaged)
        if self.round_rt.reduce([float(not finite)], op="max")[0]:
            return "the outer step would make θ_global non-finite (lower --diloco.outer_lr)"
        return ""

    def _commit(self, f: InFlight, averaged: Delta, guarded_norm: float) -> None:
        with self.outer.lock:
            self.outer.step(averaged)
            self.stats.outer_step += 1
        self.peers.averager.commit(f.pending)
        self.guard.record(guarded_norm)
        # the next round's overflow check reads what this measures, instead of scanning θ_global while it holds
        threading.Thread(target=self.outer.measure, name="diloco-measure", daemon=True).start()
        self.transfer.after_commit()
        self.stats.behind = False

    def _roll_back(self, f: InFlight, reason: str, result: RoundResult) -> None:
        rnd = f.rnd
        if result.left_behind:
            self.stats.behind = True
            # the others finished the round without us: counting it as done would leave us a round apart from
            # them with the same outer step; take their θ_global now, while they are still there to serve it
            # (staying at this round if none does, so that the next round's catch-up tries again)
            log.warning("round %d: %s; catching up with the run", rnd + 1, reason)
            self.transfer.catch_up(counted=1)
            return
        self.stats.outer_step += 1  # stay aligned with the others' round numbering
        self.transfer.after_rollback()
        log.warning("round %d rolled back (%s); continuing from this island's own parameters", rnd + 1, reason)
        if result.in_minority:
            self.transfer.resync(result.gathered, result.majority_peers)

    # ------------------------------------------------------------------- the codec's unsent part
    def _feedback_in_params(self) -> bool:
        """Whether a codec's unsent part waits in the parameters (``--averaging.error_feedback_in params``)."""
        return self.ctx.keeps_unsent and self.a.error_feedback_in == "params"

    def _owned(self, fragment: int) -> list[int]:
        """The buckets of ``fragment`` this rank owns (whose error feedback it keeps)."""
        ex, buckets = self.exchange, self.schedule.buckets(fragment)
        chosen = range(len(ex.layout.buckets)) if buckets is None else buckets
        return [b for b in chosen if ex.owner[b] == ex.rank]

    def _unscale_feedback(self, f: InFlight) -> None:
        """The round of ``f`` committed: bring the unsent part e it left from the units Δ travelled in
        (:meth:`RoundSchedule.send_scale`) back to the parameters' when e waits in them, so that the
        parameters take the right amount and checkpoints and ``unsent_norm`` say what they hold back.  In a
        buffer e stays in the travelling units, in which it is re-sent."""
        feedback = self.unsent.feedback
        if f.scale != 1.0 and self._feedback_in_params():
            for b in self._owned(f.fragment):
                if b in feedback:
                    feedback[b] = feedback[b] / f.scale

    def _unsent(self, fragment: int) -> Params:
        """Collective: ``{name: β·e}`` of the fragment's parameters on this rank, e being what the codec left
        unsent of the island's Δ in the round just committed; empty unless it waits in the parameters."""
        if not self._feedback_in_params():
            return {}
        beta, feedback = self.a.error_feedback_decay, self.unsent.feedback
        mine = {b: beta * feedback[b] if b in feedback else torch.zeros(self.exchange.layout.buckets[b].numel)
                for b in self._owned(fragment)}
        return self.exchange.scatter(mine, self.schedule.buckets(fragment))

    def unsent_norm(self) -> float:
        """Collective over the island (the training thread's groups): the norm of the island's error feedback over
        all its ranks (NaN when it keeps none)."""
        if not self.ctx.keeps_unsent:
            return float("nan")
        sq = sum(float(e.double().pow(2).sum()) for e in self.unsent.feedback.values())
        return math.sqrt(self.rt.reduce([sq])[0])
