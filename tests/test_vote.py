"""The vote that ends a round: verdicts sent member to member, the DHT record as fallback, strangers
ignored; and groups that form as soon as the expected islands joined.  Real DHTs on loopback."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from peers.discovery.calls import dht_get
from peers.discovery.dht import start_dht, visible_maddrs
from peers.discovery.membership import Membership
from peers.group import missed_group
from peers.group.averager import VerifiedAverager, fingerprint
from peers.group.vote import Verdict, VoteChannel, _submit
from peers.settings import AveragerSettings, NetworkSettings, Scope
from peers.wire.encoded import average_encoded
from peers.wire.round_keys import parts_key, vote_key
from tests.conftest import wait_until

FAST = dict(matchmaking_time=1.5, request_timeout=0.5, matchmaking_timeout=8.0, vote_timeout=3.0,
            allreduce_timeout=15.0, next_chunk_timeout=5.0, state_download_timeout=10.0)
TEMPLATE = [torch.zeros(100)]
LOST = "1 of 3 island(s) did not confirm the result (left or failed mid-round)"


@pytest.fixture
def swarm(no_leaked_daemons):
    """A factory of averagers on connected DHTs: ``make(settings, ...)`` one per settings (``run_key`` per
    DHT optional); everything is shut down afterwards."""
    made: list = []

    def make(*settings: tuple[AveragerSettings, Scope], run_keys: tuple[str, ...] = ()):
        keys = run_keys or ("",) * len(settings)
        first = start_dht(NetworkSettings(run_key=keys[0]))
        dhts = [first] + [start_dht(NetworkSettings(initial_peers=visible_maddrs(first), run_key=k)) for k in keys[1:]]
        made.extend(dhts)
        avgs = [VerifiedAverager(d, TEMPLATE, s, scope) for d, (s, scope) in zip(dhts, settings)]
        made.extend(avgs)
        for avg in avgs:  # tests that exchange parts by hand need every member's transport endpoint
            if hasattr(avg._parts, "endpoints"):
                avg._parts.endpoints.update({other.peer_id: other.endpoint for other in avgs})
        return avgs

    yield make
    for obj in reversed(made):
        obj.shutdown()


SCOPE_FIELDS = ("private", "members_key", "direct_votes")


def _settings(**overrides) -> tuple[AveragerSettings, Scope]:
    scope = {k: overrides.pop(k) for k in SCOPE_FIELDS if k in overrides}
    return AveragerSettings(**{**FAST, **overrides}), Scope(prefix="v", **scope)


def _vote_all(voters: list, peers: list[str], values: list[torch.Tensor | None], round_id: str = "r"
              ) -> list[tuple[str, int, int]]:
    """Every averager in ``voters`` votes its value (None: abstains) at once; (reason, voters, members left) of
    each."""
    out: list = [None] * len(voters)

    def go(i: int) -> None:
        out[i] = voters[i]._vote(None if values[i] is None else fingerprint([values[i]]), peers, round_id)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(voters))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def _vote_all_later(voters: list, peers: list[str], values: list, round_id: str):
    """:func:`_vote_all` in the background: returns a function that waits for it and gives its result."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(_vote_all(voters, peers, values, round_id)))
    t.start()
    return lambda: (t.join(30), out[0])[1]


def _no_dht_fallback(monkeypatch) -> None:
    """Votes can neither read nor write the DHT record: only verdicts sent member to member arrive."""
    async def no_poll(self, *args) -> bool:
        return True

    async def no_store(self, *args) -> bool:
        return False

    monkeypatch.setattr(VoteChannel, "_poll", no_poll)
    monkeypatch.setattr(VoteChannel, "_store", no_store)


def test_verdicts_travel_member_to_member_without_the_dht(swarm, monkeypatch):
    _no_dht_fallback(monkeypatch)
    avgs = swarm(*[_settings()] * 3)
    peers = sorted(a.peer_id for a in avgs)
    assert _vote_all(avgs, peers, [torch.ones(100)] * 3) == [("", 3, 0)] * 3
    # a differing verdict settles the vote at once, and a missing one still ends it by the timeout
    a, b, gone = avgs
    for reason, voters, left in _vote_all([a, b], peers, [torch.ones(100), torch.full((100,), 2.0)], "differ"):
        assert reason.startswith("islands received different averages") and voters == 2 and left == 0, reason
    assert _vote_all([a, b], peers, [torch.ones(100)] * 2, "lost") == [(LOST, 2, 2)] * 2


