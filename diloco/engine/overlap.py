"""When an island sends its rounds and applies their results, and what it trains from meanwhile.

A round is sent every H / P inner steps, rounded to whole steps (``--diloco.fragments P``: Streaming
DiLoCo; round ``r`` averages fragment ``r mod P``, P = 1 is the whole model), or every 1/P of another
budget (``--diloco.sync_every``: seconds of compute, tokens, auto; :mod:`diloco.engine.budget`).  At most one round is in flight: it is
applied (committed or rolled back, :func:`diloco.engine.outer_round.end_round`) at the latest when the next one
is due, and earlier as ``--diloco.overlap`` says:

- ``none``: exactly τ = ``overlap_steps`` inner steps after sending, waiting for the result if it has
  not arrived; the fragment's parameters then become α·θ_local + (1−α)·θ_global (τ = 0, α = 0, P = 1:
  plain blocking DiLoCo);
- ``delayed``: at the first inner step at least τ steps after sending at which the result has arrived
  on every rank; the island trained on from its own parameters meanwhile, and that progress is moved
  onto the new θ_global: θ_local ← θ_global + (θ_local − θ_local at sending);
- ``eager`` (after Kale et al. 2025): as ``delayed``, but at sending the island jumps to θ_global stepped
  with its own fresh Δ as a proxy for the average (where the outer step would land if every island had
  sent that Δ), and trains from there; the true average replaces the proxy when it arrives.  Kale et
  al.'s islands restart every round from θ_global, so their proxy adds their share of Δ to a start that
  lacks all of it; ours keep their own progress while a round is in flight, and a jump by their share
  alone would pull them back by the rest of their own Δ, which they would learn again and send twice
  (measured over 12 rounds: +29.8% held-out loss against blocking; +8.0% and +2.9% in two runs with
  the whole Δ).  A rolled-back round takes the jump back.

θ_global (the fp32 master, what islands vote on, serve and checkpoint) only ever moves by committed
averages, identically on every island, whichever mode each uses.

An island that adopts a downloaded state takes on the schedule of the island that served it (the steps
schedule counts ``inner_step + offset``), so that it sends its next round with the run's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from diloco.engine.budget import Budget, auto_seconds, parse_budget

if TYPE_CHECKING:
    from diloco.engine.island import Island

Params = dict[str, torch.Tensor]
PER_TOKENS = 1e6
"""Under a budget other than steps, Δ travels per this many tokens (a scale that suits every codec)."""


@dataclass
class InFlight:
    """A round sent and not yet applied."""

    rnd: int
    fragment: int
    names: list[str]
    """This rank's parameters in the round's fragment."""
    delta: Params
    weight: float
    meta: dict
    pending: Any
    """The averager's handle (``start`` → ``finish``)."""
    sent_at: int
    """``island.inner_step`` when it was sent."""
    tokens_at_send: int
    t_sent: float
    scale: float = 1.0
    """Δ is sent times this (per-token pseudo-gradients under a budget other than steps)."""
    steps: int = 0
    """Inner steps the island trained since its previous round was sent."""
    anchor: Params = field(default_factory=dict)
    """delayed/eager: this rank's parameters right after sending; the progress made since is kept."""
    undo: Params = field(default_factory=dict)
    """eager: the parameters before the proxy jump, where a rolled-back round puts the island back."""
    send_seconds: float = 0.0
    compute_at_formed: float | None = None
    """``stats.compute_seconds`` when the round's group formed (this rank saw its all-reduce start)."""


