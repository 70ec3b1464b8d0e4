"""The direct transport's connections: sealed bytes, a tampered message dropped and sent again, keys and modes
that do not match refused in one line, and ranks that cannot be reached taking part through lanes and relays
(real sockets on loopback; distinct 127.0.0.x addresses stand for distinct servers).  Each transport proves the
peer id of an identity made in memory (one per name, made once: an RSA key takes a while)."""

from __future__ import annotations

import base64
import select
import socket
import threading
import time

import pytest

from peers.identity import Identity
from peers.wire.transport import RefusedError, Transport, TransportError

MARKER = b"plain pseudo-gradient bytes " * 400_000
"""11 MB: several sealed records, one write in the clear."""


_IDENTITIES: dict[str, Identity] = {}


def identity(name: str) -> Identity:
    """The identity of the rank called ``name`` in these tests."""
    if name not in _IDENTITIES:
        _IDENTITIES[name] = Identity.generate()
    return _IDENTITIES[name]


@pytest.fixture
def transports():
    made: list[Transport] = []

    def make(name: str, *args, **kwargs) -> Transport:
        t = Transport(identity(name), *args, **kwargs)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def _until(condition, timeout: float = 10.0) -> bool:
    """Whether ``condition()`` holds within ``timeout`` seconds (what a reader thread does after its ack)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(condition())


def _received(t: Transport, key: str, sender: Transport, timeout: float = 10.0) -> bytes:
    got = t.box.wait_for(key, lambda m: sender.peer_id in m, time.monotonic() + timeout)
    assert sender.peer_id in got, f"{key} from {sender.peer_id} never arrived"
    return bytes(got[sender.peer_id])


class _Tap:
    """A TCP forwarder that keeps a copy of every byte it carries (what an onlooker on the link sees);
    ``rewrite=(old, new)``: replaces the first ``old`` it carries towards the target with ``new``, once."""

    def __init__(self, target: tuple[str, int], rewrite: tuple[bytes, bytes] | None = None):
        self.target, self.seen, self.rewrite, self.rewritten = target, bytearray(), rewrite, 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.server.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            for src, dst, forth in ((a, b, True), (b, a, False)):
                threading.Thread(target=self._pipe, args=(src, dst, forth), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, forth: bool) -> None:
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            self.seen += data
            if forth and self.rewrite and not self.rewritten and self.rewrite[0] in data:
                data = data.replace(*self.rewrite, 1)
                self.rewritten += 1
            try:
                dst.sendall(data)
            except OSError:  # the receiver dropped a connection it found rewritten
                src.close()
                return

    def close(self) -> None:
        self.server.close()


@pytest.mark.parametrize("encrypt", [True, False])
def test_an_onlooker_sees_the_payload_only_when_encryption_is_off(transports, encrypt):
    a = transports("a", "key", encrypt=encrypt)
    b = transports("b", "key", encrypt=encrypt)
    tap = _Tap(("127.0.0.1", b.port))
    try:
        a.send(tap.endpoint, "part", MARKER, time.monotonic() + 10)
        assert _received(b, "part", a) == MARKER
    finally:
        tap.close()
    assert (MARKER[:64] in tap.seen) is not encrypt
    assert len(tap.seen) >= len(MARKER)


def test_a_tampered_message_is_dropped_and_sent_again_never_delivered(transports):
    a, b = transports("a", "key"), transports("b", "key")
    flipped: list[str] = []
    a.tamper = lambda key: key == "part" and not flipped and not flipped.append(key)
    payload = bytes(range(256)) * 40_000  # 10 MB: several sealed records
    a.send(b.endpoint, "part", payload, time.monotonic() + 10)
    assert flipped == ["part"]
    assert _received(b, "part", a) == payload
    assert b.stats.tampered == 1 and a.stats.resent == 1
    assert b.stats.received == len(payload)  # delivered once: the tampered copy never reached the inbox


def test_a_public_run_is_encrypted_and_open_to_anyone(transports):
    a, b = transports("a", ""), transports("b", "")
    a.send(b.endpoint, "x", b"hello", time.monotonic() + 5)
    assert _received(b, "x", a) == b"hello"


@pytest.mark.parametrize("theirs, match", [
    (dict(run_key="other"), "holds another run key"),
    (dict(run_key="key", encrypt=False), "set --averaging.encrypt alike"),
])
def test_a_key_or_mode_that_does_not_match_is_refused_in_one_line(transports, theirs, match):
    mine = transports("a", "key")
    theirs = transports("b", **theirs)
    with pytest.raises(RefusedError, match=match) as e:
        theirs.send(mine.endpoint, "x", b"hello", time.monotonic() + 5)
    assert "\n" not in str(e.value)
    assert mine.box.senders("x") == [] and not mine.stats.received


def _unreachable(transports, name: str, host: str, run_key: str = "key") -> Transport:
    """A rank no other server can open a connection to (its listening socket is closed at once), and that
    takes no part in hole punching (tests/test_delay_line.py punches through emulated NATs)."""
    t = transports(name, run_key, host=host, reachable=False, punch=False)
    t.listener.server.close()
    return t


def test_a_rank_behind_nat_receives_over_the_lane_it_opened(transports):
    public = transports("public", "key", host="127.0.0.2")
    hidden = _unreachable(transports, "hidden", "127.0.0.3")
    assert hidden.endpoint.startswith("lane:127.0.0.3:")
    done = threading.Event()

    def send_back() -> None:  # waits for the lane
        public.send(hidden.endpoint, "back", b"to the hidden rank", time.monotonic() + 10)
        done.set()

    threading.Thread(target=send_back, daemon=True).start()
    time.sleep(0.3)
    assert not done.is_set()  # nothing can reach it before it opens a lane
    hidden.send(public.endpoint, "out", b"from the hidden rank", time.monotonic() + 10)
    assert _received(public, "out", hidden) == b"from the hidden rank"
    assert _received(hidden, "back", public) == b"to the hidden rank"
    assert done.wait(5)


def test_two_ranks_behind_nat_reach_each_other_through_a_reachable_one(transports):
    public = transports("public", "key", host="127.0.0.2")
    first = _unreachable(transports, "first", "127.0.0.3")
    second = _unreachable(transports, "second", "127.0.0.4")
    for t in (first, second):
        t.reach([public.endpoint])
    payload = bytes(range(256)) * 4096
    first.send(second.endpoint, "part", payload, time.monotonic() + 10)
    assert _received(second, "part", first) == payload  # from the original sender, not the relay
    assert public.stats.relayed == 1 and public.box.senders("part") == []


def test_the_ranks_of_a_server_share_one_port(transports):
    """Rank 1 listens on no TCP port: rank 0 hands it the connections that name it, and it does the handshake."""
    owner = transports("rank0", "key")
    second = transports("rank1", "key", port=owner.port, slot=1)
    assert second.endpoint == f"127.0.0.1:{owner.port}/1" and second.listener.server.family == socket.AF_UNIX
    other = transports("other", "key")
    for target, key in ((second, "to-1"), (owner, "to-0")):
        other.send(target.endpoint, key, key.encode() * 1000, time.monotonic() + 10)
        assert _received(target, key, other) == key.encode() * 1000
    assert owner.box.senders("to-1") == [] and second.box.senders("to-0") == []
    second.send(owner.endpoint, "back", b"from rank 1", time.monotonic() + 10)
    assert _received(owner, "back", second) == b"from rank 1"


@pytest.mark.parametrize("behind_nat", [False, True], ids=["reachable", "behind-nat"])
def test_a_rank_declines_the_parts_of_a_group_it_never_learned_of_back_to_their_sender(transports, behind_nat):
    """A group lists rank x, but x's matchmaking never learned of it: x knows no endpoint of that group's
    members, only that a's part reached it.  Its decline still reaches a, so a's exchange ends with x declined
    instead of waiting out its deadline for x's part: at the endpoint a announced when it called x, or, x behind
    NAT, at the endpoint of the lane x opened to a, over which a's part came (seen once in CI: a group race left
    the reachable island waiting out its whole exchange timeout for a hidden island that had declined)."""
    from peers.wire.encoded import DirectChannel

    if behind_nat:
        a, x = transports("a", "key", host="127.0.0.2"), _unreachable(transports, "x", "127.0.0.3")
        x.reach([a.endpoint])
    else:
        a, x = transports("a", "key"), transports("x", "key")
    ca, cx = DirectChannel(a, 1 << 20), DirectChannel(x, 1 << 20)
    A, X = a.peer_id, x.peer_id
    ca.endpoints = {X: x.endpoint}  # a has the group's metadata; x has none
    key = "rs.b0.0123456789abcdef.round.9"
    out: list = []
    sending = threading.Thread(target=lambda: out.append(ca.exchange(key, [A, X], {X: b"part"}, {X: 4}, 60.0)))
    sending.start()
    assert x.box.wait_for(key, lambda m: A in m, time.monotonic() + 10), "a's part never reached x"
    cx.decline(key, [A], 10.0)
    sending.join(30)
    assert out and out[0].missing == out[0].declined == [X], out
    assert x.callers == {A: a.endpoint}


def test_a_member_whose_process_is_gone_ends_the_exchange_at_once_and_is_named_gone(transports):
    """x took its place in the group, then died: nothing listens at its address any more.  a's part to it is
    refused (not lost in a network) a few times in a row, so a stops waiting for x's part well before the
    exchange's deadline and names x gone, not declined; a delivery to a live rank is still retried until its
    deadline."""
    from peers.wire.encoded import DirectChannel
    from peers.wire.transport import GoneError, TransportError

    a, x = transports("a", "run-key"), transports("x", "run-key")
    ca = DirectChannel(a, 1 << 20)
    A, X = a.peer_id, x.peer_id
    ca.endpoints = {X: x.endpoint}
    x.close()
    t0 = time.monotonic()
    out = ca.exchange("rs.b0.0123456789abcdef.round.3", [A, X], {X: b"part"}, {X: 4}, 60.0)
    assert time.monotonic() - t0 < 30, "a waited for the dead member's part until its deadline"
    assert out.missing == out.gone == [X] and out.declined == [], out
    with pytest.raises(GoneError):
        a.send(x.endpoint, "k", b"v", time.monotonic() + 60)
    with pytest.raises(TransportError) as relayed:  # no rank to relay through: a deadline, never "gone"
        a.send("lane:10.9.9.9:1", "k", b"v", time.monotonic() + 0.5)
    assert not isinstance(relayed.value, GoneError)


def test_the_first_member_to_find_one_gone_tells_the_others_whose_parts_reached_it(transports):
    """x died after b's part reached it: b alone would wait for x's part until its deadline, while a, whose part
    x refused, knew at once; the members left would then go round again at different times and miss each other.
    a tells b, so b's exchange ends with x named gone (b never sent to x itself).  A notice from outside the
    group, or about the key of another group, changes nothing."""
    from peers.wire.encoded import DirectChannel
    from peers.wire.inbox import GONE
    from peers.wire.round_keys import parts_key

    a, b, x = transports("a", "run-key"), transports("b", "run-key"), transports("x", "run-key")
    ca, cb = DirectChannel(a, 1 << 20), DirectChannel(b, 1 << 20)
    A, B, X = a.peer_id, b.peer_id, x.peer_id
    group = sorted([A, B, X])  # a group's members, as its keys name them
    ca.endpoints = cb.endpoints = {A: a.endpoint, B: b.endpoint, X: x.endpoint}
    x.close()
    key = "rs." + parts_key(group, "7")
    out: list = []
    waiting = threading.Thread(target=lambda: out.append(
        cb.exchange(key, group, {A: b"part"}, {A: 4, X: 4}, 60.0)))
    waiting.start()
    got = ca.exchange(key, group, {B: b"part", X: b"part"}, {B: 4, X: 4}, 60.0)
    waiting.join(60)
    assert got.gone == [X] and got.missing == [X], got
    assert out and out[0].gone == [X] and out[0].missing == [X] and bytes(out[0].got[A]) == b"part", out

    other = "rs." + parts_key(sorted([A, B, "y"]), "7")
    cb._heard_gone(other, A, {"gone": X, "group": group})  # the key names another group
    later = "ag." + parts_key(group, "7")
    cb._heard_gone(later, "z", {"gone": X, "group": group})  # z is not a member
    cb._heard_gone(later, A, {"gone": A, "group": group})  # nobody is gone by its own word
    assert b.box.wait_for(other, lambda m: True, 0) == {} and b.box.wait_for(later, lambda m: True, 0) == {}
    cb._heard_gone(later, A, {"gone": X, "group": group})
    assert b.box.wait_for(later, lambda m: True, 0) == {X: GONE}


def test_a_dial_back_finds_a_listener_that_can_be_reached_and_one_that_cannot(transports):
    """A joining island asks a reachable one to connect back: its own listener counts only when the nonce it
    wrote comes back; an address nothing answers at, or one on another 'server' (127.0.0.2: the listener is
    bound to 127.0.0.1, as a private address behind a NAT is), is named among those not reached, and the
    answer comes back over the asker's lane, with the address the question came from (a NAT's, behind one)."""
    from peers.wire.dial_back import ask_dial_back, serve_dial_back

    responder = transports("responder", "k", host="127.0.0.1")
    serve_dial_back(responder)
    found = ask_dial_back(identity("island"), "k", True, [responder.endpoint], "127.0.0.1", 0, "127.0.0.1", [])
    assert found.reached is True and found.failed == [] and found.answered == 1

    closed = socket.create_server(("127.0.0.1", 0))
    nobody = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    found = ask_dial_back(identity("island"), "k", True, [responder.endpoint], "127.0.0.1", 0, "127.0.0.1", [nobody])
    assert found.reached is False and found.failed == [nobody], found

    found = ask_dial_back(identity("island"), "k", True, [responder.endpoint], "127.0.0.1", 0, "127.0.0.2", [])
    assert found.reached is False and found.failed == found.addresses and found.answered == 1, found
    assert found.seen == "127.0.0.1"  # where the question came from, not the address it would announce

    # an island that declared itself behind NAT asks only where it is seen from: nothing is dialed
    found = ask_dial_back(identity("island"), "k", True, [responder.endpoint], "127.0.0.1", 0, "127.0.0.2", [nobody],
                          dial=False)
    assert found.seen == "127.0.0.1" and found.answered == 1 and found.reached is None and found.addresses == []


def test_a_dial_back_that_nobody_answers_knows_nothing(transports):
    """Asked with the wrong run key, the responder refuses the question: the asker learns nothing (None), and
    does not conclude that it is behind NAT."""
    from peers.wire.dial_back import ask_dial_back, serve_dial_back

    responder = transports("responder", "k", host="127.0.0.1")
    serve_dial_back(responder)
    found = ask_dial_back(identity("island"), "other", True, [responder.endpoint], "127.0.0.1", 0, "127.0.0.1", [],
                          timeout=3.0)
    assert found.reached is None and found.answered == 0


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_two_members_behind_nat_average_through_the_reachable_one_without_relaying(transports, codec):
    """A reduce-scatter of 3 members, 2 behind NAT: the reachable member owns every part (a star, streamed in
    pieces), so nothing is relayed, each hidden member sends exactly its payload, and all take the same weighted
    mean; with a part each (the layout before), the reachable member relays the hidden members' parts to each
    other."""
    import torch

    from outer_optim.compression import make_codec
    from peers.aggregation import weighted_mean
    from peers.wire.encoded import MIN_PIECE, DirectChannel, average_encoded, part_owners

    c, numel = make_codec(codec), 3 * MIN_PIECE + 1000
    public = transports("public", "key", host="127.0.0.2")
    first = _unreachable(transports, "first", "127.0.0.3")
    second = _unreachable(transports, "second", "127.0.0.4")
    P, F, S = public.peer_id, first.peer_id, second.peer_id
    ts = {P: public, F: first, S: second}
    for t in (first, second):
        t.reach([public.endpoint])
    endpoints = {p: t.endpoint for p, t in ts.items()}
    channels = {p: DirectChannel(t, c.nbytes(numel)) for p, t in ts.items()}
    for ch in channels.values():
        ch.endpoints.update(endpoints)
    keys: list[str] = []  # the exchanges the reachable member ran
    exchange = channels[P].exchange
    channels[P].exchange = lambda key, *a: keys.append(key) or exchange(key, *a)
    peers = sorted(ts)
    weights = {F: 1.0, P: 2.0, S: 3.0}
    gen = torch.Generator().manual_seed(0)
    deltas = {p: torch.randn(numel, generator=gen) for p in peers}
    assert set(part_owners(peers, endpoints)) == {P}
    assert part_owners(peers, {**endpoints, S: "127.0.0.4:1"}) == peers  # one hidden: no relay to spare
    punching = {**endpoints, F: "punch:127.0.0.3:1", S: "punch:127.0.0.4:1"}
    assert part_owners(peers, punching) == peers  # they connect to each other through their NATs
    assert set(part_owners(peers, {**punching, S: endpoints[S]})) == {P}  # one cannot
    assert set(part_owners(peers, punching, unpunched=[F])) == {P}  # one failed a punch lately

    def round_(key: str, owners) -> dict:
        out: dict = {}

        def one(p: str) -> None:
            out[p] = average_encoded(channels[p], c, key, p, peers, weights, c.encode(deltas[p]), numel, 10.0,
                                     owners=owners)
        threads = [threading.Thread(target=one, args=(p,)) for p in peers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return out

    star = round_("star.1", part_owners(peers, endpoints))
    assert public.stats.relayed == 0
    assert sorted(k for k in keys if k.startswith("rs.")) == [f"rs.{i}.star.1" for i in range(3)]
    assert all(star[p].mean is not None for p in peers)
    assert all(torch.equal(star[p].mean, star[P].mean) for p in peers)
    expected = weighted_mean({p: c.decode(c.encode(deltas[p]), numel) for p in peers}, weights)
    assert torch.allclose(star[P].mean, expected, atol=0.05 if c.lossy else 1e-6)
    for p in (F, S):  # its whole payload to the owner, nothing else
        assert star[p].bytes_sent == c.nbytes(numel)
    spread = round_("spread.1", None)
    assert all(torch.equal(spread[p].mean, spread[P].mean) for p in peers)
    assert public.stats.relayed > 0


# ------------------------------------------------------------------------------------------------------------
# What a holder of the run key cannot do: every test below fails against the transport before it proved senders,
# authenticated clear-text records and bounded what strangers may hold.


class _Impostor(Identity):
    """Names ``victim``'s peer id; signs with its own key, showing its own public key (``shows="own"``) or the
    victim's (``shows="victim"``)."""

    def __init__(self, own: Identity, victim: Identity, shows: str):
        self.__dict__.update(own.__dict__)
        self.peer_id = victim.peer_id
        if shows == "victim":
            self.public = victim.public


