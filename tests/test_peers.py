"""The hivemind averager behind our interface: real DHTs and averagers on loopback."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from peers.discovery.dht import start_dht, visible_maddrs
from peers.errors import PeerNetworkError
from peers.group.averager import VerifiedAverager, fingerprint, fingerprints_agree
from peers.settings import AveragerSettings, NetworkSettings, Scope

FAST = dict(matchmaking_time=1.5, request_timeout=0.5, matchmaking_timeout=8.0, vote_timeout=4.0,
            allreduce_timeout=15.0, next_chunk_timeout=5.0, state_download_timeout=10.0)
TEMPLATE = [torch.zeros(64, 8), torch.zeros(300)]


@pytest.fixture
def swarm(no_leaked_daemons):
    """A factory of connected (dht, averager) pairs; everything is shut down afterwards."""
    made: list = []

    def make(n: int, prefix: str = "t", template=TEMPLATE, **overrides):
        settings = AveragerSettings(**{**FAST, "target_group_size": n, **overrides})
        first = start_dht(NetworkSettings())
        dhts = [first] + [start_dht(NetworkSettings(initial_peers=visible_maddrs(first))) for _ in range(n - 1)]
        made.extend(dhts)
        avgs = [VerifiedAverager(d, template, settings, Scope(prefix=prefix)) for d in dhts]
        made.extend(avgs)
        return avgs

    yield make
    for obj in reversed(made):
        obj.shutdown()


def _run_round(avgs, deltas, weights, metas=None, round_id="0"):
    results = [None] * len(avgs)

    def go(i):
        meta = (metas or [{"config_fingerprint": "same"}] * len(avgs))[i]
        results[i] = avgs[i].average(deltas[i], weights[i], meta, round_id)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(avgs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def _together(calls):
    """Run ``calls`` at once (one thread each); their results in order."""
    results = [None] * len(calls)

    def go(i):
        results[i] = calls[i]()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def _rand():
    return [torch.randn_like(t) for t in TEMPLATE]


def test_weighted_average_reaches_every_island(swarm):
    # the leader waits for all three (its roster leaves the moment they joined), not matchmaking_time after two: on a
    # loaded CI machine a round went on with two, the third late or not yet in the leader's read of the registry
    avgs = swarm(3, weighting="tokens", wait_for_islands=3, matchmaking_time=10.0, matchmaking_timeout=20.0)
    deltas = [_rand() for _ in range(3)]
    weights = [1.0, 2.0, 5.0]
    results = _run_round(avgs, deltas, weights)
    expected = [sum(w * d[k] for w, d in zip(weights, deltas)) / sum(weights) for k in range(len(TEMPLATE))]
    for result, averaged in results:
        assert result.ok, result.reason
        assert result.group_size == 3 and len(result.peers) == 3
        assert result.total_weight == pytest.approx(8.0)
        # reduce-scatter then all-gather: 2·(n−1)/n of the vector out, give or take a part's rounding
        assert abs(result.bytes_sent - 2 * 4 * sum(t.numel() for t in TEMPLATE) * 2 / 3) <= 8
        for a, e in zip(averaged, expected):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_group_below_minimum_is_rejected_by_everyone(swarm):
    avgs = swarm(2, min_group_size=3, target_group_size=3)
    results = _run_round(avgs, [_rand(), _rand()], [1.0, 1.0])
    for result, averaged in results:
        assert not result.ok and averaged is None
        assert result.reason


def test_nan_from_a_peer_counts_for_nothing_and_the_round_goes_on(swarm):
    """A peer that sends NaN (past its own finiteness check, as a hostile one would) no longer fails the round for
    everyone: the part holding the NaN is checked by its owner, the peer's part counts for nothing there, and every
    island commits the same finite result, which is the honest island's own values where the NaN was."""
    avgs = swarm(2)
    honest, hostile = avgs
    mine = _rand()
    bad = torch.cat([t.reshape(-1) for t in _rand()])
    bad[3] = float("nan")
    results = _together([lambda: honest.average(mine, 1.0, {"config_fingerprint": "same"}, "0"),
                         lambda: hostile.average(_rand(), 1.0, {"config_fingerprint": "same"}, "0",
                                                 encoded=bytes(memoryview(bad.numpy()).cast("B")))])
    for result, averaged in results:
        assert result.ok, result.reason
        assert all(torch.isfinite(a).all() for a in averaged)
        assert torch.cat([a.reshape(-1) for a in averaged])[3] == torch.cat([t.reshape(-1) for t in mine])[3]
    assert [hostile.peer_id] in [r.rejected for r, _ in results]  # the owner of the part said whose it left out
    assert torch.equal(torch.cat([a.reshape(-1) for a in results[0][1]]), torch.cat([a.reshape(-1) for a in results[1][1]]))


