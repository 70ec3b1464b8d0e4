"""Bulk bytes between island ranks over TCP: pseudo-gradient parts, a round's group inside an island,
θ_global for joiners.

hivemind forms the groups and carries the votes; the bytes of a round go here, straight from one rank's
memory to another's.  Measured side by side on loopback (2 cores, 160 MB of fp32): a reduce-scatter and
all-gather over this path ran as fast as a gloo ``all_reduce`` of the same tensor (0.112 s against 0.110 s),
while the same halves over hivemind's p2p daemon took 6.4x as long and hivemind's own all-reduce 18x.

:class:`Transport` is the one object the rest of :mod:`peers` uses; it puts together one concept per module:

- :mod:`peers.wire.listener`: the port a server's ranks share (a connection handed to the rank it names) and
  the bound on connections that have not proven anything yet (one deadline for the handshake, a few at once);
- :mod:`peers.wire.secure`: one connection's life: the handshake (both ends prove the run's key and their
  hivemind identity, :mod:`peers.identity`, and agree on fresh keys), then frames sealed with AES-GCM
  (``encrypt=False``: in the clear, each record still authenticated) and their acknowledgements;
- :mod:`peers.wire.links`: the connections a rank sends on, a few to each rank, one message at a time each;
- :mod:`peers.wire.nat`: the ways to reach a rank that cannot be reached: lanes it opens, hole punching, and a
  reachable rank that passes messages on.

A message is one frame: a header (its key, the length of a small JSON ``extra`` and of the payload), then the
payload, written from the caller's buffer and read into the one buffer it is kept in; a frame announcing more than
``max_message`` bytes (what the owner expects at most: :func:`message_limit`) is refused before anything is
allocated.  The receiver acknowledges every whole message; a message whose connection fails before its
acknowledgement, or that fails its seal on the way, is sent again on a new connection, alone, until its deadline
(:attr:`Stats.resent` counts them); a receiver whose machine refuses connections a few times in a row is gone
(:class:`GoneError`).  A connection that carries nothing for :data:`~peers.wire.links.IDLE` seconds ends, and one
peer id holds :data:`PER_PEER` connections at most.  A message is attributed to the peer id its connection proved (passed on by a relay: to the
one its origin's signature proves), never to anything inside it: an ``extra``'s keys that start with ``_`` are
the transport's own.  Messages wait in an :class:`~peers.wire.inbox.Inbox` by key and sender until someone takes
them.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from peers.discovery.membership import (
    LANE_PREFIX,
    PUNCH_PREFIX,
    address_of,
    behind_nat,
    punchable,
)
from peers.identity import Identity
from peers.wire.inbox import Inbox
from peers.wire.links import IDLE, Links
from peers.wire.listener import SLOT, Listener
from peers.wire.nat import MAX_WITHIN, PUNCH_KEY, Lanes, PunchFailed, Puncher, Relay
from peers.wire.secure import (
    FRAMES,
    HANDSHAKE_TIMEOUT,
    LANE,
    Link,
    Malformed,
    Refused,
    Tampered,
    call,
    greet,
)

log = logging.getLogger(__name__)

MAX_MESSAGE = 1 << 28
"""Bytes a message may have when its owner sets no limit (256 MiB: the default buckets' largest message,
:func:`message_limit`, four times over)."""

PER_PEER = 16
"""Connections one peer id may hold open to this rank at once (a sender opens ``streams`` to a rank, 4 by
default); one more ends its oldest (a connection of a sender that restarted, most likely)."""

Buffer = bytes | bytearray | memoryview
Handler = Callable[[str, str, bytearray, dict], bool]


class TransportError(RuntimeError):
    """A message could not be delivered before its deadline."""


class RefusedError(TransportError):
    """The receiver refused the connection: the two sides hold different run keys, or encrypt differently, or one
    could not prove its peer id."""


class GoneError(TransportError):
    """Nothing listens at the receiver's address any more: its machine refused :data:`GONE_AFTER` connections
    in a row.  A live rank always listens, so its process is gone; waiting for it until the deadline would only
    hold up the ranks that are still there."""


GONE_AFTER = 3
"""Connections refused in a row (the retries 0.2 s, then 0.4 s apart) after which a receiver counts as gone."""


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"lane:host:port"``, ``"punch:host:port"``, ``"host:port/slot"``) as (host, port)."""
    host, _, port = address_of(endpoint).partition("/")[0].rpartition(":")
    return host.strip("[]"), int(port)


def slot_of(endpoint: str) -> int:
    """Which rank of the server behind the port an endpoint names (``host:port/slot``; none: 0)."""
    _, _, slot = endpoint.partition("/")
    return int(slot) if slot else 0


