"""An outsider at a run's ports: it reaches every port the islands listen on, and holds no run key.

What such a stranger on the internet can do without the key, kept up for a whole run (the ``outsider`` arm of
``diloco experiment hostile``):

- **junk**: connect, send random bytes, close;
- **oversized**: connect, take the listener's greeting, then announce the largest field a length prefix can
  name and trickle bytes into it (the island must not allocate or wait on what it is told);
- **slow**: hold :data:`SLOW_PER_PORT` connections to every port, one byte every :data:`TRICKLE` seconds, opening
  a new one whenever one is closed (a slowloris: more than the transport's cap of handshakes at once, so that an
  island's own members must still get through).

The ports are found as a scanner would find them: every listening TCP socket of the islands' process trees
(``ss``).  The outsider's own island, started with a key of its own, is in :mod:`experiments.hostile`.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from peers.proctable import descendants

SLOW_PER_PORT = 24
"""Slow connections held open to each port at once (above the transport's 16 handshakes at once)."""
TRICKLE = 2.0
"""Seconds between two bytes of a slow connection."""
RESCAN = 5.0
"""Seconds between two scans for the islands' listening ports."""


def listening(pids: Iterable[int], address: str) -> list[tuple[str, int]]:
    """(process name, port) of the listening TCP sockets of ``pids`` bound to ``address``."""
    wanted = set(pids)
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        cols = line.split()
        if len(cols) < 6 or not cols[3].startswith(f"{address}:"):
            continue
        for name, pid in re.findall(r'\("([^"]+)",pid=(\d+)', line):
            if int(pid) in wanted:
                found.append((name, int(cols[3].rsplit(":", 1)[1])))
                break
    return sorted(set(found))


def process_trees(roots: Iterable[int]) -> set[int]:
    """``roots`` and every process they started."""
    pids = set(roots)
    for root in list(pids):
        pids |= set(descendants(root))
    return pids


@dataclass
class OutsiderCounts:
    """What the outsider did and how long the islands let it hold a connection."""

    ports: set[int] = field(default_factory=set)
    junk: int = 0
    oversized: int = 0
    slow_opened: int = 0
    refused: int = 0
    """Connections the islands refused or reset at once."""
    longest_slow_s: float = 0.0
    """The longest a slow connection stayed open before the island closed it."""
    slow_open_at_end: int = 0
    """Slow connections the islands had not closed when the run ended."""

    def as_dict(self) -> dict[str, object]:
        return {"ports": sorted(self.ports), "junk": self.junk, "oversized": self.oversized,
                "slow_opened": self.slow_opened, "refused": self.refused,
                "longest_slow_s": round(self.longest_slow_s, 1), "slow_open_at_end": self.slow_open_at_end}


class Outsider:
    """Keeps up the three attacks on every port :func:`listening` finds for ``roots()`` on ``address``, in
    background threads, from :meth:`start` to :meth:`stop`, from an address of its own (``source``: on loopback,
    another address than the islands', as a stranger on the internet has)."""

    def __init__(self, roots: Callable[[], Iterable[int]], address: str = "127.0.0.1", source: str = "127.0.0.9"):
        self.roots, self.address, self.source = roots, address, source
        self.counts = OutsiderCounts()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._slow: dict[int, list[threading.Thread]] = {}

    def start(self) -> None:
        self._spawn(self._scan)
        self._spawn(self._junk_and_oversized)

    def stop(self) -> dict[str, object]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=TRICKLE + 2)
        return self.counts.as_dict()

    def _spawn(self, target: Callable[..., None], *args: object) -> threading.Thread:
        t = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(t)
        t.start()
        return t

    def _scan(self) -> None:
        while not self._stop.is_set():
            try:
                found = {port for _, port in listening(process_trees(self.roots()), self.address)}
            except (OSError, subprocess.CalledProcessError):
                found = set()
            with self._lock:
                new = found - self.counts.ports
                self.counts.ports |= found
            for port in new:
                self._slow[port] = [self._spawn(self._hold_slow, port) for _ in range(SLOW_PER_PORT)]
            self._stop.wait(RESCAN)

    def _connect(self, port: int) -> socket.socket | None:
        try:
            return socket.create_connection((self.address, port), timeout=2.0, source_address=(self.source, 0))
        except OSError:
            with self._lock:
                self.counts.refused += 1
            return None

    def _junk_and_oversized(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                ports = sorted(self.counts.ports)
            for port in ports:
                self._junk(port)
                self._oversized(port)
            self._stop.wait(0.5)

    def _junk(self, port: int) -> None:
        s = self._connect(port)
        if s is None:
            return
        with s:
            try:
                s.sendall(os.urandom(256))
                s.recv(1024)
            except OSError:
                pass
        with self._lock:
            self.counts.junk += 1

    def _oversized(self, port: int) -> None:
        s = self._connect(port)
        if s is None:
            return
        with s:
            try:
                s.recv(256)  # the greeting, where the listener speaks first
                s.sendall(b"\xff\xff\xff\xff" + os.urandom(1024))
                s.recv(1024)
            except OSError:
                pass
        with self._lock:
            self.counts.oversized += 1

    def _hold_slow(self, port: int) -> None:
        while not self._stop.is_set():
            s = self._connect(port)
            if s is None:
                self._stop.wait(TRICKLE)
                continue
            opened = time.monotonic()
            with self._lock:
                self.counts.slow_opened += 1
            with s:
                try:
                    while not self._stop.is_set():
                        s.sendall(os.urandom(1))
                        self._stop.wait(TRICKLE)
                except OSError:  # the island closed it (seen at the second byte after, at most)
                    with self._lock:
                        self.counts.longest_slow_s = max(self.counts.longest_slow_s, time.monotonic() - opened)
                    continue
            with self._lock:
                self.counts.slow_open_at_end += 1
