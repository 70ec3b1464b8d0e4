"""A private run: outsiders without the run key can't join groups, download state or write the run's keys."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from peers.discovery.dht import start_dht, visible_maddrs
from peers.discovery.membership import Membership, is_registered, wait_until
from peers.discovery.run_key import RunKeyValidator, check_run_key, key_check_key
from peers.group.averager import VerifiedAverager
from peers.settings import AveragerSettings, NetworkSettings, Scope

FAST = dict(matchmaking_time=2.0, request_timeout=0.5, matchmaking_timeout=6.0, vote_timeout=4.0,
            allreduce_timeout=10.0, next_chunk_timeout=3.0, state_download_timeout=5.0)
TEMPLATE = [torch.zeros(50)]


def test_validator_rejects_unsigned_and_tampered_records():
    good, other = RunKeyValidator("secret"), RunKeyValidator("guess")
    record = DHTRecord(b"k", b"s", b"value", 123.0)
    signed = DHTRecord(b"k", b"s", good.sign_value(record), 123.0)
    assert good.validate(signed) and good.strip_value(signed) == b"value"
    assert not other.validate(signed)
    assert not good.validate(record)
    tampered = DHTRecord(b"k", b"s", b"VALUE" + signed.value[5:], 123.0)
    assert not good.validate(tampered)
    assert not good.validate(DHTRecord(b"k", b"s", signed.value, 124.0))
    # beside other validators it signs last and checks first, and never merges into one of them
    assert good.priority > RecordValidatorBase.priority.fget(other) == 0 and not good.merge_with(other)


def test_outsider_is_refused_everywhere(no_leaked_daemons):
    made = []
    try:
        settings, private = AveragerSettings(**FAST, target_group_size=2), Scope(prefix="run", private=True)
        d1 = start_dht(NetworkSettings(run_key="secret"))
        d2 = start_dht(NetworkSettings(initial_peers=visible_maddrs(d1), run_key="secret"))
        # the outsider knows an address, the prefix and the tensor shapes, but not the run key
        d3 = start_dht(NetworkSettings(initial_peers=visible_maddrs(d1)))
        made += [d1, d2, d3]
        a1 = VerifiedAverager(d1, TEMPLATE, settings, private)
        a2 = VerifiedAverager(d2, TEMPLATE, settings, private)
        outsider = VerifiedAverager(d3, TEMPLATE, AveragerSettings(**FAST, target_group_size=3), Scope(prefix="run"))
        made += [a1, a2, outsider]
        m1, m2 = Membership(d1, "run"), Membership(d2, "run")
        m1.announce(5)
        m2.announce(5)
        outsider_membership = Membership(d3, "run")
        outsider_membership.announce(5)  # unsigned: members' DHT nodes must not believe it
        time.sleep(1.0)
        assert not is_registered(d1, "run", str(d3.peer_id))
        assert is_registered(d1, "run", str(d2.peer_id))

        x1, x2, bad = [torch.ones(50)], [torch.full((50,), 3.0)], [torch.full((50,), 1e6)]
        out = {}

        def run(name, avg, x):
            out[name] = avg.average(x, 1.0, {"config_fingerprint": "same"}, "0")

        threads = [threading.Thread(target=run, args=a) for a in
                   (("a1", a1, x1), ("a2", a2, x2), ("outsider", outsider, bad))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for name in ("a1", "a2"):
            result, averaged = out[name]
            assert result.ok, result.reason
            assert str(d3.peer_id) not in result.peers
            assert torch.allclose(averaged[0], torch.full((50,), 2.0))
        assert not out["outsider"][0].ok
    finally:
        for obj in reversed(made):
            obj.shutdown()


def test_a_wrong_run_key_is_told_as_such(no_leaked_daemons):
    made = []
    try:
        open_keys = (key_check_key("run"),)
        d1 = start_dht(NetworkSettings(run_key="secret"), open_keys=open_keys)
        made.append(d1)
        assert check_run_key(d1, "run", "secret", timeout=5.0) == ""  # the first island: nobody to compare with
        d2 = start_dht(NetworkSettings(initial_peers=visible_maddrs(d1), run_key="secret"), open_keys=open_keys)
        made.append(d2)
        assert check_run_key(d2, "run", "secret", timeout=5.0) == ""
        d3 = start_dht(NetworkSettings(initial_peers=visible_maddrs(d1), run_key="guess"), open_keys=open_keys)
        made.append(d3)
        t0 = time.monotonic()
        problem = check_run_key(d3, "run", "guess", timeout=5.0)
        assert "hold another run key" in problem and "--averaging.run_key" in problem, problem
        assert time.monotonic() - t0 < 10.0
        # the open key check did not open the rest: the outsider's member record is still not believed
        Membership(d3, "run").announce(1)
        time.sleep(0.5)
        assert not is_registered(d1, "run", str(d3.peer_id))
    finally:
        for dht in reversed(made):
            dht.shutdown()


def test_known_peers_keep_islands_that_are_restarting(tmp_path):
    """An island restarting is missing from the registry for a while but comes back at the same address:
    the remembered list keeps it (after the live ones), one address per peer id, a moved peer's newest."""
    from types import SimpleNamespace

    from peers.node import KNOWN_PEERS, PeerNode

    a, b, c = (f"/ip4/10.0.0.{i}/tcp/400{i}/p2p/Qm{i}" for i in (1, 2, 3))
    moved = "/ip4/10.0.0.2/tcp/5002/p2p/Qm2"
    live = [a, b, c]
    node = SimpleNamespace(rt=SimpleNamespace(is_main=True), run_dir=tmp_path,
                           membership=SimpleNamespace(addresses=lambda: live))

    def remember_peers(node):
        PeerNode.remember_peers(node)  # the method alone, on a stand-in with the pieces it reads
    remember_peers(node)
    live = [a]  # b and c restarting
    remember_peers(node)
    assert (tmp_path / KNOWN_PEERS).read_text().split() == [a, b, c]
    live = [moved, a]  # b came back on another port: its old address is dropped
    remember_peers(node)
    assert (tmp_path / KNOWN_PEERS).read_text().split() == [moved, a, c]