@pytest.mark.parametrize("shows", ["own", "victim"])
def test_a_rank_that_names_another_peer_id_is_refused_either_way(transports, shows):
    """A holder of the run key names another rank's peer id in its handshake: whether it shows its own public
    key (which does not hash to that peer id) or the victim's (whose signature it cannot make), the listener
    refuses it, and nothing it sent is attributed to the victim; as a listener, its callers refuse it."""
    victim, honest = transports("victim", "key"), transports("honest", "key")
    impostor = Transport(_Impostor(identity("impostor"), identity("victim"), shows), "key")
    try:
        with pytest.raises(RefusedError, match="did not prove its peer id") as e:
            impostor.send(honest.endpoint, "x", b"from the victim, says who?", time.monotonic() + 5)
        assert "\n" not in str(e.value)
        assert honest.box.senders("x") == [] and not honest.stats.received
        with pytest.raises(RefusedError, match="could not prove that it is"):
            honest.send(impostor.endpoint, "y", b"for the victim", time.monotonic() + 5)
        assert impostor.box.senders("y") == []
    finally:
        impostor.close()
    honest.send(victim.endpoint, "z", b"hello", time.monotonic() + 5)  # the real one is taken
    assert _received(victim, "z", honest) == b"hello"


def test_a_message_is_from_the_peer_its_connection_proved_whatever_its_extra_says(transports):
    """A message naming another sender (``_from``) and another origin address (``_seen``) in its extra is
    attributed to the peer id its connection proved, with the address it came from."""
    a, b, victim = transports("a", "key"), transports("b", "key"), transports("victim", "key")
    seen: list = []
    b.handlers["part"] = lambda key, sender, payload, extra: seen.append((sender, dict(extra))) or True
    a._send(b.endpoint, "part", b"mine", time.monotonic() + 5,  # _send: as a sender that skips send()'s filter
            {"_from": victim.peer_id, "_seen": "203.0.113.9", "group": ["g"]})
    assert _until(lambda: seen) and seen == [(a.peer_id, {"group": ["g"], "_seen": "127.0.0.1"})]


