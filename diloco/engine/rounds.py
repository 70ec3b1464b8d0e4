"""The outer rounds of an island, top to bottom: when they fall due, what the island trains from while one
is in flight, and each round as one transaction (as torchft's DiLoCo sync).

A round, read in the order :class:`OuterRounds` runs it:

1. **due** (:meth:`RoundSchedule.sync_due`): every H / P inner steps (``--diloco.fragments P``: Streaming
   DiLoCo; round ``r`` averages fragment ``r mod P``), or every 1/P of another budget (``--diloco.sync_every``:
   seconds of compute, tokens, auto; :mod:`diloco.config.budget`);
2. **send** (:meth:`OuterRounds.send`): an island the run moved past catches up instead (its inner steps are
   dropped, never sent as a stale Δ); an island whose θ_global the others outvote leaves the round out and
   takes their result; otherwise pseudo-gradient Δ = θ_global − θ_local of the round's fragment → the
   averager (which runs the round in the background) → what the island trains from meanwhile;
3. **apply** (:meth:`OuterRounds.apply`), at the latest when the next round is due, earlier as
   ``--diloco.overlap`` says: wait for the averager → a group that lost a member averages once more among
   the members left → validate (the averager's vote and finiteness checks, the norm guard, a θ_global that
   stays finite) → **commit** the outer step (θ_global moves, the parameters follow) or **roll back**
   (θ_global stays, the island keeps training from its own parameters, so the next Δ carries both rounds).

What the island trains from while a round is in flight (``--diloco.overlap``):

- ``none``: the result is applied exactly τ = ``overlap_steps`` inner steps after sending, waiting for it if
  it has not arrived; the fragment's parameters then become α·θ_local + (1−α)·θ_global (τ = 0, α = 0, P = 1:
  plain blocking DiLoCo);
- ``delayed``: at the first inner step at least τ steps after sending at which the result has arrived on
  every rank; the island trained on from its own parameters meanwhile, and that progress is moved onto the
  new θ_global: θ_local ← θ_global + (θ_local − θ_local at sending);
- ``eager`` (after Kale et al. 2025): as ``delayed``, but at sending the island jumps to θ_global stepped
  with its own fresh Δ as a proxy for the average (where the outer step would land if every island had sent
  that Δ), and trains from there; the true average replaces the proxy when it arrives.  Kale et al.'s
  islands restart every round from θ_global, so their proxy adds their share of Δ to a start that lacks all
  of it; ours keep their own progress while a round is in flight, and a jump by their share alone would pull
  them back by the rest of their own Δ, which they would learn again and send twice (measured over 12
  rounds: +29.8% held-out loss against blocking; +8.0% and +2.9% in two runs with the whole Δ).  A
  rolled-back round takes the jump back.

θ_global (the fp32 outer state, what islands vote on, serve and checkpoint) only ever moves by committed
averages, identically on every island, whichever mode each uses.  Fault injection and membership
announcements hang off the round as :class:`RoundHook` objects; what a round did is one
:class:`RoundMetrics`.  Nothing here sees the island: its collaborators are the runtime, the outer
optimizer, the peer node (averager and member registry), the state transfer and the run's statistics.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from diloco.config import AveragingConfig, DilocoConfig
from diloco.config.budget import Budget, auto_seconds, parse_budget
from diloco.engine.faults import FaultPlan
from diloco.engine.metrics import RunStats
from diloco.engine.runtime import Runtime
from diloco.engine.state_transfer import Adoption, StateTransfer
from outer_optim import OuterOptimizer
from outer_optim.guard import NormGuard
from peers import BucketExchange, CanonicalLayout, FeedbackBuffers, PeerNode, RoundResult, round_id, spec_tuple

log = logging.getLogger("diloco")

Params = dict[str, torch.Tensor]
Delta = dict[str, torch.Tensor]
"""A pseudo-gradient: parameter name → this rank's shard of Δ = θ_global − θ_local."""
PER_TOKENS = 1e6
"""Under a budget other than steps, Δ travels per this many tokens (a scale that suits every codec)."""
CAUGHT_UP = "caught-up"
"""The averaging backend of a round this island did not average: it took the run's state from a peer."""


