"""What one outer round did, as one record: the averaging's own :class:`peers.RoundResult` (the group, the
seconds and bytes of the exchange, the codec) and what the island adds to it (the norms, the stall, the fragment
and weight).  The run's totals (:class:`~diloco.engine.metrics.RunStats`) add these records up; the bytes on the
wire are the run's totals alone (:meth:`~diloco.engine.metrics.RunStats.traffic`), never copied into a round."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from peers import RoundResult

CAUGHT_UP = "caught-up"
"""The averaging backend of a round this island did not average: it took the run's state from a peer."""
NAN = float("nan")


@dataclass(kw_only=True)
class RoundMetrics:
    """What one outer round did (one record of ``metrics.jsonl`` with the run's byte totals beside it)."""

    rnd: int
    """The outer step the round was sent at (0-based; messages count rounds from 1)."""
    result: RoundResult = field(default_factory=lambda: RoundResult(False))
    """What the averaging did (an empty failed result when the island did not average)."""
    failure: str = ""
    """Why the round was rolled back or left out ('' when it committed)."""
    caught_up: bool = False
    """The island did not average this round: it was behind the run or outvoted, and took the run's state."""
    pseudo_grad_norm: float = NAN
    averaged_pseudo_grad_norm: float = NAN
    outer_lr: float = NAN
    retried: bool = False
    """The group lost a member mid-round and the members left averaged again among themselves."""
    overlap_seconds: float = 0.0
    """Seconds of the round's communication hidden under inner steps (0 for a blocking round)."""
    stall_seconds: float = 0.0
    """Seconds the island did not train because of this round (sending, waiting for it, applying it)."""
    send_seconds: float = 0.0
    """Of :attr:`stall_seconds`, those spent sending the round (the rest: waiting for its result, applying it)."""
    fragment: int = 0
    """The Streaming DiLoCo fragment the round averaged (0 with one fragment)."""
    inner_steps: int = 0
    """Inner steps this island trained for the round (H, or what fit in a ``--diloco.sync_every`` budget)."""
    weight: float = 0.0
    """Tokens this island's pseudo-gradient stands for (its weight in the average)."""
    unsent_norm: float = NAN
    """Norm of what a lossy codec has left unsent of this island's pseudo-gradients after the round (the error
    feedback e; NaN without one)."""

    @property
    def ok(self) -> bool:
        """Whether the round committed."""
        return not self.failure

    @classmethod
    def left_out(cls, rnd: int, outer_lr: float, reason: str) -> RoundMetrics:
        """A round this island did not take part in (it caught up with the run instead)."""
        return cls(rnd=rnd, failure=reason, caught_up=True, outer_lr=outer_lr)

    def record(self) -> dict[str, Any]:
        """The round as a flat record, its averaging's figures read from :attr:`result`."""
        r = self.result
        return {
            "round_ok": int(self.ok), "num_peers": r.group_size, "pseudo_grad_norm": self.pseudo_grad_norm,
            "averaged_pseudo_grad_norm": self.averaged_pseudo_grad_norm, "allreduce_seconds": r.seconds,
            "outer_lr": self.outer_lr, "round_failure": self.failure, "averaging_backend": self.backend,
            "used_fallback": int(bool(r.fallback_reason)), "retried": int(self.retried),
            "overlap_seconds": self.overlap_seconds, "stall_seconds": self.stall_seconds,
            "send_seconds": self.send_seconds, "fragment": self.fragment, "inner_steps": self.inner_steps,
            "weight": self.weight, "group_weight": float(r.total_weight), "unsent_norm": self.unsent_norm,
            # of allreduce_seconds: the exchange of the bytes, forming the group, agreeing on the result
            "exchange_seconds": float(r.exchange_seconds), "group_seconds": float(r.matchmaking_seconds),
            "vote_seconds": float(r.vote_seconds),
            "round_payload_bytes": int(r.island_bytes_sent), "parts_resent": int(r.parts_resent), "codec": r.codec,
            "groups": int(r.groups),
            # the members whose Δ the member check left out (island ids, comma-separated: dashboards take strings)
            "rejected": ",".join(r.rejected),
        }

    @property
    def backend(self) -> str:
        """The path the round's result came by (``caught-up`` when the island did not average)."""
        return CAUGHT_UP if self.caught_up else (self.result.backend or "none")

    def progress_line(self, outer_step: int, outer_steps: int, loss: float) -> str:
        """``round 3/10 ok peers=2 loss=1.234`` (and the path, when it is not plain hivemind)."""
        status = "ok" if self.ok else f"FAILED ({self.failure})"
        if self.caught_up:
            status = f"left out ({self.failure})"
        via = f" via={self.backend}" if self.backend in ("torch", "auto") else ""
        return f"round {outer_step}/{outer_steps} {status} peers={self.result.group_size} loss={loss:.3f}{via}"
