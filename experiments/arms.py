"""The arms a comparison can run beside blocking fp32 DiLoCo: rounds in flight (``--arms``, :data:`ARMS`)
and low-bit pseudo-gradients (``--compression``, :data:`CODECS`), each a set of config overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from experiments.islands import CompareError, island_summaries

MATCHED = "matched"
"""``diloco.sync_every`` of a timed arm, replaced before it runs by the seconds of compute per round the blocking
DiLoCo run of the same command took (:func:`matched_budget`)."""

# DiLoCo arms whose rounds do not stop the inner steps (``--arms``), each against blocking DiLoCo (c)
ARMS: dict[str, dict[str, Any]] = {
    "delayed": {"diloco.overlap": "delayed"},
    "eager": {"diloco.overlap": "eager"},
    # the same, every island sending when it has trained as long as a blocking round took rather than after
    # H steps: islands of different speed (4 sharing 2 cores) then send at once, and their rounds stay in
    # flight for the transfer alone instead of the time the slowest island takes to catch up
    "delayed-timed": {"diloco.overlap": "delayed", "diloco.sync_every": MATCHED},
    "eager-timed": {"diloco.overlap": "eager", "diloco.sync_every": MATCHED},
    # Streaming DiLoCo's setting: 4 fragments (the `small` model has 4 blocks), τ = 1, α = 0.5
    "streaming": {"diloco.fragments": 4, "diloco.overlap_steps": 1, "diloco.merge_alpha": 0.5},
    # the same 4 fragments in flight under the timed budget: each sync carries a quarter of the bytes, so it
    # is in flight (stale) a quarter as long, and the last one, which nothing hides, takes a quarter as long
    "streaming-timed": {"diloco.fragments": 4, "diloco.overlap": "delayed", "diloco.sync_every": MATCHED},
}

# DiLoCo arms with low-bit pseudo-gradients (``--compression``), each against fp32 DiLoCo (c)
CODECS: dict[str, dict[str, Any]] = {
    "fp16": {"averaging.compression": "fp16"},
    "int8": {"averaging.compression": "int8"},
    "int4": {"averaging.compression": "int4"},
    "sign": {"averaging.compression": "sign"},
    # the same with the owners' feedback: what re-encoding each averaged part drops goes into its next average
    "sign-owner": {"averaging.compression": "sign", "averaging.owner_feedback": True},
    # the same with the islands' error feedback in a buffer (EF21) instead of the parameters
    "sign-buffer": {"averaging.compression": "sign", "averaging.error_feedback_in": "buffer"},
    "topk": {"averaging.compression": "topk", "averaging.topk_density": 0.02, "averaging.topk_bits": 2},
    # the same top-k with the unsent part re-sent from a buffer (EF21) instead of kept in the parameters
    "topk-buffer": {"averaging.compression": "topk", "averaging.topk_density": 0.02, "averaging.topk_bits": 2,
                    "averaging.error_feedback_in": "buffer"},
    # the same top-k without error feedback
    "topk-noef": {"averaging.compression": "topk", "averaging.topk_density": 0.02, "averaging.topk_bits": 2,
                  "averaging.error_feedback": False},
    # SparseLoCo: the same top-k, its error-feedback buffer (β = 0.95) in place of the outer Nesterov momentum
    "sparseloco": {"averaging.compression": "topk", "averaging.topk_density": 0.02, "averaging.topk_bits": 2,
                   "diloco.outer_optimizer": "sparseloco", "averaging.error_feedback_decay": 0.95,
                   "averaging.error_feedback_in": "buffer"},
}



def arm_settings(name: str) -> dict[str, Any]:
    """The settings of an overlapped arm: a name of :data:`ARMS`, or one joined to a codec of
    :data:`CODECS` by ``+`` (``delayed+int8``: rounds in flight carrying int8 pseudo-gradients)."""
    mode, _, codec = name.partition("+")
    return {**ARMS[mode], **(CODECS[codec] if codec else {})}


def matched_budget(items: dict[str, Any], blocking_runs: Path) -> dict[str, Any]:
    """``items`` with a ``diloco.sync_every`` of :data:`MATCHED` replaced by the seconds of compute per round
    of the blocking run whose islands' logs are in ``blocking_runs`` (the median over its islands)."""
    if items.get("diloco.sync_every") != MATCHED:
        return items
    per_round = sorted(s["compute_seconds"] / s["outer_step"] for s in island_summaries(blocking_runs)
                       if s.get("outer_step"))
    if not per_round:
        raise CompareError(f"a timed arm needs the blocking run's compute per round, and {blocking_runs} has "
                           f"no island summary with a round in it: run the blocking arm first")
    return {**items, "diloco.sync_every": f"{per_round[len(per_round) // 2]:.2f}s"}


def unknown_arms(names: list[str]) -> list[str]:
    """The names of ``names`` that :func:`arm_settings` cannot read."""
    def known(name: str) -> bool:
        mode, plus, codec = name.partition("+")
        return mode in ARMS and (not plus or codec in CODECS)
    return [n for n in names if not known(n)]