def test_an_island_alone_restarts_its_peer_node_through_the_addresses_that_answer(tmp_path, monkeypatch):
    """AloneWatch: nothing while other islands are live; once alone, wait ``rejoin_after``, then offer only
    the remembered addresses that accept connections, and back off (doubling) when none does.  With company,
    it does the same for the islands of the committed roster whose records stopped refreshing (a healed
    partition whose two DHT halves never look for each other again), and only for their addresses."""
    import socket
    from types import SimpleNamespace

    from peers import node as peer_setup
    from peers.node import KNOWN_PEERS, AloneWatch

    server = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()
    live = f"/ip4/127.0.0.1/tcp/{server.getsockname()[1]}/p2p/QmA"
    dead = f"/ip4/127.0.0.1/tcp/{dead_port}/p2p/QmB"
    company = f"/ip4/127.0.0.1/tcp/{server.getsockname()[1]}/p2p/QmC"
    (tmp_path / KNOWN_PEERS).write_text(f"{dead}\n{live}\n{company}\n")
    now = [100.0]
    monkeypatch.setattr(peer_setup.time, "monotonic", lambda: now[0])
    others: list = [SimpleNamespace(island="QmA", beats=True)]
    membership = SimpleNamespace(island="me", others=lambda: others, silent=lambda m: not m.beats)
    known = (tmp_path / KNOWN_PEERS).read_text().split()
    watch = AloneWatch(rejoin_after=3.0)
    try:
        assert watch.due(membership, known) == []  # not alone
        others.clear()
        assert watch.due(membership, known) == []  # alone: the clock starts
        now[0] += 2.9
        assert watch.due(membership, known) == []
        now[0] += 0.2
        assert watch.due(membership, known) == [live, company]  # the dead address is left out
        assert 2 * 3.0 * 0.8 <= watch.wait <= 2 * 3.0 * 1.2
        # with company (QmC), apart from QmA of the committed roster, whose record stopped refreshing here
        others[:] = [SimpleNamespace(island="QmC", beats=True), SimpleNamespace(island="QmA", beats=False)]
        assert watch.due(membership, known, ["me", "QmC"]) == [] and watch.since is None  # nothing apart
        # apart from less than half of the roster (QmA of me, QmA, QmC): this side holds the majority
        assert watch.due(membership, known, ["me", "QmA", "QmC"]) == [] and watch.since is None
        committed = ["me", "QmA", "QmB", "QmC"]  # apart from QmA (silent) and QmB (not registered): half of it
        assert watch.due(membership, known, committed) == []  # the clock starts
        now[0] += 3.1
        assert watch.due(membership, known, committed) == [live]  # QmA's (QmB's is dead), not the company's
        others[1].beats = True  # its refreshes reach us again
        assert watch.due(membership, known, committed) == [] and watch.since is None
        others.clear()
        now[0] += 0.1
        assert watch.due(membership, known) == []
        server.close()
        now[0] += 3.1
        assert watch.due(membership, known) == []  # nothing answers: try again later, for longer
        assert watch.wait <= 10 * 3.0 * 1.2 and watch.wait >= 2 * 3.0 * 0.8
        others.append(SimpleNamespace(island="back", beats=True))
        assert watch.due(membership, known) == [] and watch.since is None and watch.wait == 3.0
    finally:
        server.close()


