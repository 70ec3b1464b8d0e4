"""The partition experiment's arithmetic on what the islands recorded (the experiment itself runs 8 islands for
minutes: experiments/partition.py; the cut it makes is tests/test_netns.py's)."""

from __future__ import annotations

from experiments.partition import Cut, heal_reason, held_since, in_step_from


def _rounds(*rounds: tuple[float, int]) -> list[dict]:
    """Round records at (time, committed) for outer steps 1, 2, ..."""
    return [{"outer_step": n + 1, "time": t, "round_ok": ok, "round_failure": "" if ok else "x"}
            for n, (t, ok) in enumerate(rounds)]


def test_the_cut_heals_when_the_larger_side_committed_its_rounds_or_nobody_can_commit_or_time_is_up():
    cut = Cut([[0, 1, 2], [3, 4]], split_at=2, heal_after=2, heal_timeout=100.0, split_time=10.0)
    before = [(1, 1), (5, 1)]
    # the larger side committed 1 round since the cut (round 3, twice over): not yet
    records = [_rounds(*before, (12, 1)), _rounds(*before, (12, 1)), _rounds(*before, (13, 0)),
               _rounds(*before, (20, 0)), _rounds(*before, (20, 0))]
    assert heal_reason(cut, records, now=30.0) == ""
    # round 4 committed by one island of it, the others behind or caught up: the side committed 2 rounds
    records[1] = _rounds(*before, (12, 1), (14, 1))
    assert "committed 2 rounds" in heal_reason(cut, records, now=30.0)
    # nobody committed since the cut, and the larger side failed 2 rounds each: neither side can commit
    failed = [_rounds(*before, (12, 0), (14, 0)) for _ in range(5)]
    assert "no island committed" in heal_reason(cut, failed, now=30.0)
    # one island of the smaller side committed (it should not have): that is no reason to heal, the time limit is
    failed[4] = _rounds(*before, (12, 1))
    assert heal_reason(cut, failed, now=30.0) == ""
    assert "time limit" in heal_reason(cut, failed, now=110.0)


def test_an_island_is_in_step_from_the_first_round_after_which_it_always_holds_the_common_theta():
    majority = {1: "a", 2: "b", 3: "c", 4: "d", 5: "e", 6: "f"}
    thetas = [dict(majority), dict(majority), dict(majority),
              {1: "a", 2: "b", 3: "b", 4: "b", 5: "e", 6: "f"},  # stuck at round 2's, in step again from 5
              {1: "a", 2: "b", 3: "b", 4: "d", 5: "x", 6: "f"},  # in step at 4, apart at 5, again from 6
              {1: "a", 2: "b", 3: "b", 4: "b", 5: "b", 6: "b"}]  # never again
    assert in_step_from(thetas, 3, after=2) == 5
    assert in_step_from(thetas, 4, after=2) == 6
    assert in_step_from(thetas, 5, after=2) is None
    assert in_step_from(thetas, 0, after=2) == 3
    # what an island's θ_global at the end is: the run's after round 2 for the one that never came back
    assert held_since(thetas, "b") == 2 and held_since(thetas, "f") == 6 and held_since(thetas, "zz") is None
