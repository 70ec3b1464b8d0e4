"""A round in flight: sent and not yet applied.  One small class per ``--diloco.overlap`` mode says what the
island trains from meanwhile and how its parameters follow the outcome (as torchft keeps one object per
fragment); the round's own thread (``--diloco.round_thread``) is a :class:`RoundJob`.

- :class:`Blocking` (``none``): the result is applied exactly τ = ``overlap_steps`` inner steps after sending,
  waiting for it if it has not arrived; the fragment's parameters then become α·θ_local + (1−α)·θ_global (τ = 0,
  α = 0, P = 1: plain blocking DiLoCo);
- :class:`Delayed`: at the first inner step at least τ steps after sending at which the result has arrived on
  every rank; the island trained on from its own parameters meanwhile, and that progress is moved onto the new
  θ_global: θ_local ← θ_global + (θ_local − θ_local at sending);
- :class:`Eager` (after Kale et al. 2025): as delayed, but at sending the island jumps to θ_global stepped with
  its own fresh Δ as a proxy for the average (where the outer step would land if every island had sent that Δ),
  and trains from there; the true average replaces the proxy when it arrives.  Kale et al.'s islands restart
  every round from θ_global, so their proxy adds their share of Δ to a start that lacks all of it; ours keep
  their own progress while a round is in flight, and a jump by their share alone would pull them back by the
  rest of their own Δ, which they would learn again and send twice (measured over 12 rounds: +29.8% held-out
  loss against blocking; +8.0% and +2.9% in two runs with the whole Δ).  A rolled-back round takes the jump
  back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from outer_optim import OuterOptimizer

Params = dict[str, torch.Tensor]
Delta = dict[str, torch.Tensor]
"""A pseudo-gradient: parameter name → this rank's shard of Δ = θ_global − θ_local."""


def _copies(params: Params, names: list[str]) -> Params:
    return {n: params[n].detach().clone() for n in names}


@dataclass(kw_only=True)
class InFlight:
    """A round sent and not yet applied: what it sends, where it stands, and (in the subclass of its overlap mode)
    what the island trains from meanwhile."""

    waits: ClassVar[bool] = False
    """Whether the round is applied τ steps after sending whether or not its result has arrived (waiting for it),
    rather than at the first step after that at which it has."""

    rnd: int
    fragment: int
    names: list[str]
    """This rank's parameters in the round's fragment."""
    weight: float
    meta: dict
    sent_at: int
    """The island's inner step when it was sent."""
    tokens_at_send: int
    t_sent: float
    tau: int = 0
    """Inner steps the round runs under at least (``--diloco.overlap_steps``)."""
    scale: float = 1.0
    """Δ is sent times this (per-token pseudo-gradients under a budget other than steps)."""
    delta: Params = field(default_factory=dict)
    pending: Any = None
    """The averager's handle (``start`` → ``finish``)."""
    steps: int = 0
    """Inner steps the island trained since its previous round was sent."""
    send_seconds: float = 0.0
    compute_at_formed: float | None = None
    """``stats.compute_seconds`` when the round's group formed (this rank saw its all-reduce start)."""
    source: Params = field(default_factory=dict)
    """Where Δ is taken from when a thread of its own runs the round: the parameters at sending (a copy of them
    when the island trains on meanwhile, the parameters themselves when it waits)."""
    job: RoundJob | None = None
    """The round's thread (``--diloco.round_thread``; None: the round runs on the training thread)."""

    def ripe(self, inner_step: int) -> bool:
        """Whether τ inner steps have passed since the round was sent."""
        return inner_step - self.sent_at >= self.tau

    def arrived(self) -> bool:
        """Whether the round has ended on this rank (its thread, or its averager)."""
        return self.job.done() if self.job is not None else self.pending.done()

    def outgoing(self) -> Delta:
        """What the round sends: Δ, per million tokens under a budget other than steps."""
        if self.scale == 1.0:
            return self.delta
        return {n: d * self.scale for n, d in self.delta.items()}

    def opened(self, outer: OuterOptimizer) -> None:
        """Δ was taken and the averager started (on the round's thread, if it has one)."""

    def train_from_meanwhile(self, params: Params) -> None:
        """Right after the round was sent or handed to its thread: set up what the island trains from."""

    def follow(self, params: Params, theta: Params, unsent: Params, tokens: int) -> int:
        """θ_global moved by this round: bring the fragment's parameters onto it (onto θ_global − β·e where the
        codec's unsent part e waits in the parameters, ``unsent``).  Returns the tokens the fragment's parameters
        now stand at (``tokens``: the island's now), from which its next Δ's weight counts."""
        raise NotImplementedError

    def keep_own_progress(self, params: Params) -> None:
        """θ_global stayed: the island keeps its own progress; the fragment's next Δ carries both rounds."""

    def release(self) -> None:
        """Let go of what the round held once it was applied.  Its thread and its averager's callback refer back
        to it, and such a cycle is freed only when Python's cycle collector next runs: rounds later, with Δ and
        the parameters kept at sending (on a GPU, 5 GB each at 1b) still held, round after round."""
        self.job = self.pending = None
        self.delta, self.source = {}, {}