@pytest.mark.parametrize("forgery", ["payload", "origin", "receiver", "replay"])
def test_a_relay_can_pass_a_message_on_but_not_forge_change_redirect_or_replay_it(transports, forgery):
    """Two ranks behind NAT, a reachable one between them.  The relay passes ``first``'s message on, and a
    forgery besides: the payload changed, another origin claimed (a third rank's key shown), the message
    passed on to another rank behind NAT than the one it was for, or the same message passed on twice.  The
    genuine message arrives once, from ``first``; the forgery is dropped and counted."""
    public = transports("public", "key", host="127.0.0.2")
    first = _unreachable(transports, "first", "127.0.0.3")
    second = _unreachable(transports, "second", "127.0.0.4")
    third = _unreachable(transports, "third", "127.0.0.5")
    for t in (first, second, third):
        t.reach([public.endpoint])
    got: dict[str, list] = {"second": [], "third": []}
    for name, t in (("second", second), ("third", third)):
        t.handlers["part"] = lambda key, sender, payload, extra, into=got[name]: into.append(
            (sender, bytes(payload))) or True
    genuine = _send = public._send

    def relay(endpoint, key, payload, deadline, extra, envelope=None):
        if envelope is not None and key == "part":
            proof = envelope["_relayed"]["proof"]
            if forgery == "payload":
                _send(endpoint, key, b"changed on the way", deadline, extra, envelope)
            elif forgery == "origin":
                shown = {**proof, "from": third.peer_id, "key": base64.b64encode(identity("third").public).decode()}
                _send(endpoint, key, payload, deadline, extra, {"_relayed": {**envelope["_relayed"], "proof": shown}})
            elif forgery == "receiver":
                _send(third.endpoint, key, payload, deadline, extra, envelope)
            else:
                _send(endpoint, key, payload, deadline, extra, envelope)
        return genuine(endpoint, key, payload, deadline, extra, envelope)

    public._send = relay
    first.send(second.endpoint, "part", b"first's part", time.monotonic() + 10)
    assert _until(lambda: got["second"]) and got["second"] == [(first.peer_id, b"first's part")]
    assert got["third"] == []
    forged = third if forgery == "receiver" else second
    assert _until(lambda: forged.stats.forged == 1), forged.stats
    assert got["third"] == [] and len(got["second"]) == 1


