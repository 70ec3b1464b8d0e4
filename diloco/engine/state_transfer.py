"""θ_global between islands: served to joiners, downloaded to catch up, resynchronized when outvoted.

Every rank serves its pieces of θ_global and of the outer momentum, read live under the outer optimizer's
lock (:mod:`peers.wire.state_share`: nothing is kept aside for joiners), and downloads the buckets it owns from
every rank of the freshest island, all at once; an island adopts a downloaded state only when every bucket
came whole, from one outer step (all-or-nothing over its ranks).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from diloco.config import AveragingConfig
from diloco.engine.metrics import RunStats
from diloco.engine.runtime import Runtime
from diloco.errors import TrainingError
from outer_optim import OuterOptimizer
from outer_optim.tensors import all_finite
from peers import (
    CHUNKS_PER_BUCKET,
    STATS,
    BucketExchange,
    Downloaded,
    PeerNode,
    Position,
    as_float,
    confirmed_position,
    digest,
    download_state,
    fingerprint,
    fingerprints_agree,
    round_id,
    wait_until,
    witness_state,
)

log = logging.getLogger("diloco")
NOWHERE: Position = (-1, -1)
"""The position of no state (none came, or it cannot be used)."""
WITNESSES = 2
"""Islands asked to confirm a downloaded θ_global (:meth:`StateTransfer._witnessed`): one that lies cannot refuse an
honest donor's state alone."""

State = tuple[dict, list[torch.Tensor]]
"""(metadata, θ_global shards followed by the outer momentum shards, in the outer optimizer's order)."""


class Schedule(Protocol):
    """What state transfer needs of the island's round schedule (:class:`diloco.engine.round.schedule.RoundSchedule`)."""

    def phase(self) -> int:
        """Inner steps into the run's H-step cycle (served with the state)."""

    def adopted(self, phase: int | None = None) -> None:
        """A downloaded state was adopted; ``phase``: where the island that served it stood."""

    def by_steps_now(self) -> bool:
        """Whether rounds fall due by inner steps right now."""


@dataclass
class Adoption:
    """Whether a state was adopted inside :meth:`StateTransfer.deferring` (``phase`` None: none was): the phase
    of its server's H-step cycle (-1: not given) and this island's inner step when it was adopted."""

    phase: int | None = None
    at_step: int = 0


