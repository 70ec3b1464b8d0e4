"""Scripted fault injection for tests and soak runs (as torchft does it): faults are data.

``DILOCO_FAULTS`` holds comma-separated faults ``ACTION@PHASE:ROUND`` (rounds count from 1, as in the
progress lines and every message):

- ``kill@inner:2``: SIGKILL this island half-way through the inner steps of round 2;
- ``kill@matchmaking:1`` / ``kill@allreduce:1`` / ``kill@vote:1``: SIGKILL it in that phase of round 1;
- ``scale@send:3``: multiply the pseudo-gradient sent in round 3 by 1e6 (a peer gone rogue);
- ``drift@theta:2``: shift this island's θ_global by 1e-3 before round 2 (state silently diverged: the
  group's vote puts it in the minority and it resynchronizes from the majority);
- ``stall@allreduce:1``: freeze this process (SIGSTOP) once round 1's all-reduce starts;
- ``late@send:3``: hold round 3 back for ``matchmaking_time`` + 6 s before sending it (a slow island that
  reaches the group after it formed);
- ``flip@send:3``: send the pseudo-gradient of round 3 multiplied by −4 (:data:`FLIP`: an attacker that stays
  under the member check's 10× the median norm and pulls a mean the other way);
- ``claim@send:3``: declare :data:`CLAIM` times this island's tokens as the weight of round 3's pseudo-gradient
  (a lie about weight: it matters under ``--averaging.weighting tokens``, where the group caps it);
- ``noise@send:3``: send, instead of round 3's pseudo-gradient, random values of the same norm (tensor by tensor):
  nothing a norm check can tell from an honest Δ;
- ``grow@send:3-10``: send Δ × :data:`GROW` to the power of the rounds into the span (1.5, 2.25, …): a norm that
  creeps up to ratchet a guard that compares each round with the last ones.
- ``leap@announce:3-10``: after each round of the span, claim in the run's registry an outer step :data:`LEAP` rounds
  ahead of its own, holding a θ_global of a made-up digest (a member that lures the others into catching up
  from it, or into numbering their rounds after its).
- ``lie@vote:3-10``: vote, in each round of the span, for a result other than the one it computed (a member that
  tries to veto every round, or to split the group).
- ``nan@send:3``: send round 3's pseudo-gradient as NaN (a broken or hostile member).
- ``forge@send:3-10``: send, in each round of the span, each of its parts once more in another member's name (a
  field naming it, and as if a relay passed it on from it), holding junk (NaN as floats): to get an honest member's
  Δ rejected and the member struck.
- ``forge@vote:3-10``: the same with its verdicts, for another result than it computed, and that verdict in the
  vote's DHT record under the other member's name: to make an honest member look like a liar.

``ROUND`` may be a span of rounds, ``FIRST-LAST`` (``scale@send:2-6``: every round from 2 to 6).  An attacker is
several faults of one island: ``claim@send:2-6,flip@send:2-6`` lies about its weight and sends −4 Δ.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

_STAGES = ("inner", "matchmaking", "allreduce", "vote")
PHASES_OF = {"kill": _STAGES, "stall": _STAGES, "scale": ("send",), "flip": ("send",), "claim": ("send",),
             "noise": ("send",), "grow": ("send",), "late": ("send",), "drift": ("theta",), "leap": ("announce",),
             "lie": ("vote",), "nan": ("send",), "forge": ("send", "vote")}
"""Each action and the phases it can happen in."""
ACTIONS = tuple(PHASES_OF)
PHASES = (*_STAGES, "send", "theta", "announce")

SCALE = 1e6
"""What ``scale`` multiplies Δ by: a norm far above any member check."""
FLIP = -4.0
"""What ``flip`` multiplies Δ by: within the member check's default 10× the median norm, and against the others."""
CLAIM = 1e6
"""What ``claim`` multiplies the declared weight (this island's tokens) by."""
GROW = 1.5
"""What ``grow`` multiplies Δ by once more each round of its span."""
LEAP = 1000
"""How many rounds ahead of its own outer step ``leap`` claims to be."""


@dataclass(frozen=True)
class Fault:
    action: str
    phase: str
    first: int
    """The first round it happens in (counted from 1)."""
    last: int
    """The last one (``first`` for a single round)."""

    def covers(self, action: str, phase: str, rnd: int) -> bool:
        return self.action == action and self.phase == phase and self.first <= rnd <= self.last


def parse_faults(spec: str) -> list[Fault]:
    """Parse ``ACTION@PHASE:ROUND[,...]`` (``ROUND``: a round or a span ``FIRST-LAST``); raise ValueError with
    one sentence naming the entry and the accepted forms."""
    faults = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        try:
            action, rest = item.split("@")
            phase, rounds = rest.split(":")
            first, _, last = rounds.partition("-")
            fault = Fault(action, phase, int(first), int(last or first))
        except ValueError:
            raise ValueError(f"DILOCO_FAULTS entry {item!r} must look like kill@allreduce:2 or scale@send:2-6"
                             ) from None
        if action not in ACTIONS:
            raise ValueError(f"DILOCO_FAULTS entry {item!r}: the action must be one of {', '.join(ACTIONS)}")
        if phase not in PHASES_OF[action]:
            raise ValueError(f"DILOCO_FAULTS entry {item!r}: {action} happens in phase "
                             f"{' or '.join(PHASES_OF[action])}, not {phase}")
        if not 1 <= fault.first <= fault.last:
            raise ValueError(f"DILOCO_FAULTS entry {item!r}: rounds count from 1, and a span FIRST-LAST needs "
                             "FIRST <= LAST")
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
        return any(f.covers(action, phase, rnd) for f in self.faults)

    def into(self, action: str, phase: str, rnd: int) -> int:
        """How many rounds into the span of ``action`` round ``rnd`` is (1 in its first round; 0 outside it)."""
        return max((rnd - f.first + 1 for f in self.faults if f.covers(action, phase, rnd)), default=0)

    def at(self, phase: str, rnd: int) -> None:
        """Inject the kill or stall scripted for this phase of this round, if any."""
        if self.has("kill", phase, rnd):
            print(f"[fault] SIGKILL in {phase} of round {rnd}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.has("stall", phase, rnd):
            print(f"[fault] SIGSTOP in {phase} of round {rnd}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