@pytest.fixture
def two_registries(no_leaked_daemons):
    """The registries of 2 islands of one run (ttl 6 s) on 2 connected DHTs, shut down afterwards."""
    d1 = start_dht(NetworkSettings())
    try:
        d2 = start_dht(NetworkSettings(initial_peers=visible_maddrs(d1)))
        try:
            yield Membership(d1, "run", ttl=6.0), Membership(d2, "run", ttl=6.0)
        finally:
            d2.shutdown()
    finally:
        d1.shutdown()


def test_an_island_that_missed_its_heartbeat_is_not_counted_as_beating(two_registries):
    """An island killed mid-round keeps its record until the ttl runs out; one that missed a heartbeat is
    told apart well before that (a catch-up then does not wait for the round it was averaging, nor take
    the step it had reached for one the run committed while the catch-up downloaded)."""
    killed, watcher = two_registries
    killed.start_heartbeat()
    killed.announce(4, averaging=True, held=[1.0])
    assert wait_until(lambda: [m.outer_step for m in watcher.others()] == [4], 5.0)
    assert watcher.beating(watcher.others()[0])
    killed._stop.set()  # its heartbeat stops as a SIGKILL would stop it: no leave announced
    assert watcher.furthest(beating_only=True) == (0, 4)  # (rounds committed, outer step)
    assert wait_until(lambda: any(not watcher.beating(m) for m in watcher.others()), 10.0)
    # the step it announced no longer counts as the run's furthest for a catch-up (soak seed 7)
    assert watcher.furthest() == (0, 4) and watcher.furthest(beating_only=True) == (-1, -1)


def test_a_late_island_learns_that_the_run_ended(two_registries):
    first, late = two_registries
    assert late.ended_at() is None, "a run nobody registered in has not ended"
    first.announce(6)
    assert wait_until(lambda: [m.outer_step for m in late.others()] == [6], 5.0)
    assert late.ended_at() is None, "a live island: the run goes on"
    first.final_disagreements(6, [1.0, 2.0], wait=0.0)
    assert late.ended_at() is None, "finished but not gone yet"
    first.leave()
    assert wait_until(lambda: late.ended_at() == 6, 5.0)
    time.sleep(7.0)  # past the ttl of a live record: the final one stays
    assert late.ended_at() == 6