def test_a_member_that_sends_in_another_members_name_speaks_only_for_itself(transports):
    """The hostile experiment's forgeries (``forge@send``, ``forge@vote``: :meth:`Transport._send_forged`): a key
    holder sends a message naming a third rank its sender, and one as if a relay passed it on from that rank, under
    a proof it signed itself.  The receiver attributes the first to the forger (its connection proved who it is) and
    drops the second; nothing ever counts as the third rank's."""
    forger, receiver, victim = (transports(n, "key") for n in ("forger", "receiver", "victim"))
    got: list[tuple[str, bytes]] = []
    receiver.handlers["part"] = lambda key, sender, payload, extra: got.append((sender, bytes(payload))) or True
    forger.forge = lambda key, payload: (victim.peer_id, b"junk in the victim's name")
    forger.send(receiver.endpoint, "part", b"the forger's own part", time.monotonic() + 10)
    assert _until(lambda: len(got) == 2 and receiver.stats.forged == 1), (got, receiver.stats)
    assert got == [(forger.peer_id, b"junk in the victim's name"), (forger.peer_id, b"the forger's own part")]


def test_without_encryption_bytes_rewritten_on_the_way_are_refused(transports):
    """``encrypt=False``: an onlooker reads the payload, but a byte it rewrites fails the record's tag: the
    receiver drops the message, the sender sends it again, and only the payload as sent is delivered."""
    a, b = transports("a", "key", encrypt=False), transports("b", "key", encrypt=False)
    tap = _Tap(("127.0.0.1", b.port), rewrite=(b"plain pseudo-gradient", b"PLAIN pseudo-gradient"))
    try:
        a.send(tap.endpoint, "part", MARKER, time.monotonic() + 10)
        assert _received(b, "part", a) == MARKER
    finally:
        tap.close()
    assert tap.rewritten == 1 and MARKER[:64] in tap.seen  # in the clear, and rewritten once
    assert b.stats.tampered == 1 and a.stats.resent == 1 and b.stats.received == len(MARKER)


