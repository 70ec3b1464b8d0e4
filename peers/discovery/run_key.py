"""The run key of a private run: where an island finds it, how strong it is, every DHT record signed with it,
and the check that tells a joining island it holds the wrong one.

The key never leaves the process but through the file that holds it (mode 600): :func:`obtain_run_key` takes it
from ``--averaging.run_key`` (with a warning: ``ps`` shows it), the ``DILOCO_RUN_KEY`` environment variable or
``--averaging.run_key_file``, or generates one into that file on the first island of a run.  A key estimated below
:data:`KEY_BITS` bits of entropy (:func:`key_bits`) is stretched with scrypt (:func:`stretch`), salted with the
run id, so that every island of the run derives the same one and an observer of a handshake or of a key proof
pays a slow hash for every guess.

Every DHT record of a private run carries an HMAC made with the run key (a hivemind record validator),
so a node without the key can neither write the run's keys nor have its records believed.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import secrets
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from peers.discovery.calls import DHTUnavailableError, dht_get
from peers.discovery.owned import owned_items, store_owned
from peers.errors import RunKeyError

log = logging.getLogger("diloco")  # the trainer's log: the island speaks with one voice

MAC_BYTES = 32

ENV = "DILOCO_RUN_KEY"
"""The environment variable that may hold the run key (out of ``ps`` and the shell history, unlike
``--averaging.run_key``)."""

KEY_BITS = 128
"""A run key estimated below this many bits of entropy is stretched before use."""

SCRYPT = {"n": 2 ** 17, "r": 8, "p": 1}
"""scrypt's cost: 128 MiB and about 0.35 s of one core (measured on the 2-core test machine; OWASP's minimum for
password storage), the same on every island so that all derive the same key."""


def new_run_key() -> str:
    """A fresh random run key: 256 bits, as 64 hex digits (the form :func:`key_bits` trusts as random)."""
    return secrets.token_hex(32)


def key_bits(key: str) -> float:
    """A conservative estimate of the entropy of ``key`` in bits, from its characters alone.

    Hex digits of one case (what :func:`new_run_key` and ``openssl rand -hex`` write) count 4 bits each: they may
    be random.  Any other key is taken for one a person chose and scored as NIST SP 800-63-1 (appendix A) scores
    chosen passwords: 4 bits for the first character, 2 for each of the next 7, 1.5 up to the 20th and 1 beyond,
    whatever its alphabet (words and names are far from random).  Either way a character counts at most log2 of
    the number of distinct characters in the key, and a key that repeats itself counts only its period
    (``abcabcabc`` as ``abc``).
    """
    if not key:
        return 0.0
    n = len(key)
    border = [0] * n  # the longest proper prefix of key[:i+1] that is also its suffix (KMP's failure function)
    for i in range(1, n):
        k = border[i - 1]
        while k and key[i] != key[k]:
            k = border[k - 1]
        border[i] = k + (key[i] == key[k])
    period = n - border[-1]
    most = math.log2(len(set(key))) if len(set(key)) > 1 else 0.0
    hexadecimal = all(c in "0123456789abcdef" for c in key) or all(c in "0123456789ABCDEF" for c in key)
    if hexadecimal:
        return period * min(4.0, most)
    chosen = sum(4.0 if i == 0 else 2.0 if i < 8 else 1.5 if i < 20 else 1.0 for i in range(period))
    return min(chosen, period * most)


def stretch(key: str, run_id: str) -> str:
    """``key`` through scrypt (:data:`SCRYPT`), salted with ``run_id``: 256 bits, as 64 hex digits, which
    :func:`key_bits` counts as strong, so that a stretched key handed on as is is not stretched again."""
    return hashlib.scrypt(key.encode(), salt=f"diloco-run-key:{run_id}".encode(), dklen=32, maxmem=2 ** 28,
                          **SCRYPT).hex()


@dataclass(frozen=True)
class RunKey:
    """The run key an island uses, and the file that holds it on this server."""

    key: str
    """What signs the run's records and authenticates its connections: the key as found, or stretched."""
    file: Path
    """The file on this server that holds it: a copy of it lets another server's island join the run."""


