"""What every part of a round works with, built once by the island (:class:`RoundContext`): the settings,
the runtimes, the run's counters and schedule, the outer optimizer and this rank's parameters, the island's
exchange and peer node, the state transfer, the codec's unsent part, the hooks, the norm and its guard."""

from __future__ import annotations

import math
from typing import Any

import torch

from diloco.config import AveragingConfig, DilocoConfig
from diloco.engine.faults import FaultPlan
from diloco.engine.metrics import RunStats
from diloco.engine.round.hooks import FaultHook, MembershipHook, RoundHook
from diloco.engine.round.schedule import RoundSchedule
from diloco.engine.runtime import Runtime
from diloco.engine.state_transfer import StateTransfer
from outer_optim import OuterOptimizer
from outer_optim.compression import may_drop
from outer_optim.guard import NormGuard
from peers import BucketExchange, CanonicalLayout, FeedbackBuffers, PeerNode, spec_tuple

Params = dict[str, torch.Tensor]


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


class RoundContext:
    """The collaborators of the island's rounds, built once and shared by
    :class:`~diloco.engine.round.rounds.OuterRounds`, the rounds in flight and
    :class:`~diloco.engine.round.transaction.RoundTransaction` (every rank of the island builds its own, alike).

    Collective: given the island's parts (``params``: this rank's local shards, sharing storage with the model's
    parameters; ``exchange``: the island's exchange of canonical buckets between its ranks; ``unsent``: what a lossy
    codec left unsent of the island's pseudo-gradients; ``fingerprint``: the config fingerprint islands must share;
    ``faults``: the scripted faults the rounds inject, ``DILOCO_FAULTS``), it builds the schedule, the state
    transfer, the hooks, the island's norm and its guard.  ``round_rt`` is the runtime whose process groups a
    round's collectives use (groups of their own when a thread of its own runs the round, so that they never
    interleave with the training thread's; the exchange and the peer node are built over it)."""

    def __init__(self, d: DilocoConfig, a: AveragingConfig, *, rt: Runtime, round_rt: Runtime, stats: RunStats,
                 layout: CanonicalLayout, specs: dict[str, Any], outer: OuterOptimizer, params: Params,
                 exchange: BucketExchange, peers: PeerNode, unsent: FeedbackBuffers, fingerprint: str,
                 faults: FaultPlan):
        self.d, self.a, self.rt, self.round_rt, self.stats = d, a, rt, round_rt, stats
        self.outer, self.params, self.exchange, self.peers = outer, params, exchange, peers
        self.unsent, self.fingerprint = unsent, fingerprint
        self.schedule = RoundSchedule(d, rt, stats, layout, list(params))
        self.transfer = StateTransfer(a, rt=round_rt, stats=stats, outer=outer, params=params, exchange=exchange,
                                      peers=peers, schedule=self.schedule, forget_unsent=unsent.clear,
                                      fingerprint=fingerprint)
        # the registry's hook first: a scripted lie about the step (leap) overwrites what it announced after a round
        self.hooks: list[RoundHook] = [MembershipHook(peers), FaultHook(faults, outer, a.matchmaking_time + 6.0,
                                                                        lambda: peers.membership,
                                                                        lambda: peers.averager)]
        self.norm = IslandNorm(round_rt, layout, specs)
        self.guard = NormGuard(a.max_norm_ratio)
        self.background = d.round_thread and not rt.lockstep
        """Whether rounds run on a thread of their own (islands of one torch world average in lockstep: never)."""
        self.keeps_unsent = may_drop(a.compression) and a.error_feedback
        """Whether a codec's unsent part is carried into later rounds (:attr:`unsent` fills)."""

    @property
    def blocking(self) -> bool:
        """Whether every round is applied the moment it is sent (plain DiLoCo's loop)."""
        return self.d.overlap == "none" and self.d.overlap_steps == 0
