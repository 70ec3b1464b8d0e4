"""A guard against averaged pseudo-gradients wildly out of scale with recent rounds."""

from __future__ import annotations

import math
import statistics


class NormGuard:
    """Rejects a norm above ``max_ratio`` × the median of the last ``window`` committed norms."""

    def __init__(self, max_ratio: float = 10.0, window: int = 5):
        self.max_ratio = max_ratio
        self.history: list[float] = []
        self.window = window

    def check(self, norm: float, unit: str = "") -> str:
        """'' if ``norm`` is acceptable, else the reason to reject it (``unit``: what the norm is of, e.g.
        " per million tokens", for the message)."""
        if not math.isfinite(norm):
            return f"averaged pseudo-gradient norm{unit} is {norm}"
        if self.max_ratio <= 0 or not self.history:
            return ""
        reference = statistics.median(self.history[-self.window:])
        if reference > 0 and norm > self.max_ratio * reference:
            return (f"averaged pseudo-gradient norm{unit} {norm:.3g} is {norm / reference:.0f}x the recent median "
                    f"{reference:.3g} (limit {self.max_ratio:g}x)")
        return ""

    def record(self, norm: float) -> None:
        """Remember the norm of a committed round."""
        self.history.append(norm)
        del self.history[:-self.window]

    def state_dict(self) -> dict[str, list[float]]:
        """The norms of the last committed rounds (what a resumed island compares its next rounds with)."""
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        """Restore :meth:`state_dict`."""
        self.history = [float(x) for x in state.get("history", [])]
