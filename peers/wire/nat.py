"""The ways to reach a rank that cannot be reached: lanes it opens, a reachable rank that passes messages on,
and connections punched through two NATs.

**Lanes** (:class:`Lanes`).  Ranks that cannot be reached (an island behind a NAT or a firewall:
``reachable=False``) announce ``lane:HOST:PORT`` instead of ``HOST:PORT``.  They open every connection
themselves: to send, as anyone; to receive, ``streams`` *lanes* to each reachable rank they deal with
(:meth:`Lanes.reach`, and every rank they send to), on which that rank sends its frames back: as many connections
as it has to a reachable rank, since a connection carries one message at a time (each waits for its
acknowledgement), and with one lane the averaged parts for islands behind NAT queued.  A reachable rank sending to
a ``lane:`` endpoint waits for a lane.  Ranks of one server reach each other directly whatever they announce.  A
reachable rank ends a lane that waited :data:`~peers.wire.links.IDLE` seconds untaken; the rank behind NAT opens
it again while it still deals with that rank (:data:`LANE_IDLE`).

**Hole punching** (:class:`Puncher`).  Two ranks that both cannot be reached connect to each other through their
NATs when both dial at once (a TCP simultaneous open): the sender binds a fresh port and sends a SYN from it to the
receiver's announced port, which its own NAT then lets answers in from; it asks the receiver, through a reachable
rank it holds a lane to, to dial back; the receiver sends its SYN from its announced port (its server's port,
shared with ``SO_REUSEPORT``) to the sender's port at the address the reachable rank saw the request come from,
which its NAT then lets answers in from; the two SYNs cross and the connection opens (a reachable rank and a round
trip to it, then one between the two).  It then carries the sender's messages as any connection does.  This takes
a NAT that keeps a connection's port whatever its destination (most do; RFC 4787's endpoint-independent mapping);
such ranks announce ``punch:HOST:PORT``.

**Relay** (:class:`Relay`).  Where a punch fails (a NAT that gives each destination its own port) or a rank
announces a plain ``lane:`` (``punch=False``), the sender hands its message to a reachable rank it holds a lane to,
which passes it on over the receiver's lane before acknowledging it.  The receiver's connection is the relay's, so
the message carries its origin's proof: the origin's public key and its signature over the message's key, its
extra, its payload's digest, the receiver's endpoint, a nonce and an expiry.  The receiver attributes the
message to the origin only when the key hashes to the origin's peer id and the signature holds, and takes each
nonce once: a relay can drop a message, but not forge, change, redirect or replay one.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from peers.discovery.membership import behind_nat
from peers.identity import Identity, proves
from peers.wire.links import IDLE
from peers.wire.secure import HANDSHAKE_TIMEOUT, LANE, Link, Refused

log = logging.getLogger(__name__)

LANE_IDLE = 600.0
"""Seconds a lane to a rank stays open after this rank last dealt with it."""
KEEPALIVE = 20
"""Seconds of silence before the kernel probes a lane, so that a NAT keeps its mapping."""
PUNCH_KEY = "_punch"
"""The key of a request to dial back for hole punching (see the module's docstring)."""
PUNCH_WAIT = 5.0
"""Seconds a punched connection may take to open before its messages go through a reachable rank."""
PUNCH_AGAIN = 600.0
"""Seconds after a first failed punch during which messages to that rank go through a reachable rank; each
further failure to the same rank doubles them (a NAT that failed a punch most likely always will)."""
CLOCK_SKEW = 60.0
"""Seconds a relayed message's expiry may be off between its origin's clock and its receiver's."""
MAX_WITHIN = 3600.0
"""Seconds ahead at most that a relayed message may expire (its nonce is remembered until then)."""
MAX_NONCES = 1 << 16
"""Nonces of relayed messages a rank remembers at most (the oldest-expiring go first)."""


class PunchFailed(ConnectionError):
    """The receiver asked to dial back did, but the connection did not open through the two NATs."""


def keepalive(sock: socket.socket) -> None:
    """Have the kernel probe ``sock`` after :data:`KEEPALIVE` seconds of silence, so that NATs keep its mapping."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE)


class Lanes:
    """The lanes of one rank: those it holds open to reachable ranks while it cannot be reached (``endpoint``:
    what it announces), and those ranks that cannot be reached opened to it.  ``dial(endpoint, deadline, role)``
    opens a connection after its handshake; ``read(link)`` reads what comes over a lane until it ends;
    ``streams``: lanes to each reachable rank; ``callers``: where to note, by peer id, the endpoint of each
    reachable rank a lane goes to (where to answer what comes over it)."""

    def __init__(self, endpoint: str, streams: int, dial: Callable[[str, float, int], Link],
                 read: Callable[[Link], None], callers: dict[str, str], closed: threading.Event):
        self.endpoint, self.streams, self.dial, self.read, self.closed = endpoint, streams, dial, read, closed
        self.callers = callers
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._in: dict[str, list[tuple[Link, float]]] = {}
        """Lanes opened to this rank by ranks that cannot be reached, by their endpoint, with when each came,
        until a send takes one."""
        self._out: dict[str, float] = {}
        """Reachable endpoints this rank keeps a lane to, and when it last dealt with each."""
        self._held: dict[tuple[str, int], Link] = {}

    # ---------------------------------------------------------- lanes to this rank (it is reachable)
    def keep(self, link: Link) -> bool:
        """A rank that cannot be reached opened a lane: keep it for the next send to its endpoint (its
        ``streams`` newest ones, and twice that at most from one peer id whatever endpoints it names).  Lanes that
        waited untaken for :data:`~peers.wire.links.IDLE` seconds end."""
        if not behind_nat(link.endpoint):
            log.warning("refused a lane from %s: it announces no lane endpoint", link.peer)
            return False
        link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        now = time.monotonic()
        with self._arrived:
            waiting = self._in.setdefault(link.endpoint, [])
            waiting.append((link, now))
            # a lane opened again after it broke: the oldest waiting one is the broken one
            stale = [lane for lane, _ in waiting[:-self.streams]]
            del waiting[:-self.streams]
            theirs = sorted((since, id(lane)) for lanes in self._in.values() for lane, since in lanes
                            if lane.peer == link.peer)
            too_many = {key for _, key in theirs[:max(0, len(theirs) - 2 * self.streams)]}
            for endpoint, lanes in list(self._in.items()):
                ended = {id(lane) for lane, since in lanes if now - since > IDLE or id(lane) in too_many}
                stale += [lane for lane, _ in lanes if id(lane) in ended]
                lanes[:] = [(lane, since) for lane, since in lanes if id(lane) not in ended]
                if not lanes:
                    del self._in[endpoint]
            self._arrived.notify_all()
        for old in stale:
            old.sock.close()
        return True

    def take(self, endpoint: str, deadline: float) -> Link:
        """The next lane the rank at ``endpoint`` opened to this one, waiting for one until ``deadline``."""
        with self._arrived:
            while not self._in.get(endpoint):
                left = deadline - time.monotonic()
                if left <= 0 or self.closed.is_set():
                    raise ConnectionError(f"{endpoint} opened no lane to this rank in time (it cannot be reached)")
                self._arrived.wait(min(left, 0.5))
            return self._in[endpoint].pop(0)[0]

    # ------------------------------------------------------- lanes from this rank (it cannot be reached)
    def reach(self, endpoints: list[str]) -> None:
        """This rank is about to deal with the ranks at ``endpoints``: open (or keep) a lane to each reachable
        one, so that they can send to it."""
        now = time.monotonic()
        for endpoint in endpoints:
            if behind_nat(endpoint) or endpoint == self.endpoint:
                continue
            with self._lock:
                fresh = endpoint not in self._out
                self._out[endpoint] = now
            if fresh:  # as many lanes as the reachable rank's connections to a rank: it sends on all at once
                for lane in range(self.streams):
                    threading.Thread(target=self._hold, args=(endpoint, lane), name="transport-lane",
                                     daemon=True).start()

    def _hold(self, endpoint: str, lane: int) -> None:
        """Keep lane number ``lane`` open to ``endpoint`` (again after it breaks) while this rank deals with it."""
        wait = 0.1
        while not self.closed.is_set():
            with self._lock:
                if time.monotonic() - self._out.get(endpoint, 0.0) > LANE_IDLE:
                    self._out.pop(endpoint, None)
                    return
            try:
                link = self.dial(endpoint, time.monotonic() + HANDSHAKE_TIMEOUT, LANE)
            except Refused as e:
                log.warning("could not open a lane to %s: %s", endpoint, e)
                with self._lock:
                    self._out.pop(endpoint, None)
                return
            except OSError as e:
                log.debug("could not open a lane to %s yet: %s", endpoint, e)
                self.closed.wait(wait)
                wait = min(2.0, wait * 2)
                continue
            wait = 0.1
            keepalive(link.sock)
            with self._lock:
                self._held[endpoint, lane] = link
            self.callers[link.peer] = endpoint  # what comes over the lane is answered where the lane goes
            try:
                self.read(link)
            except OSError as e:
                log.debug("the lane to %s ended: %s", endpoint, e)
            finally:
                with self._lock:
                    self._held.pop((endpoint, lane), None)
                link.sock.close()

    def relay_for(self, deadline: float) -> str:
        """A reachable rank this rank holds a lane to, to pass a message to a rank that cannot be reached."""
        while True:
            with self._lock:
                live = sorted({endpoint for endpoint, _ in self._held})
            if live:
                return live[0]
            if time.monotonic() >= deadline or self.closed.is_set():
                raise ConnectionError("neither this rank nor its receiver can be reached, and no reachable rank "
                                      "holds a lane to pass the message on")
            time.sleep(0.05)

    # --------------------------------------------------------------------------------- state
    def links(self) -> list[Link]:
        """Every lane this rank holds open, to it or from it."""
        with self._lock:
            return list(self._held.values()) + [lane for lanes in self._in.values() for lane, _ in lanes]

    def close(self) -> None:
        """End every lane (the rank is closing: ``closed`` is set)."""
        with self._arrived:
            links = list(self._held.values()) + [lane for lanes in self._in.values() for lane, _ in lanes]
            self._in.clear()
            self._arrived.notify_all()
        for link in links:
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            link.sock.close()


def _canonical(extra: dict) -> bytes:
    return json.dumps(extra, sort_keys=True, separators=(",", ":")).encode()


def _digest(key: str, extra: dict, payload: Any, to: str, nonce: bytes, expires: float) -> bytes:
    """What a relayed message's origin signs: everything the receiver takes from the message."""
    h = hashlib.sha256(b"diloco relayed message v1\0")
    for part in (key.encode(), _canonical(extra), hashlib.sha256(memoryview(payload).cast("B")).digest(),
                 to.encode(), nonce):
        h.update(struct.pack(">I", len(part)) + part)
    h.update(struct.pack(">d", expires))
    return h.digest()


class Relay:
    """Proofs of origin for messages a reachable rank passes on (see the module's docstring): this rank signs
    those it sends through a relay with ``identity``, and checks those passed on to it, each nonce once."""

    def __init__(self, identity: Identity):
        self.identity = identity
        self._public = base64.b64encode(identity.public).decode()
        self._nonces: dict[bytes, float] = {}
        self._lock = threading.Lock()

    def prove(self, key: str, extra: dict, payload: Any, to: str, within: float) -> dict:
        """The proof that this rank sends ``payload`` under ``key`` with ``extra`` to the rank at endpoint ``to``,
        valid for ``within`` seconds."""
        nonce, expires = secrets.token_bytes(16), time.time() + max(0.0, within)
        signature = self.identity.sign(_digest(key, extra, payload, to, nonce, expires))
        return {"from": self.identity.peer_id, "key": self._public, "sig": base64.b64encode(signature).decode(),
                "nonce": nonce.hex(), "expires": expires}

    def origin(self, proof: Any, key: str, extra: dict, payload: Any, me: str) -> str | None:
        """The peer id that sent a message passed on to this rank (endpoint ``me``), or None when ``proof`` does
        not prove one: malformed, for another receiver, expired, seen before, or not signed by its origin."""
        try:
            origin, nonce, expires = str(proof["from"]), bytes.fromhex(proof["nonce"]), float(proof["expires"])
            public, signature = base64.b64decode(proof["key"]), base64.b64decode(proof["sig"])
        except (TypeError, KeyError, ValueError):
            return None
        now = time.time()
        if not now - CLOCK_SKEW <= expires <= now + MAX_WITHIN + CLOCK_SKEW:
            return None
        if not proves(public, origin, _digest(key, extra, payload, me, nonce, expires), signature):
            return None
        with self._lock:
            if nonce in self._nonces:
                return None
            for old in [n for n, until in self._nonces.items() if until < now]:
                del self._nonces[old]
            while len(self._nonces) >= MAX_NONCES:
                del self._nonces[min(self._nonces, key=self._nonces.__getitem__)]
            self._nonces[nonce] = expires + CLOCK_SKEW
        return origin


class Puncher:
    """Hole punching for a rank that cannot be reached (see the module's docstring): ``host``/``port``: where it
    listens (its server's port, which it dials back from); ``ask(endpoint, deadline, port)``: deliver the request
    to dial back to ``port``; ``take(sock)``: serve a connection this rank dialed back, as if it had accepted it."""

    def __init__(self, host: str, port: int, ask: Callable[[str, float, int], None],
                 take: Callable[[socket.socket], None]):
        self.host, self.port, self.ask, self.take = host, port, ask, take
        self._unpunched: dict[str, float] = {}
        """Ranks behind NAT a punch failed to, and until when messages to them go through a reachable rank."""
        self._failures: dict[str, int] = {}
        """Ranks behind NAT a punch failed to, and how many times (each failure doubles the wait)."""

    def may_punch(self, endpoint: str) -> bool:
        """Whether messages to ``endpoint`` try a punched connection (none failed to it lately)."""
        return self._unpunched.get(endpoint, 0.0) <= time.monotonic()

    def failed(self, endpoint: str, e: PunchFailed) -> None:
        """A punch to ``endpoint`` failed: its messages go through a reachable rank for a while."""
        failures = self._failures[endpoint] = self._failures.get(endpoint, 0) + 1
        wait = PUNCH_AGAIN * 2 ** (failures - 1)
        self._unpunched[endpoint] = time.monotonic() + wait
        log.warning("%s: passing the messages for it on through a reachable island, and averaging through "
                    "the reachable islands from the next round; trying again in %.0f s "
                    "(--averaging.hole_punch false on the islands behind such a NAT saves this first "
                    "wait and the tries again)", e, wait)

    def any_failed(self) -> bool:
        """Whether messages from this rank go through a relay after a failed punch."""
        now = time.monotonic()
        return any(until > now for until in list(self._unpunched.values()))

    def punch(self, host: str, port: int, endpoint: str, deadline: float) -> socket.socket:
        """A connection to the rank behind NAT at ``endpoint`` (announced at ``host:port``), opened by both ends at
        once.  PunchFailed when the receiver dialed back but nothing got through; ConnectionError when the request
        to dial back could not be delivered."""
        now = time.monotonic()
        until = min(deadline, now + PUNCH_WAIT)
        cut_short = deadline < now + PUNCH_WAIT  # by the message's deadline: then no verdict on the NATs
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, 0))
            sock.setblocking(False)
            sock.connect_ex((host, port))  # our SYN: from now on our NAT lets in what comes from that port
            self.ask(endpoint, until, sock.getsockname()[1])
            opened = select.select([], [sock], [], max(0.0, until - time.monotonic()))[1]
            error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) if opened else errno.ETIMEDOUT
            if error == errno.ETIMEDOUT and cut_short:
                raise ConnectionError(f"the connection to {endpoint} did not open before the message's deadline")
            if error:
                raise PunchFailed(f"could not open a connection to {endpoint} through both NATs "
                                  f"({os.strerror(error)}): one of them gives each destination its own port, or "
                                  "a firewall drops the connections")
            sock.setblocking(True)
            keepalive(sock)  # keeps both NATs' mappings
            return sock
        except BaseException:
            sock.close()
            raise

    def asked(self, key: str, sender: str, payload: bytearray, extra: dict) -> bool:
        """A rank behind NAT is opening a connection to this one: dial back to its port (at the address its
        request came from, ``_seen``) from this server's port."""
        seen, port = extra.get("_seen"), extra.get("port")
        if isinstance(seen, str) and isinstance(port, int) and 0 < port < 65536:
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
        self.take(sock)


__all__ = ["Lanes", "Relay", "Puncher", "PunchFailed", "LANE_IDLE", "PUNCH_KEY", "keepalive"]