def test_a_frame_larger_than_its_owner_takes_is_refused_before_anything_is_allocated(transports, monkeypatch):
    """The default limit is far below what a frame header can announce, and an owner's own limit holds: a
    message over it is never delivered, a frame announcing 1 GiB is refused at its header (no buffer of that
    size is asked for), and a message at the limit is."""
    from peers.wire import secure

    sizes: list[int] = []
    real = secure.buffer
    monkeypatch.setattr(secure, "buffer", lambda size: sizes.append(size) or real(size))
    a, b = transports("a", "key"), transports("b", "key")
    assert b.max_message <= 1 << 28
    link = _caller(a, b)
    link._write(secure.HEADER.pack(secure.FRAME, 1, 0, 1 << 30))
    link._write(b"k")
    assert _closed_by_peer(link.sock), "a frame announcing 1 GiB was not refused at its header"
    assert max(sizes) < 1 << 23

    small = transports("small", "key", max_message=1000)
    with pytest.raises(TransportError):
        a.send(small.endpoint, "big", b"x" * 1001, time.monotonic() + 1)
    a.send(small.endpoint, "fits", b"x" * 1000, time.monotonic() + 5)
    assert small.box.senders("big") == [] and _received(small, "fits", a) == b"x" * 1000


def _caller(a: Transport, b: Transport, role: int = 0):
    """A connection from ``a`` to ``b`` after its handshake, to write raw records on."""
    from peers.wire import secure
    from peers.wire.listener import SLOT

    sock = socket.create_connection(("127.0.0.1", b.port))
    sock.sendall(SLOT.pack(0))
    return secure.call(sock, a.key, a.encrypt, a.identity, a.endpoint, role, time.monotonic() + 10)


