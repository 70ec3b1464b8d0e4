"""DHT calls that cannot hang: a lookup stops waiting when the DHT's process goes away mid-call."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from peers.discovery.calls import DHTUnavailableError, dht_get


class _DyingDHT:
    """Stands in for a DHT whose process exits while a lookup waits (it never answers)."""

    def __init__(self, dies_after: float):
        self.alive = True
        self.timer = threading.Timer(dies_after, lambda: setattr(self, "alive", False))
        self.timer.daemon = True
        self.timer.start()

    def is_alive(self) -> bool:
        return self.alive

    def get(self, key, latest, return_future):
        return concurrent.futures.Future()


def test_a_lookup_ends_when_the_dht_process_exits_not_at_its_timeout():
    dht = _DyingDHT(dies_after=0.5)
    t0 = time.monotonic()
    with pytest.raises(DHTUnavailableError, match="the DHT process exited"):
        dht_get(dht, "key", timeout=60)
    assert time.monotonic() - t0 < 30, "the lookup waited out its timeout for a DHT that was gone"


def test_a_lookup_a_live_dht_never_answers_ends_at_its_timeout():
    with pytest.raises(DHTUnavailableError, match="did not answer a lookup within 1 s"):
        dht_get(_DyingDHT(dies_after=3600), "key", timeout=1)


def test_identity_folders_of_processes_that_are_gone_are_swept(tmp_path):
    """A SIGKILLed island never runs its exit handlers: its folder of ephemeral DHT identities stayed in /tmp (51 of
    them on the development machine).  The next process to make one removes those whose process is gone, and only
    those."""
    import os
    import subprocess
    import sys

    from peers.discovery.dht import IDENTITIES_PREFIX, sweep_identities

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead = tmp_path / f"{IDENTITIES_PREFIX}{gone.stdout.strip()}-abc"
    live = tmp_path / f"{IDENTITIES_PREFIX}{os.getpid()}-def"
    older = tmp_path / f"{IDENTITIES_PREFIX}xyz"  # a folder of before this change: no pid to tell by
    for folder in (dead, live, older):
        folder.mkdir()
        (folder / "a.key").write_bytes(b"key")
    assert sweep_identities(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and live.exists() and older.exists()