# ---------------------------------------------------------------------------------------------- records
@dataclass(kw_only=True)
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
    exchange_seconds: float = 0.0
    """Of :attr:`allreduce_seconds`, those the exchange of the pseudo-gradient's bytes took (the rest: forming
    the group, the vote, the island's own gather and scatter)."""
    group_seconds: float = 0.0
    """Of :attr:`allreduce_seconds`, those spent forming the round's group: matchmaking, then hivemind's step
    that hands every member the others' metadata."""
    vote_seconds: float = 0.0
    """Of :attr:`allreduce_seconds`, those spent agreeing on the result (the vote)."""
    round_payload_bytes: int = 0
    """Payload bytes the island sent in this round (all its ranks)."""
    parts_resent: int = 0
    """Parts of this round sent again alone after their connection failed (the round went on)."""
    codec: str = ""
    """The codec the round's pseudo-gradient travelled in (``--averaging.compression auto`` picks one each round;
    '' when no exchange began)."""

    @classmethod
    def skipped(cls, stats: RunStats, outer_lr: float, reason: str) -> RoundMetrics:
        """A round this island did not take part in (it caught up with the run instead)."""
        return cls(round_ok=0, num_peers=0, pseudo_grad_norm=float("nan"), averaged_pseudo_grad_norm=float("nan"),
                   allreduce_seconds=0.0, bytes_sent=stats.bytes_sent, bytes_received=stats.bytes_received,
                   payload_bytes_sent=stats.payload_bytes_sent, outer_lr=outer_lr, round_failure=reason,
                   averaging_backend=CAUGHT_UP, used_fallback=0)

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
    """The island's inner step when it was sent."""
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
    source: Params = field(default_factory=dict)
    """Where Δ is taken from: the parameters at sending (the same tensors as :attr:`anchor` when delayed, a
    copy of them when the island trains on meanwhile, the parameters themselves when it waits)."""
    proxy: Params = field(default_factory=dict)
    """eager: where the island jumps at sending (θ_global stepped with its own Δ)."""
    job: RoundJob | None = None
    """The round's thread (``--diloco.round_thread``; None: the round runs on the training thread)."""

    def outgoing(self) -> Delta:
        """What the round sends: Δ, per million tokens under a budget other than steps."""
        if self.scale == 1.0:
            return self.delta
        return {n: d * self.scale for n, d in self.delta.items()}

    def release(self) -> None:
        """Let go of what the round held once it was applied.  Its thread and its averager's callback refer back
        to it, and such a cycle is freed only when Python's cycle collector next runs: rounds later, with Δ
        and the parameters kept at sending (on a GPU, 5 GB each at 1b) still held, round after round."""
        self.job = self.pending = None
        self.delta, self.source, self.anchor, self.undo, self.proxy = {}, {}, {}, {}, {}


@dataclass
class Settled:
    """What a round ended with, before the island's parameters follow it (:meth:`OuterRounds.apply`)."""

    result: RoundResult
    reason: str = ""
    """Why the round was rolled back ('' when it committed)."""
    norm: float = float("nan")
    avg_norm: float = float("nan")
    retried: bool = False
    unsent: Params = field(default_factory=dict)
    """A committed round: β·e of the fragment's parameters, when a codec's unsent part waits in them."""
    skipped: RoundMetrics | None = None
    """A round the island did not average (it caught up, or it was left out): its metrics."""
    adopted: Adoption | None = None
    """Whether (and where in the run's cycle) the island adopted another island's θ_global meanwhile."""


