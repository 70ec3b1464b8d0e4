"""The run key of a private run: every DHT record signed with it, and the check that tells a joining
island it holds the wrong one.

Every DHT record of a private run carries an HMAC made with the run key (a hivemind record validator),
so a node without the key can neither write the run's keys nor have its records believed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from peers.discovery.calls import DHTUnavailableError, dht_get, dht_store

MAC_BYTES = 32


def new_run_key() -> str:
    """A fresh random run key (hex), printed by the island that starts a run."""
    return secrets.token_hex(16)


class RunKeyValidator(RecordValidatorBase):
    """Signs every DHT record with HMAC-SHA256(run key) and rejects records without a valid one.

    Records under ``open_keys`` are neither signed nor checked: islands holding different keys can read
    them (the key check below uses one, so that a wrong key is told as such instead of in silence).
    """

    def __init__(self, run_key: str, open_keys: tuple[str, ...] = ()):
        self._key = hashlib.sha256(b"diloco-run-key:" + run_key.encode()).digest()
        self._open = {DHTID.generate(source=k).to_bytes() for k in open_keys}

    def _mac(self, record: DHTRecord, value: bytes) -> bytes:
        msg = b"|".join([record.key, record.subkey, value, repr(float(record.expiration_time)).encode()])
        return hmac.new(self._key, msg, hashlib.sha256).digest()

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.key in self._open:
            return record.value
        return record.value + self._mac(record, record.value)

    def validate(self, record: DHTRecord) -> bool:
        if record.key in self._open:
            return True
        if len(record.value) < MAC_BYTES:
            return False
        value, mac = record.value[:-MAC_BYTES], record.value[-MAC_BYTES:]
        return hmac.compare_digest(mac, self._mac(record, value))

    def strip_value(self, record: DHTRecord) -> bytes:
        if record.key in self._open:
            return record.value
        return record.value[:-MAC_BYTES]

    @property
    def priority(self) -> int:
        return 10  # sign last, validate first

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


def key_check_key(prefix: str) -> str:
    """The open DHT key under which every island of a private run proves it holds the run key."""
    return f"{prefix}.keycheck"


def key_proof(run_key: str, peer_id: str) -> str:
    """What ``peer_id`` publishes to show it holds ``run_key`` without revealing it."""
    return hmac.new(run_key.encode(), f"diloco-key-proof:{peer_id}".encode(), hashlib.sha256).hexdigest()[:32]


def check_run_key(dht: hivemind.DHT, prefix: str, run_key: str, timeout: float) -> str:
    """Publish this island's proof of the run key, then look for other islands' (for 3 s and two reads of the
    record, at most ``timeout`` s: proofs are stored for an hour, so an island of the run published its own long
    before).
    Returns '' when another island proves the same key or none is there yet, and a sentence when
    islands of the run are there and none holds our key."""
    me = str(dht.peer_id)
    key = key_check_key(prefix)
    deadline = time.monotonic() + timeout
    quiet_until = time.monotonic() + min(timeout, 3.0)
    foreign: set[str] = set()
    reads = 0
    try:
        dht_store(dht, key, me, key_proof(run_key, me), get_dht_time() + 3600, timeout=timeout)
        while True:
            found = dht_get(dht, key, timeout=max(1.0, deadline - time.monotonic()))
            reads += 1
            items = found.value if found is not None and isinstance(found.value, dict) else {}
            for subkey, item in items.items():
                pid = str(subkey)
                if pid == me:
                    continue
                if getattr(item, "value", None) == key_proof(run_key, pid):
                    return ""
                foreign.add(pid)
            if time.monotonic() > deadline or (time.monotonic() > quiet_until and (not foreign or reads >= 2)):
                break  # nobody else proved anything (a new run, or bootstrap nodes only), or twice another key
            time.sleep(0.5)
    except DHTUnavailableError:
        return ""
    if not foreign:
        return ""
    return (f"the {len(foreign)} island(s) of run {prefix!r} reachable from here hold another run key: pass the "
            f"--averaging.run_key printed by the island that started the run")
