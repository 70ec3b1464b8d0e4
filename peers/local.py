"""An averager for a run without peers: every round is a group of one."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from peers.averager import RoundResult


class LocalAverager:
    """Same interface as :class:`peers.averager.IslandAverager`, averaging with nobody.

    Useful for a single-island run (plain local SGD with an outer optimizer) and for tests of the
    outer step that must not depend on the network.
    """

    peer_id = "local"

    def average(self, deltas: Sequence[torch.Tensor], weight: float, metadata: dict, round_id: str,
                on_stage: Callable[[str], None] | None = None) -> tuple[RoundResult, list[torch.Tensor] | None]:
        """Return this island's own pseudo-gradient as the group's average."""
        t0 = time.perf_counter()
        if not all(torch.isfinite(d).all() for d in deltas):
            return RoundResult(False, "this island's pseudo-gradient is not finite"), None
        out = [d.detach().clone() for d in deltas]
        return RoundResult(True, group_size=1, peers=[self.peer_id], total_weight=float(weight),
                           seconds=time.perf_counter() - t0, gathered={self.peer_id: dict(metadata)}), out

    def set_state_priority(self, outer_step: int) -> None:
        """Nothing to advertise."""

    def download_state(self) -> None:
        """No peers to download from."""
        return None

    def shutdown(self) -> None:
        """Nothing to stop."""
