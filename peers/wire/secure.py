"""One connection of the direct transport, from its handshake on: who is at the other end, and every byte
after the handshake sealed.

The handshake proves that both ends hold the run's key and agrees on fresh keys for this connection alone:

1. the listener sends ``DLC2``, its flags (encrypted or not), a random nonce, an ephemeral X25519 key
   and its peer id;
2. the caller answers with its peer id, where it is reached, the connection's role (frames from the
   caller, or a *lane*: frames from the listener to a caller that cannot be reached itself), its flags, its
   own ephemeral key and ``HMAC-SHA256(run key, "caller" + transcript)``;
3. the listener checks that MAC, then answers ``WELCOME`` and ``HMAC-SHA256(run key, "listener" +
   transcript)``, which the caller checks in turn.

Both ends then derive one AES-256-GCM key per direction with HKDF-SHA256 from the X25519 secret, salted
with the run key and bound to the transcript.  Every record after that (a frame's header, its key and
extra, each 4 MiB of its payload, each acknowledgement) is sealed with the next nonce of its direction, so a
record that was changed, dropped, replayed or moved fails its tag: the reader drops the connection without
acknowledging, and the sender sends the message again on a new connection.  A public run (empty key) still
gets fresh keys per connection: its bytes are private from onlookers, but anyone may connect, as over
hivemind.  ``encrypt=False`` (``--averaging.encrypt false``) keeps the authenticated handshake and sends the
records in the clear; both ends must agree, or the listener refuses in one line.

AES-256-GCM because every server CPU of the field has AES instructions: 2.0 GB/s sealing and 2.5 GB/s
opening per core on this machine, against 1.7 / 1.9 GB/s for ChaCha20-Poly1305
(``python -m benchmarks.transport_crypto``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import (
    X25519PrivateKey,
    X25519PublicKey,
)
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

Buffer = bytes | bytearray | memoryview

HELLO = b"DLC2"
FRAME = b"DLCF"
HEADER = struct.Struct(">4sHIQ")
"""magic, key length, extra length, payload length."""
NONCE = 16
PUBLIC = 32
MAC = 32
TAG = 16
ACK = b"\x06"
WELCOME, REFUSED, MISMATCHED = b"\x01", b"\x00", b"\x02"
ENCRYPTED = 1
FRAMES, LANE = 0, 1
"""A connection's role: the caller sends frames, or (a lane) the listener sends frames to the caller."""
MAX_KEY = 1024
MAX_EXTRA = 1 << 20
CHUNK = 1 << 22
"""Bytes per socket read and per sealed record of a payload."""
HANDSHAKE_TIMEOUT = 10.0


class Refused(ConnectionError):
    """The other end turned this connection down at the handshake; the message says why and what to do."""


class Tampered(ConnectionError):
    """A record failed its tag: it was changed (or lost, or replayed) on the way."""


class Malformed(ConnectionError):
    """A frame's header does not describe a message this transport accepts."""


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ConnectionError if the connection ends first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], min(len(view) - got, CHUNK))
        if n == 0:
            raise ConnectionError("the connection closed mid-message")
        got += n


def buffer(size: int) -> memoryview:
    """A writable buffer of ``size`` bytes, not zero-filled first (``bytearray(size)`` would write it all once
    more before the socket does)."""
    return memoryview(torch.empty(size, dtype=torch.uint8).numpy()).cast("B")


def _recv(sock: socket.socket, size: int) -> bytes:
    out = bytearray(size)
    recv_exact(sock, memoryview(out))
    return bytes(out)


def _mac(key: bytes, who: bytes, transcript: bytes) -> bytes:
    return hmac.new(key, who + transcript, hashlib.sha256).digest()


def _public(private: X25519PrivateKey) -> bytes:
    return private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _keys(private: X25519PrivateKey, their_public: bytes, run_key: bytes, transcript: bytes) -> tuple[bytes, bytes]:
    """(caller → listener, listener → caller) keys of one connection."""
    shared = private.exchange(X25519PublicKey.from_public_bytes(their_public))
    out = HKDF(algorithm=hashes.SHA256(), length=64, salt=hashlib.sha256(run_key).digest(),
               info=b"diloco transport v2" + transcript).derive(shared)
    return out[:32], out[32:]