def test_an_exchange_that_raises_fails_the_round_and_returns_it_as_data(swarm):
    """A payload or transport that breaks the exchange (a decoder's error, say) ends the round with its reason on
    every member, not in an exception out of the round."""
    avgs = swarm(2)

    def broken(meta, peers, round_id):
        raise RuntimeError("the decoder broke")

    results = _together([lambda a=a: a.run_round(1.0, {"config_fingerprint": "same"}, "0", broken) for a in avgs])
    for result, averaged in results:
        assert not result.ok and averaged is None
        assert result.reason == "the exchange raised RuntimeError: the decoder broke"


def test_different_configs_are_not_averaged(swarm):
    avgs = swarm(2)
    results = _run_round(avgs, [_rand(), _rand()], [1.0, 1.0],
                         metas=[{"config_fingerprint": "a"}, {"config_fingerprint": "b"}])
    for result, _ in results:
        assert not result.ok and "different model or training configs" in result.reason


def test_our_own_nan_is_never_sent(swarm):
    (avg,) = swarm(1, min_group_size=1)
    bad = _rand()
    bad[1][0] = float("inf")
    result, averaged = avg.average(bad, 1.0, {}, "0")
    assert not result.ok and "not finite" in result.reason and averaged is None


def test_vote_tells_a_lost_member_from_a_lost_part_and_counts_who_voted(swarm):
    """A member that never votes (killed mid-round) and two members whose results differ (a part lost) are
    told apart, with the number of members that did vote: enough of them may average again."""
    a, b, gone = swarm(3, vote_timeout=2.0)
    peers = sorted(x.peer_id for x in (a, b, gone))

    def vote_both(round_id: str, values_b: list[torch.Tensor]) -> list[tuple[str, int, int]]:
        out: list = [None, None]

        def go(i, avg, values):
            out[i] = avg._vote(fingerprint(values), peers, round_id)

        threads = [threading.Thread(target=go, args=(0, a, [torch.ones(100)])),
                   threading.Thread(target=go, args=(1, b, values_b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return out

    lost = "1 of 3 island(s) did not confirm the result (left or failed mid-round)"
    assert vote_both("r1", [torch.ones(100)]) == [(lost, 2, 2), (lost, 2, 2)]
    # a verdict that differs settles the round without waiting for the missing member
    for reason, voters, left in vote_both("r2", [torch.full((100,), 2.0)]):
        assert reason.startswith("islands received different averages") and voters == 2 and left == 0, reason


def test_fingerprints_catch_a_part_left_unaveraged():
    averaged = [torch.randn(10_000)]
    partial = [averaged[0].clone()]
    partial[0][2000:2500] = torch.randn(500)  # one peer kept its local values for one part
    assert fingerprints_agree(fingerprint(averaged), fingerprint([averaged[0] * (1 + 1e-7)]), 1e-5)
    assert not fingerprints_agree(fingerprint(averaged), fingerprint(partial), 1e-5)
    nan = [averaged[0].clone()]
    nan[0][5] = float("nan")
    assert not fingerprints_agree(fingerprint(averaged), fingerprint(nan), 1e-5)


def test_unreachable_and_malformed_peers_fail_fast_with_one_line(no_leaked_daemons):
    t0 = time.time()
    with pytest.raises(PeerNetworkError, match="could not reach any initial peer"):
        start_dht(NetworkSettings(initial_peers=["/ip4/127.0.0.1/tcp/9/p2p/12D3KooWPv9PooUzajcypH6NMZc2Cp6fvGbzvTKPc4y87xBxdPV7"],
                                  startup_timeout=5))
    assert time.time() - t0 < 30
    with pytest.raises(PeerNetworkError, match="is not a valid multiaddr"):
        start_dht(NetworkSettings(initial_peers=["/ip4/1.2.3/tcp/5/p2p/x"]))
    with pytest.raises(PeerNetworkError, match="lacks its /p2p/PEER_ID"):
        start_dht(NetworkSettings(initial_peers=["/ip4/127.0.0.1/tcp/5"]))
    # a port in use is told apart from peers that do not answer (a restarted island moves only for the former)
    import socket

    from peers.errors import PortTakenError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortTakenError, match=f"could not listen on /ip4/127.0.0.1/tcp/{port}: the port is in use"):
            start_dht(NetworkSettings(host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"], startup_timeout=5))
