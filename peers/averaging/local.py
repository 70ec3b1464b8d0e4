"""An averager for a run without peers: every round is a group of one."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import torch

from outer_optim.tensors import all_finite
from peers.result import RoundResult


@dataclass
class Finished:
    """A round that ended when it started."""

    outcome: tuple[RoundResult, dict[str, torch.Tensor] | None]

    def done(self) -> bool:
        return True


class LocalAverager:
    """Same interface as :class:`peers.averaging.sharded.ShardedAverager`, averaging with nobody.

    Useful for a single-island run (plain local SGD with an outer optimizer) and for tests of the
    outer step that must not depend on the network.  Every rank of an island keeps its own shards.
    """

    peer_id = "local"
    committed: list[str] = []
    """Nobody else commits a round: the roster stays empty."""
    strikes: dict[str, int] = {}
    """Nobody to strike."""

    def __init__(self) -> None:
        self._out: dict[str, torch.Tensor] = {}
        """The average handed out, one buffer per tensor kept from round to round: a fresh copy of a 1b
        model's Δ each round paid its 5 GB of first-touch page faults again (seconds on a GPU host)."""

    def average(self, deltas: Mapping[str, torch.Tensor], weight: float, metadata: dict, round_id: str,
                on_stage: Callable[[str], None] | None = None, matchmaking_timeout: float | None = None,
                buckets: Collection[int] | None = None, expected_group_size: int | None = None
                ) -> tuple[RoundResult, dict[str, torch.Tensor] | None]:
        """Return this island's own ``{name: Δ}`` as the group's average."""
        t0 = time.perf_counter()
        if not all(all_finite(d) for d in deltas.values()):
            return RoundResult(False, "this island's pseudo-gradient is not finite"), None
        out = {n: self._buffer(n, d).copy_(d.detach()) for n, d in deltas.items()}
        return RoundResult(True, backend="local", group_size=1, peers=[self.peer_id], total_weight=float(weight),
                           seconds=time.perf_counter() - t0, gathered={self.peer_id: dict(metadata)}), out

    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        kept = self._out.get(name)
        if kept is None or kept.shape != like.shape or kept.dtype != like.dtype or kept.device != like.device:
            kept = self._out[name] = torch.empty_like(like)
        return kept

    def start(self, deltas: Mapping[str, torch.Tensor], weight: float, metadata: dict, round_id: str,
              on_stage: Callable[[str], None] | None = None, matchmaking_timeout: float | None = None,
              buckets: Collection[int] | None = None, expected_group_size: int | None = None) -> Finished:
        """The round of :meth:`average`, already over (the same interface as :meth:`ShardedAverager.start`)."""
        return Finished(self.average(deltas, weight, metadata, round_id, on_stage))

    def finish(self, pending: Finished) -> tuple[RoundResult, dict[str, torch.Tensor] | None]:
        """The outcome of a round :meth:`start` ran."""
        return pending.outcome

    def decline(self, round_id: str) -> None:
        """Nobody takes it for a leader."""

    def asked(self, round_id: str) -> dict[str, list[float] | None]:
        """Nobody asks."""
        return {}

    def attack(self, outer_step: int, how: str) -> None:
        """No peers to attack."""

    def set_state_priority(self, outer_step: int) -> None:
        """Nothing to advertise."""

    def shutdown(self) -> None:
        """Nothing to stop."""

    def commit(self, pending: Finished) -> None:
        """No codec, no error feedback to keep."""
