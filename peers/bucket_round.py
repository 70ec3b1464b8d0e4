"""What a sharded round is made of: each bucket's outcome, the island's result, and a round in flight."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from peers.averager import AveragerSettings, RoundResult


@dataclass
class BucketOutcome:
    """What happened to one bucket in a round (as seen by its owner, shared with the island)."""

    index: int
    owner: int
    ok: bool
    reason: str = ""
    group_size: int = 0
    no_group: bool = False
    """The round failed because no (large enough) group formed: a torch fallback may retry it."""
    islands: tuple[str, ...] = ()
    """Island ids in the bucket's group."""
    total_weight: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    retryable: bool = False
    """The group lost a member or a part mid-round (see :attr:`peers.averager.RoundResult.retryable`)."""
    members_left: int = 0
    """See :attr:`peers.averager.RoundResult.members_left`."""
    left_behind: bool = False
    """See :attr:`peers.averager.RoundResult.left_behind`."""


@dataclass
class ShardedRoundResult:
    """One island's outcome of a sharded round; identical on all its ranks except the byte counts."""

    ok: bool
    """True when every bucket was averaged and the results may be applied (on every rank alike)."""
    reason: str = ""
    backend: str = ""
    """"hivemind" or "torch": the path whose result this is ("" when neither produced one)."""
    group_size: int = 0
    """Islands averaged (the smallest bucket group)."""
    bytes_sent: int = 0
    """This rank's slow-link bytes sent (hivemind: :func:`~peers.averager.allreduce_bytes` per owned
    bucket; torch: the ring all-reduce equivalent)."""
    bytes_received: int = 0
    island_bytes_sent: int = 0
    """The whole island's slow-link bytes sent in the hivemind attempt (sum over its ranks)."""
    seconds: float = 0.0
    total_weight: float = 0.0
    peers: list[str] = field(default_factory=list)
    """Peer ids (hivemind) or island ids (torch) of the lead bucket's group."""
    gathered: dict[str, dict] = field(default_factory=dict)
    """Metadata each member sent with the lead bucket (the lowest bucket that formed a group)."""
    majority_peers: list[str] = field(default_factory=list)
    in_minority: bool = False
    buckets: list[BucketOutcome] = field(default_factory=list)
    fallback_reason: str = ""
    """Why the hivemind attempt was abandoned for the torch fallback (auto only)."""
    retryable: bool = False
    """Every failed bucket lost a member or a part mid-round, with enough members left to form a group
    again: the island may average the same pseudo-gradient once more (identical on all its ranks)."""
    members_left: int = 0
    """The smallest :attr:`peers.averager.RoundResult.members_left` of the failed buckets (0: unknown)."""
    left_behind: bool = False
    """A bucket stopped looking for a group because every other island had moved past the round: the
    island should take their θ_global rather than roll back (identical on all its ranks)."""


@dataclass
class PendingRound:
    """A round :meth:`ShardedAverager.start` began: this rank's gathered buckets and, while their hivemind
    rounds run in the background, the threads running them."""

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
    threads: list[threading.Thread] = field(default_factory=list)
    ended: float = 0.0
    """``time.perf_counter()`` when the last of this rank's bucket rounds ended (0 while none has)."""
    outcomes: dict[int, tuple[RoundResult, torch.Tensor | None]] = field(default_factory=dict)
    feedback: dict[int, torch.Tensor] = field(default_factory=dict)
    """With a lossy codec and error feedback: each owned bucket's buffer after this round (kept only if the
    round commits)."""
    carry: dict[int, torch.Tensor] = field(default_factory=dict)
    """With a dense lossy codec, error feedback and the owners' feedback: each owned bucket's owner feedback
    after this round (:attr:`peers.sharded.ShardedAverager.carry`; kept only if the round commits)."""

    def done(self) -> bool:
        """Whether this rank's part of the round has ended (no island collective)."""
        return not any(t.is_alive() for t in self.threads)

    def wait(self, s: AveragerSettings, slack: float = 30.0) -> dict[int, tuple[RoundResult, torch.Tensor | None]]:
        """Wait for this rank's bucket rounds (bounded by the timeouts of ``s`` plus ``slack``)."""
        if self.threads:
            deadline = self.t0 + s.matchmaking_timeout + s.allreduce_timeout + s.vote_timeout + slack
            for t in self.threads:
                t.join(max(0.0, deadline - time.perf_counter()))
        for b in self.mine:
            if b not in self.outcomes:
                self.outcomes[b] = (RoundResult(False, "the bucket's round did not finish in time"), None)
        return dict(self.outcomes)


def island_verdict(exchange: Any, outcomes: dict[int, tuple[RoundResult, torch.Tensor | None]], refusal: str,
                   rank: int, min_group_size: int, n_buckets: int) -> tuple[ShardedRoundResult, bool, bool]:
    """Share this rank's owned buckets' ``outcomes`` with the island (collective over ``exchange``, a
    :class:`peers.exchange.BucketExchange`) and decide, identically on every rank: (result, needs a fallback,
    a group rejected the round).  ``n_buckets``: the buckets of the whole model."""
    mine, lead = [], None
    for b in sorted(outcomes):
        res, _ = outcomes[b]
        islands = tuple(sorted({str(m.get("island_id", p)) for p, m in res.gathered.items()}))
        mine.append(BucketOutcome(b, rank, res.ok, res.reason, res.group_size,
                                  res.group_size < min_group_size, islands, res.total_weight,
                                  res.bytes_sent, res.bytes_received, res.retryable, res.members_left,
                                  res.left_behind))
        if lead is None and res.group_size > 0:
            lead = (b, res.peers, res.gathered, res.majority_peers, res.in_minority)
    shared = exchange.all_gather_object((mine, lead))
    buckets = sorted((o for m, _ in shared for o in m), key=lambda o: o.index)
    leads = sorted((ld for _, ld in shared if ld is not None), key=lambda ld: ld[0])
    mine_sent = sum(o.bytes_sent for o in mine)
    result = ShardedRoundResult(False, refusal, "", bytes_sent=mine_sent,
                                bytes_received=sum(o.bytes_received for o in mine),
                                island_bytes_sent=sum(o.bytes_sent for o in buckets), buckets=buckets)
    if leads:
        _, result.peers, result.gathered, result.majority_peers, _ = leads[0]
        result.in_minority = any(ld[4] for ld in leads)
    if refusal:
        return result, False, False
    failed = [o for o in buckets if not o.ok]
    result.group_size = min((o.group_size for o in buckets), default=0)
    if failed:
        f = failed[0]
        more = f" ({len(failed)} of {len(buckets)} buckets failed)" if len(failed) > 1 else ""
        # a model of one bucket fails as a whole: naming the bucket would only add noise
        result.reason = f"bucket {f.index}: {f.reason}{more}" if n_buckets > 1 else f.reason
        no_group = all(o.no_group for o in failed)
        result.retryable = all(o.retryable for o in failed)
        lefts = [o.members_left for o in failed]
        result.members_left = min(lefts) if all(lefts) else 0
        result.left_behind = any(o.left_behind for o in failed)
        return result, no_group, not no_group
    if len({o.islands for o in buckets}) > 1:
        result.reason = ("buckets were averaged with different sets of islands "
                         f"({sorted({len(o.islands) for o in buckets})} islands); discarding the round")
        return result, True, False
    result.ok, result.backend = True, "hivemind"
    result.total_weight = buckets[0].total_weight if buckets else 0.0
    return result, False, False
