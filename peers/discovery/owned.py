"""Records only their owner can write: an island's DHT records, signed with the identity key its peer id names.

The run key's HMAC (:class:`peers.discovery.run_key.RunKeyValidator`) keeps outsiders out of a private run's DHT,
but every holder of the key can write every record with it: rewrite another island's endpoint, outer step or
state fingerprint, announce that island's departure, or vote in its name.  An owned record is stored under the
writer's own peer id as its subkey, and carries the writer's public key and its RSA-PSS signature
(:mod:`peers.identity`) over the record's key, subkey, value and expiry.  A reader keeps an item only when the
public key is the one the subkey's peer id names and the signature holds: a member can write its own records
only, and cannot replay one of its old records with a later expiry.

Every DHT node of the run refuses to store a forged item under a peer id (:class:`OwnedRecords`), so that a member
cannot replace another's record either; readers check again, so that a node that lies in its answers cannot
slip one in.  (hivemind's ``RSASignatureValidator`` marks owned subkeys with the key itself; a peer id is what
our records are already named by, and what the transport proves.)
"""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import Any

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.utils.serializer import MSGPackSerializer

from peers.discovery.calls import dht_store
from peers.identity import SHA2_256, Identity, identity_of, proves

log = logging.getLogger(__name__)

_identities: dict[str, Identity] = {}
_lock = threading.Lock()


def dht_identity(dht: hivemind.DHT) -> Identity:
    """The identity ``dht`` was started with, read from its file once per process."""
    path = getattr(dht, "kwargs", {}).get("identity_path", "")
    with _lock:
        found = _identities.get(path)
        if found is None:
            found = _identities[path] = identity_of(dht)
        return found


def _message(key_id: bytes, subkey: str, body: bytes, expiration_time: float) -> bytes:
    """What the owner signs: the key as the DHT names it (its DHTID, all a DHT node sees), the subkey, the
    serialized value and the expiry."""
    return MSGPackSerializer.dumps(["diloco-owned-record", key_id, subkey, body, float(expiration_time)])


def _key_id(key: str) -> bytes:
    return DHTID.generate(source=key).to_bytes()


def is_peer_id(subkey: Any) -> bool:
    """Whether ``subkey`` is a peer id as an RSA identity names it (base58 of a sha2-256 multihash): the subkeys
    that only that peer may write (hivemind's own records use binary subkeys)."""
    if not isinstance(subkey, str) or not 40 <= len(subkey) <= 60:
        return False
    try:
        raw = PeerID.from_base58(subkey).to_bytes()
    except Exception:
        return False
    return len(raw) == 34 and raw.startswith(SHA2_256)


def owned_value(identity: Identity, key: str, value: Any, expiration_time: float) -> dict:
    """``value`` as ``identity`` stores it under ``key`` (its subkey: ``identity.peer_id``) until
    ``expiration_time``: the serialized value, the public key, the signature."""
    body = MSGPackSerializer.dumps(value)
    return {"body": body, "by": identity.public,
            "sig": identity.sign(_message(_key_id(key), identity.peer_id, body, expiration_time))}


def store_owned(dht: hivemind.DHT, key: str, value: Any, expiration_time: float, timeout: float) -> bool:
    """Store ``value`` under ``key``, subkey this rank's peer id, signed by its identity (see the module);
    raises :class:`peers.discovery.calls.DHTUnavailableError` as :func:`~peers.discovery.calls.dht_store` does."""
    identity = dht_identity(dht)
    return dht_store(dht, key, identity.peer_id, owned_value(identity, key, value, expiration_time),
                     expiration_time, timeout)


def owned_items(found: Any, key: str) -> dict[str, tuple[Any, float]]:
    """The items of a DHT lookup of ``key`` (``dht.get``'s result) whose signature proves their subkey's peer id
    wrote them: ``{peer id: (value, expiration time)}``.  Others (unsigned, signed by another key, malformed)
    are left out, and logged once per lookup."""
    out: dict[str, tuple[Any, float]] = {}
    if found is None or not isinstance(found.value, dict):
        return out
    forged, key_id = 0, _key_id(key)
    for subkey, item in found.value.items():
        pid = subkey if isinstance(subkey, str) else str(subkey)
        signed = getattr(item, "value", None)
        expiration = float(getattr(item, "expiration_time", 0.0) or 0.0)
        value = _verified(key_id, pid, signed, expiration)
        if value is _FORGED:
            forged += 1
        else:
            out[pid] = (value, expiration)
    if forged:
        log.warning("ignored %d record(s) under %s not signed by the island they name (a member writing "
                    "another's records, or an island of an older version)", forged, key)
    return out


_FORGED = object()


_checked: dict[bytes, bool] = {}
"""Signatures already checked (a registry read every second returns the same records until their next beat)."""


def _verified(key_id: bytes, pid: str, signed: Any, expiration: float) -> Any:
    """The value inside ``signed`` if ``pid`` signed it for ``key_id`` and ``expiration``, else ``_FORGED``."""
    if not isinstance(signed, dict) or not all(isinstance(signed.get(f), bytes) for f in ("body", "by", "sig")):
        return _FORGED
    message = _message(key_id, pid, signed["body"], expiration)
    memo = hashlib.sha256(message + signed["by"] + signed["sig"]).digest()
    with _lock:
        ok = _checked.get(memo)
    if ok is None:
        ok = proves(signed["by"], pid, message, signed["sig"])
        with _lock:
            if len(_checked) >= 8192:
                _checked.clear()
            _checked[memo] = ok
    if not ok:
        return _FORGED
    try:
        return MSGPackSerializer.loads(signed["body"])
    except Exception:
        return _FORGED


class OwnedRecords(RecordValidatorBase):
    """Refuses, in every DHT node of the run, a record whose subkey is a peer id (:func:`is_peer_id`) unless that
    peer signed it (:func:`owned_value`).  Readers check again (:func:`owned_items`); this keeps a member from
    replacing another's record with one of a later expiry that readers would then drop, erasing the island from
    the registry.  Stateless (a DHT's validators travel to its process)."""

    def validate(self, record: DHTRecord) -> bool:
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:
            return True
        if not is_peer_id(subkey):
            return True
        try:
            signed = MSGPackSerializer.loads(record.value)
        except Exception:
            return False
        return _verified(record.key, subkey, signed, record.expiration_time) is not _FORGED

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value  # signed by the writer before the store (:func:`store_owned`): the key stays in its process

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value

    @property
    def priority(self) -> int:
        return 5  # validated after the run key's HMAC is checked and stripped (its priority is 10)

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


__all__ = ["OwnedRecords", "is_peer_id", "dht_identity", "owned_value", "store_owned", "owned_items"]
