"""The averager's settings, its wire formats and the outcome of one round: plain data shared by
:mod:`peers.averager`, :mod:`peers.sharded` and the torch fallback."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from hivemind.compression import (
    Float16Compression,
    NoCompression,
    ScaledFloat16Compression,
    Uniform8BitQuantization,
)

from outer_optim.codecs import LOSSY_CODECS

# hivemind's butterfly codecs: name -> (codec, bytes on the wire per fp32 byte, relative tolerance of the
# vote: the owner of a part re-encodes the average, and members add it to their own values in place)
BUTTERFLY: dict[str, tuple[Callable[[], Any], float, float]] = {
    "none": (NoCompression, 1.0, 1e-5),
    "fp16": (Float16Compression, 0.5, 1e-2),
    "scaled-fp16": (ScaledFloat16Compression, 0.5, 1e-2),
    "uint8": (Uniform8BitQuantization, 0.25, 5e-2),
}
COMPRESSIONS = (*BUTTERFLY, *LOSSY_CODECS)
"""Every wire format; the low-bit codecs of :mod:`outer_optim.codecs` travel by :mod:`peers.encoded`."""
ENCODED_VOTE_RTOL = 1e-6
"""Members decode the same bytes in the same order: their averages are bit-identical."""


@dataclass
class AveragerSettings:
    """Group formation, timeouts and wire format of the pseudo-gradient averager."""

    prefix: str = "diloco"
    """DHT prefix shared by all islands of a run."""
    min_group_size: int = 2
    """Rounds with fewer islands are rejected."""
    target_group_size: int = 0
    """Start as soon as this many islands are ready (0: whoever arrives within matchmaking_time)."""
    matchmaking_time: float = 5.0
    """Seconds to gather peers before averaging."""
    matchmaking_timeout: float = 60.0
    """Give up forming a group after this long."""
    allreduce_timeout: float = 120.0
    """Give up an all-reduce after this long."""
    next_chunk_timeout: float = 30.0
    """Give up on a silent peer after this long."""
    request_timeout: float = 3.0
    """Timeout of one matchmaking request (below matchmaking_time)."""
    vote_timeout: float = 15.0
    """Seconds to wait for every group member's verdict after the all-reduce."""
    state_download_timeout: float = 60.0
    """Seconds allowed to download the global state from a peer."""
    compression: str = "none"
    """Wire format: none, fp16, scaled-fp16, uint8 (hivemind's butterfly) or int8, int4, sign, topk (encoded by
    the caller, all-gathered or reduce-scattered: see :mod:`peers.encoded`)."""
    topk_density: float = 0.02
    """Fraction of each chunk the ``topk`` codec keeps."""
    topk_bits: int = 2
    """Bits per value the ``topk`` codec sends (2 or 4)."""
    error_feedback: bool = True
    """With a codec of :mod:`outer_optim.codecs`: the bucket owners carry what it dropped into the next round
    (see :class:`peers.sharded.ShardedAverager`)."""
    error_feedback_decay: float = 1.0
    """β of the error feedback e ← β·e + Δ."""
    error_feedback_in: str = "buffer"
    """``buffer``: e is added to the next Δ before it is encoded; ``params``: the caller keeps e in the
    island's parameters (its next Δ carries it), so each Δ is encoded alone and e is only recorded (the
    island's default: ``diloco.config.AveragingConfig.error_feedback_in``)."""
    entropy_coding: bool = True
    """With a codec of :mod:`outer_optim.codecs`: Huffman-code the payloads we send (:mod:`peers.deflate`)."""
    owner_feedback: bool = False
    """With error feedback and a dense codec that reduce-scatters: the owner of an averaged part carries what
    re-encoding it dropped into the part's next average (:attr:`peers.sharded.ShardedAverager.carry`)."""
    client_mode: bool = False
    """No incoming connections: this island neither reduces parts nor serves state."""
    private: bool = False
    """Serve only islands registered in the run's member registry (see peers.membership)."""
    members_key: str = ""
    """DHT key of that member registry (empty: ``f"{prefix}.members"``); set it when the prefix is not
    the run's own, e.g. for the per-bucket averagers of :mod:`peers.sharded` (prefix ``f"{run}_b{i}"``)."""
    direct_votes: bool = True
    """Send verdicts straight to the group members (False: only through the DHT, polled: the vote as it
    was before, kept for benchmarks/round_cost.py and tests)."""


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


def allreduce_bytes(num_bytes: int, group_size: int, wire_ratio: float) -> int:
    """Bytes one peer sends (and receives) in hivemind's butterfly all-reduce with equal shares.

    Each peer sends the (n-1)/n of its vector that others reduce, then returns its reduced 1/n to
    the n-1 others: 2·(n-1)/n of the vector, times the codec's size ratio.
    """
    if group_size <= 1:
        return 0
    return int(2 * num_bytes * wire_ratio * (group_size - 1) / group_size)


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