class RoundJob:
    """One round run by a thread of its own: the training thread hands it over and goes on training."""

    def __init__(self, run: Callable[[RoundJob], Settled], device: torch.device):
        self.sent = threading.Event()
        """Set once the round was sent (or left out): what eager waits for before it jumps."""
        self.settled: Settled | None = None
        self.error: BaseException | None = None
        self._run, self._device = run, device
        self.thread = threading.Thread(target=self._main, name="diloco-round", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        try:
            self.settled = self._run(self)
        except BaseException as e:  # handed to the training thread, which raises it
            self.error = e
        finally:
            self._run = None  # the round it ran refers to this job: no cycle left behind
            self.sent.set()

    def done(self) -> bool:
        """Whether the round has ended (settled or failed) on this rank."""
        return not self.thread.is_alive()

    def wait_sent(self) -> None:
        """Wait until the round was sent; raise what the round thread raised, if anything."""
        self.sent.wait()
        if self.error is not None:
            raise self.error

    def wait(self) -> Settled:
        """Wait for the round's end; raise what the round thread raised, if anything."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.settled is not None
        return self.settled


class IslandNorm:
    """The L2 norm of a ``{name: tensor}`` over the whole island (collective), each element counted once:
    a shard held alike by several ranks (replicated under TP) counts on the lowest of them only."""

    def __init__(self, rt: Runtime, layout: CanonicalLayout, specs: dict[str, Any]):
        self.rt = rt
        mine = {n: ("full" if layout.is_full(n, s) else spec_tuple(s)) for n, s in specs.items()}
        seen: set[tuple] = set()
        self.counted: set[str] = set()
        for r, held in enumerate(rt.gather_all(mine)):
            for name, key in held.items():
                if (name, key) not in seen:
                    seen.add((name, key))
                    if r == rt.rank:
                        self.counted.add(name)

    def __call__(self, tensors: dict[str, torch.Tensor]) -> float:
        sq = sum(float(torch.linalg.vector_norm(t.detach())) ** 2 for n, t in tensors.items() if n in self.counted)
        return math.sqrt(self.rt.reduce([sq])[0])


# ------------------------------------------------------------------------------------------------ hooks
class RoundHook:
    """Something that happens around a round without being part of the transaction (no-op defaults)."""

    def before(self, rnd: int) -> None:
        """Before the round starts (θ_global as it enters the round is not taken yet)."""

    def starting(self, rnd: int, state: list[float]) -> None:
        """The island enters round ``rnd`` from the θ_global whose fingerprint is ``state``."""

    def outgoing(self, rnd: int, delta: Delta) -> Delta:
        """The pseudo-gradient about to be sent (a hook may replace it)."""
        return delta

    def stage(self, rnd: int, phase: str) -> None:
        """The averager entered ``phase`` (matchmaking, allreduce, vote)."""

    def after(self, outer_step: int) -> None:
        """After the round was committed or rolled back; ``outer_step``: the island's outer step now."""


class FaultHook(RoundHook):
    """Scripted faults (``DILOCO_FAULTS``): drifted θ_global, rogue Δ, kills and stalls in a phase.
    Hooks see the 0-based outer step; faults, like every message, count rounds from 1."""

    def __init__(self, plan: FaultPlan, outer: OuterOptimizer, late_seconds: float):
        self.plan, self.outer, self.late_seconds = plan, outer, late_seconds

    def before(self, rnd: int) -> None:
        if self.plan.has("late", "send", rnd + 1):
            time.sleep(self.late_seconds)
        if self.plan.has("drift", "theta", rnd + 1):
            with self.outer.lock, torch.no_grad():
                for m in self.outer.theta_global.values():
                    m.add_(1e-3)

    def outgoing(self, rnd: int, delta: Delta) -> Delta:
        if self.plan.has("scale", "send", rnd + 1):
            return {n: d * 1e6 for n, d in delta.items()}
        return delta

    def stage(self, rnd: int, phase: str) -> None:
        self.plan.at(phase, rnd + 1)


class MembershipHook(RoundHook):
    """Tells the run's member registry when this island averages and which outer step it holds, and keeps
    the addresses of the live islands (:meth:`PeerNode.remember_peers`)."""

    def __init__(self, peers: PeerNode):
        self.peers = peers

    def starting(self, rnd: int, state: list[float]) -> None:
        if self.peers.membership is not None:
            self.peers.membership.announce(rnd, averaging=True, state=state)

    def after(self, outer_step: int) -> None:
        if self.peers.membership is not None:
            self.peers.membership.announce(outer_step, averaging=False)
            self.peers.remember_peers()


# --------------------------------------------------------------------------------------------- schedule
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
    def applied_scale(flight: InFlight, result: RoundResult) -> float:
        """What the averaged Δ is multiplied by before it is applied: undoes :meth:`send_scale` with the
        group's mean tokens per island (Σ Δᵢ / n)."""
        if flight.scale == 1.0:
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


# ----------------------------------------------------------------------------------------------- rounds
class OuterRounds:
    """The island's outer rounds: sends them when due, holds the one in flight, applies it as a transaction.

    Every rank of the island builds one and calls it alike (its methods are collective).  ``params`` are
    this rank's local shards (sharing storage with the model's parameters), ``exchange`` the island's
    :class:`~peers.island.exchange.BucketExchange` over ``layout``; ``transfer`` is the island's
    :class:`~diloco.engine.state_transfer.StateTransfer`; ``fingerprint`` the config fingerprint islands
    must share.

    With ``background`` (``--diloco.round_thread``) a round runs on a thread of its own: at sending, the
    training thread copies the fragment's parameters (when it trains on meanwhile) and hands the round over;
    the round thread catches up, fingerprints θ_global, computes Δ, averages, votes, checks and takes the outer
    step; at applying, the training thread only brings its parameters onto the result.  ``round_rt`` is the
    runtime whose process groups the round thread's collectives use (groups of their own, so that they never
    interleave with the training thread's); the exchange, the norm, the peer node and the state transfer
    must be built over it."""

    def __init__(self, d: DilocoConfig, a: AveragingConfig, *, rt: Runtime, stats: RunStats,
                 schedule: RoundSchedule, outer: OuterOptimizer, params: Params, exchange: BucketExchange,
                 norm: IslandNorm, peers: PeerNode, transfer: StateTransfer, unsent: FeedbackBuffers, fingerprint: str,
                 keeps_unsent: bool, hooks: list[RoundHook], round_rt: Runtime | None = None,
                 background: bool = False):
        self.a, self.rt, self.stats, self.schedule = a, rt, stats, schedule
        self.round_rt = round_rt or rt
        self.outer, self.params, self.exchange, self.norm = outer, params, exchange, norm
        self.peers, self.transfer, self.unsent, self.fingerprint = peers, transfer, unsent, fingerprint
        self.keeps_unsent = keeps_unsent
        """Whether a codec's unsent part is carried into later rounds (:attr:`unsent` fills)."""
        self.mode, self.tau, self.alpha = d.overlap, d.overlap_steps, d.merge_alpha
        self.background = background and not rt.lockstep
        """Whether rounds run on a thread of their own (islands of one torch world average in lockstep: never)."""
        self.guard = NormGuard(a.max_norm_ratio)
        self.hooks = hooks
        self.flight: InFlight | None = None
        self._delta_views: dict[str, torch.Tensor] | None = None
        """Where Δ is written each round, allocated once, at start (pinned on a GPU host, so that the copies of
        the parameters into it run asynchronously; pinning gigabytes in the first round held a 1b island's GPU
        for seconds): one flat buffer in the canonical layout's order when the island is one process holding
        every parameter whole (the averager sends its buckets without a copy), else this rank's shards one
        after the other.  None when the outer state is on a GPU: Δ is computed there."""
        if self.outer.device.type == "cpu":
            flat = torch.empty(exchange.layout.total_numel if exchange.whole else outer.flat.numel(),
                               pin_memory=torch.cuda.is_available())
            self._delta_views = exchange.flat_views(flat) if exchange.whole else outer.views(flat)

    @property
    def blocking(self) -> bool:
        """Whether every round is applied the moment it is sent (plain DiLoCo's loop)."""
        return self.mode == "none" and self.tau == 0

    def theta_fingerprint(self) -> list[float]:
        """Collective: fingerprint of the whole θ_global in canonical bucket order, the same on every rank
        and on every island holding the same θ_global, whatever its shape."""
        return self.exchange.canonical_fingerprint(self.outer.theta_global)

    def apply_due(self) -> bool:
        """Collective: whether the round in flight is to be applied now (before the next inner step)."""
        f = self.flight
        if f is None or self.stats.inner_step - f.sent_at < self.tau:
            return False
        if self.mode == "none":
            return True
        # islands of one torch world finish their rounds together (the fallback's collectives span them)
        done = f.job.done() if f.job is not None else f.pending.done()
        return self.rt.reduce([float(done)], op="min", world=self.rt.lockstep)[0] > 0

    # ----------------------------------------------------------------------------------------- send
    def send(self) -> RoundMetrics | None:
        """Collective: catch up if the run moved on without us (the round's metrics), else send the round's
        pseudo-gradient (None: it is in flight until :meth:`apply`).  With :attr:`background` every round is
        in flight: a round the island does not average ends, with its metrics, at :meth:`apply`."""
        t0 = time.perf_counter()
        # hivemind starts its averager from the main thread only: a lonely island's new peer node starts here
        self.peers.rejoin_if_alone(self.transfer.main_decides)
        s, sched = self.stats, self.schedule
        fragment = sched.fragment_of(s.outer_step)
        weight = float(s.tokens - sched.tokens_at_sync[fragment])
        f = InFlight(s.outer_step, fragment, sched.fragment_names[fragment], {}, weight,
                     {"outer_step": s.outer_step, "config_fingerprint": self.fingerprint, **sched.report()}, None,
                     s.inner_step, s.tokens, t0, scale=sched.send_scale(weight))
        if not self.background:
            with self.transfer.deferring() as adopted:
                skipped = self._open(f, self.params)
            if skipped is not None:
                self._adopted(adopted)
                return skipped
            self._train_from_meanwhile(f)
        else:
            with torch.no_grad():
                # what Δ is taken from: the parameters as they are now, kept aside unless the island waits
                f.source = self.params if self.blocking else {n: self.params[n].detach().clone() for n in f.names}
            f.job = RoundJob(lambda job: self._settle(f, job), self.rt.device)
            self._train_from_meanwhile(f)
        sched.sent(f.rnd)
        f.send_seconds = time.perf_counter() - t0
        self.flight = f
        return None

    def _open(self, f: InFlight, source: Params) -> RoundMetrics | None:
        """Collective over the round's groups: catch up if the run moved on without us, or leave the round out
        when outvoted (the round's metrics), else take Δ of ``f``'s fragment from ``source`` and start averaging
        it (None)."""
        if self.transfer.catch_up(counted=1):
            # the others moved on without us: our inner steps are dropped, never sent as a stale Δ
            self.peers.averager.decline(round_id(f.rnd))
            self.stats.rounds_failed += 1
            self.stats.failures.append(f"round {f.rnd + 1}: behind the run, caught up from a peer")
            return RoundMetrics.skipped(self.stats, self.outer.lr, "behind the run; caught up from a peer")
        rnd = f.rnd
        for h in self.hooks:
            h.before(rnd)
        state = self.theta_fingerprint()
        for h in self.hooks:
            h.starting(rnd, state)
        if self.transfer.outvoted(rnd, state, wait=self.blocking):
            return self._leave_out(rnd)
        f.delta = self.outer.pseudo_gradient(source, f.names, out=self._delta_views)
        for h in self.hooks:
            f.delta = h.outgoing(rnd, f.delta)
        f.meta["state_fingerprint"] = state
        # a group forms as soon as every island the registry expects in this round has joined, not after the
        # whole matchmaking window
        expected = self.transfer.main_decides(lambda: self.peers.membership.round_size(rnd)) \
            if self.peers.membership is not None and not self.rt.lockstep else None
        f.pending = self.peers.averager.start(f.outgoing(), f.weight, f.meta, round_id=round_id(rnd),
                                              on_stage=self._on_stage(f), buckets=self.schedule.buckets(f.fragment),
                                              expected_group_size=expected)
        if self.mode == "eager":
            f.proxy = self.outer.peek({n: f.delta[n] for n in f.names})
        return None

    def round(self) -> RoundMetrics:
        """Collective: one whole round, blocking (catch up, or send and apply)."""
        return self.send() or self.apply()

    @torch.no_grad()
    def _train_from_meanwhile(self, f: InFlight) -> None:
        """Right after ``f`` was handed over or sent: remember where the island trains from (and jump, if eager,
        once the round was sent)."""
        f.steps = self.schedule.restart_budget()
        if self.mode == "none":
            return
        if self.mode == "eager":
            f.undo = f.source if f.source else {n: self.params[n].detach().clone() for n in f.names}
            if f.job is not None:
                f.job.wait_sent()  # the jump needs the island's own Δ
            for n, theta in f.proxy.items():
                self.params[n].copy_(theta)
        elif f.source:
            f.anchor = f.source  # delayed: the copy taken at sending is where the island trained from since
            return
        f.anchor = {n: self.params[n].detach().clone() for n in f.names}

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
        self.peers.averager.decline(round_id(rnd))
        resynced = self.transfer.catch_up(force_download=True, wait_for_round=True, counted=1)
        self.stats.rounds_failed += 1
        reason = reason if resynced else f"{reason} (not yet)"
        self.stats.failures.append(f"round {rnd + 1}: {reason}")
        for h in self.hooks:
            h.after(self.stats.outer_step)
        return RoundMetrics.skipped(self.stats, self.outer.lr, reason)

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
            with self.transfer.deferring() as adopted:
                settled = self._close(f)
            settled.adopted = adopted
        if settled.adopted is not None and settled.adopted.phase is not None:
            self._adopted(settled.adopted)
        elif settled.skipped is None and not settled.reason:
            self._follow_theta(f, settled.unsent)
        elif settled.skipped is None:
            self._keep_own_progress(f)
        s, result = self.stats, settled.result
        stall = f.send_seconds + time.perf_counter() - t0
        self.schedule.landed()
        if settled.skipped is not None:
            s.stall_seconds += stall
            return dataclasses.replace(settled.skipped, stall_seconds=stall, send_seconds=f.send_seconds)
        self.schedule.finished(result, stall)
        self.schedule.aligned(f)
        s.stall_seconds += stall
        return RoundMetrics(
            round_ok=int(not settled.reason), num_peers=result.group_size, pseudo_grad_norm=settled.norm,
            averaged_pseudo_grad_norm=settled.avg_norm, allreduce_seconds=result.seconds, bytes_sent=s.bytes_sent,
            bytes_received=s.bytes_received, payload_bytes_sent=s.payload_bytes_sent, outer_lr=self.outer.lr,
            round_failure=settled.reason, averaging_backend=result.backend or "none",
            used_fallback=int(bool(result.fallback_reason)), retried=int(settled.retried),
            overlap_seconds=max(0.0, min(in_flight, result.seconds)), stall_seconds=stall,
            send_seconds=f.send_seconds, fragment=f.fragment, inner_steps=f.steps, weight=f.weight,
            group_weight=float(result.total_weight), unsent_norm=self._unsent_norm(),
            exchange_seconds=float(result.exchange_seconds), round_payload_bytes=int(result.island_bytes_sent),
            group_seconds=float(result.matchmaking_seconds),
            vote_seconds=float(result.vote_seconds),
            parts_resent=int(result.parts_resent), codec=result.codec)

    def _adopted(self, adopted: Adoption) -> None:
        """Another island's θ_global replaced ours during the round (``phase`` None: it did not): train on from it,
        on the round schedule of the island that served it, as from the inner step it was adopted at."""
        if adopted.phase is not None:
            self.outer.copy_to(self.params)
            self.schedule.adopted(adopted.phase if adopted.phase >= 0 else None, adopted.at_step)

    def _settle(self, f: InFlight, job: RoundJob) -> Settled:
        """The round thread's whole round (collective over the round's groups): open it (and tell eager it was
        sent), then close it; another island's θ_global adopted meanwhile reaches the parameters at :meth:`apply`."""
        with self.transfer.deferring() as adopted:
            skipped = self._open(f, f.source)
            job.sent.set()
            settled = Settled(RoundResult(False), skipped=skipped) if skipped is not None else self._close(f)
        settled.adopted = adopted
        return settled

    def _close(self, f: InFlight) -> Settled:
        """Collective over the round's groups: wait for the averager, validate its result, commit the outer step or
        roll the round back (θ_global, the counters, the registry; the parameters follow at :meth:`apply`)."""
        result, averaged = self.peers.averager.finish(f.pending)
        result, averaged, retried = self._average_again(f, result, averaged)
        u = 1.0
        if averaged is not None and f.scale != 1.0:
            u = RoundSchedule.applied_scale(f, result)
            averaged = {n: a.mul_(u) for n, a in averaged.items()}  # the round's own result: scaled in place
        norm = self.norm(f.delta)
        avg_norm = self.norm(averaged) if averaged is not None else float("nan")
        # rounds of a budget other than steps differ in length (auto: H steps, then maybe 50x more): the guard
        # compares their averages per million tokens, as they travelled, not the longer round's larger Δ
        guarded, what = (avg_norm, "") if u == 1.0 or u <= 0 else (avg_norm / u, " per million tokens")
        reason = result.reason or self.guard.check(guarded, what) or self._overflow(averaged)
        settled = Settled(result, reason, norm, avg_norm, retried)
        if reason:
            self._roll_back(f, reason, result)
        else:
            self._commit(f, averaged, guarded)
            self._unscale_feedback(f)
            settled.unsent = self._unsent(f.fragment)
        for h in self.hooks:
            h.after(self.stats.outer_step)
        self.peers.count_bytes(result.bytes_sent, result.bytes_received, through_torch=result.backend == "torch")
        self.stats.comm_seconds += result.seconds
        return settled

    def _average_again(self, f: InFlight, result: RoundResult, averaged: Delta | None
                       ) -> tuple[RoundResult, Delta | None, bool]:
        """Average the same Δ once more instead of rolling the round back, in two cases:

        - the group lost a member mid-round (killed, cut off): the members left go round again under a
          round id of their own, so that a death costs the others a few seconds instead of a round;
        - no group formed although the registry lists a live island at this round that has not joined yet
          (it restarted or caught up and is still training towards it): wait for it once more under the
          same round id, instead of moving on to the next round just as it arrives, one round apart.

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
        elif result.group_size < a.min_group_size and self.transfer.main_decides(
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
        self.transfer.after_commit()
        self.stats.rounds_ok += 1
        self.stats.behind = False

    def _roll_back(self, f: InFlight, reason: str, result: RoundResult) -> None:
        rnd = f.rnd
        self.stats.rounds_failed += 1
        self.stats.failures.append(f"round {rnd + 1}: {reason}")
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

    # ------------------------------------------------------------------- the parameters after a round
    @torch.no_grad()
    def _follow_theta(self, f: InFlight, unsent: Params) -> None:
        """θ_global moved by the round of ``f``: bring the fragment's parameters onto it (onto θ_global − β·e
        when the codec's unsent part e waits in the parameters, ``unsent``: ``--averaging.error_feedback_in
        params``)."""
        params, theta = self.params, self.outer.theta_global
        if self.mode == "none":
            for n in f.names:
                target = theta[n].to(params[n].device, params[n].dtype)
                if n in unsent:
                    target = target - unsent[n].to(target.device, target.dtype)
                params[n].copy_(target if not self.alpha else params[n].lerp(target, 1 - self.alpha))
            self.schedule.tokens_at_sync[f.fragment] = self.stats.tokens
            return
        for n in f.names:
            params[n].add_(theta[n].to(params[n].device, params[n].dtype) - f.anchor[n])
            if n in unsent:
                params[n].sub_(unsent[n].to(params[n].device, params[n].dtype))
        self.schedule.tokens_at_sync[f.fragment] = f.tokens_at_send

    @torch.no_grad()
    def _keep_own_progress(self, f: InFlight) -> None:
        """θ_global stayed: the island keeps its own progress (and, if eager, takes the proxy jump back);
        the next Δ of the fragment carries both rounds."""
        if self.mode != "eager" or not f.undo:
            return
        for n in f.names:
            self.params[n].add_(f.undo[n].to(self.params[n].device) - f.anchor[n])

    def _feedback_in_params(self) -> bool:
        """Whether a codec's unsent part waits in the parameters (``--averaging.error_feedback_in params``)."""
        return self.keeps_unsent and self.a.error_feedback_in == "params"

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

    def _unsent_norm(self) -> float:
        """Collective: the norm of the island's error feedback over all its ranks (NaN when it keeps none)."""
        if not self.keeps_unsent:
            return float("nan")
        sq = sum(float(e.double().pow(2).sum()) for e in self.unsent.feedback.values())
        return math.sqrt(self.rt.reduce([sq])[0])