def test_an_island_looking_for_a_group_stops_once_every_other_island_is_gone(two_registries):
    """A SIGKILLed island's record lives on until its ttl runs out, but nothing listens at its address any
    more: an island looking for a group stops within a look or two instead of waiting out
    ``matchmaking_timeout`` (the soak's longest wait over 30 rounds, 17.9 s, was a round whose two other
    islands had both been killed), its next round does not count the dead island, and the island counts
    again once it restarted."""
    from peers.identity import identity_of
    from peers.wire.transport import Transport, refuses

    survivor_dht, killed_dht = two_registries[0].dht, two_registries[1].dht
    survivor, killed = Membership(survivor_dht, "run", ttl=60.0), Membership(killed_dht, "run", ttl=60.0)
    survivor.refuses = refuses
    transport = Transport(identity_of(killed_dht))
    assert transport.peer_id == killed.peer_id
    killed.endpoint = transport.endpoint
    killed.announce(3)
    assert not refuses(transport.endpoint) and not refuses("lane:" + transport.endpoint)
    assert wait_until(lambda: survivor.company() == 1, 5.0)
    assert survivor.round_size(3) == 2
    averager = VerifiedAverager(survivor_dht, TEMPLATE, AveragerSettings(**{**FAST, "matchmaking_timeout": 60.0}),
                                Scope(prefix="run"))
    try:
        averager.company = survivor.company
        outcome: list = []
        looking = threading.Thread(target=lambda: outcome.append(averager.average(
            [torch.ones(50)], 1.0, {"config_fingerprint": "same"}, "3")))
        looking.start()
        time.sleep(2.0)  # in hivemind's matchmaking, waiting for the other island
        assert looking.is_alive()
        transport.close()  # killed: nothing listens at its address, its record stays
        looking.join(30.0)
        assert not looking.is_alive(), "still looking for a group with every other island gone"
        result, averaged = outcome[0]
        assert not result.ok and averaged is None
        assert result.reason.startswith("no other island is live in the run: the others are gone"), result.reason
        assert result.seconds < 60.0
    finally:
        averager.shutdown()
    assert refuses(transport.endpoint)
    assert killed.peer_id in survivor.members(), "the dead island's record is still there"
    assert survivor.company() == 0 and survivor.others() == [] and survivor.round_size(3) == 1
    # it restarts on its port and registers again: counted again
    host, port = transport.endpoint.rsplit(":", 1)
    back = Transport(identity_of(killed_dht), host=host, port=int(port))
    try:
        killed.announce(4)
        assert wait_until(lambda: survivor.company() == 1, 5.0)
        assert [m.outer_step for m in survivor.others()] == [4]
    finally:
        back.close()


def test_one_empty_look_at_the_registry_does_not_end_a_forming_roster():
    """A loaded machine or a slow DHT can return one registry look with no other island in it: a roster that is
    forming gives up on company only after ``ALONE_LOOKS`` empty looks in a row (CI once saw a NAT'd island end
    both its rounds within seconds while the other two were still joining, and the run committed nothing)."""
    from peers.group.averager import ALONE_LOOKS

    averager = object.__new__(VerifiedAverager)  # only the give-up logic: no DHT, no hivemind averager
    averager.settings = AveragerSettings(min_group_size=2)
    averager.stopping = averager.moved_past = None
    averager._missed = lambda *_: None
    averager._alone_looks = {}
    looks = iter([0, 1] + [0] * (ALONE_LOOKS - 1) + [0])
    averager.company = lambda: next(looks)
    assert averager._give_up("r1", 0.0) is None  # one empty look
    assert averager._give_up("r1", 0.0) is None  # company again: the count starts over
    for _ in range(ALONE_LOOKS - 1):
        assert averager._give_up("r1", 0.0) is None
    gave_up = averager._give_up("r1", 0.0)
    assert gave_up is not None and gave_up.reason.startswith("no other island is live"), gave_up
    averager.company = lambda: 0
    assert averager._give_up("r2", 0.0) is None, "a new round counts its own looks"


def test_an_island_cut_off_from_the_islands_it_committed_with_stops_waiting_for_company_within_a_few_looks():
    """Of 48 islands on 2 cores, one whose registry lost every other island waited for company inside a round for
    the whole matchmaking_timeout (300 s), while its peer node looks for the run again only between rounds.  One
    that committed its last round with others gives the round up after ``ALONE_LOOKS`` empty looks; the first
    island of a new run (nobody committed with it) still waits for the others to come."""
    import time

    from peers.group.averager import ALONE_LOOKS

    averager = object.__new__(VerifiedAverager)  # only the wait: no DHT, no transport
    averager.settings = AveragerSettings(min_group_size=2)
    averager.stopping, averager.peer_id = None, "me"
    looked: list[int] = []
    averager.company = lambda: looked.append(0) or 0
    averager.committed = ("me", "other")
    cut_off = averager._wait_for_company(time.monotonic() + 2 * ALONE_LOOKS + 2.0)
    assert cut_off is not None and "cut off" in cut_off.reason and len(looked) == ALONE_LOOKS, (cut_off, looked)
    averager.committed, looked[:] = (), []
    early = averager._wait_for_company(time.monotonic() + ALONE_LOOKS + 1.5)
    assert early is not None and "waited" in early.reason and len(looked) > ALONE_LOOKS, (early, looked)


