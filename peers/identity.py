"""Who a rank is, proven: its hivemind identity, the RSA private key its DHT's p2p daemon is started from.

A libp2p peer id is the multihash (sha2-256) of the rank's public key in libp2p's protobuf encoding, so a rank
proves that it is a peer id by showing that public key and signing something fresh with the private key; anyone
can check both (:func:`proves`).  The direct transport signs its handshakes (:mod:`peers.wire.secure`) and the
messages a reachable rank passes on between two ranks behind NAT (:mod:`peers.wire.nat`) this way, so that a
message is attributed to the peer id that sent it, whatever the message says.  The key is the DHT's, so the
transport's peer ids are the names groups and votes already use (:func:`identity_of`).
"""

from __future__ import annotations

import hashlib
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from google.protobuf.message import DecodeError
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

SHA2_256 = b"\x12\x20"
"""The multihash prefix of a sha2-256 digest (code 0x12, 32 bytes): how libp2p names a peer by an RSA key."""
KEY_BITS = (2048, 4096)
"""The RSA key sizes a peer may prove itself with (hivemind makes 2048-bit keys; the bound keeps a check
cheap whatever a caller sends)."""
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)


def peer_id_of(public: bytes) -> str:
    """The libp2p peer id (base58) of a public key in libp2p's protobuf encoding."""
    return PeerID(SHA2_256 + hashlib.sha256(public).digest()).to_base58()


class Identity:
    """A rank's private key and the peer id it proves.  :meth:`load` reads the file hivemind's daemon is started
    from (``identity_path``); :meth:`generate` makes one in memory (tests, a transport nobody needs to know)."""

    def __init__(self, key: rsa.RSAPrivateKey):
        self._key = key
        der = key.public_key().public_bytes(serialization.Encoding.DER,
                                            serialization.PublicFormat.SubjectPublicKeyInfo)
        self.public = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
        """The public key as libp2p encodes it (what a peer id is the hash of)."""
        self.peer_id = peer_id_of(self.public)

    @classmethod
    def generate(cls) -> Identity:
        """A fresh 2048-bit key, as hivemind makes them."""
        return cls(rsa.generate_private_key(public_exponent=65537, key_size=2048))

    @classmethod
    def load(cls, path: str) -> Identity:
        """The key of a hivemind identity file (libp2p's ``PrivateKey`` protobuf around an RSA key in DER)."""
        with open(path, "rb") as f:
            message = crypto_pb2.PrivateKey.FromString(f.read())
        if message.key_type != crypto_pb2.RSA:
            raise ValueError(f"{path}: not an RSA identity (key type {message.key_type})")
        key = serialization.load_der_private_key(message.data, password=None)
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError(f"{path}: not an RSA identity")
        return cls(key)

    def sign(self, data: bytes) -> bytes:
        """RSA-PSS with SHA-256 over ``data``, as hivemind signs."""
        return self._key.sign(data, _PSS, hashes.SHA256())

    def __repr__(self) -> str:
        return f"Identity({self.peer_id})"


def proves(public: bytes, peer_id: str, data: bytes, signature: bytes) -> bool:
    """Whether ``public`` (libp2p's protobuf encoding) is the key of ``peer_id`` and ``signature`` its signature
    of ``data``; False for anything malformed."""
    if peer_id_of(public) != peer_id:
        return False
    try:
        message = crypto_pb2.PublicKey.FromString(public)
        if message.key_type != crypto_pb2.RSA:
            return False
        key = serialization.load_der_public_key(message.data)
        if not isinstance(key, rsa.RSAPublicKey) or not KEY_BITS[0] <= key.key_size <= KEY_BITS[1]:
            return False
        key.verify(signature, data, _PSS, hashes.SHA256())
        return True
    except (InvalidSignature, UnsupportedAlgorithm, DecodeError, ValueError, TypeError):
        return False


def identity_of(dht: Any) -> Identity:
    """The identity of a rank's hivemind DHT, read from the file its daemon was started from; ValueError when it
    was started without one (its daemon made a key of its own that nothing else can read)."""
    path = getattr(dht, "kwargs", {}).get("identity_path")
    if not path:
        raise ValueError("this rank's DHT was started without an identity file (identity_path), so its transport "
                         "cannot prove its peer id; start it with peers.discovery.dht.start_dht, or pass "
                         "identity_path to hivemind.DHT")
    return Identity.load(path)


__all__ = ["Identity", "identity_of", "peer_id_of", "proves"]
