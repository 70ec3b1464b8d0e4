"""How much an island trains before it joins the next round: ``--diloco.sync_every``.

- steps (``50``, or empty: ``--diloco.inner_steps``): every island trains H inner steps, as plain DiLoCo;
- seconds of compute (``90s``): every island trains as many steps as fit, so a fast island is never
  kept waiting for a slow one, it does more steps instead;
- tokens (``2M``, ``500K``, ``1G``): every island processes that many tokens (a fixed H in another unit);
- ``auto``: seconds of compute, chosen after every round so that the round's communication stays under
  ``--diloco.max_comm_fraction`` of the time: budget = communication × (1 − f) / f, where the
  communication is the shortest stall (seconds kept from training by its last round) any member of the
  group reported with its pseudo-gradient (the member that arrived last waited for nobody: its stall was
  all protocol, transfer, vote and applying, while the others' also held waiting for it), so all members
  of a round choose the same budget.  The first round trains H steps; the second the compute seconds the
  fastest member of the first needed for H steps; from the third on the budget follows the stalls.

A budget of seconds counts from when the group of the island's last round formed, not from its own send:
with rounds in flight an island that sent first trains on while it waits for the others, and counted from
its own send it would send every later round that much early again, each of its rounds in flight staying
stale for as long (:meth:`diloco.engine.round.schedule.RoundSchedule.aligned`).  Islands of different speed thus send at once,
and a round stays in flight for its transfer alone; a steps budget cannot do this (H is the round).

With fragments (P > 1) a sync is due every 1/P of the budget.  Only the steps budget is part of the run's
shape; islands declaring different budgets still average together (the budget is not in the config
fingerprint).

An island that trained more steps sends a longer Δ; weighting it by its tokens as well would count its
extra steps twice (its weight and its displacement both grow with them).  With a budget other than steps
the round averages the pseudo-gradient *per token*, Δᵢ/tᵢ, with weights tᵢ (the group's velocity, Σ Δᵢ /
Σ tᵢ), and applies it times the group's mean tokens per island: Σ Δᵢ / n, each island's displacement
once.  With equal tokens this is exactly the token-weighted average.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

UNITS = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}
MIN_AUTO_SECONDS = 1.0
"""``auto`` never asks for rounds shorter than this much compute (a round of a few ms would only add latency)."""


@dataclass(frozen=True)
class Budget:
    """What ``--diloco.sync_every`` asks for: ``kind`` steps, seconds, tokens or auto, and how many."""

    kind: str
    amount: float

    @property
    def by_steps(self) -> bool:
        return self.kind == "steps"


def parse_budget(text: str, inner_steps: int) -> Budget:
    """``--diloco.sync_every`` as a :class:`Budget` (ValueError with one sentence when it is not one)."""
    t = text.strip()
    if not t:
        return Budget("steps", float(inner_steps))
    if t == "auto":
        return Budget("auto", 0.0)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|[KMG]?)", t)
    if m is None:
        raise ValueError(f"--diloco.sync_every {text!r} is not steps (50), seconds of compute (90s), tokens "
                         f"(2M, 500K) or auto")
    value = float(m[1])
    if value <= 0:
        raise ValueError(f"--diloco.sync_every must be positive, got {text!r}")
    if m[2] == "s":
        return Budget("seconds", value)
    if m[2]:
        return Budget("tokens", value * UNITS[m[2]])
    if value != int(value):
        raise ValueError(f"--diloco.sync_every {text!r}: a number of steps must be whole (or add s for seconds)")
    return Budget("steps", value)


def auto_seconds(round_seconds: list[float], max_comm_fraction: float) -> float:
    """Compute seconds per round so that communication is ``max_comm_fraction`` of a round, from the
    members' last round durations (``round_seconds``; the shortest is the one without waiting)."""
    comm = min((c for c in round_seconds if c == c and c >= 0), default=0.0)
    return max(MIN_AUTO_SECONDS, comm * (1 - max_comm_fraction) / max_comm_fraction)