@pytest.mark.parametrize("rule", ["mean", "centered-clip"])
def test_a_member_voting_for_another_result_is_outvoted_and_the_round_stands_for_the_others(swarm, rule):
    """Every frame is authenticated, so members agreeing on the result received the same bytes: a member voting
    otherwise (a liar, ``lie@vote``) is outvoted under every rule.  Under ``mean`` it used to fail the round for
    the whole group, so one key holder voting anything rolled back every round of the run."""
    avgs = swarm(*[_settings(aggregate=rule)] * 3)
    peers = sorted(a.peer_id for a in avgs)
    avgs[2].attack(0, "lie")  # round "0": outer step 0
    results = _vote_all(avgs, peers, [torch.ones(100)] * 3, "0")
    assert results[:2] == [("", 3, 0)] * 2, results
    assert results[2][0].startswith("islands received different averages"), results
    assert [a.outvoted for a in avgs[:2]] == [[avgs[2].peer_id]] * 2
    # of two, one voting otherwise leaves no majority: neither's round stands
    results = _vote_all(avgs[1:], sorted(a.peer_id for a in avgs[1:]), [torch.ones(100)] * 2, "0")
    assert all(r[0].startswith("islands received different averages") for r in results), results


def test_a_member_whose_daemon_died_is_not_waited_for(swarm):
    """A member killed mid-round takes its p2p daemon with it: sending it our verdict fails at once, so the
    vote stops waiting for it once its verdict is not in the DHT record either, long before the timeout."""
    a, b, dead = swarm(*[_settings(vote_timeout=60.0)] * 3)
    peers = sorted(x.peer_id for x in (a, b, dead))
    dead.shutdown()
    dead.dht.shutdown()
    t0 = time.monotonic()
    assert _vote_all([a, b], peers, [torch.ones(100)] * 2, "killed") == [(LOST, 2, 2)] * 2
    assert time.monotonic() - t0 < 30, "the vote waited for a member that could not be reached"


def test_an_abstaining_member_counts_as_left_and_ends_the_vote(swarm):
    """A member whose all-reduce was ended (the others voted without it) abstains with an empty verdict: a
    voter stops waiting for it (not after its vote timeout) and counts it among the members left, so that
    both go round again at once; the abstainer learns the same."""
    a, b = swarm(*[_settings(vote_timeout=60.0)] * 2)
    peers = sorted([a.peer_id, b.peer_id])
    t0 = time.monotonic()
    lost = "1 of 2 island(s) did not confirm the result (left or failed mid-round)"
    assert _vote_all([a, b], peers, [torch.ones(100), None], "7") == [(lost, 1, 2)] * 2
    assert time.monotonic() - t0 < 30, "the voter waited out its timeout for the abstainer"


def test_an_island_whose_roster_never_came_abstains_on_that_groups_vote(swarm):
    """A group listed island x, but its roster never reached x (the leader's message was lost) and the
    group averaged without x's part.  x is still waiting for a roster when the group's verdicts on its round
    reach it: it stops looking and abstains on that vote, so that the voters stop waiting for it (not after
    their vote timeout) and all three go round again at once.  b's verdict comes after a's has reached x (b
    was still in its all-reduce, seen in CI): x learns the whole group from a's verdict, so it counts b among
    the members left too, and its retry expects a group of three."""
    a, b, x = swarm(*[_settings(vote_timeout=60.0)] * 2, _settings(matchmaking_time=30.0, matchmaking_timeout=60.0))
    peers = sorted(p.peer_id for p in (a, b, x))
    for other in (a, b):  # x expects them in round 5 (they are there, averaging without x)
        other.membership.announce(5, averaging=True)
    out: list = []
    matching = threading.Event()
    looking = threading.Thread(target=lambda: out.append(x.average(
        [torch.ones(100)], 1.0, {}, "5", on_stage=lambda stage: stage == "matchmaking" and matching.set())))
    looking.start()
    assert matching.wait(30)
    time.sleep(1.0)  # x is waiting for its roster (on a loaded machine too)
    t0 = time.monotonic()
    lost = "1 of 3 island(s) did not confirm the result (left or failed mid-round)"
    first = _vote_all_later([a], peers, [torch.ones(100)], "5")
    assert wait_until(lambda: a.peer_id in x._votes.box.senders(vote_key("v", peers, "5")), 30)
    time.sleep(0.5)  # x has stopped looking and abstained by now
    assert _vote_all([b], peers, [torch.ones(100)], "5") == [(lost, 2, 3)]
    assert first() == [(lost, 2, 3)]
    looking.join(30)
    assert time.monotonic() - t0 < 30, "the voters waited out their timeout for x"
    (result, averaged), = out
    assert not result.ok and averaged is None and "never learned" in result.reason, result.reason
    assert result.retryable and (result.voters, result.members_left) == (2, 3)