class StateTransfer:
    """Serving, downloading and adopting θ_global for one island rank (collective where it says so)."""

    def __init__(self, a: AveragingConfig, *, rt: Runtime, stats: RunStats, outer: OuterOptimizer,
                 params: Mapping[str, torch.Tensor], exchange: BucketExchange, peers: PeerNode,
                 schedule: Schedule, forget_unsent: Callable[[], bool], fingerprint: str):
        self.a, self.rt, self.stats, self.outer, self.params = a, rt, stats, outer, params
        self.exchange, self.layout, self.peers, self.schedule = exchange, exchange.layout, peers, schedule
        self.forget_unsent, self.fingerprint = forget_unsent, fingerprint
        """``forget_unsent()``: drop what a codec left unsent (True if anything was kept)."""
        self.serving = True
        """Whether this island serves its θ_global now (not while it replaces it with another island's)."""
        self._downloads = 0
        self._deferred: Adoption | None = None
        self._refused: dict[str, Position] = {}
        """Islands whose served θ_global did not match what the run's islands vouch for at its position, or that its
        witnesses denied, and that position: not asked again until they announce another one."""
        self._discredited: dict[str, Position] = {}
        """Of those, the islands refused on the word of more than one other island (the registry's vouch, or two
        witnesses), and that position: not asked to witness a download either."""
        self.checked_digest: list[float] | None = None
        """The digest of the θ_global the last download brought, when it matched the one the run's islands at its
        position vouch for (None: it was not checked so, or did not match)."""

    # ------------------------------------------------------------------------- serving
    def provide(self) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
        """What this rank serves to joiners, read with ``outer.lock`` held (in a transport thread): metadata,
        θ_global and momentum shards; None while the island replaces its own θ_global.  A failed round moves
        the outer step on without changing θ_global: the step served is the island's, the run's numbering."""
        if not self.serving:
            return None
        averager = self.peers.averager
        meta = {"outer_step": self.stats.outer_step, "committed_rounds": self.outer.step_count,
                "config_fingerprint": self.fingerprint,
                "layout_fingerprint": self.layout.fingerprint(), "phase": self.schedule.phase(),
                "committed": averager.committed if averager is not None else [],
                "strikes": averager.strikes if averager is not None else {}}
        return meta, self.outer.theta_global, dict(zip(self.outer.names, self.outer.momentum_buffers()))

    def _serve(self, on: bool) -> None:
        """Serve θ_global (or stop while it is replaced), and tell the run's registry."""
        self.serving = on
        if self.peers.membership is not None and self.peers.membership.serving != on:
            self.peers.membership.serving = on
            self.peers.membership.announce()

    def connected(self) -> None:
        """After every (re)connection of the peer node: serve θ_global, and announce with the outer step the rounds
        its lineage committed (the island's position in the run)."""
        if self.peers.membership is not None:
            self.peers.membership.committed_rounds = lambda: self.outer.step_count
        self._serve(True)

    def position(self) -> Position:
        """How far along the run this island is (see :data:`peers.discovery.membership.Position`)."""
        return self.outer.step_count, self.stats.outer_step

    def after_commit(self) -> None:
        """θ_global moved (served live: nothing to refresh)."""

    def after_rollback(self) -> None:
        """A failed round moved the round number on (θ_global unchanged): the step served follows it, so
        joiners prefer live islands to the stale records of departed ones."""

    # ------------------------------------------------------------------------ decisions
    def main_decides(self, decide: Callable[[], Any]) -> Any:
        """Rank 0 evaluates ``decide`` (membership lookups, clocks); every rank gets its answer."""
        rt = self.rt
        return rt.bcast(decide() if rt.is_main else None)

    def can_download(self) -> bool:
        """Whether this island can download θ_global from peers (islands of one torch world cannot:
        they average in lockstep and never fall behind each other)."""
        return self.peers.membership is not None and self.peers.transport is not None and not self.rt.lockstep

    def join_from_peers(self) -> bool:
        """Before training: wait for the expected islands, then catch up with the run if it moved on."""
        a = self.a
        if self.peers.membership is None:
            return False
        ended = self.main_decides(self.peers.membership.ended_at)
        if ended is not None:
            raise TrainingError(f"run {a.run_id} ended at outer step {ended}: every island that trained it finished "
                                f"and left, so there is nothing to join; start a new run with another "
                                f"--averaging.run_id")

        def look() -> bool:
            if a.wait_for_islands > 1:
                ok = wait_until(lambda: self.peers.membership.live_count() >= a.wait_for_islands, a.matchmaking_timeout)
                log.info("%d of %d expected islands registered%s", self.peers.membership.live_count(), a.wait_for_islands,
                         "" if ok else " (gave up waiting)")
            if a.client_mode and self.peers.membership.others() and not self.peers.membership.reachable_others():
                log.warning("every island of the run registered so far is behind NAT (--averaging.client_mode true): "
                            "none can carry the others' bytes, so no round can commit until an island that takes "
                            "incoming connections joins")
            return not all(m.outer_step <= self.stats.outer_step and not m.averaging for m in self.peers.membership.others())

        if not self.main_decides(look) or not self.can_download():
            return False  # the run has not moved past us: θ_0 comes from the shared seed (or init_from)
        return self.catch_up(force_download=True)

    def catch_up(self, force_download: bool = False, wait_for_round: bool = False, counted: int = 0) -> bool:
        """If other islands are ahead of us, adopt the freshest θ_global, outer momentum and outer step.

        When the others are averaging the round that state belongs to, wait for that round to
        commit (bounded), so that we start the next round together with them rather than one behind.
        ``force_download`` checks with the peers even if none announced a later step;
        ``wait_for_round`` waits for the others to finish the round we are at (we left it out) and
        takes its result.  Our own state is not served meanwhile.  ``counted`` of the outer steps jumped
        are rounds the caller already counts as failed; the rest count as caught up.
        """
        if not self.can_download():
            return False
        if not self.main_decides(lambda: force_download or self.peers.membership.furthest() > self.position()):
            return False
        a = self.a
        deadline = time.monotonic() + a.matchmaking_timeout + a.allreduce_timeout + a.vote_timeout
        first = None
        if wait_for_round:
            self._serve(False)  # nobody should download the state we are replacing
        while True:
            state = self.download()
            step = _position(state[0]) if state is not None else NOWHERE
            first = step if first is None and step > self.position() else first
            verdict = self.main_decides(lambda: self._verdict(step, first, deadline, wait_for_round))
            if verdict == "keep":
                if step == NOWHERE:
                    log.info("no peer served its state; keeping ours (outer step %d)", self.stats.outer_step)
                self._serve(True)
                return False
            if verdict == "adopt":
                break
            time.sleep(1.0 if verdict == "unreachable" else 0.5)
        before = self.stats.outer_step
        self.adopt(*state)
        self.stats.rounds_caught_up += max(0, self.stats.outer_step - before - counted)
        self._serve(True)
        # vouch for the state only when the download was checked against what the run's islands vouch for (its digest
        # is at hand then; computing one here would cost every rank of the island a collective)
        self.peers.membership.announce(self.stats.outer_step, averaging=False, held=self.checked_digest)
        log.info("caught up with the run at outer step %d (θ_global downloaded from peers%s)", self.stats.outer_step,
                 f"; {self.schedule.phase()} of its H steps into the round, as the island that served it"
                 if self.schedule.by_steps_now() else "")
        return True

    def wait_for_the_run(self, rnd: int) -> None:
        """Collective: before averaging round ``rnd``, when this island's failed rounds numbered it past a run still
        averaging an earlier round (:meth:`peers.discovery.membership.Membership.numbers_ahead`), wait for the run's
        round to end, bounded by one round's timeouts, rather than average alone ahead of it."""
        membership = self.peers.membership
        if not self.can_download() or not self.main_decides(lambda: membership.numbers_ahead(rnd)):
            return
        a = self.a
        limit = a.matchmaking_timeout + a.allreduce_timeout + a.vote_timeout
        log.info("round %d: the run is still averaging an earlier round (this island's failed rounds numbered it "
                 "further); waiting up to %.0f s for that round to end", rnd + 1, limit)
        deadline = time.monotonic() + limit
        while self.main_decides(lambda: time.monotonic() < deadline and membership.numbers_ahead(rnd)):
            time.sleep(1.0)

    def _verdict(self, step: Position, first: Position | None, deadline: float, wait_for_round: bool) -> str:
        """What to do with a state at position ``step`` (:data:`NOWHERE`: none came), decided on rank 0 only:
        ``adopt`` it; ``keep`` ours; ask again because the peers are ``unreachable`` or ``moving``
        (a round committed while we downloaded, or the round that state belongs to is in flight)."""
        here = self.position()
        if time.monotonic() > deadline:
            return "adopt" if step > here else "keep"
        furthest = self.peers.membership.furthest(beating_only=True)
        if step == NOWHERE:
            return "unreachable" if furthest > here or wait_for_round else "keep"
        if step <= here:
            return "moving" if wait_for_round and self.peers.membership.averaging_round(self.stats.outer_step) else "keep"
        if furthest > step:
            return "moving"  # the run committed a round while we downloaded: the state is stale already
        # wait for the round in flight when we first looked (committed or failed), not for later ones, and
        # only if it can commit without us: a lone island averaging waits for partners, and we can be one;
        # an island killed while averaging still reads "averaging" until its record expires: count the live
        averaging = sum(m.averaging and m.outer_step == step[1] and self.peers.membership.beating(m)
                        for m in self.peers.membership.others())
        return "moving" if step == first and averaging >= self.a.min_group_size else "adopt"

    def outvoted(self, rnd: int, state: list[float], wait: bool) -> bool:
        """Collective: whether the θ_global we enter round ``rnd`` with (fingerprint ``state``) disagrees
        with the majority of the islands entering it (see :meth:`peers.discovery.membership.Membership.outvoted`)."""
        if self.peers.membership is None or self.rt.lockstep:
            return False
        # a blocking round waits for the islands still training (it would wait for them in matchmaking
        # anyway); a round sent in flight must not stall the inner steps: it looks at those already
        # averaging, and a stale first-comer is caught by the group's own majority check instead
        seconds = self.a.matchmaking_time if wait else 0.0
        asked = self.peers.averager.asked if self.peers.averager is not None else (lambda _: {})
        return bool(self.main_decides(lambda: self.peers.membership.outvoted(rnd, state, seconds,
                                                                             lambda: asked(round_id(rnd)))))

    def check_in_sync(self, state: list[float], stopping: bool) -> str:
        """Collective, after the last round: publish the fingerprint ``state`` of the θ_global we end
        with and compare it with the other islands that ended at the same outer step (waiting up to
        ``vote_timeout`` for them).  Returns '' or one sentence."""
        if self.peers.membership is None or self.rt.lockstep:
            return ""
        differ, compared, alone, behind = self.main_decides(lambda: (*self.peers.membership.final_disagreements(
            self.stats.outer_step, state, self.a.vote_timeout), self.peers.alone.since is not None,
            self._behind(self.a.matchmaking_timeout if not stopping else 0.0)))
        if not differ and not compared:
            doubt = self._unconfirmed_end(alone)
            if doubt and stopping:  # stopped, not ended: --resume compares it with the run's θ_global
                log.warning("stopping with θ_global unconfirmed: %s", doubt)
                return ""
            if not doubt and behind:
                log.warning("ended first: %d live island(s) had not reached outer step %d yet, so none compared "
                            "θ_global with this one; their own end checks compare with it (its record stays)", behind,
                            self.stats.outer_step)
            return doubt
        # an island struck out of the run (--averaging.strikes) ends on a θ_global of its own: no sign of a split
        limit, strikes = self.a.strikes, getattr(self.peers.averager, "strikes", None) or {}
        differ = [d for d in differ if not (limit and strikes.get(d, 0) >= limit)]
        if not differ:
            return ""
        with_us = compared - len(differ) + 1
        if with_us > len(differ):
            # the islands that differ say so themselves and --resume brings them back; this island, on the θ_global
            # of most of the islands it compared with, ended in the run (48 islands: one island cut off in the last
            # rounds made the 47 others, all on one θ_global, exit with an error)
            log.warning("%d of the %d other island(s) that ended at outer step %d hold another θ_global (%s); this "
                        "island holds the majority's (%d of %d): those islands are the ones out of sync, and --resume "
                        "resynchronizes them", len(differ), compared, self.stats.outer_step,
                        ", ".join(d[-8:] for d in differ), with_us, compared + 1)
            return ""
        side = "the minority's" if with_us < len(differ) else "one half's"
        return (f"the run ended out of sync: θ_global of {len(differ)} of the {compared} other island(s) that ended "
                f"at outer step {self.stats.outer_step} differs from this one's ({', '.join(d[-8:] for d in differ)}), "
                f"so this island holds {side}; resume the islands with --resume so the minority resynchronizes, and "
                f"report the logs")

    def _behind(self, linger: float) -> int:
        """On rank 0, at the end of the run: the live islands that have not reached this island's position, after
        serving θ_global up to ``linger`` seconds more while there are any (an island late for the last rounds, under
        load, would otherwise find nobody left to catch up from, and end out of sync).  By position, not outer step:
        an island whose last round rolled back ends at the same step with one round fewer committed (32 islands: one
        such ended alone on a stale θ_global)."""
        membership, until, said = self.peers.membership, time.monotonic() + linger, False
        while True:
            behind = sum(1 for m in membership.others() if not m.left and not membership.silent(m)
                         and m.position < self.position())
            if not behind or time.monotonic() >= until:
                return behind
            if not said:
                log.info("%d live island(s) have not reached this island's position (%d rounds committed, outer step "
                         "%d) yet: serving θ_global up to %.0f s more for them to catch up", behind,
                         *self.position(), linger)
                said = True
            time.sleep(1.0)

    def _unconfirmed_end(self, alone: bool) -> str:
        """Why an island that found no other island to compare its final θ_global with may be out of sync
        ('' when nothing says so)."""
        if self.stats.behind:
            return (f"the other islands averaged this island's last round without it and none was left to take "
                    f"θ_global from or compare with, so the run may have ended out of sync (this island at outer "
                    f"step {self.stats.outer_step}); resume the islands with --resume so the minority resynchronizes")
        if alone:
            return (f"this island ended alone: the islands of the run it knew stopped answering before its last "
                    f"round (they finished without it, or the network between them split) and none was left to "
                    f"compare θ_global with, so the run may have ended out of sync (this island at outer step "
                    f"{self.stats.outer_step}); compare the islands' theta_global.pt, or restart this island with --resume "
                    f"while the others run")
        # 48 islands: one whose registry look-ups found nobody in the last round rolled it back and ended, exit 0, on
        # a θ_global none of the 39 islands that committed that round held
        mates = set(getattr(self.peers.averager, "committed", None) or []) - {self.peers.membership.island}
        if self.stats.failed_in_a_row and mates:
            return (f"this island's last round did not commit and none of the {len(mates)} island(s) it last committed "
                    f"a round with compared θ_global with it at the end (their records did not reach it), so the run "
                    f"may have ended out of sync (this island at outer step {self.stats.outer_step}); compare the "
                    f"islands' theta_global.pt, or restart this island with --resume while the others run")
        return ""

    def resync(self, gathered: dict[str, dict], majority: list[str], attempts: int = 3) -> bool:
        """We hold a θ_global the majority does not: download theirs, verified against the majority's
        state fingerprint."""
        if not self.can_download():
            log.warning("θ_global differs from the majority's and this island cannot download state; "
                        "continuing with ours")
            return False
        target = gathered[majority[0]].get("state_fingerprint")
        self._serve(False)  # nobody should download our stale state meanwhile
        try:
            for attempt in range(attempts):
                state = self.download(target)
                if state is not None:
                    self.adopt(*state)
                    log.warning("resynchronized θ_global from the majority (outer step %d)", self.stats.outer_step)
                    return True
                log.warning("resync attempt %d/%d did not get the majority's state", attempt + 1, attempts)
            return False
        finally:
            self._serve(True)

    @contextmanager
    def deferring(self) -> Iterator[Adoption]:
        """Inside the block, a state adopted (:meth:`adopt`) replaces θ_global, the outer momentum and step at once,
        but the island's parameters and round schedule are left to the caller: the yielded :class:`Adoption`
        says whether one was, and from which phase the parameters restart (a round thread must not write the
        parameters the training thread trains)."""
        self._deferred = Adoption()
        try:
            yield self._deferred
        finally:
            self._deferred = None

    # ------------------------------------------------------------------ download, adopt
    def download(self, target: list[float] | None = None) -> State | None:
        """Collective: every rank downloads the buckets it owns from every rank of the freshest island that
        serves (all requests at once, :func:`peers.wire.state_share.download`); when every bucket came whole from
        one outer step (and matches ``target``, a canonical fingerprint, if given; else the digest of θ_global the
        run's islands at the donor's position announce in their signed records, when they do: a donor whose state
        does not match is refused and not asked again at that position) return
        ``(meta, this rank's θ shards + momentum shards)`` on every rank, else None on every rank."""
        donor, donor_id, vouched_at, vouched = self.main_decides(self._donor)
        if target is None and vouched is not None:
            target = vouched
        else:
            vouched_at = None  # the caller's target (the majority's, when resynchronizing) rules
        got: dict[int, Downloaded] = {}
        verdict: dict[int, int] = {}
        prints: dict[int, list[float]] = {}
        foreign, phase, committed = "", -1, None
        if donor:
            self._downloads += 1
            buckets = {b: self.layout.buckets[b].numel for b in self.exchange.owned}
            got, why = download_state(self.peers.transport, donor, buckets, self.a.state_download_timeout,
                                      f"{self.stats.outer_step}.{self._downloads}")
            if why:
                log.info("could not download θ_global: %s", why)
            for b, piece in got.items():
                step, problem = self._check_bucket(b, piece, None if vouched_at is not None else target)
                if vouched_at is not None and step != NOWHERE:
                    if step != vouched_at:  # it moved on since we read the registry: look again
                        step = NOWHERE
                    else:
                        prints[b] = fingerprint([piece.theta], CHUNKS_PER_BUCKET)
                verdict[b] = step
                foreign = foreign or problem
                served = as_float(piece.meta.get("phase"))  # a peer's metadata: anything may come
                phase = max(phase, int(served) if math.isfinite(served) else -1)
                roster = [piece.meta.get("committed"), piece.meta.get("strikes")]
                if _committed_state(roster):
                    committed = roster if committed is None or committed == roster else [[], {}]
        merged: dict[int, int] = {}
        rosters = []
        whole: dict[int, list[float]] = {}
        for part, why, p, roster, printed in self.rt.gather_all((verdict, foreign, phase, committed, prints)):
            merged.update(part)
            foreign = foreign or why
            phase = max(phase, p)
            rosters.append(roster)
            whole.update(printed)
        if foreign:
            raise TrainingError(foreign)
        # the whole state, as its owners fingerprinted it, must be the θ_global the run holds at that position
        self.checked_digest = None
        if vouched_at is not None and len(whole) == len(self.layout.buckets):
            held = digest([x for b in sorted(whole) for x in whole[b]])
            if not fingerprints_agree(held, target, 1e-5):
                self._refused[donor_id] = self._discredited[donor_id] = vouched_at
                log.warning("refused the θ_global island %s served at position %s: it does not match the fingerprint "
                            "the run's islands at that position announce; trying another island", donor_id[-8:],
                            vouched_at)
                return None
            self.checked_digest = held
        steps = set(merged.values())
        if len(merged) != len(self.layout.buckets) or len(steps) != 1 or NOWHERE in steps:
            return None
        if not self._witnessed(donor_id, next(iter(steps)), {b: d.theta for b, d in got.items()}):
            return None
        theta = self.exchange.scatter({b: d.theta for b, d in got.items()})
        momentum = self.exchange.scatter({b: d.momentum for b, d in got.items()})
        names = self.outer.names
        # the committed roster that θ_global comes with (the donor's ranks hold the same one; ranks that own no
        # bucket saw none)
        served = [r for r in rosters if r is not None]
        roster, strikes = served[0] if served and all(r == served[0] for r in served) else ([], {})
        committed_rounds, outer_step = steps.pop()
        meta = {"outer_step": outer_step, "committed_rounds": committed_rounds, "config_fingerprint": self.fingerprint,
                "phase": phase, "committed": roster, "strikes": strikes}
        return meta, [theta[n] for n in names] + [momentum[n] for n in names]

    def _donor(self) -> tuple[list[str], str, Position | None, list[float] | None]:
        """On rank 0: the island to download from: the transport endpoints of its ranks ([] if none), its id, its
        position and the fingerprint the run's islands at that position vouch for (None if none announces one).
        Of the live islands that serve, one at the furthest position the run confirms, not beyond it (an island
        announcing a position no majority holds would serve its own θ_global), and not one whose state at its
        position was refused.  Islands that missed one heartbeat still serve (on a loaded machine many do at any
        moment); one that missed two may be dead."""
        membership = self.peers.membership
        others = membership.others()
        live = [m for m in others if not membership.silent(m) and m.serving]
        floor = confirmed_position([m.position for m in live])
        for m in sorted((m for m in live if m.position >= floor), key=lambda m: (m.position, m.averaging, m.peer_id)):
            if self._refused.get(m.island) == m.position:
                continue
            endpoints = membership.endpoints(m.peer_id)
            if endpoints:
                vouched, _ = membership.vouched_state(m.position, others)
                return endpoints, m.island, m.position, vouched
        return [], "", None, None

    def _witnessed(self, donor_id: str, position: Position, theta: dict[int, torch.Tensor]) -> bool:
        """Collective: whether other islands holding the run's θ_global at ``position`` confirm the downloaded one
        (``theta``: this rank's buckets), each by keyed prints under a seed picked after the bytes came
        (:func:`peers.wire.state_share.witness`).  That catches what the registry's per-chunk sums cannot: a donor
        that permutes values inside a chunk, or serves a made-up θ_global right after a commit, before any record
        vouches for one.  Up to :data:`WITNESSES` islands are asked; the state stands when at least one confirms it
        and no more deny it (a lying witness cannot refuse an honest donor alone).  When more deny it, the donor is
        refused at that position (one donor's word against one witness's settles nothing: the next download asks
        another donor, and the witness is not discredited).  True when no other island serves; False, to ask again,
        when islands that the registry places at that position did not answer from it."""
        candidates = self.main_decides(lambda: self._witnesses(donor_id, position))
        if not candidates:
            return True
        answers = witness_state(self.peers.transport, [endpoints for _, endpoints, _ in candidates], theta,
                                self.a.state_download_timeout, f"{self.stats.outer_step}.{self._downloads}") \
            if theta else [None] * len(candidates)
        # per witness: this rank's word on its buckets ("" when it owns none, so has no word)
        words = ["" if not theta else "silent" if a is None or any(_position(m) != position for m in a[0])
                 else "agree" if a[1] else "deny" for a in answers]
        said = [set(w) - {""} for w in zip(*self.rt.gather_all(words))]
        verdicts = ["deny" if "deny" in w else "agree" if w == {"agree"} else "silent" for w in said]
        agree, deny = verdicts.count("agree"), verdicts.count("deny")
        if agree and agree >= deny:
            return True
        named = ", ".join(f"{island[-8:]} {v}" for (island, _, _), v in zip(candidates, verdicts))
        if deny:
            self._refused[donor_id] = position
            if deny > 1:
                self._discredited[donor_id] = position
            log.warning("refused the θ_global island %s served at position %s: the other islands holding the run's "
                        "θ_global there do not confirm it (%s); trying another island", donor_id[-8:], position, named)
            return False
        if any(at for _, _, at in candidates):
            log.info("no island at position %s confirmed the θ_global downloaded from %s yet (%s); asking again",
                     position, donor_id[-8:], named)
            return False
        return True

    def _witnesses(self, donor_id: str, position: Position) -> list[tuple[str, list[str], bool]]:
        """On rank 0: up to :data:`WITNESSES` live islands that serve, other than the donor, islands struck out of the
        run and islands discredited at their position, those the registry places at ``position`` first: (island id,
        its ranks' transport endpoints, whether the registry places it there)."""
        membership, limit = self.peers.membership, self.a.strikes
        struck = getattr(self.peers.averager, "strikes", None) or {}
        found = []
        for m in sorted((m for m in membership.others() if m.island != donor_id and m.serving and not m.left
                         and not membership.silent(m) and not (limit and struck.get(m.island, 0) >= limit)
                         and self._discredited.get(m.island) != m.position),
                        key=lambda m: (m.position != position, m.peer_id)):
            endpoints = membership.endpoints(m.peer_id)
            if endpoints:
                found.append((m.island, endpoints, m.position == position))
            if len(found) == WITNESSES:
                break
        return found

    def _check_bucket(self, b: int, piece: Downloaded, target: list[float] | None) -> tuple[Position, str]:
        """(the position of a downloaded bucket's state, or :data:`NOWHERE` if unusable; a reason to stop, if
        any)."""
        meta = piece.meta
        if meta.get("config_fingerprint") != self.fingerprint:
            return NOWHERE, (f"the run you joined uses a different model or outer-optimizer config (fingerprint "
                        f"{meta.get('config_fingerprint')} vs ours {self.fingerprint}); use the same --model.*, --seed "
                        f"and --diloco.outer_* settings as the other islands")
        if meta.get("layout_fingerprint") != self.layout.fingerprint():
            return NOWHERE, ("the run you joined cuts the model into other buckets; use the same --averaging.bucket_numel "
                        "as the other islands")
        if not (all_finite(piece.theta) and all_finite(piece.momentum)):
            return NOWHERE, ""
        if target is not None:
            per_bucket = len(target) // len(self.layout.buckets)
            mine = fingerprint([piece.theta], per_bucket // STATS)
            if not fingerprints_agree(mine, target[per_bucket * b:per_bucket * (b + 1)], 1e-5):
                return NOWHERE, ""
        return _position(meta), ""

    def adopt(self, meta: dict, tensors: list[torch.Tensor]) -> None:
        """Install this rank's shards of a downloaded θ_global, outer momentum and outer step (collective) and
        restart inner training from θ_global, on the round schedule of the island that served it."""
        self.stats.behind = False
        n = len(self.outer.names)
        shapes_ok = len(tensors) == 2 * n and all(
            t.shape == p.shape for t, p in zip(tensors[:n], self.outer.theta_global.values()))
        if not shapes_ok or not all(all_finite(t) for t in tensors):
            raise TrainingError("the state downloaded from a peer does not match this model's parameter shapes "
                                "or is not finite; use the same --model.* settings as the other islands")
        with self.outer.lock, torch.no_grad():
            for t, m in zip(tensors[:n], self.outer.theta_global.values()):
                m.copy_(t)
            self.outer.set_momentum_buffers(tensors[n:])
            self.outer.step_count, self.stats.outer_step = _position(meta)
        if self.peers.averager is not None:  # θ_global's lineage comes with it
            self.peers.averager.committed = list(meta.get("committed") or [])
            self.peers.averager.strikes = dict(meta.get("strikes") or {})
        # the inner steps since the last sync were dropped with the state; the round schedule is the server's
        phase = int(meta.get("phase", -1))
        if self._deferred is not None:
            self._deferred.phase, self._deferred.at_step = phase, self.stats.inner_step
        else:
            self.outer.copy_to(self.params)
            self.schedule.adopted(phase if phase >= 0 else None)
        if self.forget_unsent():  # what our codec dropped belongs to our own past, not to the adopted state
            log.info("error feedback reset: adopted another island's θ_global")


def _position(meta: dict) -> Position:
    """The position of a served state (:data:`NOWHERE` when its metadata names none: a peer's metadata is
    untrusted); a donor that does not say how many rounds its lineage committed is taken at its outer step."""
    step, committed = as_float(meta.get("outer_step", -1)), as_float(meta.get("committed_rounds", math.nan))
    if not math.isfinite(step) or step < 0:
        return NOWHERE
    return (int(committed) if math.isfinite(committed) and committed >= 0 else int(step)), int(step)


def _committed_state(served: list) -> bool:
    """Whether a donor's ``[committed roster, strikes]`` is well formed (a peer's metadata: anything may come)."""
    roster, strikes = served
    return (isinstance(roster, list) and all(isinstance(i, str) for i in roster) and isinstance(strikes, dict)
            and all(isinstance(i, str) and isinstance(n, int) for i, n in strikes.items()))
