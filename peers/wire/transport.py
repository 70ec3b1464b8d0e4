"""Bulk bytes between island ranks over TCP: pseudo-gradient parts, a round's group inside an island,
θ_global for joiners.

hivemind forms the groups and carries the votes; the bytes of a round go here, straight from one rank's
memory to another's.  Measured side by side on loopback (2 cores, 160 MB of fp32): a reduce-scatter and
all-gather over this path ran as fast as a gloo ``all_reduce`` of the same tensor (0.112 s against 0.110 s),
while the same halves over hivemind's p2p daemon took 6.4x as long and hivemind's own all-reduce 18x.

A server's ranks take connections on one TCP port (below).  A connection starts with the handshake of
:mod:`peers.wire.secure`: both ends prove they hold the run's key (a public run has an empty key: anyone may
connect, as over hivemind), agree on fresh keys, and every byte after it is sealed with AES-GCM
(``encrypt=False``: sent in the clear).  A message is one frame: a header (its key, the length of a small
JSON ``extra`` and of the payload), then the payload, written from the caller's buffer and read into the one
buffer it is kept in.
The receiver acknowledges every whole message; a message whose connection fails before its acknowledgement,
or that fails its seal on the way, is sent again on a new connection, alone, until its deadline
(:attr:`Stats.resent` counts them).  Messages wait in an :class:`~peers.wire.inbox.Inbox` by key and sender
until someone takes them.

**One port per server.**  The ranks of a server share the port of their rank 0 (``slot`` 0): rank ``r``
announces ``HOST:PORT/r``, a connection names the rank it is for in its first two bytes, and rank 0 hands
it to rank ``r``'s process over a Unix socket (the file descriptor itself, ``SCM_RIGHTS``), which does the
handshake and reads it: the bytes never pass through rank 0, and every rank still sends its own parts on
its own connections, so a server fills its link with several TCP streams.

**Ranks that cannot be reached** (an island behind a NAT or a firewall: ``reachable=False``) announce
``lane:HOST:PORT`` instead of ``HOST:PORT``.  They open every connection themselves: to send, as anyone; to
receive, ``streams`` *lanes* to each reachable rank they deal with (:meth:`Transport.reach`, and every rank
they send to), on which that rank sends its frames back: as many connections as it has to a reachable rank,
since a connection carries one message at a time (each waits for its acknowledgement), and with one lane the
averaged parts for islands behind NAT queued.  A reachable rank sending to a ``lane:`` endpoint waits for a
lane.  Ranks of one server reach each other directly whatever they announce.

**Hole punching.**  Two ranks that both cannot be reached connect to each other through their NATs when both
dial at once (a TCP simultaneous open): the sender binds a fresh port and sends a SYN from it to the receiver's
announced port, which its own NAT then lets answers in from; it asks the receiver, through a reachable rank it
holds a lane to, to dial back; the receiver sends its SYN from its announced port (its server's port, shared
with ``SO_REUSEPORT``) to the sender's port at the address the reachable rank saw the request come from, which
its NAT then lets answers in from; the two SYNs cross and the connection opens (a reachable rank and a round
trip to it, then one between the two).  It then carries the sender's messages as any connection does.  This
takes a NAT that keeps a connection's port whatever its destination (most do; RFC 4787's endpoint-independent
mapping); such ranks announce ``punch:HOST:PORT``.  Where a punch fails (a NAT that gives each destination its
own port) or a rank announces a plain ``lane:`` (``punch=False``), the sender hands its message to a reachable
rank it holds a lane to, which passes it on over the receiver's lane before acknowledging it
(:attr:`Stats.relayed`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from peers.discovery.membership import (
    LANE_PREFIX,
    PUNCH_PREFIX,
    address_of,
    behind_nat,
    punchable,
)
from peers.wire.inbox import Inbox
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
    recv_exact,
)

log = logging.getLogger(__name__)

LANE_IDLE = 600.0
"""Seconds a lane to a rank stays open after this rank last dealt with it."""
SLOT = struct.Struct(">H")
"""What a connection names first: the rank of the server behind the port it is for."""
KEEPALIVE = 20
"""Seconds of silence before the kernel probes a lane, so that a NAT keeps its mapping."""
PUNCH_KEY = "_punch"
"""The key of a request to dial back for hole punching (see the module's docstring)."""
PUNCH_WAIT = 5.0
"""Seconds a punched connection may take to open before its messages go through a reachable rank."""
PUNCH_AGAIN = 600.0
"""Seconds after a first failed punch during which messages to that rank go through a reachable rank; each
further failure to the same rank doubles them (a NAT that failed a punch most likely always will)."""

Buffer = bytes | bytearray | memoryview


class TransportError(RuntimeError):
    """A message could not be delivered before its deadline."""


class RefusedError(TransportError):
    """The receiver refused the connection: the two sides hold different run keys, or encrypt differently."""


class PunchFailed(ConnectionError):
    """The receiver asked to dial back did, but the connection did not open through the two NATs."""


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


def _slot_address(host: str, port: int, slot: int) -> str:
    """The Unix socket (abstract: nothing on disk) where the rank of ``slot`` takes connections handed over
    by the rank that owns ``host:port``."""
    return f"\0diloco-transport-{host}-{port}-{slot}"


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


@dataclass
class _Peer:
    """One outgoing connection (made on first use, made again after a failure), or a lane from the peer."""

    endpoint: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    link: Link | None = None


class Transport:
    """This rank's endpoint for bulk bytes: listens on ``host:port`` (0: any free port), names itself
    ``peer_id`` and accepts only callers holding ``run_key`` (empty: anyone).  ``advertise``: the host other
    ranks reach it at (default: ``host``, or 127.0.0.1 when listening on all interfaces); ``encrypt``: seal
    every byte after the handshake; ``reachable=False``: no other server can open a connection to it (see
    the module's docstring); ``punch``: when it cannot be reached, take part in hole punching; ``slot``: this
    rank's share of the port ``port`` its server's rank 0 owns (0: this rank owns ``port``); ``streams``:
    connections at most to one rank, for messages in flight together."""

    def __init__(self, peer_id: str, run_key: str = "", host: str = "127.0.0.1", port: int = 0,
                 advertise: str = "", max_message: int = 1 << 34, inbox_ttl: float = 300.0, encrypt: bool = True,
                 reachable: bool = True, slot: int = 0, streams: int = 4, punch: bool = True):
        self.peer_id, self.key, self.max_message = peer_id, run_key.encode(), max_message
        self.encrypt, self.reachable, self.streams = encrypt, reachable, max(1, streams)
        self.punch = punch and not reachable
        self.box = Inbox(inbox_ttl, max_keys=4096)
        self.stats = Stats()
        self.handlers: dict[str, Callable[[str, str, bytearray, dict], bool]] = {}
        """By key prefix: called (in the connection's reader thread) with (key, sender, payload, extra) for a
        message whose key starts with it (the longest prefix wins) before it goes to the inbox; returning True
        keeps it out of the inbox (a request served at once, a message stored otherwise)."""
        self.callers: dict[str, str] = {}
        """Peer id -> the endpoint it announced when it called this rank (checked by the handshake), or, behind
        NAT, the endpoint of the reachable rank this rank opened a lane to: where to answer a rank that sent us
        something although we never learned of it from a group's metadata."""
        self.fault: Callable[[str], bool] | None = None
        """Tests: ``fault(key)`` True makes the next send of that key break its connection half-way."""
        self.tamper: Callable[[str], bool] | None = None
        """Tests: ``tamper(key)`` True flips one bit of that send's payload on the way out."""
        self._peers: dict[str, list[_Peer]] = {}
        self._turn = 0
        self._peers_lock = threading.Lock()
        self._lanes_in: dict[str, list[Link]] = {}
        """Lanes opened to this rank by ranks that cannot be reached, by their endpoint, until a send takes one
        (each such rank opens ``streams`` lanes, as many as this rank's connections to a reachable one)."""
        self._lane_arrived = threading.Condition(self._peers_lock)
        self._lanes_out: dict[str, float] = {}
        """Reachable endpoints this rank keeps a lane to (when it cannot be reached), and when it last dealt
        with each."""
        self._lane_links: dict[tuple[str, int], Link] = {}
        self._unpunched: dict[str, float] = {}
        """Ranks behind NAT a punch failed to, and until when messages to them go through a reachable rank."""
        self._punch_failures: dict[str, int] = {}
        """Ranks behind NAT a punch failed to, and how many times (each failure doubles the wait)."""
        self.handlers[PUNCH_KEY] = self._asked_to_punch
        self._closed = threading.Event()
        self.host, self.slot = host, slot
        self._handoff: dict[int, socket.socket] = {}
        self._handoff_lock = threading.Lock()
        if slot == 0:
            # punching, the ranks of this server dial out from this port too
            self._server = socket.create_server((host, port), reuse_port=self.punch, backlog=64,
                                                family=socket.AF_INET6 if ":" in host else socket.AF_INET)
            self.port = self._server.getsockname()[1]
        else:
            if not port:
                raise ValueError("a transport that shares a port needs the port of the rank that owns it")
            self.port = port
            self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._server.bind(_slot_address(host, port, slot))
            self._server.listen(16)
        if not advertise:
            advertise = "127.0.0.1" if host in ("0.0.0.0", "") else host
        self.address = f"{advertise}:{self.port}" + (f"/{slot}" if slot else "")
        """Where this rank is reached (directly, by the ranks of its own server)."""
        self.endpoint = self.address if reachable else (PUNCH_PREFIX if self.punch else LANE_PREFIX) + self.address
        """What other ranks send to."""
        self._conns: set[socket.socket] = set()
        threading.Thread(target=self._accept if slot == 0 else self._accept_handed, name="transport-accept",
                         daemon=True).start()

    # --------------------------------------------------------------------------------- receiving
    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="transport-conn", daemon=True).start()

    def _accept_handed(self) -> None:
        """A rank that shares its server's port: take the connections the port's owner hands over."""
        while not self._closed.is_set():
            try:
                owner, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._take_handed, args=(owner,), name="transport-handed", daemon=True).start()

    def _take_handed(self, owner: socket.socket) -> None:
        with owner:
            while not self._closed.is_set():
                try:
                    msg, fds, _, _ = socket.recv_fds(owner, 1, 4)
                except OSError:
                    return
                if not msg:
                    return
                for fd in fds:
                    threading.Thread(target=self._serve, args=(socket.socket(fileno=fd), True),
                                     name="transport-conn", daemon=True).start()

    def _hand_over(self, conn: socket.socket, slot: int) -> None:
        """Pass a connection for the rank of ``slot`` to its process (it does the handshake)."""
        with self._handoff_lock:
            for _ in range(2):  # a link to a rank that restarted fails once
                link = self._handoff.get(slot)
                try:
                    if link is None:
                        link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        link.connect(_slot_address(self.host, self.port, slot))
                        self._handoff[slot] = link
                    socket.send_fds(link, [b"c"], [conn.fileno()])
                    return
                except OSError as e:
                    log.debug("could not hand a connection to the rank of slot %d: %s", slot, e)
                    if link is not None:
                        link.close()
                    self._handoff.pop(slot, None)

    def _serve(self, conn: socket.socket, handed: bool = False) -> None:
        self._conns.add(conn)
        kept = False
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not handed:
                conn.settimeout(HANDSHAKE_TIMEOUT)
                head = bytearray(SLOT.size)
                recv_exact(conn, memoryview(head))
                (slot,) = SLOT.unpack(head)
                if slot != self.slot:
                    self._hand_over(conn, slot)
                    return
            try:
                link = greet(conn, self.key, self.encrypt, self.peer_id)
            except Refused as e:
                log.warning("%s", e)
                return
            if link.role == LANE:
                kept = self._keep_lane_in(link)
                return
            if link.endpoint:
                self.callers[link.peer] = link.endpoint
            self._read_frames(link)
        except OSError as e:
            if not self._closed.is_set():
                log.debug("transport connection ended: %s", e)
        finally:
            self._conns.discard(conn)
            if not kept:
                conn.close()

    def _read_frames(self, link: Link) -> None:
        """Read, acknowledge and deliver the frames of one connection until it ends."""
        seen = link.sock.getpeername()[0]  # where its frames come from, as this end sees it (a relay tells its own)
        while not self._closed.is_set():
            try:
                key, meta, payload = link.read_frame(self.max_message)
            except Tampered as e:
                self.stats.tampered += 1
                log.warning("dropped a message from %s: %s (its sender sends it again)", link.peer, e)
                return
            except Malformed as e:
                log.warning("refused a malformed message from %s: %s", link.peer, e)
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
            if "_from" not in extra:
                extra["_seen"] = seen
            relayed = "_relay" in extra
            if relayed and not self._pass_on(key, payload, extra, link):
                return  # not acknowledged: the sender tries again
            link.write_ack()
            if relayed:
                continue
            sender = str(extra.pop("_from", link.peer))
            self.stats.received += len(payload)
            handler = self._handler(key)
            if handler is not None and handler(key, sender, payload, extra):
                continue
            self.box.put(key, sender, payload, extra.get("group", ()))

    def _pass_on(self, key: str, payload: memoryview, extra: dict, link: Link) -> bool:
        """A message between two ranks that cannot be reached: send it on over the receiver's lane, with where it
        came from (its sender, and the address it came from, ``_seen``: the sender's NAT's, for a punch)."""
        target = str(extra.pop("_relay"))
        within = float(extra.pop("_within", 30.0))
        try:
            self.send(target, key, payload, time.monotonic() + max(0.05, within), {**extra, "_from": link.peer})
        except TransportError as e:
            log.info("could not pass %s on to %s: %s", key, target, e)
            return False
        self.stats.relayed += 1
        return True

    def _handler(self, key: str) -> Callable[[str, str, bytearray, dict], bool] | None:
        best = max((p for p in self.handlers if key.startswith(p)), key=len, default=None)
        return self.handlers.get(best) if best is not None else None

    # ------------------------------------------------------------------------------------- lanes
    def _keep_lane_in(self, link: Link) -> bool:
        """A rank that cannot be reached opened a lane: keep it for the next send to its endpoint."""
        if not behind_nat(link.endpoint):
            log.warning("refused a lane from %s: it announces no lane endpoint", link.peer)
            return False
        link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        with self._lane_arrived:
            waiting = self._lanes_in.setdefault(link.endpoint, [])
            waiting.append(link)
            # a lane opened again after it broke: the oldest waiting one is the broken one
            stale = waiting[:-self.streams]
            del waiting[:-self.streams]
            self._lane_arrived.notify_all()
        for old in stale:
            old.sock.close()
        return True

    def _wait_lane(self, endpoint: str, deadline: float) -> Link:
        with self._lane_arrived:
            while not self._lanes_in.get(endpoint):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed.is_set():
                    raise ConnectionError(f"{endpoint} opened no lane to this rank in time (it cannot be reached)")
                self._lane_arrived.wait(min(left, 0.5))
            return self._lanes_in[endpoint].pop(0)

    def reach(self, endpoints: list[str]) -> None:
        """This rank is about to deal with the ranks at ``endpoints``: when it cannot be reached, open (or keep)
        a lane to each reachable one, so that they can send to it."""
        if self.reachable:
            return
        now = time.monotonic()
        for endpoint in endpoints:
            if behind_nat(endpoint) or endpoint == self.endpoint:
                continue
            with self._peers_lock:
                fresh = endpoint not in self._lanes_out
                self._lanes_out[endpoint] = now
            if fresh:  # as many lanes as the reachable rank's connections to a rank: it sends on all at once
                for lane in range(self.streams):
                    threading.Thread(target=self._hold_lane, args=(endpoint, lane), name="transport-lane",
                                     daemon=True).start()

    def _hold_lane(self, endpoint: str, lane: int) -> None:
        """Keep lane number ``lane`` open to ``endpoint`` (again after it breaks) while this rank deals with it."""
        wait = 0.1
        while not self._closed.is_set():
            with self._peers_lock:
                if time.monotonic() - self._lanes_out.get(endpoint, 0.0) > LANE_IDLE:
                    self._lanes_out.pop(endpoint, None)
                    return
            try:
                link = self._dial(endpoint, time.monotonic() + HANDSHAKE_TIMEOUT, LANE)
            except Refused as e:
                log.warning("could not open a lane to %s: %s", endpoint, e)
                with self._peers_lock:
                    self._lanes_out.pop(endpoint, None)
                return
            except OSError as e:
                log.debug("could not open a lane to %s yet: %s", endpoint, e)
                self._closed.wait(wait)
                wait = min(2.0, wait * 2)
                continue
            wait = 0.1
            link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            if hasattr(socket, "TCP_KEEPIDLE"):
                link.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE)
            with self._peers_lock:
                self._lane_links[endpoint, lane] = link
            self.callers[link.peer] = endpoint  # what comes over the lane is answered where the lane goes
            try:
                self._read_frames(link)
            except OSError as e:
                log.debug("the lane to %s ended: %s", endpoint, e)
            finally:
                with self._peers_lock:
                    self._lane_links.pop((endpoint, lane), None)
                link.sock.close()

    def _relay_for(self, deadline: float) -> str:
        """A reachable rank this rank holds a lane to, to pass a message to a rank that cannot be reached."""
        while True:
            with self._peers_lock:
                live = sorted({endpoint for endpoint, _ in self._lane_links})
            if live:
                return live[0]
            if time.monotonic() >= deadline or self._closed.is_set():
                raise ConnectionError("neither this rank nor its receiver can be reached, and no reachable rank "
                                      "holds a lane to pass the message on")
            time.sleep(0.05)

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
        return endpoint if punch and self._unpunched.get(endpoint, 0.0) <= time.monotonic() else ""

    def send(self, endpoint: str, key: str, payload: Buffer, deadline: float, extra: dict | None = None) -> None:
        """Deliver one message to the rank at ``endpoint`` (acknowledged), sending it again on a new connection
        if its connection fails, until ``deadline`` (``time.monotonic``); raises TransportError then."""
        if self._route(endpoint, key) == endpoint:
            self.reach([endpoint])
        attempt = refused = 0
        while True:
            route = self._route(endpoint, key)  # a failed punch sends through a reachable rank from then on
            hop, hop_extra = route, extra
            try:
                if not hop:
                    hop = self._relay_for(deadline)
                    hop_extra = {**(extra or {}), "_relay": endpoint, "_within": deadline - time.monotonic()}
                meta = json.dumps(hop_extra).encode() if hop_extra else b""
                peer = self._take(hop)
                try:
                    link = peer.link or self._dial(hop, deadline, FRAMES)
                    peer.link = link
                    link.sock.settimeout(max(0.05, deadline - time.monotonic()))
                    link.tamper = self.tamper
                    link.write_frame(key, meta, payload, cut=self.fault is not None and self.fault(key))
                    link.read_ack()
                except OSError:
                    # dropped before the lock is let go: a message queued behind this one on the same
                    # connection opens a new one instead of failing on the dead one (and moving twice)
                    if peer.link is not None:
                        peer.link.sock.close()
                        peer.link = None
                    raise
                finally:
                    peer.lock.release()
                self.stats.sent += memoryview(payload).nbytes
                return
            except Refused as e:
                raise RefusedError(f"{endpoint}: {e}") from None
            except PunchFailed as e:
                failures = self._punch_failures[endpoint] = self._punch_failures.get(endpoint, 0) + 1
                wait = PUNCH_AGAIN * 2 ** (failures - 1)
                self._unpunched[endpoint] = time.monotonic() + wait
                log.warning("%s: passing the messages for it on through a reachable island, and averaging through "
                            "the reachable islands from the next round; trying again in %.0f s "
                            "(--averaging.hole_punch false on the islands behind such a NAT saves this first "
                            "wait and the tries again)", e, wait)
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
                self.stats.resent_bytes += memoryview(payload).nbytes
                log.info("sending %s to %s again (attempt %d): %s", key, endpoint, attempt + 1, e)
                time.sleep(min(0.2 * attempt, max(0.0, deadline - time.monotonic())))

    def _take(self, endpoint: str) -> _Peer:
        """One of this rank's connections to ``endpoint``, its lock held: a free one (``streams`` at most, lanes
        included), else the next in turn once it is free.  A message waits for its acknowledgement on its
        connection, so several in flight to one rank need several connections; over a long round trip they
        also fill more of the link than one TCP window does."""
        n = self.streams
        with self._peers_lock:
            pool = self._peers.setdefault(endpoint, [_Peer(endpoint) for _ in range(n)])
            self._turn += 1
            turn = self._turn
        for peer in pool:
            if peer.lock.acquire(blocking=False):
                return peer
        peer = pool[turn % n]
        peer.lock.acquire()
        return peer

    def _dial(self, endpoint: str, deadline: float, role: int) -> Link:
        """A new connection to ``endpoint`` after its handshake (a rank behind NAT: the next lane it opens, or,
        from behind NAT, a punched connection)."""
        if behind_nat(endpoint):
            if self.reachable:
                return self._wait_lane(endpoint, deadline)
            sock = self._punch(endpoint, deadline)
        else:
            sock = socket.create_connection(parse_endpoint(endpoint), timeout=max(0.05, min(
                HANDSHAKE_TIMEOUT, deadline - time.monotonic())))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(SLOT.pack(slot_of(endpoint)))
            return call(sock, self.key, self.encrypt, self.peer_id, self.endpoint, role)
        except BaseException:
            sock.close()
            raise

    # ------------------------------------------------------------------------------ hole punching
    def punch_failed(self) -> bool:
        """Whether messages from this rank go through a relay after a failed punch (for :data:`PUNCH_AGAIN` seconds,
        doubled at each failure to the same rank): its island then has its groups average through the reachable
        islands (:func:`peers.wire.encoded.part_owners`)."""
        now = time.monotonic()
        return any(until > now for until in list(self._unpunched.values()))

    def _punch(self, endpoint: str, deadline: float) -> socket.socket:
        """A connection to the rank behind NAT at ``endpoint``, opened by both ends at once (see the module's
        docstring).  PunchFailed when the receiver dialed back but nothing got through; ConnectionError when
        the request to dial back could not be delivered."""
        host, port = parse_endpoint(endpoint)
        now = time.monotonic()
        until = min(deadline, now + PUNCH_WAIT)
        cut_short = deadline < now + PUNCH_WAIT  # by the message's deadline: then no verdict on the NATs
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, 0))
            sock.setblocking(False)
            sock.connect_ex((host, port))  # our SYN: from now on our NAT lets in what comes from that port
            try:
                self.send(endpoint, PUNCH_KEY, b"", until, {"port": sock.getsockname()[1]})
            except TransportError as e:
                raise ConnectionError(f"could not ask {endpoint} to dial back: {e}") from None
            opened = select.select([], [sock], [], max(0.0, until - time.monotonic()))[1]
            error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) if opened else errno.ETIMEDOUT
            if error == errno.ETIMEDOUT and cut_short:
                raise ConnectionError(f"the connection to {endpoint} did not open before the message's deadline")
            if error:
                raise PunchFailed(f"could not open a connection to {endpoint} through both NATs "
                                  f"({os.strerror(error)}): one of them gives each destination its own port, or "
                                  "a firewall drops the connections")
            sock.setblocking(True)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # keeps both NATs' mappings
            if hasattr(socket, "TCP_KEEPIDLE"):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE)
            return sock
        except BaseException:
            sock.close()
            raise

    def _asked_to_punch(self, key: str, sender: str, payload: bytearray, extra: dict) -> bool:
        """A rank behind NAT is opening a connection to this one: dial back to its port from this server's."""
        seen, port = extra.get("_seen"), extra.get("port")
        if self.punch and isinstance(seen, str) and isinstance(port, int) and 0 < port < 65536:
            threading.Thread(target=self._dial_back, args=(seen, port), name="transport-punch", daemon=True).start()
        return True

    def _dial_back(self, host: str, port: int) -> None:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((self.host, self.port))
            sock.settimeout(PUNCH_WAIT)
            sock.connect((host, port))
        except OSError as e:  # the caller's SYN may have come in on the listener instead: then all is well
            log.debug("dialing back to %s:%d for a punch: %s", host, port, e)
            sock.close()
            return
        self._serve(sock)

    def _links(self) -> list[Link]:
        """Every connection this rank made or holds a lane on (the caller holds ``_peers_lock``)."""
        made = [p.link for pool in self._peers.values() for p in pool if p.link is not None]
        return made + list(self._lane_links.values()) + [link for links in self._lanes_in.values() for link in links]

    def socket_inodes(self) -> set[int]:
        """Inodes of this transport's live connections (what :class:`peers.wire.counters.WireCounter` counts)."""
        socks = list(self._conns)
        with self._peers_lock:
            socks += [link.sock for link in self._links()]
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
        try:  # a close alone leaves the socket listening while the accept thread still blocks in accept()
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._server.close()
        except OSError:
            pass
        for conn in list(self._conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._handoff_lock:
            for link in self._handoff.values():
                link.close()
            self._handoff.clear()
        with self._peers_lock:
            links = self._links()
            for pool in self._peers.values():
                for peer in pool:
                    peer.link = None
            self._lanes_in.clear()
            self._lane_arrived.notify_all()
        for link in links:
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            link.sock.close()


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
           "refuses", "tensor_bytes"]