def write_private(path: Path, text: str, replace: bool = True) -> bool:
    """Write ``text`` to ``path`` atomically, readable by its owner alone from the first byte on (the temporary file
    is created mode 600, not changed to it afterwards).  ``replace`` False leaves a file already there as it is
    (two islands generating a key into one file at once: one wins, both read it); returns whether it wrote."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        if replace:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
    finally:
        tmp.unlink(missing_ok=True)


def _read_key_file(path: Path) -> str:
    """The key in ``path`` (its first line, stripped), or :class:`RunKeyError` in one line."""
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise RunKeyError(f"cannot read the run key file {path} ({why}); make it readable by this user") from None
    key = text.strip().splitlines()[0].strip() if text.strip() else ""
    if not key:
        raise RunKeyError(f"the run key file {path} is empty; copy there the run key file of the island that "
                          f"started the run (its join line names it)")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("the run key file %s can be read by other users of this server (mode %o): chmod 600 %s",
                    path, stat.S_IMODE(mode), path)
    return key


def obtain_run_key(given: str, key_file: str, default_file: Path, run_id: str, *, read_default: bool,
                   first: bool) -> RunKey:
    """The run key of a private run, and the file that holds it on this server.

    Looked for, in order: ``given`` (``--averaging.run_key``: it works, with a warning that ``ps`` and the shell
    history show it), the ``DILOCO_RUN_KEY`` environment variable, the file ``key_file`` (``--averaging.run_key_file``)
    or else ``default_file`` when ``read_default`` (an island resuming: it kept its key there).  Where none is found,
    the ``first`` island of a run writes a fresh key into that file (mode 600, atomically); an island joining
    one is told how to get it (:class:`RunKeyError`).  A key from the command line or the environment is kept in
    ``default_file`` (stretched, if it was), for a restart and for copying to the other servers.  A key estimated
    below :data:`KEY_BITS` bits (:func:`key_bits`) is stretched (:func:`stretch`, salted with ``run_id``), and the
    log says so: every island of the run derives the same key from it, whichever way each was given it.
    """
    path = Path(key_file) if key_file else default_file
    if given:
        raw, origin = given, "--averaging.run_key"
        log.warning("--averaging.run_key shows the run key to anyone who lists this server's processes (ps) and keeps "
                    "it in the shell history: put it in a file (--averaging.run_key_file, mode 600) or in the %s "
                    "environment variable instead", ENV)
    elif os.environ.get(ENV, "").strip():
        raw, origin = os.environ[ENV].strip(), ENV
    elif (key_file or read_default) and path.is_file():
        raw, origin = _read_key_file(path), str(path)
    elif first:
        wrote = write_private(path, new_run_key() + "\n", replace=not key_file)
        log.info("%s the run key file %s (mode 600)", "generated" if wrote else "another island generated first",
                 path)
        return RunKey(_read_key_file(path), path)
    elif key_file:
        raise RunKeyError(f"the run key file {path} does not exist: copy there the run key file named in the join "
                          f"line of the island that started the run (or set {ENV})")
    else:
        raise RunKeyError(f"this run is private: copy the run key file named in the join line of the island that "
                          f"started it to this server and pass --averaging.run_key_file FILE (or set {ENV}; or "
                          f"--averaging.public true if the run is public)")
    key = raw
    bits = key_bits(raw)
    if bits < KEY_BITS:
        t0 = time.perf_counter()
        key = stretch(raw, run_id)
        log.warning("the run key from %s has about %.0f bits of entropy by its length and characters, short of %d: "
                    "stretched with scrypt (N=2^%d, r=%d, p=%d, salted with the run id) in %.2f s, so that every "
                    "guess at it costs as much; a generated key needs none", origin,
                    bits, KEY_BITS, int(math.log2(SCRYPT["n"])), SCRYPT["r"], SCRYPT["p"], time.perf_counter() - t0)
    if origin == str(path):
        return RunKey(key, path)
    write_private(default_file, key + "\n")
    return RunKey(key, default_file)


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


KEY_PROOF_TTL = 3600.0
"""Seconds an island's proof of the run key lives in the DHT; it is published again at half that while the island
runs (:func:`keep_key_proof`), so that a joiner with a wrong key an hour into the run still finds one to be told by."""


def publish_key_proof(dht: hivemind.DHT, prefix: str, run_key: str, timeout: float,
                      ttl: float = KEY_PROOF_TTL) -> None:
    """Store this rank's proof of ``run_key`` (:func:`key_proof`) under the run's key-check key for ``ttl`` s."""
    me = str(dht.peer_id)
    store_owned(dht, key_check_key(prefix), key_proof(run_key, me), get_dht_time() + ttl, timeout=timeout)


def keep_key_proof(dht: hivemind.DHT, prefix: str, run_key: str, ttl: float = KEY_PROOF_TTL) -> threading.Thread:
    """Publish this rank's proof again every ``ttl / 2`` s in a daemon thread, until its DHT stops."""
    def refresh() -> None:
        next_at = time.monotonic() + ttl / 2
        while dht.is_alive():
            if time.monotonic() >= next_at:
                try:
                    publish_key_proof(dht, prefix, run_key, timeout=30.0, ttl=ttl)
                except DHTUnavailableError as e:
                    log.debug("could not refresh the key proof: %s", e)
                next_at = time.monotonic() + ttl / 2
            time.sleep(min(1.0, ttl / 4))

    thread = threading.Thread(target=refresh, name="key-proof", daemon=True)
    thread.start()
    return thread


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
        publish_key_proof(dht, prefix, run_key, timeout)
        while True:
            found = dht_get(dht, key, timeout=max(1.0, deadline - time.monotonic()))
            reads += 1
            for pid, (proof, _) in owned_items(found, key).items():
                if pid == me:
                    continue
                if proof == key_proof(run_key, pid):
                    return ""
                foreign.add(pid)
            if time.monotonic() > deadline or (time.monotonic() > quiet_until and (not foreign or reads >= 2)):
                break  # nobody else proved anything (a new run, or bootstrap nodes only), or twice another key
            time.sleep(0.5)
    except DHTUnavailableError:
        return ""
    if not foreign:
        return ""
    return (f"the {len(foreign)} island(s) of run {prefix!r} reachable from here hold another run key: use a copy "
            f"of the run key file named in the join line of the island that started the run "
            f"(--averaging.run_key_file FILE, or its content in {ENV})")
