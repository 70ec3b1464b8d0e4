"""The scale simulation (experiments.scale_sim): the invariants its predictions rest on.  Bytes of the two-level
round stay flat with the number of islands while an all-gather's grow with it; a round is never shorter than its
bandwidth and latency terms; churn costs retries and time; a seed repeats a run; the quorum never lets two rosters
commit one round, and a network split in halves commits nothing (while today's flat group splits θ)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from experiments.scale_sim import (
    Settings,
    gossip_spread,
    main,
    settings_from,
    simulate,
    slow_start_seconds,
    split,
)

QUIET = dict(churn=0.0, step_jitter=0.0, inner_steps=10, step_s="0.1", rounds=3)
"""No churn, no stragglers, short compute: what is left is the exchange."""


def _sent_per_island_round(r) -> float:
    return r.per_island_round(r.payload_sent_bytes)


def test_two_level_bytes_per_island_stay_flat_from_16_to_1024_islands_while_an_all_gather_grows_linearly():
    s = Settings(**QUIET, payload_mb=10.0, group_size=16)
    c = s.payload
    two_level = {n: simulate(s, n, "roster") for n in (16, 64, 256, 1024)}
    for n, r in two_level.items():
        assert r.committed == s.rounds
        assert c <= _sent_per_island_round(r) <= 2 * c, n  # 2c(1 - 1/n) for equal groups
    payload = [_sent_per_island_round(r) for r in two_level.values()]
    assert max(payload) / min(payload) < 1.1
    # everything an island sends (registry, join, roster, vote included) grows by less than the 64x of the islands
    total = [r.per_island_round(r.sent_bytes) for r in two_level.values()]
    assert total[-1] / total[0] < 1.5

    gather = dataclasses.replace(s, exchange="gather", schemes=["flat"])
    flat = {n: simulate(gather, n, "flat") for n in (16, 64, 256)}
    for n, r in flat.items():
        assert _sent_per_island_round(r) == pytest.approx((n - 1) * c, rel=1e-6)
    assert _sent_per_island_round(flat[256]) > 15 * _sent_per_island_round(flat[16])


def test_a_round_without_churn_takes_at_least_its_bytes_over_the_rate_and_its_latency_terms():
    rtt = 0.1
    for payload_mb, rtt_ms in ((100.0, "100"), (0.01, "1000")):
        s = Settings(**QUIET, payload_mb=payload_mb, rtt_ms=rtt_ms, rate="1gbit", group_size=16)
        rtt = float(rtt_ms) / 1e3
        bandwidth = s.payload / (1e9 / 8)
        roster = simulate(s, 64, "roster")  # 4 groups: the two-level round
        assert roster.median_idle >= bandwidth  # c / B: an island sends nearly 2c
        assert roster.median_idle >= roster.per_island_round(roster.payload_sent_bytes) / (1e9 / 8)
        # registry (2 RTT), join, roster, 4 one-way phases, vote: 5.5 RTT
        assert roster.median_idle >= (s.registry_rtts + 3.5) * rtt
        flat = simulate(s, 64, "flat")
        assert flat.median_idle >= (s.hivemind_rtts + 1.5) * rtt
        gossip = simulate(s, 64, "gossip")
        assert gossip.median_idle >= 1.5 * rtt + bandwidth


def test_churn_brings_deaths_retries_and_longer_rounds():
    calm = Settings(rounds=10, churn=0.0, step_jitter=0.0)
    churn = dataclasses.replace(calm, churn=0.05)
    quiet, busy = simulate(calm, 100, "roster"), simulate(churn, 100, "roster")
    assert quiet.deaths == quiet.retries == 0 and quiet.committed == calm.rounds
    assert busy.deaths > 0 and busy.retries > quiet.retries
    assert busy.median_round > quiet.median_round
    assert busy.p90_round > quiet.p90_round
    for scheme in ("roster", "flat", "gossip"):  # nobody is left waiting for a round that will not come
        assert quiet.finished == 100 and simulate(churn, 100, scheme).finished >= 80, scheme


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    s = Settings(rounds=6, churn=0.1, step_s="0.3..0.7", rtt_ms="50..150")

    def fields(r):
        return {k: v for k, v in dataclasses.asdict(r).items() if k != "sim_seconds"}

    for scheme in ("roster", "flat", "gossip"):
        first, again = simulate(s, 40, scheme), simulate(s, 40, scheme)
        assert fields(first) == fields(again)
        assert fields(simulate(dataclasses.replace(s, seed=1), 40, scheme)) != fields(first)


def test_a_half_and_half_split_commits_nothing_while_the_flat_group_commits_on_both_sides():
    s = Settings(**QUIET, partition=0.5, silent_timeout=5.0, round_timeout=20.0)
    roster = simulate(s, 16, "roster")
    assert roster.committed == 0
    flat = simulate(s, 16, "flat")  # today's rule: whatever group formed commits
    assert flat.max_commits_per_round == 2


def test_quorum_lets_at_most_one_roster_commit_a_round_under_a_split_and_churn():
    s = Settings(rounds=8, churn=0.1, partition=0.3, silent_timeout=5.0, round_timeout=20.0)
    r = simulate(s, 40, "roster")
    assert r.max_commits_per_round == 1
    assert r.committed >= 1  # the 70% side holds a majority of the last roster


def test_islands_sharing_cores_compute_in_proportion_to_their_number():
    alone = Settings(**QUIET, payload_mb=0.001, rtt_ms="0.05", rate="20gbit")
    shared = dataclasses.replace(alone, cores=2.0)
    own = simulate(alone, 8, "roster")
    two_cores = simulate(shared, 8, "roster")
    compute = alone.inner_steps * 0.1
    assert own.median_round == pytest.approx(compute, rel=0.1)
    assert two_cores.median_round >= 8 / 2 * compute


def test_a_fresh_connection_is_slower_than_a_warm_one_only_beyond_its_first_window():
    assert slow_start_seconds(10_000, 125e6, 0.1, 14_600) == 0.0
    assert slow_start_seconds(100e6, 125e6, 0.1, 14_600) > 0.5  # ~10 round trips to a 12.5 MB window
    assert slow_start_seconds(100e6, 125e6, 0.0, 14_600) == 0.0


def test_the_roster_splits_into_groups_of_near_equal_size():
    groups = split(list(range(100)), 16)
    assert len(groups) == 7 and sorted(map(len, groups)) == [14] * 5 + [15] * 2
    assert [i for g in groups for i in g] == list(range(100))
    assert split(list(range(5)), 16) == [list(range(5))]


def test_gossip_spread_halves_per_round_and_settles_at_one_round_of_drift():
    rounds, steady = gossip_spread(1000, 0.01, seed=0)
    assert 10 <= rounds <= 20  # variance halves per round: log2(1e4) = 13.3
    assert 0.7 <= steady <= 1.3


def test_calibration_figures_are_read_and_flags_win(tmp_path):
    s = settings_from({"cores": "4"}, {"cores": 2, "step_s": 0.35, "islands": [8, 16], "reuse_connections": False})
    assert (s.cores, s.step_s, s.islands, s.reuse_connections) == (4.0, "0.35", [8, 16], False)
    out = tmp_path / "out"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"cpu_per_bite_s": 1e-9}))
    assert main(["--calibrate", str(bad), "--out", str(out)]) == 2
    assert main(["--islands", "1", "--out", str(out)]) == 2
    assert main(["--schemes", "roster", "--exchange", "gather", "--out", str(out)]) == 2
    assert not out.exists()


def test_the_command_writes_its_table_and_plot(tmp_path, capsys):
    calibration = tmp_path / "measured.json"
    calibration.write_text(json.dumps({"cores": 2, "rtt_ms": 0.05, "rate": "20gbit", "step_s": 0.05,
                                       "inner_steps": 10, "payload_mb": 1}))
    assert main(["--calibrate", str(calibration), "--islands", "4,8", "--rounds", "3", "--churn", "0",
                 "--out", str(tmp_path)]) == 0
    table = (tmp_path / "results.md").read_text()
    rows = [[cell.strip() for cell in line.split("|")[1:3]] for line in table.splitlines() if line.startswith("|")]
    assert ["8", "roster"] in rows and ["4", "gossip"] in rows
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [(r["islands"], r["scheme"]) for r in results] == [(n, s) for n in (4, 8) for s in ("roster", "flat",
                                                                                             "gossip")]
    assert (tmp_path / "scale_sim.png").stat().st_size > 0
    assert "roster" in capsys.readouterr().out