def test_a_member_cannot_write_or_erase_another_islands_records(no_leaked_daemons):
    """Two islands of one private run on real DHTs.  The second holds the run key and tries to rewrite the first
    island's registration (a step of 99 to hijack catch-ups, its departure, an endpoint of its own) and to vote in
    its name: unsigned, and signed with its own identity but under the first's peer id.  Every DHT node refuses
    each store, so the first island's own record stays as it wrote it; and a reader handed a forged item anyway
    (a node that lies in its answers) drops it.  Without the owner's signature, the first forgery replaced the
    record (it carried a later expiry) and a catch-up downloaded from the forger."""
    from hivemind.utils import get_dht_time

    from peers.discovery.calls import dht_get, dht_store
    from peers.discovery.owned import dht_identity, owned_items, owned_value

    d1 = start_dht(NetworkSettings(run_key="k" * 32))
    try:
        d2 = start_dht(NetworkSettings(run_key="k" * 32, initial_peers=visible_maddrs(d1)))
        try:
            honest, liar = Membership(d1, "run", ttl=30.0), Membership(d2, "run", ttl=30.0)
            honest.announce(3)
            assert wait_until(lambda: [m.outer_step for m in liar.others()] == [3], 10.0)
            victim, later = honest.peer_id, get_dht_time() + 600
            forged = {"outer_step": 99, "committed": 99, "averaging": False, "left": False, "endpoint": "10.0.0.9:1"}
            assert not dht_store(d2, "run.members", victim, forged, later, timeout=10.0)
            assert not dht_store(d2, "run.members", victim, owned_value(dht_identity(d2), "run.members", forged, later),
                                 later, timeout=10.0)
            assert not dht_store(d2, "run.members", victim, dict(forged, left=True), later, timeout=10.0)
            assert not dht_store(d2, "vote.r7", victim, [1.0, 2.0, 3.0], later, timeout=10.0)
            for reader in (liar, honest):
                found = reader.members()
                assert found[victim].outer_step == 3 and not found[victim].left and found[victim].endpoint == ""
            assert liar.furthest() == (0, 3)
            # the liar's own records are its to write
            liar.announce(5)
            assert wait_until(lambda: [m.outer_step for m in honest.others()] == [5], 10.0)
            # an answer carrying a forged item (as a lying node could send): dropped on reading
            real = dht_get(d1, "run.members", timeout=10.0)
            real.value[victim] = type(real.value[victim])(
                owned_value(dht_identity(d2), "run.members", forged, later), later)
            assert victim not in owned_items(real, "run.members") and liar.peer_id in owned_items(real, "run.members")
        finally:
            d2.shutdown()
    finally:
        d1.shutdown()


def test_an_islands_key_proof_is_published_again_while_it_runs(no_leaked_daemons):
    """A proof of the run key lives ``ttl`` s; the island publishes it again at half that while its DHT runs, so
    that a joiner with a wrong key late in a run still finds one and is told (before, proofs lived an hour: a joiner
    after that met a run whose records it could not read, in silence)."""
    from hivemind.utils import get_dht_time

    from peers.discovery.calls import dht_get
    from peers.discovery.owned import owned_items
    from peers.discovery.run_key import keep_key_proof, key_proof, publish_key_proof

    d1 = start_dht(NetworkSettings())
    try:
        publish_key_proof(d1, "run", "secret", timeout=10.0, ttl=3.0)
        keep_key_proof(d1, "run", "secret", ttl=3.0)
        time.sleep(5.0)  # past the first proof's expiry
        proofs = owned_items(dht_get(d1, "run.keycheck", timeout=10.0), "run.keycheck")
        proof, expires = proofs[str(d1.peer_id)]
        assert proof == key_proof("secret", str(d1.peer_id)) and expires > get_dht_time()
    finally:
        d1.shutdown()