def message_limit(bucket_numel: int) -> int:
    """The largest message a rank of a run cut into buckets of ``bucket_numel`` values should take: a joiner's
    piece of a bucket (θ_global and the outer momentum, fp32: 8 bytes a value) is the largest a round or a state
    download sends; twice that, plus 1 MiB, leaves room for headers and an entropy coding that grew."""
    return 16 * bucket_numel + (1 << 20)


@dataclass
class Stats:
    """What this rank's transport moved (payload bytes; the kernel adds its headers)."""

    sent: int = 0
    received: int = 0
    resent: int = 0
    """Messages sent again alone after their connection failed before they were acknowledged."""
    resent_bytes: int = 0
    tampered: int = 0
    """Messages dropped on arrival because a record failed its seal (sent again by their sender)."""
    relayed: int = 0
    """Messages this rank passed on between two ranks that cannot be reached."""
    forged: int = 0
    """Messages passed on to this rank that were dropped because nothing proved their origin."""


def _swallow(key: str, sender: str, payload: bytearray, extra: dict) -> bool:
    return True


class Transport:
    """This rank's endpoint for bulk bytes: listens on ``host:port`` (0: any free port), proves itself with
    ``identity`` (its peer id is ``identity.peer_id``) and accepts only callers holding ``run_key`` (empty:
    anyone) who prove theirs.  ``advertise``: the host other ranks reach it at (default: ``host``, or 127.0.0.1
    when listening on all interfaces); ``max_message``: the largest payload it takes (:func:`message_limit`);
    ``encrypt``: seal every byte after the handshake (False: authenticate only); ``reachable=False``: no other
    server can open a connection to it (see :mod:`peers.wire.nat`); ``punch``: when it cannot be reached, take
    part in hole punching; ``slot``: this rank's share of the port ``port`` its server's rank 0 owns (0: this rank
    owns ``port``); ``streams``: connections at most to one rank, for messages in flight together."""

    def __init__(self, identity: Identity, run_key: str = "", host: str = "127.0.0.1", port: int = 0,
                 advertise: str = "", max_message: int = MAX_MESSAGE, inbox_ttl: float = 300.0, encrypt: bool = True,
                 reachable: bool = True, slot: int = 0, streams: int = 4, punch: bool = True):
        self.identity, self.peer_id = identity, identity.peer_id
        self.key, self.max_message = run_key.encode(), max_message
        self.encrypt, self.reachable, self.streams = encrypt, reachable, max(1, streams)
        self.punch = punch and not reachable
        self.host, self.slot = host, slot
        self.box = Inbox(inbox_ttl, max_keys=4096)
        self.stats = Stats()
        self.handlers: dict[str, Handler] = {}
        """By key prefix: called (in the connection's reader thread) with (key, sender, payload, extra) for a
        message whose key starts with it (the longest prefix wins) before it goes to the inbox; returning True
        keeps it out of the inbox (a request served at once, a message stored otherwise).  ``sender`` is the
        proven peer id; ``extra["_seen"]`` the address the message came from (passed on by a relay: as the relay
        saw it, and ``extra["_via"]`` is the relay's peer id)."""
        self.callers: dict[str, str] = {}
        """Peer id -> the endpoint it announced when it called this rank (in its signed handshake), or, behind
        NAT, the endpoint of the reachable rank this rank opened a lane to: where to answer a rank that sent us
        something although we never learned of it from a group's metadata."""
        self.fault: Callable[[str], bool] | None = None
        """Tests: ``fault(key)`` True makes the next send of that key break its connection half-way."""
        self.tamper: Callable[[str], bool] | None = None
        """Tests: ``tamper(key)`` True flips one bit of that send's payload on the way out."""
        self.forge: Callable[[str, Buffer], tuple[str, bytes] | None] | None = None
        """Fault injection (``forge@send``, ``forge@vote``): ``forge(key, payload)`` gives (another peer id, a
        payload) to send, before that send, in that peer's name twice (:meth:`_send_forged`)."""
        self._closed = threading.Event()
        self._inbound: dict[str, list[Link]] = {}
        """The connections each peer id holds open to this rank, oldest first (:data:`PER_PEER` at most)."""
        self._inbound_lock = threading.Lock()
        # punching, the ranks of this server dial out from this port too
        self.listener = Listener(host, port, slot, self._greet, self._serve, reuse_port=self.punch)
        self.port = self.listener.port
        if not advertise:
            advertise = "127.0.0.1" if host in ("0.0.0.0", "") else host
        self.address = f"{advertise}:{self.port}" + (f"/{slot}" if slot else "")
        """Where this rank is reached (directly, by the ranks of its own server)."""
        self.endpoint = self.address if reachable else (PUNCH_PREFIX if self.punch else LANE_PREFIX) + self.address
        """What other ranks send to."""
        self.links = Links(lambda endpoint, deadline: self._dial(endpoint, deadline, FRAMES), self.streams)
        self.lanes = Lanes(self.endpoint, self.streams, self._dial, self._read_frames, self.callers, self._closed)
        self.relay = Relay(identity)
        self.puncher = Puncher(host, self.port, self._ask_to_punch, lambda sock: self.listener.adopt(sock, True))
        self.handlers[PUNCH_KEY] = self.puncher.asked if self.punch else _swallow
        self.listener.start()

    # --------------------------------------------------------------------------------- receiving
    def _greet(self, conn: socket.socket, deadline: float) -> Link | None:
        try:
            return greet(conn, self.key, self.encrypt, self.identity, deadline)
        except Refused as e:
            log.warning("%s", e)
            return None

    def _serve(self, link: Link) -> bool:
        """A connection that passed its handshake: a lane to keep (True: it stays open), or frames to read."""
        if link.role == LANE:
            return self.lanes.keep(link)
        if link.endpoint:
            self.callers[link.peer] = link.endpoint
        link.sock.settimeout(IDLE)  # a connection that carries nothing for that long ends
        with self._inbound_lock:
            held = self._inbound.setdefault(link.peer, [])
            held.append(link)
            oldest = held.pop(0) if len(held) > PER_PEER else None
        if oldest is not None:
            log.info("ended the oldest connection from %s: it holds %d", link.peer, PER_PEER)
            try:
                oldest.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            self._read_frames(link)
        finally:
            with self._inbound_lock:
                held = [other for other in self._inbound.get(link.peer, []) if other is not link]
                if held:
                    self._inbound[link.peer] = held
                else:
                    self._inbound.pop(link.peer, None)
        return False

    def _read_frames(self, link: Link) -> None:
        """Read, acknowledge and deliver the frames of one connection until it ends."""
        seen = link.sock.getpeername()[0]  # where its frames come from, as this end sees it
        while not self._closed.is_set():
            try:
                key, meta, payload = link.read_frame(self.max_message)
            except Tampered as e:
                self.stats.tampered += 1
                log.warning("dropped a message from %s: %s (its sender sends it again)", link.peer, e)
                return
            except Malformed as e:
                log.warning("refused a message from %s: %s", link.peer, e)
                return
            except TimeoutError:
                log.debug("ended the connection from %s: idle", link.peer)
                return
            except ConnectionError:
                return
            try:
                extra = json.loads(meta) if meta else {}
            except ValueError:
                log.warning("refused a message from %s whose extra is not JSON", link.peer)
                return
            if not isinstance(extra, dict):
                extra = {}
            own = {k: v for k, v in extra.items() if not k.startswith("_")}
            if "_relay" in extra:
                if not self._pass_on(key, payload, own, extra, link.peer, seen):
                    return  # not acknowledged: the sender tries again
                link.write_ack()
                continue
            link.write_ack()
            sender, relayed = link.peer, extra.get("_relayed")
            if relayed is not None:
                relayed = relayed if isinstance(relayed, dict) else {}
                origin = self.relay.origin(relayed.get("proof"), key, own, payload, self.endpoint)
                if origin is None:
                    self.stats.forged += 1
                    log.warning("dropped %s, passed on by %s: nothing proves who sent it", key, link.peer)
                    continue
                sender, own["_via"], own["_seen"] = origin, link.peer, str(relayed.get("seen", ""))
            else:
                own["_seen"] = seen
            self.stats.received += len(payload)
            handler = self._handler(key)
            if handler is not None and handler(key, sender, payload, own):
                continue
            self.box.put(key, sender, payload, own.get("group", ()))

    def _pass_on(self, key: str, payload: memoryview, own: dict, extra: dict, origin: str, seen: str) -> bool:
        """A message between two ranks that cannot be reached: send it on over the receiver's lane, with its
        origin's proof and the address it came from (``seen``: the origin's NAT's, for a punch)."""
        target, proof = extra.get("_relay"), extra.get("_proof")
        if not isinstance(target, str) or not behind_nat(target) or not isinstance(proof, dict) \
                or proof.get("from") != origin:
            log.warning("refused to pass %s on from %s: it names no rank behind NAT, or no proof of its origin",
                        key, origin)
            return False
        try:
            within = min(max(0.05, float(extra.get("_within", 30.0))), MAX_WITHIN)
        except (TypeError, ValueError):
            within = 30.0
        try:
            self._send(target, key, payload, time.monotonic() + within, own,
                       {"_relayed": {"proof": proof, "seen": seen}})
        except TransportError as e:
            log.info("could not pass %s on to %s: %s", key, target, e)
            return False
        self.stats.relayed += 1
        return True

    def _handler(self, key: str) -> Handler | None:
        best = max((p for p in self.handlers if key.startswith(p)), key=len, default=None)
        return self.handlers.get(best) if best is not None else None

    # ----------------------------------------------------------------------------------- sending
    def _route(self, endpoint: str, key: str = "") -> str:
        """Where a message for ``endpoint`` goes first: the endpoint itself (a connection, its lane, or a punched
        connection), its address on this server, or ``""`` when it must be passed on by a reachable rank."""
        if not behind_nat(endpoint):
            return endpoint
        address = address_of(endpoint)
        if parse_endpoint(address)[0] == parse_endpoint(self.address)[0]:
            return address  # a rank of this server
        if self.reachable:
            return endpoint
        punch = self.punch and punchable(endpoint) and key != PUNCH_KEY
        return endpoint if punch and self.puncher.may_punch(endpoint) else ""

    def send(self, endpoint: str, key: str, payload: Buffer, deadline: float, extra: dict | None = None) -> None:
        """Deliver one message to the rank at ``endpoint`` (acknowledged), sending it again on a new connection
        if its connection fails, until ``deadline`` (``time.monotonic``); raises TransportError then.  ``extra``:
        a small JSON object that goes with it (its keys that start with ``_`` are the transport's: not sent)."""
        own = {k: v for k, v in (extra or {}).items() if not str(k).startswith("_")}
        self._send(endpoint, key, payload, deadline, own)

    def _send(self, endpoint: str, key: str, payload: Buffer, deadline: float, extra: dict,
              envelope: dict | None = None) -> None:
        """:meth:`send`, with the transport's own fields ``envelope`` (a relay's) added on a direct hop."""
        forged = self.forge(key, payload) if self.forge is not None and envelope is None else None
        if forged is not None:
            self._send_forged(endpoint, key, deadline, extra, *forged)
        if self._route(endpoint, key) == endpoint:
            self.reach([endpoint])
        size = memoryview(payload).nbytes
        attempt = refused = 0
        while True:
            route = self._route(endpoint, key)  # a failed punch sends through a reachable rank from then on
            try:
                if route:
                    hop, hop_extra = route, {**extra, **(envelope or {})}
                else:
                    hop = self.lanes.relay_for(deadline)
                    within = deadline - time.monotonic()
                    hop_extra = {**extra, "_relay": endpoint, "_within": within,
                                 "_proof": self.relay.prove(key, extra, payload, endpoint, within)}
                meta = json.dumps(hop_extra).encode() if hop_extra else b""
                self.links.deliver(hop, key, meta, payload, deadline, self.fault, self.tamper)
                self.stats.sent += size
                return
            except Refused as e:
                raise RefusedError(f"{endpoint}: {e}") from None
            except PunchFailed as e:
                self.puncher.failed(endpoint, e)
            except OSError as e:
                attempt += 1
                # through a relay, a refusal is the relay's, not the receiver's
                refused = refused + 1 if isinstance(e, ConnectionRefusedError) and route else 0
                if refused >= GONE_AFTER:
                    raise GoneError(f"could not deliver {key} to {endpoint}: nothing listens there any more "
                                    f"({refused} connections refused in a row)") from None
                if time.monotonic() >= deadline or self._closed.is_set():
                    raise TransportError(f"could not deliver {key} to {endpoint}: {e}") from None
                self.stats.resent += 1
                self.stats.resent_bytes += size
                log.info("sending %s to %s again (attempt %d): %s", key, endpoint, attempt + 1, e)
                time.sleep(min(0.2 * attempt, max(0.0, deadline - time.monotonic())))

    def _dial(self, endpoint: str, deadline: float, role: int) -> Link:
        """A new connection to ``endpoint`` after its handshake (a rank behind NAT: the next lane it opens, or,
        from behind NAT, a punched connection)."""
        if behind_nat(endpoint):
            if self.reachable:
                return self.lanes.take(endpoint, deadline)
            host, port = parse_endpoint(endpoint)
            sock = self.puncher.punch(host, port, endpoint, deadline)
        else:
            sock = socket.create_connection(parse_endpoint(endpoint), timeout=max(0.05, min(
                HANDSHAKE_TIMEOUT, deadline - time.monotonic())))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(SLOT.pack(slot_of(endpoint)))
            return call(sock, self.key, self.encrypt, self.identity, self.endpoint, role,
                        time.monotonic() + HANDSHAKE_TIMEOUT)
        except BaseException:
            sock.close()
            raise

    def _ask_to_punch(self, endpoint: str, deadline: float, port: int) -> None:
        try:
            self._send(endpoint, PUNCH_KEY, b"", deadline, {"port": port})
        except TransportError as e:
            raise ConnectionError(f"could not ask {endpoint} to dial back: {e}") from None

    # ----------------------------------------------------------------------------------- the rest
    def reach(self, endpoints: list[str]) -> None:
        """This rank is about to deal with the ranks at ``endpoints``: when it cannot be reached, open (or keep)
        a lane to each reachable one, so that they can send to it."""
        if not self.reachable:
            self.lanes.reach(endpoints)

    def _send_forged(self, endpoint: str, key: str, deadline: float, extra: dict, victim: str, payload: bytes
                     ) -> None:
        """An attacker's two ways to speak as ``victim``: the message with a field naming it the sender, and the
        message as if a relay passed it on from ``victim``, under a proof signed with this rank's own key.  The
        receiver attributes the first to this rank (its connection proved who it is) and drops the second
        (:attr:`Stats.forged`)."""
        proof = dict(self.relay.prove(key, extra, payload, endpoint, max(0.05, deadline - time.monotonic())),
                     **{"from": victim})
        for claim in ({"_from": victim, "_sender": victim}, {"_relayed": {"proof": proof, "seen": ""}}):
            try:
                self.links.deliver(endpoint, key, json.dumps({**extra, **claim}).encode(), payload, deadline)
            except (OSError, Refused, PunchFailed) as e:
                log.debug("could not send a forged %s to %s: %s", key, endpoint, e)

    def punch_failed(self) -> bool:
        """Whether messages from this rank go through a relay after a failed punch (for
        :data:`~peers.wire.nat.PUNCH_AGAIN` seconds, doubled at each failure to the same rank): its island then
        has its groups average through the reachable islands (:func:`peers.wire.encoded.part_owners`)."""
        return self.puncher.any_failed()

    def socket_inodes(self) -> set[int]:
        """Inodes of this transport's live connections (what :class:`peers.wire.counters.WireCounter` counts)."""
        socks = self.listener.sockets() + [link.sock for link in self.links.links() + self.lanes.links()]
        out = set()
        for s in socks:
            try:
                out.add(os.fstat(s.fileno()).st_ino)
            except (OSError, ValueError):
                continue  # closed meanwhile
        return out

    def close(self) -> None:
        """Stop listening and drop every connection (messages in the inbox stay readable)."""
        self._closed.set()
        self.listener.close()
        self.links.close()
        self.lanes.close()


