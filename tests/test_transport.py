"""The direct transport's connections: sealed bytes, a tampered message dropped and sent again, keys and modes
that do not match refused in one line, and ranks that cannot be reached taking part through lanes and relays
(real sockets on loopback; distinct 127.0.0.x addresses stand for distinct servers).  Each transport proves the
peer id of an identity made in memory (one per name, made once: an RSA key takes a while)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from peers.wire.identity import Identity
from peers.wire.transport import RefusedError, Transport

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


def _received(t: Transport, key: str, sender: Transport, timeout: float = 10.0) -> bytes:
    got = t.box.wait_for(key, lambda m: sender.peer_id in m, time.monotonic() + timeout)
    assert sender.peer_id in got, f"{key} from {sender.peer_id} never arrived"
    return bytes(got[sender.peer_id])


class _Tap:
    """A TCP forwarder that keeps a copy of every byte it carries (what an onlooker on the link sees)."""

    def __init__(self, target: tuple[str, int]):
        self.target, self.seen = target, bytearray()
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
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
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
            dst.sendall(data)

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


def _unreachable(transports, name: str, host: str) -> Transport:
    """A rank no other server can open a connection to (its listening socket is closed at once), and that
    takes no part in hole punching (tests/test_delay_line.py punches through emulated NATs)."""
    t = transports(name, "key", host=host, reachable=False, punch=False)
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
    group = [A, B, X]
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

    other = "rs." + parts_key([A, B, "y"], "7")
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

    from outer_optim.codecs import make_codec
    from peers.wire.encoded import (
        MIN_PIECE,
        DirectChannel,
        average_encoded,
        part_owners,
        weighted_mean,
    )

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
