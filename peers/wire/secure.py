"""One connection of the direct transport, from its handshake on: who is at the other end, proven, and every
byte after the handshake authenticated (and, by default, encrypted).

The handshake proves that both ends hold the run's key and that each is the peer id it names, and agrees on
fresh keys for this connection alone, all within one deadline (:data:`HANDSHAKE_TIMEOUT` for the whole
exchange, however the bytes trickle in):

1. the listener sends ``DLC3``, its flags (encrypted or not), a random nonce, an ephemeral X25519 key
   and its peer id;
2. the caller answers with its peer id, where it is reached, the connection's role (frames from the
   caller, or a *lane*: frames from the listener to a caller that cannot be reached itself), its flags, its
   own ephemeral key, its public key (its hivemind identity's, :mod:`peers.identity`),
   ``HMAC-SHA256(run key, "caller" + transcript)`` and its signature of the transcript;
3. the listener checks that MAC, that the public key hashes to the peer id the caller named and the signature,
   then answers ``WELCOME``, its own public key, its signature of the transcript and its own MAC, which the
   caller checks in turn.

Both ends then derive one AES-256-GCM key per direction with HKDF-SHA256 from the X25519 secret, salted
with the run key and bound to the transcript.  Both signatures cover both ephemeral keys and the listener's
nonce, so neither can be replayed into another connection, and everything on a connection comes from the peer
id it proved: :attr:`Link.peer`.  Every record after that (a frame's header, its key and extra, each 4 MiB of
its payload, each acknowledgement) carries a GCM tag under the next nonce of its direction, so a record that was
changed, dropped, replayed or moved fails its tag: the reader drops the connection without acknowledging, and
the sender sends the message again on a new connection.  A public run (empty key) still gets fresh keys per
connection: its bytes are private from onlookers, but anyone may connect, as over hivemind.
``encrypt=False`` (``--averaging.encrypt false``) sends the records in the clear, each still followed by its tag
(GMAC: the record as GCM's associated data, nothing encrypted), so it gives up privacy only: a byte changed on
the way is refused as in an encrypted one.  Both ends must agree, or the listener refuses in one line.

AES-256-GCM because every server CPU of the field has AES instructions: 3.1 GB/s sealing and 4.2 GB/s
opening per core on this machine, against 2.6 / 2.3 GB/s for ChaCha20-Poly1305; the tag alone (GMAC) runs at
18 / 17 GB/s, against 2.0 / 1.1 GB/s for an HMAC-SHA256 of the record, so a record in the clear costs almost
nothing more than an untagged one (``python -m benchmarks.transport_crypto``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
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

from peers.identity import Identity, proves

Buffer = bytes | bytearray | memoryview

HELLO = b"DLC3"
FRAME = b"DLCF"
HEADER = struct.Struct(">4sHIQ")
"""magic, key length, extra length, payload length."""
NONCE = 16
PUBLIC = 32
MAC = 32
TAG = 16
ACK = b"\x06"
WELCOME, REFUSED, MISMATCHED, UNPROVEN = b"\x01", b"\x00", b"\x02", b"\x03"
ENCRYPTED = 1
FRAMES, LANE = 0, 1
"""A connection's role: the caller sends frames, or (a lane) the listener sends frames to the caller."""
CALLER, LISTENER = b"diloco transport v3 caller", b"diloco transport v3 listener"
"""What each end's MAC and signature are over, before the transcript: neither can stand for the other's."""
MAX_KEY = 1024
MAX_EXTRA = 1 << 20
CHUNK = 1 << 22
"""Bytes per socket read and per sealed record of a payload."""
SMALL = 1 << 16
"""A record in the clear at most this long goes out in one write with its tag."""
HANDSHAKE_TIMEOUT = 10.0
"""Seconds the whole handshake may take (one deadline for every read and write of it)."""


class Refused(ConnectionError):
    """The other end turned this connection down at the handshake; the message says why and what to do."""


class Tampered(ConnectionError):
    """A record failed its tag: it was changed (or lost, or replayed) on the way."""


class Malformed(ConnectionError):
    """A frame's header does not describe a message this transport accepts."""


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``; ConnectionError if the connection ends first, TimeoutError if ``deadline``
    (``time.monotonic``) passes first however the bytes trickle in (None: the socket's own timeout, per read)."""
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the other end took too long")
            sock.settimeout(left)
        n = sock.recv_into(view[got:], min(len(view) - got, CHUNK))
        if n == 0:
            raise ConnectionError("the connection closed mid-message")
        got += n


def buffer(size: int) -> memoryview:
    """A writable buffer of ``size`` bytes, not zero-filled first (``bytearray(size)`` would write it all once
    more before the socket does)."""
    return memoryview(torch.empty(size, dtype=torch.uint8).numpy()).cast("B")


def _recv(sock: socket.socket, size: int, deadline: float | None = None) -> bytes:
    out = bytearray(size)
    recv_exact(sock, memoryview(out), deadline)
    return bytes(out)


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the other end took too long")
    sock.settimeout(left)
    sock.sendall(data)


def _mac(key: bytes, who: bytes, transcript: bytes) -> bytes:
    return hmac.new(key, who + transcript, hashlib.sha256).digest()


def _public(private: X25519PrivateKey) -> bytes:
    return private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _keys(private: X25519PrivateKey, their_public: bytes, run_key: bytes, transcript: bytes) -> tuple[bytes, bytes]:
    """(caller → listener, listener → caller) keys of one connection; Refused when the other end's ephemeral key
    is one no secret can be agreed with."""
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(their_public))
    except ValueError:
        raise Refused("the other end sent an ephemeral key no secret can be agreed with") from None
    out = HKDF(algorithm=hashes.SHA256(), length=64, salt=hashlib.sha256(run_key).digest(),
               info=b"diloco transport v3" + transcript).derive(shared)
    return out[:32], out[32:]


