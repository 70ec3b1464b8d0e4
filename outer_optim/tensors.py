"""Checks on whole pseudo-gradients and parameters that cost one pass over memory, not a temporary of their size.

``torch.isfinite(t).all()`` writes a boolean tensor as large as ``t`` and reads it again (70 ms for 40 MB
on one core here); a sum reads ``t`` once (3 ms) and is NaN or infinite as soon as one value is.  Its only
false alarm is a sum that overflows, which needs values near 1e38 / n: a tensor like that is refused
anyway, by the norm guard if not here.
"""

from __future__ import annotations

import math

import torch


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite (see the module docstring for the one false alarm)."""
    return t.numel() == 0 or math.isfinite(float(t.sum()))


def max_abs(t: torch.Tensor) -> float:
    """The largest magnitude in ``t`` (0 for an empty tensor; NaN if it holds one), without a temporary
    of its size (``t.abs().amax()`` writes one)."""
    if t.numel() == 0:
        return 0.0
    lo, hi = torch.aminmax(t)  # one pass (amax then amin read t twice)
    return max(float(hi), -float(lo))
