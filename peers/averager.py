"""Averaging pseudo-gradients between islands over hivemind, one verified round at a time.

hivemind's all-reduce can report success while part of the vector kept local values (a peer that
failed mid-round) and has no timeouts by default.  :class:`VerifiedAverager` closes both holes:
every timeout is explicit, retries are off, and each round ends with a vote (:mod:`peers.vote`) in
which every group member sends a fingerprint of what it received to the others.  A round counts only
if the group is large enough, every member voted, and all fingerprints agree and are finite;
otherwise the caller gets a failed :class:`RoundResult` and the averaged values are thrown away.
"""

from __future__ import annotations

import hashlib
import logging
import math
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import hivemind
import torch
from hivemind.averaging.control import AveragingStage
from hivemind.utils import get_dht_time
from hivemind.compression import (Float16Compression, NoCompression, ScaledFloat16Compression,
                                  Uniform8BitQuantization)

from peers.fingerprints import FINGERPRINT_CHUNKS, fingerprint, fingerprints_agree, majority_by_state
from peers.hivemind_averager import StateProvider, _PseudoGradientAverager
from peers.vote import MemberCheck, VoteChannel

__all__ = ["AveragerGoneError", "AveragerSettings", "COMPRESSIONS", "FINGERPRINT_CHUNKS", "RoundResult", "StateProvider",
           "VerifiedAverager", "allreduce_bytes", "fingerprint", "fingerprints_agree", "majority_by_state"]

log = logging.getLogger(__name__)

# name -> (hivemind codec, bytes on the wire per fp32 byte, relative tolerance of the vote)
COMPRESSIONS: dict[str, tuple[Callable[[], Any], float, float]] = {
    "none": (NoCompression, 1.0, 1e-5),
    "fp16": (Float16Compression, 0.5, 1e-2),
    "scaled-fp16": (ScaledFloat16Compression, 0.5, 1e-2),
    "uint8": (Uniform8BitQuantization, 0.25, 5e-2),
}



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
    """Wire format: none, fp16, scaled-fp16 or uint8."""
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


def allreduce_bytes(num_bytes: int, group_size: int, wire_ratio: float) -> int:
    """Bytes one peer sends (and receives) in hivemind's butterfly all-reduce with equal shares.

    Each peer sends the (n-1)/n of its vector that others reduce, then returns its reduced 1/n to
    the n-1 others: 2·(n-1)/n of the vector, times the codec's size ratio.
    """
    if group_size <= 1:
        return 0
    return int(2 * num_bytes * wire_ratio * (group_size - 1) / group_size)