def _closed_by_peer(sock: socket.socket, timeout: float = 10.0) -> bool:
    """Whether the other end closes ``sock`` within ``timeout`` seconds (it sends nothing before)."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_handshake_has_one_deadline_however_slowly_its_bytes_trickle_in(transports, monkeypatch):
    """A stranger that sends its handshake a byte at a time, each well within the handshake's time, is closed
    once the handshake's one deadline passes, long before its bytes would end."""
    from peers.wire import listener

    monkeypatch.setattr(listener, "HANDSHAKE_TIMEOUT", 1.0)
    b = transports("b", "key")
    sock = socket.create_connection(("127.0.0.1", b.port))
    try:
        sock.sendall(listener.SLOT.pack(0) + b"\xff\xff")  # a peer id of 65535 bytes to come
        closed = False
        for _ in range(100):  # 10 s of bytes, 0.1 s apart
            time.sleep(0.1)
            try:
                sock.sendall(b"x")
            except OSError:
                closed = True
                break
            if select.select([sock], [], [], 0)[0] and _closed_by_peer(sock, 0):
                closed = True
                break
        assert closed, "a handshake trickled in byte by byte kept its connection open"
    finally:
        sock.close()


def test_strangers_in_their_handshake_are_capped_and_get_no_thread_each(transports, monkeypatch):
    """With HANDSHAKES connections silent in their handshake, one more is closed as it comes, with no thread
    started for it; the silent ones stay until their deadline; once they are gone, ranks connect again."""
    from peers.wire import listener

    monkeypatch.setattr(listener, "HANDSHAKES", 4)
    monkeypatch.setattr(listener, "HANDSHAKE_TIMEOUT", 60.0)
    a, b = transports("a", "key"), transports("b", "key")
    threads = {t.ident for t in threading.enumerate()}
    silent = [socket.create_connection(("127.0.0.1", b.port)) for _ in range(4)]
    extra = [socket.create_connection(("127.0.0.1", b.port)) for _ in range(12)]
    try:
        assert all(_closed_by_peer(s) for s in extra), "a connection past the cap was kept"
        assert b.listener.turned_away == 12
        assert not any(_closed_by_peer(s, 0.2) for s in silent)
        started = [t for t in threading.enumerate() if t.ident not in threads and t.name == "transport-conn"]
        assert len(started) <= 4
    finally:
        for s in silent + extra:
            s.close()
    a.send(b.endpoint, "x", b"after the strangers", time.monotonic() + 10)
    assert _received(b, "x", a) == b"after the strangers"


