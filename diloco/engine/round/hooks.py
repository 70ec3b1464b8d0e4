"""What happens around a round without being part of its transaction: scripted faults and the run's member
registry, as :class:`RoundHook` objects the transaction calls at each of its moments."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from diloco.engine.faults import CLAIM, FLIP, GROW, LEAP, SCALE, FaultPlan
from outer_optim import OuterOptimizer
from peers import PeerNode, digest

Delta = dict[str, torch.Tensor]
"""A pseudo-gradient: parameter name → this rank's shard of Δ = θ_global − θ_local."""


class RoundHook:
    """Something that happens around a round without being part of the transaction (no-op defaults)."""

    def before(self, rnd: int) -> None:
        """Before the round starts (θ_global as it enters the round is not taken yet)."""

    def starting(self, rnd: int, state: list[float]) -> None:
        """The island enters round ``rnd`` from the θ_global whose fingerprint is ``state``."""

    def outgoing(self, rnd: int, delta: Delta) -> Delta:
        """The pseudo-gradient about to be sent (a hook may replace it)."""
        return delta

    def claimed(self, rnd: int, weight: float) -> float:
        """The weight declared for the pseudo-gradient about to be sent (a hook may replace it)."""
        return weight

    def stage(self, rnd: int, phase: str) -> None:
        """The averager entered ``phase`` (matchmaking, allreduce, vote)."""

    def after(self, outer_step: int) -> None:
        """After the round was committed or rolled back; ``outer_step``: the island's outer step now."""


class FaultHook(RoundHook):
    """Scripted faults (``DILOCO_FAULTS``): drifted θ_global, rogue Δ and weights, kills and stalls in a phase.
    Hooks see the 0-based outer step; faults, like every message, count rounds from 1."""

    def __init__(self, plan: FaultPlan, outer: OuterOptimizer, late_seconds: float,
                 membership: Callable[[], Any] = lambda: None, averager: Callable[[], Any] = lambda: None):
        self.plan, self.outer, self.late_seconds, self.membership = plan, outer, late_seconds, membership
        self.averager = averager

    def before(self, rnd: int) -> None:
        averager = self.averager()
        for fault, how in ((("lie", "vote"), "lie"), (("nan", "send"), "nan"), (("forge", "send"), "forge-parts"),
                           (("forge", "vote"), "forge-verdicts")):
            if averager is not None and self.plan.has(*fault, rnd + 1):
                averager.attack(rnd, how)
        if self.plan.has("late", "send", rnd + 1):
            time.sleep(self.late_seconds)
        if self.plan.has("drift", "theta", rnd + 1):
            with self.outer.lock, torch.no_grad():
                for m in self.outer.theta_global.values():
                    m.add_(1e-3)

    def outgoing(self, rnd: int, delta: Delta) -> Delta:
        if self.plan.has("noise", "send", rnd + 1):
            g = torch.Generator().manual_seed(rnd)
            noise = {n: torch.randn(d.shape, generator=g, dtype=torch.float32).to(d) for n, d in delta.items()}
            delta = {n: x * (delta[n].norm() / x.norm().clamp_min(1e-30)) for n, x in noise.items()}
        factor = (SCALE if self.plan.has("scale", "send", rnd + 1) else 1.0) * \
            (FLIP if self.plan.has("flip", "send", rnd + 1) else 1.0) * GROW ** self.plan.into("grow", "send", rnd + 1)
        return delta if factor == 1.0 else {n: d * factor for n, d in delta.items()}

    def claimed(self, rnd: int, weight: float) -> float:
        return weight * CLAIM if self.plan.has("claim", "send", rnd + 1) else weight

    def stage(self, rnd: int, phase: str) -> None:
        self.plan.at(phase, rnd + 1)

    def after(self, outer_step: int) -> None:
        registry = self.membership()
        if registry is not None and self.plan.has("leap", "announce", outer_step):  # after the registry's own
            registry.announce(outer_step + LEAP, averaging=False, held=digest([float(outer_step + LEAP)] * 72))


class MembershipHook(RoundHook):
    """Tells the run's member registry when this island averages and which outer step it holds, and keeps
    the addresses of the live islands (:meth:`PeerNode.remember_peers`)."""

    def __init__(self, peers: PeerNode):
        self.peers = peers

    def starting(self, rnd: int, state: list[float]) -> None:
        # the digest of the θ_global it holds, for islands catching up to check their downloads against; after the
        # round it is not known until the next one starts (another collective a round cost multi-rank islands
        # under load the timing their rosters need)
        if self.peers.membership is not None:  # stored off the training thread: joins carry the digest too
            self.peers.membership.announce(rnd, averaging=True, held=digest(state), wait=False)

    def after(self, outer_step: int) -> None:
        if self.peers.membership is not None:
            # off the training thread: a DHT store and a read of the registry held every blocking round 20-40 ms
            self.peers.membership.announce(outer_step, averaging=False, wait=False)
            self.peers.remember_peers(wait=False)
