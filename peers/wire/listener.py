"""Where a rank's transport takes connections: its server's one port, shared by the server's ranks, and the
bound on connections that have not proven anything yet.

**One port per server.**  The ranks of a server share the port of their rank 0 (``slot`` 0): rank ``r``
announces ``HOST:PORT/r``, a connection names the rank it is for in its first two bytes, and rank 0 hands
it to rank ``r``'s process over a Unix socket (the file descriptor itself, ``SCM_RIGHTS``), which does the
handshake and reads it: the bytes never pass through rank 0, and every rank still sends its own parts on
its own connections, so a server fills its link with several TCP streams.

**Connections nobody vouches for yet.**  Anyone on the internet can open a connection to the port.  Until its
handshake (:func:`peers.wire.secure.greet`) proves the run key and a peer id, a connection is held to one
deadline for the whole exchange (:data:`~peers.wire.secure.HANDSHAKE_TIMEOUT`: bytes trickled in slowly do not
keep it open), and at most :data:`HANDSHAKES` are in their handshake (or, on the port's owner, in their first
two bytes) at once.  One more evicts the oldest handshake of the address that holds the most of them, unless
that address is its own: then it is closed as it comes, with no thread started for it.  So a stranger that holds
every slot with slow handshakes from one address (a slowloris) evicts only its own, and a member from another
address still gets through at once; a sender whose connection ends tries again, as after any failure.  A stranger
with many addresses can still take turns with the members; that is the bound, not a cure.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable

from peers.wire.secure import HANDSHAKE_TIMEOUT, Link, recv_exact

log = logging.getLogger(__name__)

SLOT = struct.Struct(">H")
"""What a connection names first: the rank of the server behind the port it is for."""
HANDSHAKES = 16
"""Connections of one rank in their handshake at once (see the module's docstring for one more)."""


def slot_address(host: str, port: int, slot: int) -> str:
    """The Unix socket (abstract: nothing on disk) where the rank of ``slot`` takes connections handed over
    by the rank that owns ``host:port``."""
    return f"\0diloco-transport-{host}-{port}-{slot}"


def listen(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket listening on ``host:port`` (0: a free port); ``reuse_port``: one that lets others bind the port
    too (SO_REUSEPORT).

    Such a socket would also share a port that another listener holds, if that one allows sharing, as hivemind's
    libp2p daemon does with the DHT's port: the kernel would then deal each new connection to one of them at
    random.  So a port asked for by number is first taken without sharing, which fails (EADDRINUSE) while any
    other socket listens there."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if reuse_port and port:
        socket.create_server((host, port), family=family).close()
    return socket.create_server((host, port), reuse_port=reuse_port, backlog=64, family=family)


class Listener:
    """Takes this rank's connections: on ``host:port`` (0: any free port) when ``slot`` is 0, else handed over by
    the rank that owns ``port`` on this server.  Each gets its handshake from ``greet(sock, deadline)`` (a
    :class:`~peers.wire.secure.Link`, or None when refused), then goes to ``serve(link)`` in its own thread, which
    returns whether it keeps the connection open past its return (a lane, held for later sends).
    ``reuse_port``: others may bind the port too (hole punching dials out from it); the port must still be free
    when the listener takes it (:func:`listen`)."""

    def __init__(self, host: str, port: int, slot: int, greet: Callable[[socket.socket, float], Link | None],
                 serve: Callable[[Link], bool], reuse_port: bool = False):
        self.host, self.slot, self.greet, self.serve = host, slot, greet, serve
        self._pending: dict[socket.socket, tuple[str, float]] = {}
        """Connections in their handshake: their address and when they came (see the module's docstring)."""
        self._pending_lock = threading.Lock()
        self.turned_away = 0
        """Connections closed as they came because :data:`HANDSHAKES` others were in their handshake, the most of
        them from the same address."""
        self.evicted = 0
        """Handshakes ended to make room for a connection from another address."""
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._handoff: dict[int, socket.socket] = {}
        self._handoff_lock = threading.Lock()
        if slot == 0:
            self.server = listen(host, port, reuse_port)
            self.port = self.server.getsockname()[1]
        else:
            if not port:
                raise ValueError("a transport that shares a port needs the port of the rank that owns it")
            self.port = port
            self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.server.bind(slot_address(host, port, slot))
            self.server.listen(16)

    def start(self) -> None:
        """Start taking connections (once whatever ``greet`` and ``serve`` need is ready)."""
        threading.Thread(target=self._accept if self.slot == 0 else self._accept_handed, name="transport-accept",
                         daemon=True).start()

    # ------------------------------------------------------------------------------- taking
    def adopt(self, conn: socket.socket, named: bool = False) -> None:
        """Take ``conn`` as a connection to this rank (``named``: its first two bytes, the slot, still to read),
        in a thread of its own, making room among the connections in their handshake as the module's docstring
        says, or close it."""
        if self._closed.is_set() or not self._admit(conn):
            conn.close()
            return
        threading.Thread(target=self._take, args=(conn, named), name="transport-conn", daemon=True).start()

    def _admit(self, conn: socket.socket) -> bool:
        """Count ``conn`` among the connections in their handshake, evicting one if they are :data:`HANDSHAKES`;
        False where ``conn``'s own address holds the most of them."""
        try:
            address = conn.getpeername()[0]
        except (OSError, IndexError, TypeError):
            address = ""
        evict = None
        with self._pending_lock:
            if len(self._pending) >= HANDSHAKES:
                held = Counter(a for a, _ in self._pending.values())
                most = max(held.values())
                if held[address] >= most:
                    self.turned_away += 1
                    log.debug("closed a transport connection: %d others are in their handshake, %d of them from "
                              "its address", HANDSHAKES, held[address])
                    return False
                evict = min((c for c, (a, _) in self._pending.items() if held[a] == most),
                            key=lambda c: self._pending[c][1])
                evicted_from = self._pending.pop(evict)[0]
                self.evicted += 1
            self._pending[conn] = (address, time.monotonic())
        if evict is not None:
            log.debug("ended a handshake from %s to make room for a connection from another address", evicted_from)
            try:
                evict.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return True

    def _done(self, conn: socket.socket) -> bool:
        """``conn`` leaves its handshake; False where it was evicted meanwhile (its socket is shut)."""
        with self._pending_lock:
            return self._pending.pop(conn, None) is not None

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.adopt(conn, named=True)

    def _accept_handed(self) -> None:
        """A rank that shares its server's port: take the connections the port's owner hands over."""
        while not self._closed.is_set():
            try:
                owner, _ = self.server.accept()
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
                    self.adopt(socket.socket(fileno=fd))

    def _hand_over(self, conn: socket.socket, slot: int) -> None:
        """Pass a connection for the rank of ``slot`` to its process (it does the handshake)."""
        with self._handoff_lock:
            for _ in range(2):  # a link to a rank that restarted fails once
                link = self._handoff.get(slot)
                try:
                    if link is None:
                        link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        link.connect(slot_address(self.host, self.port, slot))
                        self._handoff[slot] = link
                    socket.send_fds(link, [b"c"], [conn.fileno()])
                    return
                except OSError as e:
                    log.debug("could not hand a connection to the rank of slot %d: %s", slot, e)
                    if link is not None:
                        link.close()
                    self._handoff.pop(slot, None)

    def _take(self, conn: socket.socket, named: bool) -> None:
        """One connection: its slot and handshake (the handshake slot held), then whatever ``serve`` makes of it."""
        self._conns.add(conn)
        kept = False
        try:
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                deadline = time.monotonic() + HANDSHAKE_TIMEOUT
                if named:
                    head = bytearray(SLOT.size)
                    recv_exact(conn, memoryview(head), deadline)
                    (slot,) = SLOT.unpack(head)
                    if slot != self.slot:
                        self._hand_over(conn, slot)
                        return
                link = self.greet(conn, deadline)
            finally:
                admitted = self._done(conn)
            if link is not None and admitted:
                kept = self.serve(link)
        except OSError as e:
            if not self._closed.is_set():
                log.debug("transport connection ended: %s", e)
        finally:
            self._conns.discard(conn)
            if not kept:
                conn.close()

    # --------------------------------------------------------------------------------- state
    def sockets(self) -> list[socket.socket]:
        """The connections this listener took that are still being served."""
        return list(self._conns)

    def close(self) -> None:
        """Stop listening and end every connection it took."""
        self._closed.set()
        try:  # a close alone leaves the socket listening while the accept thread still blocks in accept()
            self.server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.server.close()
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


__all__ = ["Listener", "HANDSHAKES", "SLOT", "listen", "slot_address"]