def test_an_island_that_gave_up_as_a_group_averaged_without_it_abstains_on_that_groups_vote(swarm, monkeypatch):
    """x gives up waiting for its roster just as a group that listed it averages without it (seen in CI with
    hivemind's matchmaking: the two then waited for each other under different round ids, and the round was lost
    on both): the group's verdict reaches x only after x gave up.  x waits a moment for such messages before it reports the
    failure, and abstains on that vote, so that a counts it as alive and both go round again at once."""
    monkeypatch.setattr(missed_group, "MISSED_GRACE", 15.0)
    a, x = swarm(_settings(vote_timeout=20.0), _settings(matchmaking_time=1.0, matchmaking_timeout=1.5))
    peers = sorted([a.peer_id, x.peer_id])
    a.membership.announce(8, averaging=True)
    out: list = []
    failing = threading.Thread(target=lambda: out.append(x.average([torch.ones(100)], 1.0, {}, "8")))
    failing.start()
    time.sleep(4.0)  # x gave up after 1.5 s (or, on a loaded machine, x is still waiting)
    assert not out, out[0][0].reason
    lost = "1 of 2 island(s) did not confirm the result (left or failed mid-round)"
    t0 = time.monotonic()
    assert _vote_all([a], peers, [torch.ones(100)], "8") == [(lost, 1, 2)]
    assert time.monotonic() - t0 < 15, "a waited out its vote timeout for x"
    failing.join(30)
    (result, averaged), = out
    assert "never learned" in result.reason and result.retryable and result.members_left == 2, result.reason


def test_an_island_whose_roster_never_came_declines_that_groups_exchange(swarm):
    """The same with a low-bit codec, one step earlier: the group's members send x their encoded parts and
    wait for x's, which never comes (allreduce_timeout, 60 s here).  x, still waiting for a roster, declines
    their exchange, so that they stop waiting at once, count x as alive, and all three go round again."""
    a, b, x = swarm(*[_settings(compression="topk")] * 2,
                    _settings(compression="topk", matchmaking_time=30.0, matchmaking_timeout=60.0))
    payload = a.codec.encode(torch.ones(100))
    peers = sorted(p.peer_id for p in (a, b, x))
    for other in (a, b):
        other.membership.announce(5, averaging=True)
    out: list = []
    matching = threading.Event()
    looking = threading.Thread(target=lambda: out.append(x.average(
        [torch.ones(100)], 1.0, {}, "5", encoded=payload,
        on_stage=lambda stage: stage == "matchmaking" and matching.set())))
    looking.start()
    assert matching.wait(30)
    time.sleep(1.0)
    t0 = time.monotonic()
    gathered: dict = {}

    def gather(avg) -> None:
        gathered[avg.peer_id] = average_encoded(avg._parts, avg.codec, parts_key(peers, "5"), avg.peer_id, peers,
                                                {p: 1.0 for p in peers}, payload, 100, 60.0)

    members = [threading.Thread(target=gather, args=(avg,)) for avg in (a, b)]
    members[0].start()  # b's parts come after a's reached x: x learns the whole group from a's
    assert wait_until(lambda: a.peer_id in x._parts.box.senders(parts_key(peers, "5")), 30)
    time.sleep(missed_group.PARTS_GRACE + 1.0)  # x has stopped waiting and declined by now
    members[1].start()
    for t in members:
        t.join(60)
    assert time.monotonic() - t0 < 30, "the members waited out their allreduce_timeout for x"
    for got in gathered.values():
        assert got.mean is None and got.missing == got.declined == [x.peer_id]
    looking.join(30)
    (result, averaged), = out
    assert not result.ok and averaged is None and "never learned" in result.reason, result.reason
    assert result.retryable and result.members_left == 3 and result.peers == peers


