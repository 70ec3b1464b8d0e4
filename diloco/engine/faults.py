"""Scripted fault injection for tests and soak runs (as torchft does it): faults are data.

``DILOCO_FAULTS`` holds comma-separated faults ``ACTION@PHASE:ROUND`` (rounds count from 1, as in the
progress lines and every message):

- ``kill@inner:2``: SIGKILL this island half-way through the inner steps of round 2;
- ``kill@matchmaking:1`` / ``kill@allreduce:1`` / ``kill@vote:1``: SIGKILL it in that phase of round 1;
- ``scale@send:3``: multiply the pseudo-gradient sent in round 3 by 1e6 (a peer gone rogue);
- ``drift@theta:2``: shift this island's θ_global by 1e-3 before round 2 (state silently diverged: the
  group's vote puts it in the minority and it resynchronizes from the majority);
- ``stall@allreduce:1``: freeze this process (SIGSTOP) once round 1's all-reduce starts;
- ``late@send:3``: hold round 3 back for ``matchmaking_time`` + 3 s before sending it (a slow island that
  reaches the group after it formed).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

ACTIONS = ("kill", "scale", "stall", "drift", "late")
PHASES = ("inner", "matchmaking", "allreduce", "vote", "send", "theta")


@dataclass(frozen=True)
class Fault:
    action: str
    phase: str
    round: int


def parse_faults(spec: str) -> list[Fault]:
    """Parse ``ACTION@PHASE:ROUND[,...]``; raise ValueError with the accepted forms."""
    faults = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        try:
            action, rest = item.split("@")
            phase, rnd = rest.split(":")
            fault = Fault(action, phase, int(rnd))
        except ValueError:
            raise ValueError(f"DILOCO_FAULTS entry {item!r} must look like kill@allreduce:2") from None
        if action not in ACTIONS or phase not in PHASES:
            raise ValueError(f"DILOCO_FAULTS entry {item!r}: action must be one of {ACTIONS}, phase one of {PHASES}")
        faults.append(fault)
    return faults


class FaultPlan:
    """The faults this process will inject, triggered by :meth:`at`."""

    def __init__(self, faults: list[Fault]):
        self.faults = faults

    @classmethod
    def from_env(cls) -> "FaultPlan":
        return cls(parse_faults(os.environ.get("DILOCO_FAULTS", "")))

    def has(self, action: str, phase: str, rnd: int) -> bool:
        return Fault(action, phase, rnd) in self.faults

    def at(self, phase: str, rnd: int) -> None:
        """Inject the kill or stall scripted for this phase of this round, if any."""
        if self.has("kill", phase, rnd):
            print(f"[fault] SIGKILL in {phase} of round {rnd}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.has("stall", phase, rnd):
            print(f"[fault] SIGSTOP in {phase} of round {rnd}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
