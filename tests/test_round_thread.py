"""Rounds on a thread of their own (``--diloco.round_thread``): the island's trajectory is the one the training
thread's own rounds give, the training thread trains on while a slow averager holds the round, and what goes
wrong on the round thread stops the island with its own error."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch

from diloco.engine.island import Island
from diloco.engine.round import OuterRounds
from peers.averaging.local import LocalAverager
from tests.conftest import tiny_config

CASES = {
    "blocking": {},
    "delayed": {"diloco.overlap": "delayed", "diloco.overlap_steps": 1},
    "eager": {"diloco.overlap": "eager", "diloco.overlap_steps": 1},
    "fragments": {"diloco.overlap": "delayed", "diloco.fragments": 2, "diloco.inner_steps": 6},
    "merged": {"diloco.overlap_steps": 2, "diloco.merge_alpha": 0.5},
}


def _theta(island: Island) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in island.outer.theta_global.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_the_round_thread_keeps_the_trajectory(tmp_path, case, arrives_on_time):
    runs = {}
    for background in (False, True):
        island = Island(tiny_config(tmp_path / str(background), **{**CASES[case], "diloco.round_thread": background}))
        summary = island.run()
        assert summary["rounds_ok"] == island.schedule.total_rounds
        runs[background] = _theta(island), island.params
    (inline, inline_params), (threaded, threaded_params) = runs[False], runs[True]
    assert max(float((inline[n] - threaded[n]).abs().max()) for n in inline) < 1e-6
    assert max(float((inline_params[n] - threaded_params[n]).abs().max()) for n in inline) < 1e-6


def test_a_slow_averager_does_not_hold_the_inner_steps(tmp_path, monkeypatch):
    """While the averager takes its time to start a round, the island trains on (delayed) with the round on its
    own thread, and not at all with the round on the training thread."""
    start = LocalAverager.start
    trained: list[int] = []
    island: Island | None = None

    def slow_start(self, deltas, weight, metadata, *args, **kwargs):
        if metadata["outer_step"] < 2:  # the last round is waited for at once: nothing is left to train
            before = island.stats.inner_step
            deadline = time.monotonic() + (10.0 if island.rounds.background else 0.5)
            while island.stats.inner_step < before + 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            trained.append(island.stats.inner_step - before)
        return start(self, deltas, weight, metadata, *args, **kwargs)

    monkeypatch.setattr(LocalAverager, "start", slow_start)
    for background in (True, False):
        trained.clear()
        island = Island(tiny_config(tmp_path / str(background), **{
            "diloco.overlap": "delayed", "diloco.inner_steps": 8, "diloco.round_thread": background}))
        summary = island.run()
        assert summary["rounds_ok"] == 3 and summary["inner_step"] == 24
        if background:
            assert min(trained) >= 3, trained  # each round: three inner steps while the averager was slow
        else:
            assert trained == [0, 0]


def test_an_error_on_the_round_thread_stops_the_island_with_that_error(tmp_path, monkeypatch):
    def broken(self, *args, **kwargs):
        raise RuntimeError("the averager broke")

    monkeypatch.setattr(LocalAverager, "start", broken)
    island = Island(tiny_config(tmp_path, **{"diloco.overlap": "eager"}))
    with pytest.raises(RuntimeError, match="the averager broke"):
        island.run()


@pytest.mark.parametrize("mode", ["delayed", "eager"])
def test_an_applied_round_frees_what_it_held_without_the_cycle_collector(tmp_path, monkeypatch, mode):
    """The round's thread and its averager's callback refer back to the round: unless the round lets go of them
    when applied, its Δ and the parameters copied at sending (5 GB each on a GPU at 1b) live on until Python's
    cycle collector runs, and a GPU island ran out of memory after 3 rounds."""
    send = OuterRounds.send
    held: list[weakref.ref] = []

    def watched(self):
        out = send(self)
        if self.flight is not None:
            held.extend(weakref.ref(t) for t in self.flight.source.values())
            held.append(weakref.ref(self.flight))
        return out

    monkeypatch.setattr(OuterRounds, "send", watched)
    island = Island(tiny_config(tmp_path, **{"diloco.overlap": mode, "diloco.inner_steps": 4}))
    gc.disable()
    try:
        island.run()
        assert held and all(r() is None for r in held), f"{sum(r() is not None for r in held)} of {len(held)} alive"
    finally:
        gc.enable()
