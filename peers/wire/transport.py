"""Bulk bytes between island ranks over plain TCP: pseudo-gradient parts, a round's group inside an island,
θ_global for joiners.

hivemind forms the groups and carries the votes; the bytes of a round go here, straight from one rank's
memory to another's.  Measured side by side on loopback (2 cores, 160 MB of fp32, ``benchmarks/transport.py``):
a reduce-scatter and all-gather over this path ran as fast as a gloo ``all_reduce`` of the same tensor
(0.112 s against 0.110 s), while the same halves over hivemind's p2p daemon took 6.4x as long and hivemind's
own all-reduce 18x.

Every rank listens on one TCP port.  A connection starts with a handshake: the listener sends a random
nonce, the caller answers with its peer id and ``HMAC-SHA256(run key, nonce + peer id)``, so only islands
holding the run's key can send anything (a public run has an empty key: anyone may, as over hivemind).  A
message is one frame: a fixed header (its key, the length of a small JSON ``extra`` and of the payload),
then the payload, written from the caller's buffer and read straight into the one buffer it is kept in.
The receiver acknowledges every whole message; a message whose connection fails before its acknowledgement
is sent again on a new connection, alone, until its deadline (:attr:`Transport.resent` counts them).
Messages wait in an :class:`~peers.wire.inbox.Inbox` by key and sender until someone takes them.

The bytes are not encrypted: runs over the open internet that need it use ``--averaging.transport p2p``
(hivemind's daemon, encrypted and slower).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from peers.wire.inbox import Inbox

log = logging.getLogger(__name__)

MAGIC = b"DLC1"
HEADER = struct.Struct(">4sHIQ")
"""magic, key length, extra length, payload length."""
NONCE = 16
ACK = b"\x06"
WELCOME, REFUSED = b"\x01", b"\x00"
MAX_KEY = 1024
MAX_EXTRA = 1 << 20
CHUNK = 1 << 22
"""Bytes per ``recv_into`` (the kernel hands over what it has; a bigger buffer only wastes nothing)."""
HANDSHAKE_TIMEOUT = 10.0

Buffer = bytes | bytearray | memoryview


class TransportError(RuntimeError):
    """A message could not be delivered before its deadline."""


class RefusedError(TransportError):
    """The receiver refused the connection: the two sides hold different run keys."""


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"host:port"`` as (host, port)."""
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def _mac(key: bytes, nonce: bytes, peer: bytes) -> bytes:
    return hmac.new(key, nonce + peer, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], min(len(view) - got, CHUNK))
        if n == 0:
            raise ConnectionError("the connection closed mid-message")
        got += n


def _buffer(size: int) -> memoryview:
    """A writable buffer of ``size`` bytes, not zero-filled first (``bytearray(size)`` would write it all once
    more before the socket does)."""
    return memoryview(torch.empty(size, dtype=torch.uint8).numpy()).cast("B")


def _send_frame(sock: socket.socket, key: str, extra: bytes, payload: Buffer) -> None:
    k = key.encode()
    body = memoryview(payload).cast("B")
    sock.sendall(HEADER.pack(MAGIC, len(k), len(extra), len(body)) + k + extra)
    if len(body):
        sock.sendall(body)


@dataclass
class Stats:
    """What this rank's transport moved (payload bytes; the kernel adds its headers)."""

    sent: int = 0
    received: int = 0
    resent: int = 0
    """Messages sent again alone after their connection failed before they were acknowledged."""
    resent_bytes: int = 0


@dataclass
class _Peer:
    """One outgoing connection (made on first use, made again after a failure)."""

    endpoint: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    sock: socket.socket | None = None