def test_a_stranger_holding_every_handshake_slot_from_one_address_evicts_only_its_own(transports, monkeypatch):
    """A slowloris from one address (HANDSHAKES silent connections, and more as they are closed) cannot keep a
    member out: a connection from another address ends the stranger's oldest handshake and gets through at once,
    while the stranger's next connection, its address holding the most, is closed as it comes."""
    from peers.wire import listener

    monkeypatch.setattr(listener, "HANDSHAKES", 4)
    monkeypatch.setattr(listener, "HANDSHAKE_TIMEOUT", 60.0)
    a, b = transports("a", "key"), transports("b", "key")
    stranger = [socket.create_connection(("127.0.0.1", b.port), source_address=("127.0.0.9", 0)) for _ in range(4)]
    try:
        assert not any(_closed_by_peer(s, 0.2) for s in stranger), "the stranger's handshakes are held"
        more = socket.create_connection(("127.0.0.1", b.port), source_address=("127.0.0.9", 0))
        stranger.append(more)
        assert _closed_by_peer(more) and b.listener.turned_away == 1, "the stranger took a fifth slot"
        a.send(b.endpoint, "x", b"through the slowloris", time.monotonic() + 10)  # well before their 60 s deadline
        assert _received(b, "x", a) == b"through the slowloris"
        assert b.listener.evicted >= 1 and _closed_by_peer(stranger[0]), "the stranger's oldest handshake was kept"
    finally:
        for s in stranger:
            s.close()


def test_the_hostile_experiments_outsider_is_closed_out_and_members_still_talk(transports, monkeypatch):
    """``experiments.outsider`` at a real transport: it finds the port as a scanner would (the listening sockets of
    this process), the transport closes its junk, its oversized length prefixes and its slow handshakes, and a
    member's message still gets through while the stranger keeps every slot busy."""
    import os

    from experiments import outsider
    from peers.wire import listener

    monkeypatch.setattr(outsider, "TRICKLE", 0.2)
    monkeypatch.setattr(outsider, "RESCAN", 0.2)
    monkeypatch.setattr(listener, "HANDSHAKE_TIMEOUT", 1.0)
    a, b = transports("a", "key"), transports("b", "key")
    stranger = outsider.Outsider(lambda: [os.getpid()])
    stranger.start()
    try:
        seen = stranger.counts
        assert _until(lambda: b.port in seen.ports and seen.junk and seen.oversized and seen.longest_slow_s > 0), \
            f"the outsider found no port or the transport closed nothing of it: {seen.as_dict()}"
        a.send(b.endpoint, "x", b"past the stranger", time.monotonic() + 10)
        assert _received(b, "x", a) == b"past the stranger"
    finally:
        done = stranger.stop()
    assert done["slow_opened"] > outsider.SLOW_PER_PORT and b.listener.turned_away + b.listener.evicted > 0


