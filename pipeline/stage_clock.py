"""The idle fraction a pipeline actually shows: time each rank spends computing during a few training
steps, compared over the island once, then the clock stops.

Busy time is what the stage's ``forward_one_chunk`` / ``backward_one_chunk`` /
``backward_weight_one_chunk`` and the loss take (the schedule waits on transfers outside them), the
same split of a step as ``benchmarks/pipeline_bench.py`` uses.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pipeline.balance import idle_fraction, sync_device

SKIP_STEPS = 2
"""Training steps left alone first (their first runs pay one-off costs)."""
MEASURED_STEPS = 3
"""Steps measured, then the clock reports once and stops timing."""

STAGE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class StageClock:
    """Measures this pipeline rank's busy time in steps ``SKIP_STEPS + 1 .. SKIP_STEPS + MEASURED_STEPS``.

    Every rank of a PP group must run the same steps; after the last measured one the busy times are
    summed over ``pp_group`` (a collective) and :attr:`measured` holds ``(busy per rank, wall)`` in
    seconds per step.  ``report`` is called with them on every rank.
    """

    def __init__(self, device: torch.device, pp_group: ProcessGroup, pp_rank: int, pp: int,
                 report: Callable[[list[float], float], None]):
        self.device, self.group, self.pp_rank, self.pp = device, pp_group, pp_rank, pp
        self.report = report
        self.steps = 0
        self.active = False
        self.busy = 0.0
        self.wall = 0.0
        self.measured: tuple[list[float], float] | None = None

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` adding its duration to the busy time while a measured step runs."""
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            sync_device(self.device)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync_device(self.device)
                self.busy += time.perf_counter() - start
        return run

    def wrap_stages(self, stages: list[Any]) -> None:
        """Time the compute methods of these ``PipelineStage`` objects (instance attributes; the
        classes are untouched)."""
        for stage in stages:
            for name in STAGE_METHODS:
                setattr(stage, name, self.timed(getattr(stage, name)))

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around one training step of the schedule."""
        self.steps += 1
        measuring = self.measured is None and SKIP_STEPS < self.steps <= SKIP_STEPS + MEASURED_STEPS
        if not measuring:
            yield
            return
        sync_device(self.device)
        start = time.perf_counter()
        self.active = True
        try:
            yield
        finally:
            self.active = False
        sync_device(self.device)
        self.wall += time.perf_counter() - start
        if self.steps == SKIP_STEPS + MEASURED_STEPS:
            self._finish()

    def _finish(self) -> None:
        t = torch.zeros(self.pp + 1, dtype=torch.float64, device=self.device)
        t[self.pp_rank] = self.busy / MEASURED_STEPS
        t[self.pp] = self.wall / MEASURED_STEPS / self.pp  # summed to the mean wall time of the ranks
        dist.all_reduce(t, group=self.group)
        values = t.tolist()
        self.measured = (values[:self.pp], values[self.pp])
        self.report(*self.measured)


def measured_line(busy: list[float], wall: float, predicted: float) -> str:
    """One log line on what the clock measured, next to the predicted idle fraction."""
    per_rank = "/".join(f"{b * 1e3:.4g}" for b in busy)
    whole = 1.0 - sum(busy) / len(busy) / wall if wall > 0 else 0.0
    return (f"pipeline measured over steps {SKIP_STEPS + 1}-{SKIP_STEPS + MEASURED_STEPS}: busy per rank {per_rank} ms "
            f"per step, idle from imbalance {idle_fraction(busy):.1%} (predicted {predicted:.1%}), idle in the "
            f"{wall * 1e3:.4g} ms step {whole:.1%} (with the schedule's bubble and transfers)")