class _Sealer:
    """One direction of a connection: AES-256-GCM with a counter nonce; ``encrypt`` False: the records go in the
    clear, each followed by its tag all the same (GMAC)."""

    def __init__(self, key: bytes, encrypt: bool):
        self.aead, self.encrypt = AESGCM(key), encrypt
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
    """The other end's peer id, as it proved with its identity's signature."""
    role: int
    tx: _Sealer
    rx: _Sealer
    endpoint: str = ""
    """Where the other end is reached (told by a caller)."""
    tamper: Callable[[str], bool] | None = None
    """Tests: ``tamper(key)`` True flips one bit of that message's payload on the way out."""

    # ------------------------------------------------------------------------------ records
    def _write(self, data: Buffer, flip: bool = False, scratch: memoryview | None = None) -> None:
        view = memoryview(data).cast("B")
        if not self.tx.encrypt:
            tag = self.tx.aead.encrypt(self.tx.nonce(), b"", view)
            head, rest = (bytes([view[0] ^ 1]), view[1:]) if flip else (b"", view)
            if len(view) <= SMALL:
                self.sock.sendall(head + bytes(rest) + tag)
            else:
                self.sock.sendall(head)
                self.sock.sendall(rest)
                self.sock.sendall(tag)
            return
        out = (scratch if scratch is not None else buffer(len(view) + TAG))[:len(view) + TAG]
        self.tx.aead.encrypt_into(self.tx.nonce(), view, None, out)
        if flip:
            out[0] ^= 1
        self.sock.sendall(out)

    def _read(self, out: memoryview, scratch: memoryview | None = None) -> None:
        try:
            if not self.rx.encrypt:
                recv_exact(self.sock, out)
                self.rx.aead.decrypt(self.rx.nonce(), _recv(self.sock, TAG), out)
                return
            sealed = (scratch if scratch is not None else buffer(len(out) + TAG))[:len(out) + TAG]
            recv_exact(self.sock, sealed)
            self.rx.aead.decrypt_into(self.rx.nonce(), sealed, None, out)
        except InvalidTag:
            raise Tampered("a record failed its check: it was changed on the way") from None

    # ------------------------------------------------------------------------------- frames
    def write_frame(self, key: str, extra: bytes, payload: Buffer, cut: bool = False) -> None:
        """One message: header, key and extra, then the payload (a record of each 4 MiB).  ``cut`` (fault
        injection) writes half the payload and shuts the connection down."""
        k = key.encode()
        body = memoryview(payload).cast("B")
        self._write(HEADER.pack(FRAME, len(k), len(extra), len(body)))
        if k or extra:  # as read_frame reads it: no record for nothing
            self._write(k + extra)
        end = len(body) // 2 if cut else len(body)
        flip = self.tamper is not None and len(body) > 0 and self.tamper(key)
        scratch = buffer(min(end, CHUNK) + TAG) if self.tx.encrypt and end else None
        for start in range(0, end, CHUNK):
            self._write(body[start:min(start + CHUNK, end)], flip and start == 0, scratch)
        if cut:
            self.sock.shutdown(socket.SHUT_RDWR)
            raise ConnectionError("fault injected: connection cut mid-message")

    def read_frame(self, max_message: int) -> tuple[str, bytes, memoryview]:
        """The next message as (key, extra, payload); Malformed if its header is not ours or announces a
        payload over ``max_message`` bytes (refused before a byte of it is allocated)."""
        head = bytearray(HEADER.size)
        self._read(memoryview(head))
        magic, klen, xlen, plen = HEADER.unpack(head)
        if magic != FRAME or klen > MAX_KEY or xlen > MAX_EXTRA or plen > max_message:
            raise Malformed(f"a frame of {plen} bytes (at most {max_message} taken) with a {klen}-byte key")
        meta = bytearray(klen + xlen)
        if meta:
            self._read(memoryview(meta))
        payload = buffer(plen)
        scratch = buffer(min(plen, CHUNK) + TAG) if self.rx.encrypt and plen else None
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


def _read_field(sock: socket.socket, deadline: float) -> bytes:
    (size,) = struct.unpack(">H", _recv(sock, 2, deadline))
    return _recv(sock, size, deadline)