@dataclass(kw_only=True)
class Blocking(InFlight):
    """``--diloco.overlap none``: applied τ steps after sending, waiting for the result; the parameters then take
    θ_global, or merge with it (α·θ_local + (1−α)·θ_global)."""

    waits: ClassVar[bool] = True
    alpha: float = 0.0
    """``--diloco.merge_alpha``."""

    @torch.no_grad()
    def follow(self, params: Params, theta: Params, unsent: Params, tokens: int) -> int:
        for n in self.names:
            target = theta[n].to(params[n].device, params[n].dtype)
            if n in unsent:
                target = target - unsent[n].to(target.device, target.dtype)
            params[n].copy_(target if not self.alpha else params[n].lerp(target, 1 - self.alpha))
        return tokens


@dataclass(kw_only=True)
class Delayed(InFlight):
    """``--diloco.overlap delayed``: the island trains on from its own parameters; the progress it made since
    sending moves onto the new θ_global."""

    anchor: Params = field(default_factory=dict)
    """This rank's fragment parameters right after sending: the progress made since is kept."""

    @torch.no_grad()
    def train_from_meanwhile(self, params: Params) -> None:
        # the copy taken at sending for the round's thread is where the island trains from
        self.anchor = self.source or _copies(params, self.names)

    @torch.no_grad()
    def follow(self, params: Params, theta: Params, unsent: Params, tokens: int) -> int:
        for n in self.names:
            params[n].add_(theta[n].to(params[n].device, params[n].dtype) - self.anchor[n])
            if n in unsent:
                params[n].sub_(unsent[n].to(params[n].device, params[n].dtype))
        return self.tokens_at_send

    def release(self) -> None:
        super().release()
        self.anchor = {}


@dataclass(kw_only=True)
class Eager(Delayed):
    """``--diloco.overlap eager``: as :class:`Delayed`, from θ_global stepped with the island's own Δ (the
    proxy) instead of its own parameters; a rolled-back round takes the jump back."""

    proxy: Params = field(default_factory=dict)
    """Where the island jumps at sending: θ_global stepped with its own Δ."""
    undo: Params = field(default_factory=dict)
    """The parameters before the jump, where a rolled-back round puts the island back."""

    def opened(self, outer: OuterOptimizer) -> None:
        self.proxy = outer.peek({n: self.delta[n] for n in self.names})

    @torch.no_grad()
    def train_from_meanwhile(self, params: Params) -> None:
        self.undo = self.source or _copies(params, self.names)
        if self.job is not None:
            self.job.wait_sent()  # the jump needs the island's own Δ
        for n, theta in self.proxy.items():
            params[n].copy_(theta)
        self.anchor = _copies(params, self.names)

    @torch.no_grad()
    def keep_own_progress(self, params: Params) -> None:
        if not self.undo:
            return
        for n in self.names:
            params[n].add_(self.undo[n].to(params[n].device) - self.anchor[n])

    def release(self) -> None:
        super().release()
        self.undo, self.proxy = {}, {}


FLIGHTS: dict[str, type[InFlight]] = {"none": Blocking, "delayed": Delayed, "eager": Eager}
"""The class of a round in flight, by ``--diloco.overlap``."""


class RoundJob:
    """One round run by a thread of its own: the training thread hands it over and goes on training."""

    def __init__(self, run: Callable[[RoundJob], Any], device: torch.device):
        self.sent = threading.Event()
        """Set once the round was sent (or left out): what eager waits for before it jumps."""
        self.settled: Any = None
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

    def wait(self) -> Any:
        """Wait for the round's end (what its run returned); raise what the round thread raised, if anything."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.settled is not None
        return self.settled
