"""What the trainer's rounds hold of an island's averager: one interface, whichever averager it is."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

import torch

from peers.result import RoundResult

Averaged = dict[str, torch.Tensor]
"""This rank's pieces of the group's averaged pseudo-gradient, by parameter name."""


class Pending(Protocol):
    """A round an averager started and has not finished."""

    def done(self) -> bool:
        """Whether this rank's part of the round has ended (no collective)."""


class IslandAverager(Protocol):
    """An island's averager (:class:`~peers.averaging.sharded.ShardedAverager`,
    :class:`~peers.averaging.local.LocalAverager`): collective over the island's ranks where it says so."""

    def start(self, deltas: Mapping[str, torch.Tensor], weight: float, metadata: dict, round_id: str,
              on_stage: Callable[[str], None] | None = None, matchmaking_timeout: float | None = None,
              buckets: Collection[int] | None = None, expected_group_size: int | None = None) -> Pending:
        """Begin a round with this rank's ``deltas`` (weight: the tokens they stand for); it runs in the
        background until :meth:`finish`."""

    def finish(self, pending: Any) -> tuple[RoundResult, Averaged | None]:
        """Wait for the round :meth:`start` began: its result, and the averaged values when it succeeded."""

    def average(self, deltas: Mapping[str, torch.Tensor], weight: float, metadata: dict, round_id: str,
                on_stage: Callable[[str], None] | None = None, matchmaking_timeout: float | None = None,
                buckets: Collection[int] | None = None, expected_group_size: int | None = None
                ) -> tuple[RoundResult, Averaged | None]:
        """One whole round: :meth:`start`, then :meth:`finish`."""

    def commit(self, pending: Any) -> None:
        """The island applied the round: keep what its codec left unsent."""

    def decline(self, round_id: str) -> None:
        """The island takes no part in ``round_id``: islands that took it for the round's leader are sent on."""

    def asked(self, round_id: str) -> dict[str, list[float] | None]:
        """The islands that asked this island to join ``round_id`` before it reached it, and the digest of the
        θ_global each enters it with (rank 0)."""

    def attack(self, outer_step: int, how: str) -> None:
        """Fault injection: attack ``outer_step``'s rounds (see :meth:`peers.group.averager.VerifiedAverager.attack`:
        ``lie`` in the vote, ``forge-parts``, ``forge-verdicts``)."""

    @property
    def committed(self) -> list[str]:
        """The run's committed roster as this island holds it: the islands that committed the last round it
        committed or adopted (rank 0; [] elsewhere, and for an averager that averages with nobody)."""

    @committed.setter
    def committed(self, islands: Collection[str]) -> None:
        """Adopt another island's committed roster (with its θ_global)."""

    @property
    def strikes(self) -> dict[str, int]:
        """The strikes the run holds against members (island id → rejected committed rounds), kept like
        :attr:`committed`."""

    @strikes.setter
    def strikes(self, strikes: Mapping[str, int]) -> None:
        """Adopt another island's strikes (with its θ_global)."""

    def shutdown(self) -> None:
        """Stop the averager's threads and processes."""