class Overlap:
    """The island's schedule of rounds and the in-flight round (one per island rank, decisions collective)."""

    def __init__(self, island: Island):
        d = island.cfg.diloco
        self.island = island
        self.mode, self.tau, self.alpha, self.n = d.overlap, d.overlap_steps, d.merge_alpha, d.fragments
        self.interval = d.inner_steps // d.fragments
        self.total_rounds = d.outer_steps * d.fragments
        # the layout was cut along the same fragments; without fragments it has one group, the model
        self.groups = island.layout.groups or [island.layout.names]
        self.flight: InFlight | None = None
        self.tokens_at_sync = [0] * self.n
        """Per fragment: ``stats.tokens`` when its parameters last took θ_global (the weight of its next Δ)."""
        self.budget: Budget = parse_budget(d.sync_every, d.inner_steps)
        self.max_comm_fraction = d.max_comm_fraction
        self.auto: float | None = None
        """auto: compute seconds per round the group agreed on (None until measured: H steps meanwhile)."""
        self.last_comm_seconds = float("nan")
        """Seconds the last round this island applied kept it from training (its stall: sending, waiting,
        applying), sent to the group for ``auto``."""
        self.mark = (0.0, 0, 0)
        """(compute seconds, tokens, inner step) when the island last sent a round or adopted a state."""
        self.skew = 0.0
        """Compute seconds the island trained after sending its last round and before that round's group
        formed: a budget of seconds counts from the group, not from the island's own send (see :meth:`aligned`)."""
        self.offset = 0
        """Added to ``inner_step`` by the steps schedule: set when a state is adopted, so that the island's
        rounds fall due with the run's (see :meth:`adopted`)."""
        self._due: tuple[int, bool] = (-1, False)

    # --------------------------------------------------------------------------- schedule
    @property
    def blocking(self) -> bool:
        """Whether every round is applied the moment it is sent (plain DiLoCo's loop)."""
        return self.mode == "none" and self.tau == 0

    def fragment_of(self, rnd: int) -> int:
        return rnd % self.n

    def names(self, fragment: int) -> list[str]:
        """This rank's parameters in ``fragment``."""
        params = self.island.params
        return [n for n in self.groups[fragment] if n in params]

    def buckets(self, fragment: int) -> list[int] | None:
        """The canonical buckets of ``fragment`` (None: the whole model)."""
        return None if self.n == 1 else self.island.layout.group_buckets(fragment)

    def sync_due(self) -> bool:
        """Whether the island has trained up to its next round: by steps, the inner step just taken crossed
        a multiple of H / P (rounds every ⌈H/P⌉ or ⌊H/P⌋ steps when P does not divide H; every H with
        P = 1); by another budget, 1/P of it was used since the last round (collective over the island's
        ranks, and over the torch world when islands average in lockstep: all of them sync together)."""
        isl = self.island
        k, d = isl.inner_step, isl.cfg.diloco
        if self.by_steps_now():
            k += self.offset
            return k > 0 and (k * self.n) // d.inner_steps != ((k - 1) * self.n) // d.inner_steps
        if self._due[0] != k:
            used = isl.stats.tokens - self.mark[1] if self.budget.kind == "tokens" else self._seconds_used()
            due = k > self.mark[2] and used >= self._amount() / self.n
            self._due = (k, isl.rt.reduce([float(due)], op="max", world=isl.rt.lockstep)[0] > 0)
        return self._due[1]

    def by_steps_now(self) -> bool:
        """Whether rounds fall due by inner steps right now (H steps; ``auto`` before its first measure)."""
        return self.budget.by_steps or (self.budget.kind == "auto" and self.auto is None)

    def phase(self) -> int:
        """Inner steps into the run's H-step cycle this island is at (what a state it serves carries, so
        that an island adopting it sends its next round with this one's)."""
        return (self.island.inner_step + self.offset) % self.island.cfg.diloco.inner_steps

    def restarted_now(self) -> bool:
        """Whether the round budget restarted at this very inner step without a round being sent (the
        island adopted a downloaded state): it has trained nothing since to send."""
        return self.mark[2] == self.island.inner_step and self.flight is None

    def _seconds_used(self) -> float:
        """Compute seconds a budget of seconds counts as used: since the last send, less the :attr:`skew`."""
        return self.island.stats.compute_seconds - self.mark[0] - self.skew

    def _amount(self) -> float:
        return self.auto if self.budget.kind == "auto" else self.budget.amount

    def progress(self) -> float:
        """Fraction of the run done, rounds and the part of the current one (drives the inner lr schedule
        under a budget other than steps, where the number of inner steps is not known in advance)."""
        isl = self.island
        if self.by_steps_now():
            part = (isl.inner_step - self.mark[2]) * self.n / isl.cfg.diloco.inner_steps
        elif self.budget.kind == "tokens":
            part = (isl.stats.tokens - self.mark[1]) * self.n / self.budget.amount
        else:
            part = self._seconds_used() * self.n / self._amount()
        return min(1.0, (isl.outer_step + min(1.0, part)) / self.total_rounds)

    def send_scale(self, weight: float) -> float:
        """What Δ is multiplied by before sending: 1 by steps; per million tokens otherwise (see
        :mod:`diloco.engine.budget`)."""
        return 1.0 if self.budget.by_steps else PER_TOKENS / max(weight, 1.0)

    def applied_scale(self, flight: InFlight, result: Any) -> float:
        """What the averaged Δ is multiplied by before it is applied: undoes :meth:`send_scale` with the
        group's mean tokens per island (Σ Δᵢ / n)."""
        if flight.scale == 1.0:
            return 1.0
        return result.total_weight / max(result.group_size, 1) / PER_TOKENS

    def report(self) -> dict[str, float]:
        """What the island tells the group with its next pseudo-gradient: the inner steps of the round it is
        sending and, for ``auto``, the compute seconds per step and its last round's stall."""
        isl = self.island
        steps = isl.inner_step - self.mark[2]
        return {"steps": steps, "comm_seconds": self.last_comm_seconds,
                "step_seconds": (isl.stats.compute_seconds - self.mark[0]) / steps if steps else float("nan")}

    def finished(self, result: Any, stall: float) -> None:
        """A round this island took part in ended after keeping it from training ``stall`` seconds: remember
        that, and under ``auto`` set the budget from the group's reports (identical on every member: they
        all hold the same reports): after the first round, H steps of the fastest member; from then on
        :func:`~diloco.engine.budget.auto_seconds` of the stalls."""
        self.last_comm_seconds = float(stall)
        if self.budget.kind != "auto" or not getattr(result, "ok", False):
            return
        reports = list(getattr(result, "gathered", {}).values())
        stalls = [float(m.get("comm_seconds", float("nan"))) for m in reports]
        steps = [float(m.get("step_seconds", float("nan"))) for m in reports]
        if any(c == c for c in stalls):
            self.auto = auto_seconds(stalls, self.max_comm_fraction)
        elif any(s == s for s in steps):
            self.auto = min(s for s in steps if s == s) * self.island.cfg.diloco.inner_steps

    def apply_due(self) -> bool:
        """Collective: whether the round in flight is to be applied now (before the next inner step)."""
        f, isl = self.flight, self.island
        if f is None or isl.inner_step - f.sent_at < self.tau:
            return False
        if self.mode == "none":
            return True
        # islands of one torch world finish their rounds together (the fallback's collectives span them)
        return isl.rt.reduce([float(f.pending.done())], op="min", world=isl.rt.lockstep)[0] > 0

    # --------------------------------------------------------------------- local parameters
    def _restart_budget(self) -> int:
        """Start counting the next round's budget now; returns the inner steps since the last start."""
        isl = self.island
        steps = isl.inner_step - self.mark[2]
        self.mark = (isl.stats.compute_seconds, isl.stats.tokens, isl.inner_step)
        self.skew = 0.0
        return steps

    def aligned(self, f: InFlight) -> None:
        """Collective, when ``f`` is applied: under a budget of seconds, count the next round from when the
        group of ``f`` formed rather than from this island's send.  An island that sent early trains on
        while it waits for the others (rounds in flight); counting from its own send it would send every
        later round that much early again and wait as long each time, its rounds in flight staying stale
        by the run's first offset.  Counting from the group, every member's next round falls due at once."""
        if self.budget.kind == "tokens" or self.by_steps_now():
            return
        early = 0.0 if f.compute_at_formed is None else max(0.0, f.compute_at_formed - self.mark[0])
        if self.mark[2] == f.sent_at:  # the budget was not restarted since (an adopted state restarts it)
            self.skew = self.island.rt.reduce([early], op="max")[0]

    @torch.no_grad()
    def sent(self, f: InFlight) -> None:
        """Right after ``f`` was sent: remember where the island trains from (and jump, if eager)."""
        f.steps = self._restart_budget()
        if self.mode == "none":
            return
        params = self.island.params
        if self.mode == "eager":
            f.undo = {n: params[n].detach().clone() for n in f.names}
            for n, theta in self.island.outer.peek({n: f.delta[n] for n in f.names}).items():
                params[n].copy_(theta)
        f.anchor = {n: params[n].detach().clone() for n in f.names}

    @torch.no_grad()
    def committed(self, f: InFlight) -> None:
        """θ_global moved by the round of ``f``: bring the fragment's parameters onto it (onto θ_global − β·e
        when the codec's unsent part e waits in the parameters: ``--averaging.error_feedback_in params``)."""
        isl, params = self.island, self.island.params
        self._unscale_feedback(f)
        unsent = self._unsent(f.fragment)
        if self.mode == "none":
            for n in f.names:
                target = isl.outer.master[n].to(params[n].device, params[n].dtype)
                if n in unsent:
                    target = target - unsent[n].to(target.device, target.dtype)
                params[n].copy_(target if not self.alpha else params[n].lerp(target, 1 - self.alpha))
            self.tokens_at_sync[f.fragment] = isl.stats.tokens
            return
        for n in f.names:
            params[n].add_(isl.outer.master[n].to(params[n].device, params[n].dtype) - f.anchor[n])
            if n in unsent:
                params[n].sub_(unsent[n].to(params[n].device, params[n].dtype))
        self.tokens_at_sync[f.fragment] = f.tokens_at_send

    def _feedback_in_params(self) -> bool:
        """Whether a codec's unsent part waits in the parameters (``--averaging.error_feedback_in params``)."""
        isl = self.island
        return isl.keeps_unsent and isl.cfg.averaging.error_feedback_in == "params"

    def _owned(self, fragment: int) -> list[int]:
        """The buckets of ``fragment`` this rank owns (whose error feedback it keeps)."""
        ex, buckets = self.island.exchange, self.buckets(fragment)
        chosen = range(len(self.island.layout.buckets)) if buckets is None else buckets
        return [b for b in chosen if ex.owner[b] == ex.rank]

    def _unscale_feedback(self, f: InFlight) -> None:
        """The round of ``f`` committed: bring the unsent part e it left from the units Δ travelled in
        (:meth:`send_scale`) back to the parameters' when e waits in them, so that the parameters take the
        right amount and checkpoints and ``unsent_norm`` say what they hold back.  In a buffer e stays in the
        travelling units, in which it is re-sent."""
        feedback = self.island.feedback
        if f.scale != 1.0 and self._feedback_in_params():
            for b in self._owned(f.fragment):
                if b in feedback:
                    feedback[b] = feedback[b] / f.scale

    def _unsent(self, fragment: int) -> Params:
        """Collective: ``{name: β·e}`` of the fragment's parameters on this rank, e being what the codec left
        unsent of the island's Δ in the round just committed; empty unless it waits in the parameters."""
        isl = self.island
        if not self._feedback_in_params():
            return {}
        beta = isl.cfg.averaging.error_feedback_decay
        mine = {b: beta * isl.feedback[b] if b in isl.feedback else torch.zeros(isl.layout.buckets[b].numel)
                for b in self._owned(fragment)}
        return isl.exchange.scatter(mine, self.buckets(fragment))

    @torch.no_grad()
    def rolled_back(self, f: InFlight) -> None:
        """θ_global stayed: the island keeps its own progress (and, if eager, takes the proxy jump back);
        the next Δ of the fragment carries both rounds."""
        if self.mode != "eager" or not f.undo:
            return
        params = self.island.params
        for n in f.names:
            params[n].add_(f.undo[n].to(params[n].device) - f.anchor[n])

    def adopted(self, phase: int | None = None) -> None:
        """θ_global was replaced by a downloaded one and the parameters reset to it.  ``phase``: where the
        island that served it stood in its H-step cycle (:meth:`phase`).  The steps schedule takes it on:
        an island that adopted the state a round in flight committed mid-way through the others' next round
        would otherwise send its own H steps later than they do, miss their group, catch up again, and
        trail the run by the same phase round after round, never averaging again."""
        self._restart_budget()
        if phase is not None and self.by_steps_now():
            self.offset = (int(phase) - self.island.inner_step) % self.island.cfg.diloco.inner_steps
        self.tokens_at_sync = [self.island.stats.tokens] * self.n

    # ------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (taken with no round in flight)."""
        return {"tokens_at_sync": list(self.tokens_at_sync), "auto": self.auto,
                "last_comm_seconds": self.last_comm_seconds, "mark": list(self.mark), "offset": self.offset,
                "skew": self.skew}

    def load_state_dict(self, state: dict[str, Any] | None, legacy_tokens_at_sync: int) -> None:
        """Restore :meth:`state_dict` (None: a checkpoint from before fragments, with one counter)."""
        if not state:
            self.tokens_at_sync = [legacy_tokens_at_sync] * self.n
            return
        self.tokens_at_sync = [int(t) for t in state["tokens_at_sync"]]
        self.auto = state.get("auto")
        self.last_comm_seconds = float(state.get("last_comm_seconds", float("nan")))
        compute, tokens, step = state.get("mark", (0.0, 0, 0))
        self.mark = (float(compute), int(tokens), int(step))
        self.offset = int(state.get("offset", 0))
        self.skew = float(state.get("skew", 0.0))
