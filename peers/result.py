"""What an averaging round did, the one result type every averager returns (the island's averagers of
:mod:`peers.averaging`, the group's :class:`peers.group.averager.VerifiedAverager`): failures are data, not
exceptions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RoundResult:
    """What one averaging round did; failures are data, not exceptions."""

    ok: bool
    """True when the averaged values may be applied."""
    reason: str = ""
    """Why the round failed (empty on success)."""
    backend: str = ""
    """The island's averagers: "hivemind", "torch" or "local", the path whose result this is ("" when none
    produced one)."""
    group_size: int = 0
    """Islands in the group (including this one)."""
    peers: list[str] = field(default_factory=list)
    """Peer ids of the group members."""
    bytes_sent: int = 0
    """Bytes this island sent in the all-reduce (from the butterfly protocol, see :func:`allreduce_bytes`)."""
    bytes_received: int = 0
    """Bytes this island received in the all-reduce."""
    island_bytes_sent: int = 0
    """The island's averagers: the whole island's payload bytes sent (sum over its ranks)."""
    seconds: float = 0.0
    """Wall-clock seconds of the whole round (matchmaking, all-reduce, vote)."""
    matchmaking_seconds: float = 0.0
    """Part of ``seconds`` spent until the group formed and the all-reduce finished."""
    allreduce_seconds: float = 0.0
    """Part of ``matchmaking_seconds`` spent in the all-reduce itself (after the group formed)."""
    vote_seconds: float = 0.0
    """Part of ``seconds`` spent agreeing on the result."""
    exchange_seconds: float = 0.0
    """Part of ``allreduce_seconds`` spent moving the pseudo-gradient's bytes (the exchange)."""
    total_weight: float = 0.0
    """Sum of the group's weights (tokens processed by all members)."""
    gathered: dict[str, dict] = field(default_factory=dict)
    """Metadata each member sent with its pseudo-gradient, by peer id."""
    majority_peers: list[str] = field(default_factory=list)
    """Members whose θ_global agrees with the largest agreeing subset of the group."""
    in_minority: bool = False
    """True when this island's θ_global disagrees with the majority: it must resynchronize."""
    voters: int = 0
    """Group members (this one included) whose verdict on the result arrived."""
    retryable: bool = False
    """The group formed but lost a member or a part mid-round (a verdict missing or two differing), and
    enough members voted to form a group again: they may average the same values once more."""
    members_left: int = 0
    """Members (this one included) known to be still in the round when it failed, i.e. how large a group
    a retry can form at once; 0 when unknown (two verdicts differed)."""
    left_behind: bool = False
    """This island stopped looking for a group because every other island had moved past the round
    (:attr:`peers.group.averager.VerifiedAverager.moved_past`): their θ_global may be ahead of ours."""
    carry: torch.Tensor | None = None
    """With the owners' feedback (``owner_feedback``) on a dense codec: what this member's re-encoding
    of the averaged parts it owns left out, to add to them next round (kept only if the round commits)."""
    parts_resent: int = 0
    """Parts of this round sent again alone after their connection failed (the round went on; the island's
    averagers: over all its ranks)."""
    codec: str = ""
    """The codec the round's pseudo-gradient travelled in (``--averaging.compression auto`` picks one each
    round; '' when no exchange began)."""
    rejected: list[str] = field(default_factory=list)
    """Members (island ids) whose pseudo-gradient, or a part of it, failed the member check and counted for nothing
    (see :func:`peers.wire.encoded.aggregate_checked`)."""
    groups: int = 1
    """Groups the roster averaged in (1: one flat group; more when it was larger than ``max_group_size``, see
    :func:`peers.group.roster.split_groups`)."""
    fallback_reason: str = ""
    """Why the hivemind attempt was abandoned for the torch fallback (``auto`` only)."""


def as_float(x: Any) -> float:
    """``x`` as a float, NaN when it is none (a peer's metadata is untrusted)."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def short_error(e: BaseException) -> str:
    """``e``'s message on one line, at most 300 characters (its type's name when it has none)."""
    return " ".join(str(e).split())[:300] or type(e).__name__