def test_an_abstainer_answers_the_verdicts_of_members_it_had_not_heard_from(swarm):
    """x abstains on a group's vote knowing only the members whose verdicts had reached it (here a's): a
    member whose verdict comes later (b, still in its all-reduce when x abstained) gets x's abstention in
    reply, so it counts x as left at once instead of waiting out its vote timeout for x (seen in CI)."""
    a, b, x = swarm(*[_settings(vote_timeout=10.0)] * 3)
    peers = sorted(p.peer_id for p in (a, b, x))
    key = vote_key("v", peers, "9")
    first = _vote_all_later([a], peers, [torch.ones(100)], "9")
    assert wait_until(lambda: a.peer_id in x._votes.box.senders(key), 30)
    assert x._vote(None, sorted([a.peer_id, x.peer_id]), "9", key)[1:] == (1, 2)
    lost = "1 of 3 island(s) did not confirm the result (left or failed mid-round)"
    assert _vote_all([b], peers, [torch.ones(100)], "9") == [(lost, 2, 3)]
    assert first() == [(lost, 2, 3)]


def test_a_decliner_answers_the_parts_of_members_it_had_not_heard_from(swarm):
    """The same for the exchange of encoded parts: x declined the exchange of the members whose parts had
    reached it (a's); b's parts, coming later, are declined at once, so b stops waiting for x's part."""
    a, b, x = swarm(*[_settings(compression="topk")] * 3)
    payload = a.codec.encode(torch.ones(100))
    peers = sorted(p.peer_id for p in (a, b, x))
    key = parts_key(peers, "9")
    gathered: dict = {}

    def gather(avg) -> threading.Thread:
        t = threading.Thread(target=lambda: gathered.__setitem__(avg.peer_id, average_encoded(
            avg._parts, avg.codec, key, avg.peer_id, peers, {p: 1.0 for p in peers}, payload, 100, 10.0)))
        t.start()
        return t

    first = gather(a)
    assert wait_until(lambda: a.peer_id in x._parts.box.senders(key), 30)
    x._parts.decline(key, [a.peer_id], 5.0)
    gather(b).join(30)
    first.join(30)
    for got in gathered.values():
        assert got.mean is None and got.missing == got.declined == [x.peer_id]


def test_a_stopping_island_gives_up_looking_for_a_group_at_once(swarm):
    """Ctrl-C on an island alone in its round (leading it, it waits for others to make a group of
    ``min_group_size``): it stops looking for a group instead of waiting out ``matchmaking_timeout``."""
    alone, = swarm(_settings(matchmaking_time=30.0, matchmaking_timeout=60.0))
    asked = time.monotonic() + 1.0
    alone.stopping = lambda: time.monotonic() > asked
    result, averaged = alone.average([torch.ones(100)], 1.0, {}, "0")
    assert not result.ok and averaged is None and "stopping" in result.reason, result.reason
    assert result.seconds < 30, "it waited for the matchmaking window"


def test_dht_record_stands_in_for_a_member_without_the_direct_channel(swarm):
    """A member that takes no direct verdicts (another version, or one that cannot be reached) votes through
    the DHT record: the others publish theirs there when sending to it fails, and find its verdict there."""
    avgs = swarm(_settings(), _settings(), _settings(direct_votes=False))
    peers = sorted(a.peer_id for a in avgs)
    assert _vote_all(avgs, peers, [torch.ones(100)] * 3) == [("", 3, 0)] * 3
    key = vote_key("v", peers, "r")
    found = dht_get(avgs[0].dht, key, timeout=10)
    assert found is not None and avgs[2].peer_id in {str(k) for k in found.value}


def _send(channel: VoteChannel, to: str, key: str, fp: list[float]) -> bool:
    """What a peer outside the vote can do: send a verdict straight to a member; whether it was taken."""
    from hivemind.p2p import PeerID

    async def go():
        return await channel._handler.p2p.call_protobuf_handler(PeerID.from_base58(to), channel.name,
                                                        Verdict(key=key, fingerprint=fp), Verdict)

    return _submit(go()).result(10).accepted