def greet(sock: socket.socket, run_key: bytes, encrypt: bool, me: Identity, deadline: float) -> Link:
    """The listener's side of the handshake on a new connection, by ``deadline`` (``time.monotonic``); Refused
    (after telling the caller) when the caller does not hold ``run_key``, does not encrypt alike, or does not
    prove the peer id it names."""
    private, nonce, flags = X25519PrivateKey.generate(), os.urandom(NONCE), ENCRYPTED if encrypt else 0
    hello = HELLO + bytes([flags]) + nonce + _public(private) + _field(me.peer_id.encode())
    _send(sock, hello, deadline)
    peer, endpoint = _read_field(sock, deadline), _read_field(sock, deadline)
    role, their_flags = _recv(sock, 2, deadline)
    their_public, their_key = _recv(sock, PUBLIC, deadline), _read_field(sock, deadline)
    mac, signature = _recv(sock, MAC, deadline), _read_field(sock, deadline)
    transcript = (hello + _field(peer) + _field(endpoint) + bytes([role, their_flags]) + their_public
                  + _field(their_key))
    name = peer.decode(errors="replace")
    if not hmac.compare_digest(mac, _mac(run_key, CALLER, transcript)):
        _send(sock, REFUSED, deadline)
        raise Refused(f"refused a transport connection: wrong run key (claimed peer {name})")
    if their_flags != flags or role not in (FRAMES, LANE):
        _send(sock, MISMATCHED, deadline)
        raise Refused(f"refused a transport connection from {name}: it "
                      f"{'encrypts' if their_flags & ENCRYPTED else 'does not encrypt'} its bytes and this island "
                      f"{'does' if encrypt else 'does not'}")
    if not proves(their_key, name, CALLER + transcript, signature):
        _send(sock, UNPROVEN, deadline)
        raise Refused(f"refused a transport connection claiming to be {name}: its key and signature do not prove "
                      "that peer id")
    mine = _field(me.public)
    transcript += mine
    to_listener, to_caller = _keys(private, their_public, run_key, transcript)
    _send(sock, WELCOME + mine + _field(me.sign(LISTENER + transcript)) + _mac(run_key, LISTENER, transcript),
          deadline)
    sock.settimeout(None)
    return Link(sock, name, role, _Sealer(to_caller, encrypt), _Sealer(to_listener, encrypt),
                endpoint=endpoint.decode(errors="replace"))


def call(sock: socket.socket, run_key: bytes, encrypt: bool, me: Identity, endpoint: str, role: int,
         deadline: float) -> Link:
    """The caller's side of the handshake (``me``: this rank's identity, ``endpoint``: where it is reached), by
    ``deadline`` (``time.monotonic``); Refused when the listener holds another run key, encrypts otherwise, or
    cannot prove that it holds ``run_key`` and the peer id it names."""
    hello = _recv(sock, len(HELLO) + 1 + NONCE + PUBLIC, deadline)
    if hello[:len(HELLO)] != HELLO:
        raise Refused("the other end does not speak this transport (another program, or another version of it)")
    their_flags, their_public = hello[len(HELLO)], hello[-PUBLIC:]
    listener = _read_field(sock, deadline)
    hello += _field(listener)
    private, flags = X25519PrivateKey.generate(), ENCRYPTED if encrypt else 0
    mine = (_field(me.peer_id.encode()) + _field(endpoint.encode()) + bytes([role, flags]) + _public(private)
            + _field(me.public))
    transcript = hello + mine
    _send(sock, mine + _mac(run_key, CALLER, transcript) + _field(me.sign(CALLER + transcript)), deadline)
    answer = _recv(sock, 1, deadline)
    if answer == REFUSED:
        raise Refused("refused this island: it holds another run key (use a copy of the run's key file, "
                      "--averaging.run_key_file)")
    if answer == MISMATCHED:
        mode = "encrypts" if their_flags & ENCRYPTED else "does not encrypt"
        raise Refused(f"refused this island: the other island {mode} its bytes; set --averaging.encrypt alike "
                      "on every island of the run")
    if answer == UNPROVEN:
        raise Refused("refused this island: its signature did not prove its peer id (its identity file does not "
                      "hold the key of the peer id it announces)")
    if answer != WELCOME:
        raise Refused("the other end could not prove that it holds the run key")
    theirs = _field(_read_field(sock, deadline))
    signature, mac = _read_field(sock, deadline), _recv(sock, MAC, deadline)
    transcript += theirs
    name = listener.decode(errors="replace")
    if not hmac.compare_digest(mac, _mac(run_key, LISTENER, transcript)):
        raise Refused("the other end could not prove that it holds the run key")
    if not proves(theirs[2:], name, LISTENER + transcript, signature):
        raise Refused(f"the other end could not prove that it is {name}, the peer id it names")
    sock.settimeout(None)
    to_listener, to_caller = _keys(private, their_public, run_key, transcript)
    return Link(sock, name, role, _Sealer(to_listener, encrypt), _Sealer(to_caller, encrypt))


__all__ = ["Link", "Refused", "Tampered", "Malformed", "greet", "call", "recv_exact", "buffer", "FRAMES", "LANE",
           "HANDSHAKE_TIMEOUT"]