def test_a_read_that_visits_fewer_nodes_than_the_run_has_still_lists_every_island(no_leaked_daemons):
    """A registry read keeps the 8 nodes nearest its key (``READ_BEAM``), not every node of the run (each answers
    with every record: 24 islands sent 17.7 MB each a round, most of it registry reads): with 12 islands, every
    island still reads every island's record."""
    from peers.discovery.membership import READ_BEAM

    n = READ_BEAM + 4
    first = start_dht(NetworkSettings())
    dhts = [first]
    try:
        dhts += [start_dht(NetworkSettings(initial_peers=visible_maddrs(first))) for _ in range(n - 1)]
        registries = [Membership(d, "wide") for d in dhts]
        for step, m in enumerate(registries):
            m.announce(step)
        for m in registries[::3]:
            assert wait_until(lambda: m.live_count() == n, 20.0), m.live_count()
            assert sorted(o.outer_step for o in m.others()) == [s for s in range(n) if s != m.outer_step]
    finally:
        for d in dhts:
            d.shutdown()


def test_a_large_registry_is_read_and_refreshed_less_often_and_each_beat_is_judged_by_its_writers_period():
    """One read or store of the registry costs every record once per DHT node it passes (hivemind answers with the
    key's whole value): an island reads and refreshes it less often the more islands there are, publishes its
    heartbeat period, and others judge its beats by that period instead of their own.  (Narrow: a stand-in DHT.)"""
    from types import SimpleNamespace

    from hivemind.utils import get_dht_time

    from peers.discovery.membership import BEAT_PACE, FRESH, HEARTBEAT, READ_PACE, Member

    small, large = (Membership(SimpleNamespace(peer_id=name), "run", ttl=60.0) for name in ("small", "large"))
    assert (small.period, small.fresh) == (HEARTBEAT, FRESH) and "beat" not in small._value()
    large.registry_size = 32
    assert large.period == 32 / BEAT_PACE > HEARTBEAT and large.fresh == 32 / READ_PACE > FRESH
    assert large._value()["beat"] == large.period
    large.registry_size = 10_000
    assert large.period == 20.0  # never past a third of the ttl: the record would expire between two beats

    now = get_dht_time()
    quiet = Member("large", 3, False, expires=now + 60.0 - 9.0, read_at=now)  # refreshed 9 s before the read
    assert not small.beating(quiet) and small.silent(quiet)
    paced = Member("large", 3, False, expires=quiet.expires, read_at=now, beat=8.0)
    assert small.beating(paced) and not small.silent(paced)
    lying = Member("large", 3, False, expires=now + 60.0 - 45.0, read_at=now, beat=1e9)
    assert small.silent(lying)  # a period past a third of the ttl counts as that third


def test_a_record_a_read_missed_stays_until_it_expires_and_ages_meanwhile(monkeypatch):
    """Narrow (the DHT's answers stood in): a read that misses a member's record (a store whose calls timed out under
    load reached fewer replicas) does not drop the member while its record is within its expiry; the record ages as
    the refresh the read did not see (no longer beating, then silent), and is gone once it expires."""
    from types import SimpleNamespace

    from hivemind.utils import get_dht_time

    from peers.discovery import membership as registry

    now = get_dht_time()
    record = {"outer_step": 3, "island": "b", "endpoint": "10.0.0.2:1"}
    answers = [{"a": ({"outer_step": 3}, now + 60), "b": (record, now + 60)},
               {"a": ({"outer_step": 4}, now + 60)},  # b missed
               {"a": ({"outer_step": 4}, now + 60), "c": ({"outer_step": 4}, now + 1)}]
    monkeypatch.setattr(registry, "dht_get", lambda *args, **kwargs: answers.pop(0))
    monkeypatch.setattr(registry, "owned_items", lambda found, key: found)
    m = Membership(SimpleNamespace(peer_id="a"), "run")
    first = m.members()
    m.forget_read()
    second = m.members()
    assert set(second) == {"a", "b"} and second["a"].outer_step == 4
    assert second["b"].outer_step == 3 and second["b"].expires == first["b"].expires  # the same record
    assert m.beating(first["b"])
    m.forget_read()
    monkeypatch.setattr(registry, "get_dht_time", lambda: now + 30)
    third = m.members()
    assert set(third) == {"a", "b", "c"}
    assert not m.beating(third["b"]) and m.silent(third["b"])  # 30 s without a refresh seen: ten heartbeats missed
    answers.append({"a": ({"outer_step": 5}, now + 90)})
    monkeypatch.setattr(registry, "get_dht_time", lambda: now + 61)
    m.forget_read()
    assert set(m.members()) == {"a"}  # b and c expired