class Transport:
    """This rank's endpoint for bulk bytes: listens on ``host:port`` (0: any free port), names itself
    ``peer_id`` and accepts only callers holding ``run_key`` (empty: anyone).  ``advertise``: the host other
    ranks reach it at (default: ``host``, or 127.0.0.1 when listening on all interfaces)."""

    def __init__(self, peer_id: str, run_key: str = "", host: str = "127.0.0.1", port: int = 0,
                 advertise: str = "", max_message: int = 1 << 34, inbox_ttl: float = 300.0):
        self.peer_id, self.key, self.max_message = peer_id, run_key.encode(), max_message
        self.box = Inbox(inbox_ttl, max_keys=4096)
        self.stats = Stats()
        self.handlers: dict[str, Callable[[str, str, bytearray, dict], bool]] = {}
        """By key prefix: called (in the connection's reader thread) with (key, sender, payload, extra) for a
        message whose key starts with it (the longest prefix wins) before it goes to the inbox; returning True
        keeps it out of the inbox (a request served at once, a message stored otherwise)."""
        self.fault: Callable[[str], bool] | None = None
        """Tests: ``fault(key)`` True makes the next send of that key break its connection half-way."""
        self._peers: dict[str, _Peer] = {}
        self._peers_lock = threading.Lock()
        self._closed = threading.Event()
        self._server = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                            reuse_port=False, backlog=64)
        self.port = self._server.getsockname()[1]
        if not advertise:
            advertise = "127.0.0.1" if host in ("0.0.0.0", "") else host
        self.endpoint = f"{advertise}:{self.port}"
        self._conns: set[socket.socket] = set()
        threading.Thread(target=self._accept, name="transport-accept", daemon=True).start()

    # --------------------------------------------------------------------------------- receiving
    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="transport-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        self._conns.add(conn)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(HANDSHAKE_TIMEOUT)
            nonce = os.urandom(NONCE)
            conn.sendall(nonce)
            head = bytearray(2)
            _recv_exact(conn, memoryview(head))
            peer = bytearray(struct.unpack(">H", head)[0])
            _recv_exact(conn, memoryview(peer))
            mac = bytearray(32)
            _recv_exact(conn, memoryview(mac))
            if not hmac.compare_digest(bytes(mac), _mac(self.key, nonce, bytes(peer))):
                log.warning("refused a transport connection: wrong run key (claimed peer %s)",
                            peer.decode(errors="replace"))
                conn.sendall(REFUSED)
                return
            conn.sendall(WELCOME)
            sender = peer.decode()
            conn.settimeout(None)
            while not self._closed.is_set():
                header = bytearray(HEADER.size)
                try:
                    _recv_exact(conn, memoryview(header))
                except ConnectionError:
                    return
                magic, klen, xlen, plen = HEADER.unpack(header)
                if magic != MAGIC or klen > MAX_KEY or xlen > MAX_EXTRA or plen > self.max_message:
                    log.warning("refused a malformed message from %s", sender)
                    return
                meta = bytearray(klen + xlen)
                _recv_exact(conn, memoryview(meta))
                payload = _buffer(plen)
                _recv_exact(conn, payload)
                conn.sendall(ACK)
                key = meta[:klen].decode()
                extra = json.loads(meta[klen:]) if xlen else {}
                self.stats.received += plen
                handler = self._handler(key)
                if handler is not None and handler(key, sender, payload, extra):
                    continue
                self.box.put(key, sender, payload, extra.get("group", ()) if isinstance(extra, dict) else ())
        except (OSError, ValueError) as e:
            if not self._closed.is_set():
                log.debug("transport connection ended: %s", e)
        finally:
            self._conns.discard(conn)
            conn.close()

    def _handler(self, key: str) -> Callable[[str, str, bytearray, dict], bool] | None:
        best = max((p for p in self.handlers if key.startswith(p)), key=len, default=None)
        return self.handlers.get(best) if best is not None else None

    # ----------------------------------------------------------------------------------- sending
    def send(self, endpoint: str, key: str, payload: Buffer, deadline: float, extra: dict | None = None) -> None:
        """Deliver one message to the rank at ``endpoint`` (acknowledged), sending it again on a new connection
        if its connection fails, until ``deadline`` (``time.monotonic``); raises TransportError then."""
        meta = json.dumps(extra).encode() if extra else b""
        peer = self._peer(endpoint)
        attempt = 0
        while True:
            try:
                with peer.lock:
                    try:
                        sock = peer.sock or self._connect(endpoint, deadline)
                        peer.sock = sock
                        sock.settimeout(max(0.05, deadline - time.monotonic()))
                        if self.fault is not None and self.fault(key):
                            self._break_mid_message(sock, key, meta, payload)
                        _send_frame(sock, key, meta, payload)
                        ack = sock.recv(1)
                        if ack != ACK:
                            raise ConnectionError("the receiver closed the connection")
                    except OSError:
                        # dropped before the lock is let go: a message queued behind this one to the same
                        # rank opens a new connection instead of failing on the dead one (and moving twice)
                        if peer.sock is not None:
                            peer.sock.close()
                            peer.sock = None
                        raise
                self.stats.sent += memoryview(payload).nbytes
                return
            except RefusedError:
                raise
            except OSError as e:
                attempt += 1
                if time.monotonic() >= deadline or self._closed.is_set():
                    raise TransportError(f"could not deliver {key} to {endpoint}: {e}") from None
                self.stats.resent += 1
                self.stats.resent_bytes += memoryview(payload).nbytes
                log.info("sending %s to %s again (attempt %d): %s", key, endpoint, attempt + 1, e)
                time.sleep(min(0.2 * attempt, max(0.0, deadline - time.monotonic())))

    def _break_mid_message(self, sock: socket.socket, key: str, meta: bytes, payload: Buffer) -> None:
        """Fault injection: write the header and half the payload, then cut the connection."""
        k = key.encode()
        body = memoryview(payload).cast("B")
        sock.sendall(HEADER.pack(MAGIC, len(k), len(meta), len(body)) + k + meta)
        sock.sendall(body[:len(body) // 2])
        sock.shutdown(socket.SHUT_RDWR)
        raise ConnectionError("fault injected: connection cut mid-message")

    def _peer(self, endpoint: str) -> _Peer:
        with self._peers_lock:
            peer = self._peers.get(endpoint)
            if peer is None:
                peer = self._peers[endpoint] = _Peer(endpoint)
            return peer

    def _connect(self, endpoint: str, deadline: float) -> socket.socket:
        host, port = parse_endpoint(endpoint)
        sock = socket.create_connection((host, port), timeout=max(0.05, min(HANDSHAKE_TIMEOUT,
                                                                              deadline - time.monotonic())))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = bytearray(NONCE)
        _recv_exact(sock, memoryview(nonce))
        me = self.peer_id.encode()
        sock.sendall(struct.pack(">H", len(me)) + me + _mac(self.key, bytes(nonce), me))
        if sock.recv(1) != WELCOME:
            sock.close()
            raise RefusedError(f"{endpoint} refused this island: it holds another run key")
        return sock

    def socket_inodes(self) -> set[int]:
        """Inodes of this transport's live connections (what :class:`peers.wire.counters.WireCounter` counts)."""
        socks = list(self._conns)
        with self._peers_lock:
            socks += [p.sock for p in self._peers.values() if p.sock is not None]
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
        try:
            self._server.close()
        except OSError:
            pass
        for conn in list(self._conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._peers_lock:
            for peer in self._peers.values():
                if peer.sock is not None:
                    peer.sock.close()
                    peer.sock = None


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


def tensor_bytes(t: Any) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    return memoryview(t.contiguous().numpy()).cast("B")


__all__ = ["Transport", "TransportError", "RefusedError", "Stats", "send_all", "parse_endpoint", "tensor_bytes"]
