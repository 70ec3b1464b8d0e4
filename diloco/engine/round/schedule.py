"""When an island's rounds fall due: every H / P inner steps, or every 1/P of a budget of compute seconds or
tokens (:mod:`diloco.config.budget`), each round averaging fragment ``r mod P`` (Streaming DiLoCo); the weight of
each fragment's next Δ, the units Δ travels in, and the schedule an island takes on when it adopts another's
state."""

from __future__ import annotations

from typing import Any

from diloco.config import DilocoConfig
from diloco.config.budget import Budget, auto_seconds, parse_budget
from diloco.engine.metrics import RunStats
from diloco.engine.runtime import Runtime
from peers import CanonicalLayout, RoundResult

PER_TOKENS = 1e6
"""Under a budget other than steps, Δ travels per this many tokens (a scale that suits every codec)."""


class RoundSchedule:
    """When this island's rounds fall due, the weight of each fragment's next Δ and the budget's units
    (one per island rank, decisions collective).

    A round is sent every H / P inner steps, rounded to whole steps, or every 1/P of another budget.  An
    island that adopts a downloaded state takes on the schedule of the island that served it (the steps
    schedule counts ``inner_step + offset``), so that it sends its next round with the run's."""

    def __init__(self, d: DilocoConfig, rt: Runtime, stats: RunStats, layout: CanonicalLayout,
                 names: list[str]):
        self.rt, self.stats, self.layout = rt, stats, layout
        self.inner_steps, self.n = d.inner_steps, d.fragments
        self.interval = d.inner_steps // d.fragments
        self.total_rounds = d.outer_steps * d.fragments
        # the layout was cut along the same fragments; without fragments it has one group, the model
        groups = layout.groups or [layout.names]
        mine = set(names)
        self.fragment_names = [[n for n in g if n in mine] for g in groups]
        """This rank's parameters in each fragment."""
        self.tokens_at_sync = [0] * self.n
        """Per fragment: ``stats.tokens`` when its parameters last took θ_global (the weight of its next Δ)."""
        self.budget: Budget = parse_budget(d.sync_every, d.inner_steps)
        self.max_comm_fraction = d.max_comm_fraction
        self.hidden_steps = d.overlap_steps
        """Inner steps a round in flight runs under (0 when the island waits for each round)."""
        self.auto: float | None = None
        """auto: compute seconds per round the group agreed on (None until measured: H steps meanwhile)."""
        self.last_comm_seconds = float("nan")
        """Seconds the last round this island applied kept it from training (its stall: sending, waiting,
        applying), sent to the group for ``auto``."""
        self.last_overhead_seconds = 0.0
        """Seconds the last committed round's averaging spent beside its exchange of bytes (forming the group,
        the vote), which no codec shortens: taken off the exchange's budget under ``--averaging.compression
        auto``.  Waiting for the others to arrive is left out: it is their compute, not the link."""
        self.mark = (0.0, 0, 0)
        """(compute seconds, tokens, inner step) when the island last sent a round or adopted a state."""
        self.skew = 0.0
        """Compute seconds the island trained after sending its last round and before that round's group
        formed: a budget of seconds counts from the group, not from the island's own send (see :meth:`aligned`)."""
        self.offset = 0
        """Added to the inner step by the steps schedule: set when a state is adopted, so that the island's
        rounds fall due with the run's (see :meth:`adopted`)."""
        self._due: tuple[int, bool] = (-1, False)
        self._in_flight: int | None = None
        """The outer step the round in flight was sent at (None: no round in flight)."""

    @property
    def outer_step(self) -> int:
        """The outer step as the training thread sees it: the one a round in flight was sent at, until it is
        applied (a round thread moves ``stats.outer_step`` when it commits, at a moment that differs between
        ranks; what the loop decides must not)."""
        return self.stats.outer_step if self._in_flight is None else self._in_flight

    def sent(self, rnd: int) -> None:
        """A round was sent at outer step ``rnd``; it is in flight until :meth:`landed`."""
        self._in_flight = rnd

    def landed(self) -> None:
        """The round in flight was applied."""
        self._in_flight = None

    def fragment_of(self, rnd: int) -> int:
        """The fragment round ``rnd`` averages (Streaming DiLoCo: in turn)."""
        return rnd % self.n

    def buckets(self, fragment: int) -> list[int] | None:
        """The canonical buckets of ``fragment`` (None: the whole model)."""
        return None if self.n == 1 else self.layout.group_buckets(fragment)

    def sync_due(self) -> bool:
        """Whether the island has trained up to its next round: by steps, the inner step just taken crossed
        a multiple of H / P (rounds every ⌈H/P⌉ or ⌊H/P⌋ steps when P does not divide H; every H with
        P = 1); by another budget, 1/P of it was used since the last round (collective over the island's
        ranks, and over the torch world when islands average in lockstep: all of them sync together)."""
        k = self.stats.inner_step
        if self.by_steps_now():
            k += self.offset
            return k > 0 and (k * self.n) // self.inner_steps != ((k - 1) * self.n) // self.inner_steps
        if self._due[0] != k:
            used = self.stats.tokens - self.mark[1] if self.budget.kind == "tokens" else self._seconds_used()
            due = k > self.mark[2] and used >= self._amount() / self.n
            self._due = (k, self.rt.reduce([float(due)], op="max", world=self.rt.lockstep)[0] > 0)
        return self._due[1]

    def by_steps_now(self) -> bool:
        """Whether rounds fall due by inner steps right now (H steps; ``auto`` before its first measure)."""
        return self.budget.by_steps or (self.budget.kind == "auto" and self.auto is None)

    def phase(self) -> int:
        """Inner steps into the run's H-step cycle this island is at (what a state it serves carries, so
        that an island adopting it sends its next round with this one's)."""
        return (self.stats.inner_step + self.offset) % self.inner_steps

    def restarted_now(self) -> bool:
        """Whether the round budget restarted at this very inner step (the island adopted a downloaded
        state): it has trained nothing since to send."""
        return self.mark[2] == self.stats.inner_step

    def _seconds_used(self) -> float:
        """Compute seconds a budget of seconds counts as used: since the last send, less the :attr:`skew`."""
        return self.stats.compute_seconds - self.mark[0] - self.skew

    def _amount(self) -> float:
        return self.auto if self.budget.kind == "auto" else self.budget.amount

    def progress(self) -> float:
        """Fraction of the run done, rounds and the part of the current one (drives the inner lr schedule
        under a budget other than steps, where the number of inner steps is not known in advance)."""
        s = self.stats
        if self.by_steps_now():
            part = (s.inner_step - self.mark[2]) * self.n / self.inner_steps
        elif self.budget.kind == "tokens":
            part = (s.tokens - self.mark[1]) * self.n / self.budget.amount
        else:
            part = self._seconds_used() * self.n / self._amount()
        return min(1.0, (self.outer_step + min(1.0, part)) / self.total_rounds)

    def send_scale(self, weight: float) -> float:
        """What Δ is multiplied by before sending: 1 by steps; per million tokens otherwise (see
        :mod:`diloco.config.budget`)."""
        return 1.0 if self.budget.by_steps else PER_TOKENS / max(weight, 1.0)

    @staticmethod
    def applied_scale(scale: float, result: RoundResult) -> float:
        """What the averaged Δ of a round sent times ``scale`` (:meth:`send_scale`) is multiplied by before it is
        applied: undoes the scale with the group's mean tokens per island (Σ Δᵢ / n)."""
        if scale == 1.0:
            return 1.0
        return result.total_weight / max(result.group_size, 1) / PER_TOKENS

    def report(self) -> dict[str, float]:
        """What the island tells the group with its next pseudo-gradient: the inner steps of the round it is
        sending and, for a budget of ``auto``, the compute seconds per step and its last round's stall; for
        ``--averaging.compression auto``, the seconds of exchange it can take: the overlap's steps, plus
        ``max_comm_fraction`` of the round's wall-clock time, less what its last round's averaging spent beside
        the exchange (:attr:`last_overhead_seconds`)."""
        s = self.stats
        steps = s.inner_step - self.mark[2]
        step_seconds = (s.compute_seconds - self.mark[0]) / steps if steps else float("nan")
        f = self.max_comm_fraction
        hide = step_seconds * (self.hidden_steps + steps * f / (1 - f))
        return {"steps": steps, "comm_seconds": self.last_comm_seconds, "step_seconds": step_seconds,
                "hide_seconds": max(0.0, hide - self.last_overhead_seconds) if hide == hide else hide}

    def finished(self, result: RoundResult, stall: float) -> None:
        """A round this island took part in ended after keeping it from training ``stall`` seconds: remember
        that, and under ``auto`` set the budget from the group's reports (identical on every member: they
        all hold the same reports): after the first round, H steps of the fastest member; from then on
        :func:`~diloco.config.budget.auto_seconds` of the stalls."""
        self.last_comm_seconds = float(stall)
        if result.ok:
            self.last_overhead_seconds = max(0.0, result.seconds - result.exchange_seconds)
        if self.budget.kind != "auto" or not result.ok:
            return
        reports = list(result.gathered.values())
        stalls = [float(m.get("comm_seconds", float("nan"))) for m in reports]
        steps = [float(m.get("step_seconds", float("nan"))) for m in reports]
        if any(c == c for c in stalls):
            self.auto = auto_seconds(stalls, self.max_comm_fraction)
        elif any(s == s for s in steps):
            self.auto = min(s for s in steps if s == s) * self.inner_steps

    def restart_budget(self) -> int:
        """Start counting the next round's budget now; returns the inner steps since the last start."""
        s = self.stats
        steps = s.inner_step - self.mark[2]
        self.mark = (s.compute_seconds, s.tokens, s.inner_step)
        self.skew = 0.0
        return steps

    def aligned(self, sent_at: int, compute_at_formed: float | None) -> None:
        """Collective, when the round sent at inner step ``sent_at`` is applied: under a budget of seconds, count
        the next round from when its group formed (``compute_at_formed``: ``stats.compute_seconds`` then, None if
        this rank did not see it form) rather than from this island's send.  An island that sent early trains on
        while it waits for the others (rounds in flight); counting from its own send it would send every
        later round that much early again and wait as long each time, its rounds in flight staying stale
        by the run's first offset.  Counting from the group, every member's next round falls due at once."""
        if self.budget.kind == "tokens" or self.by_steps_now():
            return
        early = 0.0 if compute_at_formed is None else max(0.0, compute_at_formed - self.mark[0])
        if self.mark[2] == sent_at:  # the budget was not restarted since (an adopted state restarts it)
            self.skew = self.rt.reduce([early], op="max")[0]

    def adopted(self, phase: int | None = None, at_step: int | None = None) -> None:
        """θ_global was replaced by a downloaded one and the parameters reset to it.  ``phase``: where the
        island that served it stood in its H-step cycle (:meth:`phase`).  The steps schedule takes it on:
        an island that adopted the state a round in flight committed mid-way through the others' next round
        would otherwise send its own H steps later than they do, miss their group, catch up again, and
        trail the run by the same phase round after round, never averaging again.  ``at_step``: the inner
        step the state was adopted at, when the parameters take it later (None: now)."""
        self.restart_budget()
        if phase is not None and self.by_steps_now():
            step = self.stats.inner_step if at_step is None else at_step
            self.offset = (int(phase) - step) % self.inner_steps
        self.tokens_at_sync = [self.stats.tokens] * self.n

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (taken with no round in flight)."""
        return {"tokens_at_sync": list(self.tokens_at_sync), "auto": self.auto,
                "last_comm_seconds": self.last_comm_seconds, "mark": list(self.mark), "offset": self.offset,
                "skew": self.skew}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (a checkpoint from before fragments holds one ``tokens_at_sync`` for all)."""
        kept = state["tokens_at_sync"]
        self.tokens_at_sync = [int(t) for t in kept] if isinstance(kept, list) else [int(kept)] * self.n
        self.auto = state.get("auto")
        self.last_comm_seconds = float(state.get("last_comm_seconds", float("nan")))
        compute, tokens, step = state.get("mark", (0.0, 0, 0))
        self.mark = (float(compute), int(tokens), int(step))
        self.offset = int(state.get("offset", 0))
        self.skew = float(state.get("skew", 0.0))