def send_all(transport: Transport, messages: list[tuple[str, str, Buffer, dict | None]], deadline: float
             ) -> list[str]:
    """Send ``(endpoint, key, payload, extra)`` messages in parallel (one thread per destination, in order per
    destination); returns the endpoints some message could not be delivered to."""
    by_dest: dict[str, list[tuple[str, Buffer, dict | None]]] = {}
    for endpoint, key, payload, extra in messages:
        by_dest.setdefault(endpoint, []).append((key, payload, extra))
    failed: list[str] = []

    def run(endpoint: str, items: list[tuple[str, Buffer, dict | None]]) -> None:
        for key, payload, extra in items:
            try:
                transport.send(endpoint, key, payload, deadline, extra)
            except TransportError as e:
                log.debug("%s", e)
                failed.append(endpoint)
                return

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in by_dest.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 1.0)
    return failed


def refuses(endpoint: str, timeout: float = 1.0) -> bool:
    """Whether the machine behind ``endpoint`` refuses a connection to it: nothing listens there, so the rank
    that announced it is gone (a live rank always listens; the signal :class:`GoneError` counts).  False when
    the connection opens, when no answer comes within ``timeout`` (a server that dropped off the network
    cannot be told from a slow one), and for a lane (a rank behind NAT takes no connection).  The probe sends
    nothing: the listener sees a connection end before its handshake."""
    if not endpoint or behind_nat(endpoint):
        return False
    try:
        with socket.create_connection(parse_endpoint(endpoint), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False


def tensor_bytes(t: Any) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    return memoryview(t.contiguous().numpy()).cast("B")


__all__ = ["Transport", "TransportError", "RefusedError", "GoneError", "Stats", "send_all", "parse_endpoint", "slot_of",
           "refuses", "tensor_bytes", "message_limit", "MAX_MESSAGE", "Identity"]
