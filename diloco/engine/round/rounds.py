"""The island's outer rounds, top to bottom: a round is sent when the schedule says it is due, is in flight
while the island trains on (as its overlap mode says), and is applied as a transaction."""

from __future__ import annotations

import time
from functools import partial

import torch

from diloco.engine.round.context import RoundContext
from diloco.engine.round.flight import FLIGHTS, Blocking, InFlight, RoundJob
from diloco.engine.round.record import RoundMetrics
from diloco.engine.round.transaction import RoundTransaction, Settled
from diloco.engine.state_transfer import Adoption

STUCK_AFTER = 2
"""Rounds failed in a row after which an island apart from part of its committed roster looks for it (see
:meth:`peers.node.PeerNode.rejoin_if_alone`)."""


class OuterRounds:
    """The island's outer rounds: sends them when due, holds the one in flight, applies it as a transaction.

    Every rank of the island builds one over its :class:`~diloco.engine.round.context.RoundContext` and calls it
    alike (its methods are collective).  With ``--diloco.round_thread`` a round runs on a thread of its own: at
    sending, the training thread copies the fragment's parameters (when it trains on meanwhile) and hands the round
    over; the round thread catches up, fingerprints θ_global, computes Δ, averages, votes, checks and takes the
    outer step; at applying, the training thread only brings its parameters onto the result."""

    def __init__(self, ctx: RoundContext):
        self.ctx = ctx
        self.stats, self.schedule, self.params, self.outer = ctx.stats, ctx.schedule, ctx.params, ctx.outer
        self.transaction = RoundTransaction(ctx)
        self.background = ctx.background
        """Whether rounds run on a thread of their own."""
        self.flight: InFlight | None = None
        """The round sent and not yet applied."""
        d = ctx.d
        kind = FLIGHTS[d.overlap]
        self._new_flight = partial(kind, tau=d.overlap_steps, **({"alpha": d.merge_alpha} if kind is Blocking else {}))

    @property
    def blocking(self) -> bool:
        """Whether every round is applied the moment it is sent (plain DiLoCo's loop)."""
        return self.ctx.blocking

    def theta_fingerprint(self) -> list[float]:
        """Collective: fingerprint of the whole θ_global (see :meth:`RoundTransaction.theta_fingerprint`)."""
        return self.transaction.theta_fingerprint()

    def apply_due(self) -> bool:
        """Collective: whether the round in flight is to be applied now (before the next inner step)."""
        f = self.flight
        if f is None or not f.ripe(self.stats.inner_step):
            return False
        if f.waits:
            return True
        # islands of one torch world finish their rounds together (the fallback's collectives span them)
        rt = self.ctx.rt
        return rt.reduce([float(f.arrived())], op="min", world=rt.lockstep)[0] > 0

    # ----------------------------------------------------------------------------------------- send
    def send(self) -> RoundMetrics | None:
        """Collective: catch up if the run moved on without us (the round's metrics), else send the round's
        pseudo-gradient (None: it is in flight until :meth:`apply`).  With :attr:`background` every round is
        in flight: a round the island does not average ends, with its metrics, at :meth:`apply`."""
        t0 = time.perf_counter()
        ctx, s, sched = self.ctx, self.stats, self.schedule
        # hivemind starts its averager from the main thread only: a lonely island's new peer node starts here
        ctx.peers.rejoin_if_alone(ctx.transfer.main_decides, stuck=s.failed_in_a_row >= STUCK_AFTER)
        fragment = sched.fragment_of(s.outer_step)
        weight = float(s.tokens - sched.tokens_at_sync[fragment])
        scale = sched.send_scale(weight)
        # per_tokens: Δ travels per million tokens (a budget of time or tokens), and the group weighs it by tokens
        meta = {"outer_step": s.outer_step, "config_fingerprint": ctx.fingerprint, "per_tokens": scale != 1.0,
                **sched.report()}
        f = self._new_flight(rnd=s.outer_step, fragment=fragment, names=sched.fragment_names[fragment], weight=weight,
                             meta=meta, sent_at=s.inner_step, tokens_at_send=s.tokens, t_sent=t0, scale=scale)
        if not self.background:
            with ctx.transfer.deferring() as adopted:
                skipped = self.transaction.open(f, self.params)
            if skipped is not None:
                self._adopted(adopted)
                s.add_round(skipped)
                return skipped
        else:
            with torch.no_grad():
                # what Δ is taken from: the parameters as they are now, kept aside unless the island waits
                f.source = self.params if self.blocking else {n: self.params[n].detach().clone() for n in f.names}
            f.job = RoundJob(lambda job: self._settle(f, job), ctx.rt.device)
        f.steps = sched.restart_budget()
        f.train_from_meanwhile(self.params)
        sched.sent(f.rnd)
        f.send_seconds = time.perf_counter() - t0
        self.flight = f
        return None

    def round(self) -> RoundMetrics:
        """Collective: one whole round, blocking (catch up, or send and apply)."""
        return self.send() or self.apply()

    def _settle(self, f: InFlight, job: RoundJob) -> Settled:
        """The round thread's whole round (collective over the round's groups): open it (and tell eager it was
        sent), then close it; another island's θ_global adopted meanwhile reaches the parameters at :meth:`apply`."""
        with self.ctx.transfer.deferring() as adopted:
            skipped = self.transaction.open(f, f.source)
            job.sent.set()
            settled = Settled(skipped) if skipped is not None else self.transaction.close(f)
        settled.adopted = adopted
        return settled

    # ---------------------------------------------------------------------------------------- apply
    def apply(self) -> RoundMetrics:
        """Collective: wait for the round in flight, validate it, commit it or roll it back, and bring the
        island's parameters onto the outcome."""
        f, self.flight = self.flight, None
        try:
            return self._apply(f)
        finally:
            f.release()

    def _apply(self, f: InFlight) -> RoundMetrics:
        t0 = time.perf_counter()
        in_flight = t0 - f.t_sent
        if f.job is not None:
            settled = f.job.wait()
        else:
            with self.ctx.transfer.deferring() as adopted:
                settled = self.transaction.close(f)
            settled.adopted = adopted
        m = settled.metrics
        if settled.adopted is not None and settled.adopted.phase is not None:
            self._adopted(settled.adopted)
        elif not m.caught_up and m.ok:
            self.schedule.tokens_at_sync[f.fragment] = f.follow(self.params, self.outer.theta_global, settled.unsent,
                                                                self.stats.tokens)
        elif not m.caught_up:
            f.keep_own_progress(self.params)
        m.stall_seconds, m.send_seconds = f.send_seconds + time.perf_counter() - t0, f.send_seconds
        self.schedule.landed()
        if not m.caught_up:
            self.schedule.finished(m.result, m.stall_seconds)
            self.schedule.aligned(f.sent_at, f.compute_at_formed)
            m.outer_lr, m.overlap_seconds = self.outer.lr, max(0.0, min(in_flight, m.result.seconds))
            m.fragment, m.inner_steps, m.weight = f.fragment, f.steps, f.weight
            m.unsent_norm = self.transaction.unsent_norm()
        self.stats.add_round(m)
        return m

    def _adopted(self, adopted: Adoption) -> None:
        """Another island's θ_global replaced ours during the round (``phase`` None: it did not): train on from it,
        on the round schedule of the island that served it, as from the inner step it was adopted at."""
        if adopted.phase is not None:
            self.outer.copy_to(self.params)
            self.schedule.adopted(adopted.phase if adopted.phase >= 0 else None, adopted.at_step)