def test_a_verdict_from_outside_the_group_is_ignored(swarm, monkeypatch):
    _no_dht_fallback(monkeypatch)
    a, b, stranger = swarm(*[_settings()] * 3)
    peers = sorted([a.peer_id, b.peer_id])
    key = vote_key("v", peers, "r")
    bad = fingerprint([torch.full((100,), 9.0)])
    # sent before the vote (kept for it, as early verdicts of members are) and it reaches both members
    assert _send(stranger._votes, a.peer_id, key, bad) and _send(stranger._votes, b.peer_id, key, bad)
    assert _vote_all([a, b], peers, [torch.ones(100)] * 2) == [("", 2, False)] * 2


def test_private_run_refuses_verdicts_of_unregistered_peers(swarm):
    """In a private run an unregistered peer's verdict counts neither sent directly nor through the DHT (its
    records are not signed with the run key), even when the group lists it."""
    private = _settings(private=True, members_key="v.members")
    a, b, outsider = swarm(private, private, _settings(), run_keys=("secret", "secret", "guess"))
    for avg in (a, b):
        Membership(avg.dht, "v").announce(0)
    peers = sorted(x.peer_id for x in (a, b, outsider))
    key = vote_key("v", peers, "r")
    same = fingerprint([torch.ones(100)])
    assert not _send(outsider._votes, a.peer_id, key, same)
    assert _send(b._votes, a.peer_id, f"{key}-other", same)  # registered members are heard
    results = _vote_all([a, b, outsider], peers, [torch.ones(100)] * 3)
    assert results[:2] == [(LOST, 2, 2)] * 2


def _average_all(avgs: list, expected: int | None, round_id: str) -> list:
    out: list = [None] * len(avgs)

    def go(i: int) -> None:
        out[i] = avgs[i].average([torch.full((100,), float(i))], 1.0, {"config_fingerprint": "same"}, round_id,
                                 expected_group_size=expected)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(avgs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return [r for r, _ in out]


def test_group_forms_once_the_expected_islands_joined(swarm):
    long_wait = _settings(target_group_size=0, matchmaking_time=20.0, matchmaking_timeout=40.0)
    avgs = swarm(long_wait, long_wait)
    t0 = time.monotonic()
    results = _average_all(avgs, 2, "0")
    assert all(r.ok and r.group_size == 2 for r in results), [r.reason for r in results]
    # both joined within moments: nobody waited out the 20 s matchmaking window
    assert time.monotonic() - t0 < long_wait[0].matchmaking_time / 2


def test_expecting_an_island_that_never_comes_costs_the_matchmaking_window_only(swarm):
    avgs = swarm(_settings(target_group_size=0), _settings(target_group_size=0))
    results = _average_all(avgs, 3, "0")
    assert all(r.ok and r.group_size == 2 for r in results), [r.reason for r in results]


def test_round_size_counts_the_live_islands_at_that_step(no_leaked_daemons):
    first = start_dht(NetworkSettings())
    dhts = [first] + [start_dht(NetworkSettings(initial_peers=visible_maddrs(first))) for _ in range(3)]
    try:
        me, training, averaging, behind = (Membership(d, "v") for d in dhts)
        training.announce(4)
        averaging.announce(4, averaging=True, held=[1.0])
        behind.announce(3)
        assert me.round_size(4) == 3 and me.round_size(3) == 2
        averaging.leave()
        assert wait_until(lambda: me.round_size(4) == 2, 5.0)  # seen once a read of the registry is a second old
    finally:
        for d in dhts:
            d.shutdown()


def test_a_group_listed_in_a_message_counts_only_when_its_key_names_it():
    """The member list a verdict or part carries is what a member that missed its group goes by: it is
    taken only from a member of that list, and only when the key is that group's (a list that does not
    hash to the key, forged or stale, is ignored and the senders are all that is known)."""
    from peers.wire.inbox import Inbox
    group = ["a", "b", "x"]
    key = vote_key("v", group, "3")
    box = Inbox(ttl=60.0)
    box.put(key, "a", [1.0], group=["a", "x"])  # not the key's group
    box.put(key, "c", [1.0], group=["a", "b", "c"])
    assert box.group(key, "x") == ["a", "c", "x"]
    box.put(key, "b", [1.0], group=["x", "b", "a"])  # in any order
    assert box.group(key, "x") == group
    assert box.group(parts_key(group, "3"), "x") == ["x"]
    rs = f"rs.{parts_key(group, '3')}"
    box.put(rs, "z", b"", group=group)  # a sender outside the group it lists
    assert box.group(rs, "x") == ["x", "z"]
