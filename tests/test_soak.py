"""The soak's arithmetic on what the islands recorded (the soak itself runs for many minutes: experiments/)."""

from __future__ import annotations

import time

import pytest

from experiments.soak import joined_intervals, longest_stall, round_report, stall_story


def test_the_longest_stall_counts_only_time_with_two_islands_in_the_run_and_says_what_they_logged(tmp_path):
    t0 = time.mktime((2026, 11, 24, 10, 0, 0, 0, 0, -1))
    logs = []
    for i, lines in enumerate([
        ["10:00:01 [i0] INFO diloco: data: x", "10:00:02 [i0] INFO diloco: 2 islands registered",
         "10:00:30 [i0] WARNING diloco.engine.outer_round: round 5: averaging failed: peer lost",
         "10:00:35 [i0] WARN diloco: round 5 rolled back", "10:01:00 [i0] INFO end"],
        ["10:00:01 [i1] INFO diloco: data: x", "10:00:02 [i1] INFO diloco: 2 islands registered",
         "10:00:20 [i1] INFO killed here", "10:00:40 [i1] INFO diloco: data: x",
         "10:00:45 [i1] INFO diloco: caught up", "10:01:00 [i1] INFO end"]]):
        logs.append(tmp_path / f"island{i}.log")
        logs[-1].write_text("\n".join(lines) + "\n")
    joined = [joined_intervals(log, t0) for log in logs]
    assert joined[1] == [(t0 + 2, t0 + 20), (t0 + 45, t0 + 60)]
    # commits at 10 s and 50 s: island 1 was out from 20 s to 45 s, so 10 of the 40 s count
    stalled, start, end = longest_stall([t0 + 10, t0 + 50, t0 + 52], joined)
    assert stalled == pytest.approx(15.0, abs=0.2) and (start, end) == (t0 + 10, t0 + 50)
    story = stall_story(logs, t0, start, end)
    assert len(story) == 2 and story[0].startswith("   30s") and "averaging failed" in story[0]
    assert story[1].startswith("   35s") and "rolled back" in story[1]


def test_a_kill_costs_the_living_the_stall_of_the_rounds_it_was_in_flight_for_not_the_victims_own(tmp_path):
    """Island 1 is killed at t = 15 during its round; island 0's round spanning the kill stalled 4 s (waiting for it,
    then averaging again without it), its other rounds 0.5 s; island 1's own round across its kill stalled 30 s (it
    was restarting): that is no wait of the living."""
    import json

    rounds = {0: [(0, 0.5), (10, 0.5), (20, 4.0), (30, 0.5)], 1: [(0, 0.5), (10, 0.5), (45, 30.0), (55, 0.5)]}
    dirs = []
    for i, recs in rounds.items():
        d = tmp_path / f"island{i}"
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps({"round_ok": 1, "outer_step": n + 1, "time": t,
                                                              "stall_seconds": s}) + "\n"
                                                  for n, (t, s) in enumerate(recs)))
        dirs.append(d)
    report = round_report(dirs, [15.0], [1])
    assert report["longest_kill_wait_s"] == 4.0 and report["median_kill_wait_s"] == 4.0
    assert report["clean_rounds"] == 4 and report["clean_committed"] == 4