class _Sealer:
    """One direction of a connection: AES-GCM with a counter nonce (None: records in the clear)."""

    def __init__(self, key: bytes | None):
        self.aead = AESGCM(key) if key is not None else None
        self.count = 0

    def nonce(self) -> bytes:
        self.count += 1
        return self.count.to_bytes(12, "big")


@dataclass
class Link:
    """A connection after its handshake: frames go one way (from the caller, or from the listener on a lane:
    ``role``), acknowledgements the other."""

    sock: socket.socket
    peer: str
    """The other end's peer id (as it proved with the run key; in a public run, as it claims)."""
    role: int
    tx: _Sealer
    rx: _Sealer
    endpoint: str = ""
    """Where the other end is reached (told by a caller that opens a lane)."""
    tamper: Callable[[str], bool] | None = None
    """Tests: ``tamper(key)`` True flips one bit of that message's payload on the way out."""

    # ------------------------------------------------------------------------------ records
    def _write(self, data: Buffer, flip: bool = False, scratch: memoryview | None = None) -> None:
        if self.tx.aead is None:
            self.sock.sendall(data)
            return
        view = memoryview(data).cast("B")
        out = (scratch if scratch is not None else buffer(len(view) + TAG))[:len(view) + TAG]
        self.tx.aead.encrypt_into(self.tx.nonce(), view, None, out)
        if flip:
            out[0] ^= 1
        self.sock.sendall(out)

    def _read(self, out: memoryview, scratch: memoryview | None = None) -> None:
        if self.rx.aead is None:
            recv_exact(self.sock, out)
            return
        sealed = (scratch if scratch is not None else buffer(len(out) + TAG))[:len(out) + TAG]
        recv_exact(self.sock, sealed)
        try:
            self.rx.aead.decrypt_into(self.rx.nonce(), sealed, None, out)
        except InvalidTag:
            raise Tampered("a record failed its check: it was changed on the way") from None

    # ------------------------------------------------------------------------------- frames
    def write_frame(self, key: str, extra: bytes, payload: Buffer, cut: bool = False) -> None:
        """One message: header, key and extra, then the payload (sealed by 4 MiB when encrypted).  ``cut``
        (fault injection) writes half the payload and shuts the connection down."""
        k = key.encode()
        body = memoryview(payload).cast("B")
        head = HEADER.pack(FRAME, len(k), len(extra), len(body))
        if self.tx.aead is None:
            self.sock.sendall(head + k + extra)
        else:
            self._write(head)
            if k or extra:  # as read_frame reads it: no record for nothing
                self._write(k + extra)
        end = len(body) // 2 if cut else len(body)
        flip = self.tamper is not None and len(body) > 0 and self.tamper(key)
        step = CHUNK if self.tx.aead is not None else max(end, 1)  # in the clear: one write of it all
        scratch = buffer(min(end, CHUNK) + TAG) if self.tx.aead is not None and end else None
        for start in range(0, end, step):
            self._write(body[start:min(start + step, end)], flip and start == 0, scratch)
        if cut:
            self.sock.shutdown(socket.SHUT_RDWR)
            raise ConnectionError("fault injected: connection cut mid-message")

    def read_frame(self, max_message: int) -> tuple[str, bytes, memoryview]:
        """The next message as (key, extra, payload); Malformed if its header is not ours or too big."""
        head = bytearray(HEADER.size)
        self._read(memoryview(head))
        magic, klen, xlen, plen = HEADER.unpack(head)
        if magic != FRAME or klen > MAX_KEY or xlen > MAX_EXTRA or plen > max_message:
            raise Malformed(f"a frame of {plen} bytes with a {klen}-byte key")
        meta = bytearray(klen + xlen)
        if meta:
            self._read(memoryview(meta))
        payload = buffer(plen)
        if self.rx.aead is None:
            recv_exact(self.sock, payload)
        else:
            scratch = buffer(min(plen, CHUNK) + TAG)
            for start in range(0, plen, CHUNK):
                self._read(payload[start:min(start + CHUNK, plen)], scratch)
        try:
            key = meta[:klen].decode()
        except UnicodeDecodeError:
            raise Malformed(f"a frame whose {klen}-byte key is not UTF-8") from None
        return key, bytes(meta[klen:]), payload

    def write_ack(self) -> None:
        """Acknowledge the whole message just read."""
        self._write(ACK)

    def read_ack(self) -> None:
        """Wait for the acknowledgement of the message just written; ConnectionError if none comes."""
        ack = bytearray(1)
        try:
            self._read(memoryview(ack))
        except ConnectionError:
            raise ConnectionError("the receiver closed the connection") from None
        if bytes(ack) != ACK:
            raise ConnectionError("the receiver answered something else than an acknowledgement")


