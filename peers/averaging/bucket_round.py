"""What a sharded round is made of: a round in flight on one rank, what an island tells its ranks, and the
island's result."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from peers.result import RoundResult
from peers.settings import AveragerSettings

SHARED = ("ok", "reason", "group_size", "total_weight", "peers", "gathered", "majority_peers", "in_minority",
          "retryable", "members_left", "left_behind", "exchange_seconds", "matchmaking_seconds", "allreduce_seconds",
          "vote_seconds", "codec", "groups", "rejected")
"""The fields of a round's result that the island's rank 0 tells its other ranks (the rest is per rank)."""


def shared_fields(result: RoundResult) -> dict[str, Any]:
    """What rank 0 tells its ranks of the island's round (JSON-ready)."""
    return {k: getattr(result, k) for k in SHARED}


def from_shared(values: dict[str, Any]) -> RoundResult:
    """The island's result as rank 0 told it (anything else in ``values`` is ignored)."""
    known = {f.name for f in fields(RoundResult)}
    return RoundResult(**{k: v for k, v in values.items() if k in SHARED and k in known})


@dataclass
class PendingRound:
    """A round :meth:`peers.averaging.sharded.ShardedAverager.start` began: this rank's gathered buckets and, while
    the round runs in the background, the thread running it."""

    owned: dict[int, torch.Tensor]
    weight: float
    meta: dict
    round_id: str
    refusal: str
    """Why the island does not take part ('' when it does); the same on every rank."""
    t0: float
    buckets: Collection[int] | None
    """The buckets averaged (None: all)."""
    mine: list[int]
    """Of those, the buckets this rank averages with the other islands."""
    thread: threading.Thread | None = None
    ended: float = 0.0
    """``time.perf_counter()`` when this rank's part of the round ended (0 while it has not)."""
    result: RoundResult | None = None
    """The island's result, as this rank learned it."""
    averaged: dict[int, torch.Tensor] = field(default_factory=dict)
    """This rank's buckets, averaged (only when the round succeeded)."""
    bytes_sent: int = 0
    bytes_received: int = 0
    parts_resent: int = 0
    codec: str = ""
    """The codec the round's buckets travel in ('' under ``auto`` until the group picked one)."""
    feedback: dict[int, torch.Tensor] = field(default_factory=dict)
    """With a lossy codec and error feedback: each owned bucket's buffer after this round (kept only if the
    round commits)."""
    carry: dict[int, torch.Tensor] = field(default_factory=dict)
    """With a dense lossy codec, error feedback and the owners' feedback: each owned bucket's owner feedback
    after this round (:attr:`peers.averaging.sharded.ShardedAverager.carry`; kept only if the round commits)."""

    def done(self) -> bool:
        """Whether this rank's part of the round has ended (no island collective)."""
        return self.thread is None or not self.thread.is_alive()

    def wait(self, s: AveragerSettings, slack: float = 30.0) -> RoundResult:
        """Wait for this rank's part of the round (bounded by the timeouts of ``s`` plus ``slack``)."""
        if self.thread is not None:
            deadline = self.t0 + s.matchmaking_timeout + 2 * s.allreduce_timeout + s.vote_timeout + slack
            self.thread.join(max(0.0, deadline - time.perf_counter()))
        if self.result is None:
            self.result = RoundResult(False, "the round did not finish in time")
        return self.result


def island_verdict(exchange: Any, pending: PendingRound, min_group_size: int
                   ) -> tuple[RoundResult, bool, bool]:
    """Share this rank's view of the round with the island (collective over ``exchange``, a
    :class:`peers.island.exchange.BucketExchange`) and decide, identically on every rank: (result, needs a fallback,
    a group rejected the round).  Every rank learned the island's result from its rank 0, which heard
    every rank's buckets before it voted; a rank whose own part failed since makes the whole island fail."""
    res = pending.result if pending.result is not None else RoundResult(False, pending.refusal)
    mine = (res.ok, res.reason, pending.bytes_sent, pending.parts_resent)
    everyone = exchange.all_gather_object(mine)
    lead = everyone[0]
    result = RoundResult(False, pending.refusal, bytes_sent=pending.bytes_sent,
                                bytes_received=pending.bytes_received,
                                island_bytes_sent=sum(e[2] for e in everyone),
                                parts_resent=sum(e[3] for e in everyone))
    for k in SHARED:
        if k not in ("ok", "reason"):
            setattr(result, k, getattr(res, k))
    if pending.refusal:
        return result, False, False
    failed = [e for e in everyone if not e[0]]
    if failed:
        result.reason = lead[1] if not lead[0] else failed[0][1]
        no_group = res.group_size < min_group_size
        return result, no_group, not no_group
    result.ok, result.backend = True, "hivemind"
    return result, False, False
