"""Rounds formed from the run's registry (peers/group/roster.py): the quorum rule, the deterministic groups and
leader order, and real rounds of averagers on loopback: one group of every member whatever the timing, two levels
when the roster is larger than ``max_group_size``, and a lone island with ``min_group_size 1``."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from peers.discovery.dht import start_dht, visible_maddrs
from peers.discovery.membership import confirmed_position, meeting_step, run_moved_past, run_numbers_behind
from peers.group.averager import VerifiedAverager
from peers.group.roster import GENESIS, RoundView, leader_order, lineage, quorum_problem, split_groups
from peers.settings import AveragerSettings, NetworkSettings, Scope

FAST = dict(matchmaking_time=1.5, request_timeout=0.5, matchmaking_timeout=10.0, vote_timeout=4.0,
            allreduce_timeout=10.0)
ISLANDS = [f"island{i:02d}" for i in range(10)]


# ------------------------------------------------------------------------------------------- the rule
def test_a_group_commits_only_with_a_majority_of_the_last_committed_roster():
    committed = ISLANDS[:8]
    assert not quorum_problem(ISLANDS[:5], committed, (), 8)  # 5 of 8
    assert "4 of the 8" in quorum_problem(ISLANDS[:4], committed, (), 8)  # 4 of 8: no majority
    assert "3 of the 8" in quorum_problem(ISLANDS[5:8], committed, (), 8)
    # islands known to have left before the round (or gone) are not counted: 3 of the 5 others is a majority
    assert not quorum_problem(ISLANDS[5:8], committed, ISLANDS[:3], 5)
    # ... of the roster, but not of the run when more islands are live than the roster kept: a lineage nobody
    # would follow (the 16-island run: 5 of the 9 left of a roster of 10 committed, with 15 live, and forked)
    assert "5 of the 15" in quorum_problem(ISLANDS[:5], ISLANDS[:9], (), 15)
    assert not quorum_problem(ISLANDS[:8], ISLANDS[:9], (), 15)
    # newcomers count in the group but not towards the majority of those who committed
    assert "2 of the 8" in quorum_problem(ISLANDS[6:10], committed, (), 10)
    # before any round committed: a majority of the most islands any member saw registered
    assert not quorum_problem(ISLANDS[:2], (), (), 3)
    assert "2 of the 4" in quorum_problem(ISLANDS[:2], (), (), 4)
    assert "2 of the 4" in quorum_problem(ISLANDS[:2], (), (), 3, wait_for=4)  # the islands the run waits for


def test_an_island_struck_out_counts_nowhere_in_the_quorum():
    """3 honest islands and a struck attacker that trains on alone: the attacker is in the committed roster of the
    round that struck it and in the registry, but a group of 2 honest islands is a majority of the run (counted, it
    held 2 of 4: two rounds failed so in the hostile experiment's `vote` arm)."""
    honest, liar = ISLANDS[:3], ISLANDS[3]
    view = RoundView(committed=tuple(ISLANDS[:4]), endpoints={i: f"10.0.0.{n}:1" for n, i in enumerate(ISLANDS[:4])},
                     expected=set(ISLANDS[:4]), seen=4)
    assert quorum_problem(honest[:2], view.committed, view.out, view.seen)  # 2 of 4
    cut = view.without({liar})
    assert liar not in cut.expected and liar in cut.out and cut.seen == 3
    assert not quorum_problem(honest[:2], cut.committed, cut.out, cut.seen)  # 2 of 3
    assert quorum_problem(honest[:1], cut.committed, cut.out, cut.seen)
    assert view.without(set()) is view


def test_an_island_is_behind_once_half_the_run_is_further_along():
    """Positions are (rounds committed, outer step).  Once half the run is further along, the rest can no longer
    commit the round: a healed minority catches up at once, even when its failed rounds numbered further, and of
    two equal sides that committed nothing the one whose numbering fell behind takes the other's."""
    assert run_moved_past([(3, 3)], (2, 2))  # of 2 islands, the other moved on
    assert not run_moved_past([(2, 2)], (2, 2)) and not run_moved_past([], (2, 2))
    # 5/3 healed: the 5 committed 3 rounds during the cut, the 3 rolled back 5 (numbering further)
    assert run_moved_past([(5, 5)] * 5 + [(2, 7)] * 2, (2, 7))
    assert not run_moved_past([(2, 7)] * 3 + [(5, 5)] * 4, (5, 5))  # the 5 go on
    # 4/4 healed, nothing committed on either side, numbering 6 and 5: the side at 5 takes the other's
    assert run_moved_past([(2, 6)] * 4 + [(2, 5)] * 3, (2, 5)) and not run_moved_past([(2, 5)] * 4 + [(2, 6)] * 3,
                                                                                   (2, 6))
    assert not run_moved_past([(3, 3), (2, 2)], (2, 2))  # of 3 islands, 2 at the round can still hold a majority
    assert not run_moved_past([(3, 3)] * 3 + [(2, 2)] * 4, (2, 2))  # 3 of 8 past: the 5 left still can


def test_an_island_whose_failed_rounds_numbered_it_past_the_run_waits_for_the_run():
    """Of 48 islands, one failed 6 rounds in a row alone (quickly) while the run averaged a slow round, and ended
    apart: an island of the run's lineage that numbers its round past where half the run is waits for that round to
    end; one whose lineage is behind catches up instead, and a minority numbering behind it holds nobody back."""
    assert run_numbers_behind([(3, 3)], (3, 4))  # of 2 islands, the other is still at the earlier round
    assert run_numbers_behind([(3, 3)] * 40 + [(3, 4)] * 7, (3, 4))
    assert not run_numbers_behind([(4, 4)] * 40, (3, 4))  # the run committed it: catch up, not wait
    assert not run_numbers_behind([(3, 4)] * 40, (3, 4)) and not run_numbers_behind([], (3, 4))
    assert not run_numbers_behind([(3, 3)] * 2 + [(3, 4)] * 5, (3, 4))  # 2 of 8 behind: the 6 go on
    assert not run_numbers_behind([(3, 0)] + [(3, 4)] * 3, (3, 4))  # one member claiming an old round draws nobody
    assert not run_numbers_behind([(2, 3)] * 5, (3, 4))  # an island ahead in the lineage is ahead


def test_a_position_counts_once_half_the_run_reached_it():
    """One island announcing a position nobody else holds draws no catch-up, whatever it claims; what the run
    reached (a majority of it) does."""
    assert confirmed_position([]) == (-1, -1)
    assert confirmed_position([(9, 9)]) == (9, 9)  # of 2 islands, the other is half the run
    assert confirmed_position([(10**9, 10**9), (5, 5)]) == (5, 5)  # of 3, a liar alone counts for nothing
    assert confirmed_position([(10**9, 10**9)] + [(5, 5)] * 4 + [(4, 4)] * 2) == (5, 5)
    assert confirmed_position([(6, 6)] * 3 + [(5, 5)] * 4) == (5, 5)  # 3 of 8 at round 6: not yet the run's


def test_islands_of_one_lineage_numbered_apart_meet_at_the_step_a_quarter_of_them_reached():
    """Failed rounds spread the numbering of islands that hold one θ_global (the 16-island run: 2 of 10 rounds
    committed so); an island behind averages its next round with those ahead, never moves back, and follows no
    lone member that announces a step far ahead."""
    # 16 islands spread over steps 7, 8, 9: every one meets at 9, where 6 are already
    spread = [7] * 5 + [8] * 5 + [9] * 6
    for mine in (7, 8, 9):
        others = list(spread)
        others.remove(mine)
        assert meeting_step(others, mine) == 9
    assert meeting_step([7] * 13 + [9] * 2, 7) == 7  # 2 of 16 ahead: the 14 hold the round, the 2 catch up after
    assert meeting_step([10**9] + [5] * 6, 5) == 5  # one liar far ahead draws nobody
    assert meeting_step([10**9] * 2 + [6] * 2 + [5] * 4, 5) == 6  # of 9, 2 liars are not a quarter; 4 ahead are
    assert meeting_step([4] * 3, 5) == 5  # never back
    assert meeting_step([6], 5) == 6 and meeting_step([], 5) == 5  # of 2 islands, the other's number
    assert meeting_step([6, 5], 5) == 5  # of 3, one ahead is not enough


def test_two_groups_without_a_common_member_never_both_hold_a_majority():
    """The property the rule exists for, over every split of a committed roster of 1 to 8 islands, and every set of
    islands known out of the round."""
    import itertools

    for n in range(1, 9):
        committed = ISLANDS[:n]
        for out_size in range(n):
            for out in itertools.combinations(committed, out_size):
                counted = [i for i in committed if i not in out]
                for k in range(len(counted) + 1):
                    for left in itertools.combinations(counted, k):
                        right = [i for i in counted if i not in left]
                        both = not quorum_problem(left, committed, out, n) and not quorum_problem(right, committed,
                                                                                                   out, n)
                        assert not both, (committed, out, left, right)


def test_groups_and_leaders_are_the_same_on_every_island_and_change_every_round():
    members = ISLANDS[:10]
    assert split_groups(list(reversed(members)), "7", 4) == split_groups(members, "7", 4)
    groups = split_groups(members, "7", 4)
    assert len(groups) == 3 and sorted(len(g) for g in groups) == [3, 3, 4]
    assert sorted(i for g in groups for i in g) == members
    assert split_groups(members, "7", 16) == [members] and split_groups(members, "7", 0) == [members]
    assert split_groups(members, "8", 4) != groups  # a slow island is not grouped with the same others every round
    assert leader_order(members, "7") == leader_order(list(reversed(members)), "7")
    assert len({leader_order(members, str(r))[0] for r in range(30)}) > 3  # the lead rotates
    assert lineage(()) == GENESIS and lineage(["b", "a"]) == lineage(["a", "b"]) != lineage(["a"])


# ---------------------------------------------------------------------------------------- real rounds
@pytest.fixture
def averagers(no_leaked_daemons):
    made: list = []

    def make(n: int, **settings) -> list[VerifiedAverager]:
        first = start_dht(NetworkSettings())
        dhts = [first] + [start_dht(NetworkSettings(initial_peers=visible_maddrs(first))) for _ in range(n - 1)]
        made.extend(dhts)
        avgs = [VerifiedAverager(d, [torch.zeros(4096)], AveragerSettings(**{**FAST, **settings}), Scope(prefix="r"))
                for d in dhts]
        made.extend(avgs)
        return avgs

    yield make
    for obj in reversed(made):
        obj.shutdown()


def _round(avgs: list[VerifiedAverager], values: list[torch.Tensor], weights: list[float], round_id: str) -> list:
    out: list = [None] * len(avgs)

    def go(i: int) -> None:
        out[i] = avgs[i].average([values[i]], weights[i], {"config_fingerprint": "c"}, round_id)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(avgs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.alone  # a new run's first roster of 6 under a busy second core: a .ci/run formed a group of 4
@pytest.mark.parametrize("compression", ["none", "int8"])
def test_a_roster_larger_than_max_group_size_averages_in_two_levels_to_the_same_bits_everywhere(averagers,
                                                                                               compression):
    """6 islands, groups of at most 3: two groups average inside themselves, then across; every island ends with the
    same bits, the weighted average of the six (up to the codec), in one round."""
    # a registry read waits up to matchmaking_time: under the suite's load 1.5 s left a leader that read none of the
    # others, and it closed its roster without one of them
    avgs = averagers(6, max_group_size=3, compression=compression, weighting="tokens", matchmaking_time=6.0)
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(4096, generator=g) for _ in avgs]
    weights = [1.0, 2.0, 3.0, 1.0, 2.0, 3.0]
    out = _round(avgs, values, weights, "0")
    assert all(r.ok and r.group_size == 6 for r, _ in out), [r.reason for r, _ in out]
    averaged = [a[0] for _, a in out]
    for other in averaged[1:]:
        assert torch.equal(other, averaged[0])
    expected = sum(w * v for w, v in zip(weights, values)) / sum(weights)
    tolerance = 1e-6 if compression == "none" else 0.05
    assert (averaged[0] - expected).abs().max() < tolerance * expected.abs().max()


def test_two_islands_with_min_group_size_1_average_together_every_round(averagers):
    """Before, two islands that both saw each other registered formed a group of one each, every round, and the run
    ended with two θ_global.  A group of one is for an island with nobody else there."""
    avgs = averagers(2, min_group_size=1)
    for r in range(3):
        out = _round(avgs, [torch.full((4096,), 1.0), torch.full((4096,), 3.0)], [1.0, 1.0], str(r))
        assert all(res.ok and res.group_size == 2 for res, _ in out), [res.reason for res, _ in out]
        assert all(torch.equal(a[0], torch.full((4096,), 2.0)) for _, a in out)


def test_a_lone_island_with_min_group_size_1_still_averages_alone(averagers):
    alone, = averagers(1, min_group_size=1)
    (result, averaged), = _round([alone], [torch.full((4096,), 5.0)], [1.0], "0")
    assert result.ok and result.group_size == 1 and torch.equal(averaged[0], torch.full((4096,), 5.0))


def test_six_islands_forced_into_two_groups_train_and_end_identical(tmp_path, no_leaked_daemons):
    """Six islands (separate processes, forked warm) with groups of at most 3: every round averages in two levels,
    every round commits on every island, and they end with one θ_global, bit for bit."""
    from diloco.launch.simulate import simulate
    from tests.conftest import tiny_config

    cfg = tiny_config(tmp_path, **{
        "averaging.backend": "hivemind", "averaging.min_group_size": 2, "averaging.max_group_size": 3,
        "averaging.wait_for_islands": 6, "averaging.request_timeout": 1.0, "averaging.matchmaking_timeout": 60.0,
        # a registry read waits up to matchmaking_time: on a loaded machine 5 s left a leader expecting 2 of the 6
        "averaging.matchmaking_time": 10.0, "diloco.outer_steps": 3, "diloco.inner_steps": 8, "checkpoint.every": 0,
        "threads": 1})
    result = simulate(cfg, 6)
    islands = result["islands"]
    assert len(islands) == 6
    for s in islands:
        assert s["rounds_ok"] == 3 and s["rounds_failed"] == 0, s["failures"]
    assert len({s["theta_checksum"] for s in islands}) == 1
    assert result["theta_global_max_abs_diff"] == 0.0
    from diloco.engine.metrics import read_metrics

    run_dirs = sorted(p.parent for p in tmp_path.glob("**/metrics.jsonl"))
    assert len(run_dirs) == 6
    for d in run_dirs:
        rounds = [r for r in read_metrics(d) if "round_ok" in r]
        assert [r["groups"] for r in rounds] == [2, 2, 2], rounds  # two levels, every round


def test_a_robust_rule_leaves_a_scaled_member_out_on_every_island_alike(averagers):
    """Four islands under centered-clip, one sending its Δ × 1000: every island checks every member's whole Δ (an
    all-gather), so all reject the same member, name it alike (the evidence a strike needs) and commit the same
    bits, the honest islands' average."""
    # the roster waits for all 4 (a member late on a loaded machine would miss the round, and the test its point)
    avgs = averagers(4, aggregate="centered-clip", target_group_size=4, matchmaking_time=5.0)
    g = torch.Generator().manual_seed(1)
    honest = [torch.randn(4096, generator=g) for _ in range(3)]
    out: list = [None] * 4
    hostile = avgs[3]
    payload = hostile.codec.encode(torch.randn(4096, generator=g) * 1000)

    def go(i: int) -> None:
        delta = honest[i] if i < 3 else torch.zeros(4096)
        out[i] = avgs[i].average([delta], 1.0, {"config_fingerprint": "c"}, "0",
                                 encoded=payload if i == 3 else None)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for result, averaged in out:
        assert result.ok and result.rejected == [hostile.peer_id], (result.reason, result.rejected)
        assert torch.equal(averaged[0], out[0][1][0])
    expected = sum(honest) / 3
    assert (out[0][1][0] - expected).abs().max() < 1e-5


def test_under_a_robust_rule_a_lie_about_tokens_buys_no_more_than_the_median_weight(averagers):
    """Weighed by tokens under centered-clip, one member of four claims a million times the others' tokens with
    a Δ of −4 × theirs (inside the member check's 10× the median norm).  Capped at 8× the median claim it would
    hold 8/11 of the weight, a majority CenteredClip centres on; capped at the median, the honest three hold the
    aggregate near their mean, every island names the liar an outlier, and the aggregate is the honest mean."""
    avgs = averagers(4, aggregate="centered-clip", weighting="tokens", target_group_size=4, matchmaking_time=5.0)
    g = torch.Generator().manual_seed(2)
    base = torch.randn(4096, generator=g)
    honest = [base + 0.1 * torch.randn(4096, generator=g) for _ in range(3)]
    values = honest + [-4 * base]
    results = _round(avgs, values, [100.0, 100.0, 100.0, 1e8], "0")
    honest_mean = sum(honest) / 3
    for result, averaged in results:
        assert result.ok, result.reason
        assert torch.equal(averaged[0], results[0][1][0])
        # far from the aggregate, it is named on every island alike (a strike: --averaging.outlier_ratio) and the
        # aggregate is taken again without it: the honest mean
        assert result.rejected == [avgs[3].peer_id]
        assert (averaged[0] - honest_mean).abs().max() < 1e-5


# ------------------------------------------------------------------------------ forming a roster, scripted
@pytest.fixture
def three_transports():
    from peers.identity import Identity
    from peers.wire.transport import Transport

    made = [Transport(Identity.generate(), encrypt=False) for _ in range(3)]
    yield made
    for t in made:
        t.close()


def test_two_islands_that_follow_each_other_end_with_one_leader_and_one_roster(three_transports):
    """The cycle a loaded machine made (a 6-island round ended with every island waiting for a roster): an island
    that came late to a round joins an island that had asked it (Y), while Y, sent on by a third (Z) that took no
    part, joined it in turn: each waited for the other's roster.  Of the two, the one first in the order leads, and
    one roster of both forms."""
    import time

    from peers.group.roster import JOIN, PASS_BODY, ROSTER, RosterForming, RoundView

    by_id = {t.peer_id: t for t in three_transports}
    z_id, x_id, y_id = leader_order(by_id, "0")  # Z first, X before Y
    z, x, y = by_id[z_id], by_id[x_id], by_id[y_id]
    joined_z: list[str] = []
    z.handlers[JOIN] = lambda key, sender, payload, extra: joined_z.append(sender) or True  # takes joins, answers none
    forming = {i: RosterForming(by_id[i], i, matchmaking_time=0.5, request_timeout=2.0) for i in (x_id, y_id)}
    endpoints = {i: t.endpoint for i, t in by_id.items()}
    deadline = time.monotonic() + 15.0

    # Y asked X before X reached the round: X remembers it as an asker
    y.send(x.endpoint, JOIN + "0", b'{"round_id": "0"}', deadline, {"endpoint": y.endpoint})
    assert x_id in y.box.wait_for(ROSTER + "0", lambda m: x_id in m, deadline)
    y.box.release(ROSTER + "0", drop=True)

    results: dict[str, object] = {}

    def form(island: str, expected: set[str]) -> None:
        view = RoundView((), endpoints, expected, set(), 3)
        results[island] = forming[island].form("0", {"round_id": "0", "who": island[-4:]}, view, deadline,
                                               lambda: None)

    # Y enters the round and follows Z (first in its order), which says nothing yet
    ty = threading.Thread(target=form, args=(y_id, {z_id, x_id, y_id}))
    ty.start()
    assert _until(lambda: y_id in joined_z)
    # X enters: Y asked it before, so it joins Y (which is there, following Z)
    tx = threading.Thread(target=form, args=(x_id, {x_id, y_id}))
    tx.start()
    assert _until(lambda: forming[y_id].transport.box.wait_for(JOIN + "0", lambda m: x_id in m, 0.0))
    # Z takes no part: Y goes on to X, which is there and follows Y
    z.send(y.endpoint, ROSTER + "0", PASS_BODY, deadline)
    _one_roster_of_both([ty, tx], forming, results, (x_id, y_id))


def _one_roster_of_both(threads: list[threading.Thread], forming: dict, results: dict, pair: tuple[str, str]) -> None:
    """Wait for the islands' ``threads``, stop their rosters' handlers, and check that both islands of ``pair`` hold
    one roster of the two of them."""
    for t in threads:
        t.join(25)
    for f in forming.values():
        f.close()
    assert all(isinstance(results.get(i), dict) for i in pair), results
    assert set(results[pair[0]]) == set(results[pair[1]]) == set(pair)


def _until(condition, timeout: float = 10.0) -> bool:
    import time

    end = time.monotonic() + timeout
    while not condition() and time.monotonic() < end:
        time.sleep(0.02)
    return bool(condition())


def test_a_leader_reaching_its_target_without_a_majority_waits_for_the_committed_island_still_coming(
        three_transports):
    """The flake a CI run met (test_faults' stale member): the last round was committed by the leader L and C; the
    island J, left out of it, came back and joined L at once, while C was still finishing its inner steps.  A target
    of 2 islands closed L's roster with J alone, a group of 1 of the 2 committed islands, bound to roll back, and C
    came after the roster left.  L waits for C: the roster holds all three."""
    import time

    from peers.group.roster import JOIN, RosterForming, RoundView

    by_id = {t.peer_id: t for t in three_transports}
    l_id, c_id = leader_order([t.peer_id for t in three_transports[:2]], "5")  # L leads the committed pair
    j_id = three_transports[2].peer_id
    endpoints = {i: t.endpoint for i, t in by_id.items()}
    forming = RosterForming(by_id[l_id], l_id, matchmaking_time=0.5, request_timeout=2.0, target=2)
    deadline = time.monotonic() + 15.0
    view = RoundView((l_id, c_id), endpoints, {l_id, c_id, j_id}, set(), 3)
    result: dict[str, object] = {}
    leading = threading.Thread(target=lambda: result.update(
        roster=forming.form("5", {"round_id": "5"}, view, deadline, lambda: None)))
    leading.start()

    def join(island: str) -> None:
        body = json.dumps({"round_id": "5", "endpoint": endpoints[island]}).encode()
        by_id[island].send(endpoints[l_id], JOIN + "5", body, deadline, {"endpoint": endpoints[island]})

    join(j_id)
    time.sleep(1.5)  # three times the grace window: C finishes its inner steps
    join(c_id)
    leading.join(20)
    forming.close()
    assert isinstance(result.get("roster"), dict), result
    assert set(result["roster"]) == {l_id, c_id, j_id}


def test_a_leader_handing_over_to_an_island_still_training_waits_for_it(three_transports):
    """The 40M round in flight that failed beside torchft: island A led round 5 alone (its first read of the registry
    counted B out), and each later read named B before it.  A handed the round over to B, which had not reached the
    round yet, led again, and after three hand-offs in 3 s gave the round up ("never agreed on a leader") while B was
    still training towards it.  A hand-off to an island not there yet is a wait: B arrives after 4.5 s, and one
    roster of both forms."""
    import time

    from peers.group.roster import RosterForming, RoundView

    by_id = {t.peer_id: t for t in three_transports[:2]}
    b_id, a_id = leader_order(list(by_id), "5")  # B leads when both are counted
    endpoints = {i: t.endpoint for i, t in by_id.items()}
    forming = {i: RosterForming(by_id[i], i, matchmaking_time=0.5, request_timeout=2.0) for i in by_id}
    deadline = time.monotonic() + 20.0
    both = RoundView((a_id, b_id), endpoints, {a_id, b_id}, set(), 2)
    alone = RoundView((a_id, b_id), endpoints, {a_id}, {b_id}, 2)
    assert alone.leaders("5") == [a_id] and both.leaders("5") == [b_id, a_id]
    results: dict[str, object] = {}

    def form(island: str, view: RoundView) -> None:
        results[island] = forming[island].form("5", {"round_id": "5"}, view, deadline, lambda: None,
                                               refresh=lambda: both)

    leading = threading.Thread(target=form, args=(a_id, alone))
    leading.start()
    time.sleep(4.5)  # B trains on
    coming = threading.Thread(target=form, args=(b_id, both))
    coming.start()
    _one_roster_of_both([leading, coming], forming, results, (a_id, b_id))


def test_a_leader_tells_the_islands_it_expects_that_it_came(three_transports):
    """A blocking round's first comer waits for the islands still training to come (a stale one then leaves before the
    roster forms).  One that joins it says so in its join; a leader that came last joins nobody, and the first comer
    learned of it at its next read of the registry, up to a second later, while the leader waited for its join (the
    last comer held 0.69-0.76 s at 9M beside torchft's 0.13-0.16 s).  The leader tells the islands it expects that it
    came, with the digest of the θ_global it enters with."""
    import time

    from peers import digest
    from peers.group.roster import RosterForming, RoundView

    by_id = {t.peer_id: t for t in three_transports[:2]}
    l_id, f_id = leader_order(list(by_id), "5")
    endpoints = {i: t.endpoint for i, t in by_id.items()}
    forming = {i: RosterForming(by_id[i], i, matchmaking_time=0.5, request_timeout=2.0) for i in by_id}
    deadline = time.monotonic() + 15.0
    view = RoundView((l_id, f_id), endpoints, {l_id, f_id}, set(), 2)
    state = [1.0, 4.0, 12.0] * 8
    results: dict[str, object] = {}
    leading = threading.Thread(target=lambda: results.update({l_id: forming[l_id].form(
        "5", {"round_id": "5", "state_fingerprint": state}, view, deadline, lambda: None)}))
    leading.start()
    assert _until(lambda: l_id in forming[f_id].asked("5"), timeout=5.0)
    assert forming[f_id].asked("5")[l_id] == pytest.approx(digest(state))
    results[f_id] = forming[f_id].form("5", {"round_id": "5"}, view, deadline, lambda: None)
    _one_roster_of_both([leading], forming, results, (l_id, f_id))
    assert forming[f_id].asked("5") == {}  # reaching the round forgets what it was told before


def _forming_in_threads(forming: dict, deadline: float, refresh: dict | None = None):
    """``start(island, view)`` starts ``island``'s :meth:`RosterForming.form` of round "0" in a thread; the result
    lands in ``results`` (what the function returns with the list of threads)."""
    results: dict[str, object] = {}
    threads: list[threading.Thread] = []

    def start(island: str, view: RoundView) -> None:
        def go() -> None:
            results[island] = forming[island].form("0", {"round_id": "0"}, view, deadline, lambda: None,
                                                   refresh=(refresh or {}).get(island))

        threads.append(threading.Thread(target=go))
        threads[-1].start()

    return start, results, threads


def test_two_leaders_whose_reads_of_a_new_run_missed_each_other_end_with_one_roster(three_transports):
    """The CI flake of the two-level round of 6: one island's first read of the registry listed only itself, so it
    led alone, first in no order the others computed, and waited out its deadline with a group of 1 while the rest
    committed without it.  A leader tells the islands it expects that it came; one leading too, later in the
    order, hands its round over to it (before: each led until its deadline, a group of 1 each)."""
    import time

    from peers.group.roster import RosterForming

    by_id = {t.peer_id: t for t in three_transports[:2]}
    x_id, y_id = leader_order(list(by_id), "0")  # X first
    endpoints = {i: t.endpoint for i, t in by_id.items()}
    forming = {i: RosterForming(by_id[i], i, matchmaking_time=0.5, request_timeout=2.0) for i in by_id}
    start, results, threads = _forming_in_threads(forming, time.monotonic() + 15.0)
    start(y_id, RoundView((), {y_id: endpoints[y_id]}, {y_id}, set(), 1))  # Y's read missed X: it leads alone
    assert _until(lambda: forming[y_id]._current == "0")
    start(x_id, RoundView((), endpoints, {x_id, y_id}, set(), 2))
    _one_roster_of_both(threads, forming, results, (x_id, y_id))


def test_the_leader_of_a_new_run_looks_at_the_registry_again_before_it_closes_its_roster(three_transports):
    """Y leads the first round with Z (their reads missed X); X's read listed only itself and it leads alone, later
    in the order than Y.  Y closed its roster as soon as Z joined, and X waited out its deadline alone.  Y reads the
    registry again before closing, finds X, tells it that it leads: X hands its round over, one roster of three."""
    import time

    from peers.group.roster import RosterForming

    by_id = {t.peer_id: t for t in three_transports}
    y_id, x_id, z_id = leader_order(list(by_id), "0")
    endpoints = {i: t.endpoint for i, t in by_id.items()}
    forming = {i: RosterForming(by_id[i], i, matchmaking_time=0.5, request_timeout=2.0) for i in by_id}
    everyone = RoundView((), endpoints, set(by_id), set(), 3)
    start, results, threads = _forming_in_threads(forming, time.monotonic() + 15.0, refresh={y_id: lambda: everyone})
    start(x_id, RoundView((), {x_id: endpoints[x_id]}, {x_id}, set(), 1))
    assert _until(lambda: forming[x_id]._current == "0")
    pair = RoundView((), {i: endpoints[i] for i in (y_id, z_id)}, {y_id, z_id}, set(), 2)
    start(y_id, pair)
    start(z_id, pair)
    for t in threads:
        t.join(25)
    for f in forming.values():
        f.close()
    assert all(isinstance(results.get(i), dict) and set(results[i]) == set(by_id) for i in by_id), results


def test_an_island_following_a_leader_names_it_to_another_island_that_leads_the_round(three_transports):
    """X's read missed Y and listed Z after X, so X leads and tells Z; Z follows Y (first in the order, waiting for a
    third island: ``wait_for`` 3), and answers X with the leader it follows.  X hands its round over to Y: one roster
    of three (before: Y closed with Z after its grace window, and X waited out its deadline alone)."""
    import time

    from peers.group.roster import RosterForming

    by_id = {t.peer_id: t for t in three_transports}
    y_id, x_id, z_id = leader_order(list(by_id), "0")
    endpoints = {i: t.endpoint for i, t in by_id.items()}
    forming = {i: RosterForming(by_id[i], i, matchmaking_time=3.0, request_timeout=2.0, wait_for=3) for i in by_id}
    start, results, threads = _forming_in_threads(forming, time.monotonic() + 15.0)
    pair = RoundView((), {i: endpoints[i] for i in (y_id, z_id)}, {y_id, z_id}, set(), 2)
    start(y_id, pair)
    assert _until(lambda: forming[y_id]._current == "0")
    start(z_id, pair)
    assert _until(lambda: forming[z_id]._following is not None)
    start(x_id, RoundView((), {i: endpoints[i] for i in (x_id, z_id)}, {x_id, z_id}, set(), 2))
    for t in threads:
        t.join(25)
    for f in forming.values():
        f.close()
    assert all(isinstance(results.get(i), dict) and set(results[i]) == set(by_id) for i in by_id), results
