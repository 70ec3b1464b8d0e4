"""The averager's settings, its wire formats and the outcome of one round: plain data shared by
:mod:`peers.averager`, :mod:`peers.sharded` and the torch fallback."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch



VOTE_RTOL = 1e-5
"""Members hold the same bits (every part's owner sends its average to all, or each decodes the same bytes
in the same order), so the vote's tolerance only absorbs the fingerprint's float32 sums taken in another
order; a part left unaveraged moves a chunk's sums by far more."""


@dataclass(frozen=True)
class Scope:
    """Where an averager's rounds happen and who may take part: what the island is, not how it averages
    (that is :class:`peers.settings.AveragerSettings`)."""

    prefix: str = "diloco"
    """DHT prefix shared by all islands of a run (the run id)."""
    private: bool = False
    """Serve only islands registered in the run's member registry (see peers.membership)."""
    members_key: str = ""
    """DHT key of that member registry (empty: ``f"{prefix}.members"``)."""
    client_mode: bool = False
    """No incoming connections: this island neither forms groups for others nor takes their requests."""
    direct_votes: bool = True
    """Send verdicts straight to the group members (False: only through the DHT, polled: the vote as it
    was before, kept for benchmarks/round_cost.py and tests)."""

    @property
    def registry(self) -> str:
        """The DHT key of the run's member registry."""
        return self.members_key or f"{self.prefix}.members"


@dataclass
class Exchange:
    """What an exchange of a round's pseudo-gradient gave (see :meth:`peers.averager.VerifiedAverager.run_round`)."""

    fingerprint: list[float] | None
    """Of the result, in the order every member uses (None: no result)."""
    averaged: Any
    """The result, for the caller (None: none)."""
    bytes_sent: int = 0
    bytes_received: int = 0
    reason: str = ""
    """Why there is no result ('' when there is)."""
    members_left: int = 0
    """Without a result: how many members are known alive (those whose parts came, and those that declined)."""
    carry: torch.Tensor | None = None
    finite: bool = True
    parts_resent: int = 0
    """Parts sent again alone after their connection failed (the round went on)."""


@dataclass
class RoundResult:
    """What one averaging round did; failures are data, not exceptions."""

    ok: bool
    """True when the averaged values may be applied."""
    reason: str = ""
    """Why the round failed (empty on success)."""
    group_size: int = 0
    """Islands in the group (including this one)."""
    peers: list[str] = field(default_factory=list)
    """Peer ids of the group members."""
    bytes_sent: int = 0
    """Bytes this island sent in the all-reduce (from the butterfly protocol, see :func:`allreduce_bytes`)."""
    bytes_received: int = 0
    """Bytes this island received in the all-reduce."""
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
    (:attr:`peers.averager.VerifiedAverager.moved_past`): their θ_global may be ahead of ours."""
    carry: torch.Tensor | None = None
    """With the owners' feedback (``owner_feedback``) on a dense codec: what this member's re-encoding
    of the averaged parts it owns left out, to add to them next round (kept only if the round commits)."""
    parts_resent: int = 0
    """Parts of this round sent again alone after their connection failed (the round went on)."""


def as_float(x: Any) -> float:
    """``x`` as a float, NaN when it is none (a peer's metadata is untrusted)."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def check_group(meta: dict[str, dict], round_id: str, min_group_size: int) -> str:
    """Reasons to reject a group of islands from the metadata each sent (``meta``: peer → metadata), or '':
    every member computes the same verdict from the same data."""
    if not meta:
        return "no island could send a pseudo-gradient this round"
    if len(meta) < min_group_size:
        return f"group of {len(meta)} island(s) is below --averaging.min_group_size {min_group_size}"
    rounds = {str(m.get("round_id")) for m in meta.values()}
    if rounds != {round_id}:
        return f"islands were at different rounds {sorted(rounds)}"
    if len({m.get("config_fingerprint") for m in meta.values()}) > 1:
        return "islands in the group run different model or training configs (config fingerprints differ)"
    weights = [as_float(m.get("weight")) for m in meta.values()]
    if not all(math.isfinite(w) and w > 0 for w in weights):
        return f"a peer declared an invalid weight ({weights}); weights must be positive token counts"
    return ""


class AveragerGoneError(RuntimeError):
    """hivemind's averaging process is no longer running."""


def short_error(e: BaseException) -> str:
    """``e``'s message on one line, at most 300 characters (its type's name when it has none)."""
    return " ".join(str(e).split())[:300] or type(e).__name__