class VerifiedAverager:
    """Averages one island's pseudo-gradient with other islands and serves its state to joiners.

    ``template`` fixes the shapes of the averaged tensors (fp32, CPU); every island of a run must
    use the same shapes.  Call :meth:`average` once per outer round and :meth:`shutdown` at the end.
    """

    def __init__(self, dht: hivemind.DHT, template: Sequence[torch.Tensor], settings: AveragerSettings,
                 state_provider: StateProvider | None = None):
        if settings.compression not in COMPRESSIONS:
            raise ValueError(f"unknown compression {settings.compression!r}; use one of {', '.join(COMPRESSIONS)}")
        codec, self._wire_ratio, self._vote_rtol = COMPRESSIONS[settings.compression]
        self.settings = settings
        self.dht = dht
        self._buffers = [torch.zeros(t.shape, dtype=torch.float32) for t in template]
        self._num_bytes = sum(b.numel() * 4 for b in self._buffers)
        self._lock = threading.Lock()
        # hivemind's start makes the calling process ignore SIGINT for good; keep that for its child
        # process only and give the caller its own handler back
        main = threading.current_thread() is threading.main_thread()
        previous_sigint = signal.getsignal(signal.SIGINT) if main else None
        members = (MemberCheck(dht, settings.members_key or f"{settings.prefix}.members")
                   if settings.private else None)
        self._averager = _PseudoGradientAverager(
            self._buffers, dht, start=True, prefix=settings.prefix,
            target_group_size=settings.target_group_size or None,
            min_group_size=settings.min_group_size,
            min_matchmaking_time=settings.matchmaking_time,
            request_timeout=settings.request_timeout,
            allreduce_timeout=settings.allreduce_timeout,
            next_chunk_timeout=settings.next_chunk_timeout,
            compression=codec(),
            client_mode=settings.client_mode,
            state_provider=state_provider, members=members, shutdown_timeout=5,
        )
        if main and previous_sigint is not None:
            signal.signal(signal.SIGINT, previous_sigint)
        self._target: int | None = settings.target_group_size or None
        self.peer_id = str(dht.peer_id)
        try:
            self._votes = VoteChannel(dht, settings.prefix, members, direct=settings.direct_votes,
                                      ttl=max(60.0, 4 * settings.vote_timeout))
        except BaseException:
            self._averager.shutdown()
            raise

    @property
    def num_bytes(self) -> int:
        """Size of the averaged vector in fp32 bytes."""
        return self._num_bytes

    def average(self, deltas: Sequence[torch.Tensor], weight: float, metadata: dict, round_id: str,
                on_stage: Callable[[str], None] | None = None, matchmaking_timeout: float | None = None,
                expected_group_size: int | None = None) -> tuple[RoundResult, list[torch.Tensor] | None]:
        """Run one verified averaging round.

        ``deltas`` are this island's pseudo-gradients, ``weight`` its share (tokens processed),
        ``metadata`` small facts sent to every member (config fingerprint, ``state_fingerprint`` of
        θ_global, ...), and ``round_id`` a label all islands of the round agree on (the outer step).
        ``on_stage`` is called with "matchmaking", "allreduce" and "vote" as the round moves on
        (used for fault injection and progress); ``matchmaking_timeout`` overrides the settings' (a
        retry among the members left waits less).  ``expected_group_size``: how many islands (this one
        included) are expected in the group, e.g. the live registered islands entering this round; with
        ``target_group_size`` 0 the group then forms as soon as that many joined instead of after
        ``matchmaking_time`` (fewer: it forms after ``matchmaking_time`` as before; more: the group is
        capped at that size).  Returns the result and, only when it succeeded, the weighted average of
        the group's deltas.
        """
        t0 = time.perf_counter()
        stage = on_stage or (lambda _: None)
        if weight <= 0 or not all(torch.isfinite(d).all() for d in deltas):
            return RoundResult(False, "this island's pseudo-gradient is not finite or its weight is not positive; "
                               "not sending it"), None
        with self._averager.get_tensors() as bufs:
            for buf, d in zip(bufs, deltas):
                buf.copy_(d.detach().reshape(buf.shape))
        try:
            stage("matchmaking")
            # islands at different rounds must never meet: each round matches in its own DHT bucket
            self._averager.set_group_bits(_round_bits(round_id))
            self._set_target(expected_group_size)
            control = self._averager.step(
                gather=dict(metadata, round_id=round_id, weight=float(weight)), weight=float(weight),
                timeout=matchmaking_timeout or self.settings.matchmaking_timeout, allow_retries=False, wait=False)
            t_allreduce = None
            # hivemind's own timeouts end the step, unless its process is gone (SIGTERM to the whole
            # process group, OOM killer): then nothing would ever end it
            deadline = time.monotonic() + self.settings.matchmaking_timeout + self.settings.allreduce_timeout + 30.0
            while not control.done():
                if not self._averager.is_alive():
                    raise AveragerGoneError("hivemind's averaging process exited (killed or crashed)")
                if time.monotonic() > deadline:
                    control.cancel()
                    raise TimeoutError("the averaging step outlived --averaging.matchmaking_timeout + "
                                       "--averaging.allreduce_timeout")
                if t_allreduce is None and control.stage == AveragingStage.RUNNING_ALLREDUCE:
                    t_allreduce = time.perf_counter()
                    stage("allreduce")
                time.sleep(0.005)
            gathered = control.result()
        except Exception as e:  # hivemind raises several types when no group forms or a peer fails
            return RoundResult(False, f"averaging failed: {type(e).__name__}: {_short(e)}",
                               seconds=time.perf_counter() - t0), None
        t1 = time.perf_counter()
        if not gathered:
            return RoundResult(False, "averaging returned no group", seconds=t1 - t0), None
        peers = sorted(str(p) for p in gathered)
        meta = {str(p): (m if isinstance(m, dict) else {}) for p, m in gathered.items()}
        n = len(peers)
        nbytes = allreduce_bytes(self._num_bytes, n, self._wire_ratio)
        result = RoundResult(False, group_size=n, peers=peers, bytes_sent=nbytes, bytes_received=nbytes,
                             matchmaking_seconds=t1 - t0, allreduce_seconds=t1 - (t_allreduce or t1), gathered=meta,
                             total_weight=float(sum(_as_float(m.get("weight")) for m in meta.values())))
        with self._averager.get_tensors() as bufs:
            averaged = [b.clone() for b in bufs]
        result.reason = self._check_group(meta, n, round_id)
        result.majority_peers, result.in_minority = majority_by_state(meta, self.peer_id)
        if not result.reason and len(result.majority_peers) < n:
            result.reason = (f"θ_global differs between islands ({n - len(result.majority_peers)} of {n} hold "
                             f"another one); the minority resynchronizes from the majority")
        if not result.reason and not all(torch.isfinite(a).all() for a in averaged):
            result.reason = "the averaged pseudo-gradient is not finite (a peer sent NaN or Inf)"
        stage("vote")
        if not result.reason:
            result.reason, result.voters = self._vote(averaged, peers, round_id)
            result.retryable = bool(result.reason) and result.voters >= self.settings.min_group_size
        result.vote_seconds = time.perf_counter() - t1
        result.seconds = time.perf_counter() - t0
        result.ok = not result.reason
        return result, (averaged if result.ok else None)

    def _check_group(self, meta: dict[str, dict], n: int, round_id: str) -> str:
        """Reasons to reject the group itself, identical on every member (they all see the same data)."""
        if n < self.settings.min_group_size:
            return f"group of {n} island(s) is below --averaging.min_group_size {self.settings.min_group_size}"
        rounds = {m.get("round_id") for m in meta.values()}
        if len(rounds) > 1:
            return f"islands were at different rounds {sorted(map(str, rounds))}"
        prints = {m.get("config_fingerprint") for m in meta.values()}
        if len(prints) > 1:
            return "islands in the group run different model or training configs (config fingerprints differ)"
        weights = [_as_float(m.get("weight")) for m in meta.values()]
        if not all(math.isfinite(w) and w > 0 for w in weights):
            return f"a peer declared an invalid weight ({weights}); weights must be positive token counts"
        return ""

    def _set_target(self, expected: int | None) -> None:
        """The group size this step assembles at: the configured target, else the expected one."""
        target = self.settings.target_group_size or (max(expected, self.settings.min_group_size)
                                                      if expected else None)
        if target != self._target:
            self._averager.set_target_group_size(target)
            self._target = target

    def _vote(self, averaged: list[torch.Tensor], peers: list[str], round_id: str) -> tuple[str, int]:
        """Send our fingerprint of the result to the group and wait for every member's; returns ('' if all
        agree, else why not; how many members voted).  A verdict that differs from ours ends the wait at
        once: the round is lost whatever the missing members say."""
        if not self.dht.is_alive():
            return "the vote on the result could not be held: the DHT process exited", 0
        key = f"{self.settings.prefix}.vote.{_group_key(peers, round_id)}"
        expiration = get_dht_time() + max(60.0, 4 * self.settings.vote_timeout)
        tally = self._votes.hold(key, self.peer_id, peers, fingerprint(averaged),
                                 lambda a, b: fingerprints_agree(a, b, self._vote_rtol), self.settings.vote_timeout,
                                 expiration)
        if tally.missing and not self.dht.is_alive():
            return "the vote on the result could not be held: the DHT process exited", 0
        if not all(torch.isfinite(torch.tensor(v, dtype=torch.float64)).all() for v in tally.votes.values()):
            return "the averaged pseudo-gradient is not finite (a peer sent NaN or Inf)", 0
        voters = len(tally.votes)
        if tally.differ:
            return "islands received different averages (an all-reduce part failed); discarding the round", voters
        if tally.missing:
            return (f"{len(tally.missing)} of {len(peers)} island(s) did not confirm the result (left or failed "
                    f"mid-round)", voters)
        return "", voters

    def set_state_priority(self, outer_step: int) -> None:
        """Advertise how fresh our state is: joiners download from the island with the highest outer step."""
        self._averager.state_sharing_priority = float(outer_step) + 1.0

    def download_state(self) -> tuple[dict, list[torch.Tensor]] | None:
        """Download (metadata, tensors) of the freshest island of the run, or None if none answers."""
        timeout = self.settings.state_download_timeout
        if not self._averager.is_alive():
            log.warning("could not download state from peers: hivemind's averaging process exited")
            return None
        try:
            return self._averager.load_state_from_peers(timeout=timeout)
        except Exception as e:  # TimeoutError and hivemind's own errors
            log.warning("could not download state from peers: %s", _short(e))
            return None

    def shutdown(self) -> None:
        """Stop the vote channel and the averager process (the DHT is the caller's)."""
        self._votes.close()
        if self._averager.is_alive():
            self._averager.shutdown()


class AveragerGoneError(RuntimeError):
    """hivemind's averaging process is no longer running."""


def _as_float(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def _round_bits(round_id: str, nbits: int = 12) -> str:
    value = int(hashlib.sha1(round_id.encode()).hexdigest(), 16) % (1 << nbits)
    return format(value, f"0{nbits}b")


def _group_key(peers: list[str], round_id: str) -> str:
    return hashlib.sha1(("|".join(peers) + "#" + round_id).encode()).hexdigest()[:16]


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__