def test_a_connection_that_carries_nothing_ends_and_its_sender_opens_a_new_one(transports, monkeypatch):
    """A receiver ends a proven connection idle for IDLE seconds; the sender, which stops using one sooner, sends
    its next message on a new connection instead of into the ended one."""
    from peers.wire import links, transport

    monkeypatch.setattr(transport, "IDLE", 0.5)
    monkeypatch.setattr(links, "REUSE_IDLE", 0.2)
    a, b = transports("a", "key"), transports("b", "key")
    a.send(b.endpoint, "one", b"1", time.monotonic() + 5)
    assert b.listener.sockets(), "the connection is open after its message"
    assert _until(lambda: not b.listener.sockets()), "an idle connection stayed open"
    a.send(b.endpoint, "two", b"2", time.monotonic() + 5)
    assert _received(b, "two", a) == b"2" and a.stats.resent == 0


class _Banner:
    """A TCP server at ``host`` that writes 16 bytes to whoever connects, counting them."""

    TEXT = b"SECRET-BANNER-16"

    def __init__(self, host: str):
        self.server = socket.create_server((host, 0))
        self.address, self.accepted = f"{host}:{self.server.getsockname()[1]}", 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.accepted += 1
            with conn:
                conn.sendall(self.TEXT)

    def close(self) -> None:
        self.server.close()


def test_a_dial_back_dials_only_the_asker_s_address_and_tells_no_banner(transports):
    """A question naming an address of another machine than the one it came from (127.0.0.3, asked from
    127.0.0.1) is answered "not reached" without a connection to it; an address of the asker's own machine is
    dialed, but the answer says only whether the asker's nonce came back, never what was read there."""
    import json

    from peers.wire.dial_back import REPLY, REQUEST, ask_dial_back, serve_dial_back

    # the responder sits on another machine than the asker (127.0.0.2): it would dial a rank of its own machine
    # straight instead of answering over the lane the asker opens
    responder = transports("responder", "k", host="127.0.0.2")
    serve_dial_back(responder)
    elsewhere, own = _Banner("127.0.0.3"), _Banner("127.0.0.1")
    try:
        found = ask_dial_back(identity("island"), "k", True, [responder.endpoint], "127.0.0.1", 0, "127.0.0.1",
                              [elsewhere.address])
        assert elsewhere.accepted == 0 and found.failed == [elsewhere.address] and found.reached is False, found

        asker = _unreachable(transports, "asker", "127.0.0.1", "k")
        replies: list[bytes] = []
        asker.handlers[REPLY] = lambda key, sender, payload, extra: replies.append(bytes(payload)) or True
        request = {"addresses": [own.address], "greeted": [own.address], "nonce": "00" * 16,
                   "reply": f"{REPLY}x", "reply_to": asker.endpoint}
        asker.send(responder.endpoint, f"{REQUEST}x", json.dumps(request).encode(), time.monotonic() + 10)
        # the kernel completes the dial-back's connection before the banner's thread counts it: wait for both
        assert _until(lambda: replies and own.accepted, 15) and own.accepted == 1 and len(replies) == 1
        assert _Banner.TEXT not in replies[0] and _Banner.TEXT.hex().encode() not in replies[0], replies[0]
    finally:
        elsewhere.close()
        own.close()


def test_one_peer_holds_a_bounded_number_of_connections_and_lanes(transports, monkeypatch):
    """A peer that opens more connections than PER_PEER has its oldest ended; one that opens lanes under more
    endpoints than its own keeps twice ``streams`` of them at most."""
    from peers.wire import secure
    from peers.wire import transport as module

    monkeypatch.setattr(module, "PER_PEER", 2)
    a, b = transports("a", "key"), transports("b", "key", streams=1)
    held = [_caller(a, b) for _ in range(3)]
    assert _closed_by_peer(held[0].sock), "the oldest connection past the bound stayed open"
    assert not any(_closed_by_peer(link.sock, 0.2) for link in held[1:])

    lanes = []
    for port in range(1, 5):  # lanes naming four endpoints, as if from four ranks
        a.endpoint = f"lane:127.0.0.9:{port}"
        lanes.append(_caller(a, b, secure.LANE))
    assert _until(lambda: len(b.lanes.links()) == 2), b.lanes.links()
    ended = [_closed_by_peer(link.sock, 5 if i < 2 else 0.2) for i, link in enumerate(lanes)]
    assert ended == [True, True, False, False]  # the oldest two