def _field(value: bytes) -> bytes:
    return struct.pack(">H", len(value)) + value


def _read_field(sock: socket.socket) -> bytes:
    (size,) = struct.unpack(">H", _recv(sock, 2))
    return _recv(sock, size)


def greet(sock: socket.socket, run_key: bytes, encrypt: bool, me: str) -> Link:
    """The listener's side of the handshake on a new connection (``me``: this rank's peer id); Refused (after
    telling the caller) when the caller does not hold ``run_key`` or does not encrypt alike."""
    sock.settimeout(HANDSHAKE_TIMEOUT)
    private, nonce, flags = X25519PrivateKey.generate(), os.urandom(NONCE), ENCRYPTED if encrypt else 0
    hello = HELLO + bytes([flags]) + nonce + _public(private) + _field(me.encode())
    sock.sendall(hello)
    peer, endpoint = _read_field(sock), _read_field(sock)
    role, their_flags = _recv(sock, 2)
    their_public, mac = _recv(sock, PUBLIC), _recv(sock, MAC)
    transcript = hello + _field(peer) + _field(endpoint) + bytes([role, their_flags]) + their_public
    name = peer.decode(errors="replace")
    if not hmac.compare_digest(mac, _mac(run_key, b"caller", transcript)):
        sock.sendall(REFUSED)
        raise Refused(f"refused a transport connection: wrong run key (claimed peer {name})")
    if their_flags != flags or role not in (FRAMES, LANE):
        sock.sendall(MISMATCHED)
        raise Refused(f"refused a transport connection from {name}: it "
                      f"{'encrypts' if their_flags & ENCRYPTED else 'does not encrypt'} its bytes and this island "
                      f"{'does' if encrypt else 'does not'}")
    sock.sendall(WELCOME + _mac(run_key, b"listener", transcript))
    sock.settimeout(None)
    to_listener, to_caller = _keys(private, their_public, run_key, transcript)
    return Link(sock, peer.decode(), role, _Sealer(to_caller if encrypt else None),
                _Sealer(to_listener if encrypt else None), endpoint=endpoint.decode())


def call(sock: socket.socket, run_key: bytes, encrypt: bool, me: str, endpoint: str = "", role: int = FRAMES
         ) -> Link:
    """The caller's side of the handshake (``me``: this rank's peer id, ``endpoint``: where it is reached, for
    a lane); Refused when the listener holds another run key, encrypts otherwise, or cannot prove that it
    holds ``run_key``."""
    sock.settimeout(HANDSHAKE_TIMEOUT)
    hello = _recv(sock, len(HELLO) + 1 + NONCE + PUBLIC)
    if hello[:len(HELLO)] != HELLO:
        raise Refused("the other end does not speak this transport (another program, or another version of it)")
    their_flags, their_public = hello[len(HELLO)], hello[-PUBLIC:]
    listener = _read_field(sock)
    hello += _field(listener)
    private, flags = X25519PrivateKey.generate(), ENCRYPTED if encrypt else 0
    mine = _field(me.encode()) + _field(endpoint.encode()) + bytes([role, flags]) + _public(private)
    transcript = hello + mine
    sock.sendall(mine + _mac(run_key, b"caller", transcript))
    answer = _recv(sock, 1)
    if answer == REFUSED:
        raise Refused("refused this island: it holds another run key (pass the run's --averaging.run_key)")
    if answer == MISMATCHED:
        mode = "encrypts" if their_flags & ENCRYPTED else "does not encrypt"
        raise Refused(f"refused this island: the other island {mode} its bytes; set --averaging.encrypt alike "
                      "on every island of the run")
    if answer != WELCOME or not hmac.compare_digest(_recv(sock, MAC), _mac(run_key, b"listener", transcript)):
        raise Refused("the other end could not prove that it holds the run key")
    sock.settimeout(None)
    to_listener, to_caller = _keys(private, their_public, run_key, transcript)
    return Link(sock, listener.decode(), role, _Sealer(to_listener if encrypt else None),
                _Sealer(to_caller if encrypt else None))


__all__ = ["Link", "Refused", "Tampered", "Malformed", "greet", "call", "recv_exact", "buffer", "FRAMES", "LANE",
           "HANDSHAKE_TIMEOUT"]
