"""DHT reads and writes that cannot hang.

hivemind's ``DHT.store`` and ``DHT.get`` wait without a limit for the DHT's own process.  When that
process or its p2p daemon is gone (SIGTERM sent to a whole process group, as ``docker stop`` and
systemd do, or the OOM killer) they would block the island forever instead of letting it checkpoint
and leave.  Every DHT read and write of ours goes through these two functions instead.
"""

from __future__ import annotations

import time
from typing import Any

import hivemind

ALIVE_CHECK = 0.5
"""Seconds between two checks, while waiting for an answer, that the DHT's process is still there."""


class DHTUnavailableError(RuntimeError):
    """The DHT did not answer in time, or its process is gone."""


def _result(dht: hivemind.DHT, future: Any, timeout: float, what: str) -> Any:
    """The future's result, or :class:`DHTUnavailableError` after ``timeout`` s or as soon as the DHT's
    process is gone (its answer would then never come)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return future.result(timeout=max(0.0, min(ALIVE_CHECK, deadline - time.monotonic())))
        except TimeoutError:
            if not dht.is_alive():
                raise DHTUnavailableError("the DHT process exited") from None
            if time.monotonic() >= deadline:
                raise DHTUnavailableError(f"the DHT did not {what} within {timeout:.0f} s") from None


def dht_store(dht: hivemind.DHT, key: str, subkey: Any, value: Any, expiration_time: float,
              timeout: float) -> bool:
    """``dht.store`` waiting at most ``timeout`` seconds; raises :class:`DHTUnavailableError`."""
    if not dht.is_alive():
        raise DHTUnavailableError("the DHT process exited")
    future = dht.store(key, subkey=subkey, value=value, expiration_time=expiration_time, return_future=True)
    return bool(_result(dht, future, timeout, "store a value"))


def dht_get(dht: hivemind.DHT, key: str, timeout: float, beam_size: int | None = None) -> Any:
    """``dht.get(key, latest=True)`` waiting at most ``timeout`` seconds; raises :class:`DHTUnavailableError`.
    ``beam_size``: how many of the nodes nearest the key the search keeps (hivemind's default: 20); every node it
    visits that holds the key answers with all of it."""
    if not dht.is_alive():
        raise DHTUnavailableError("the DHT process exited")
    extra = {} if beam_size is None else {"beam_size": beam_size}
    return _result(dht, dht.get(key, latest=True, return_future=True, **extra), timeout, "answer a lookup")
