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
(from ``/proc``, as ``ss -ltnp`` lists them).  The outsider's own island, started with a key of its own, is in
:mod:`experiments.hostile`.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from peers.proctable import process_trees

SLOW_PER_PORT = 24
"""Slow connections held open to each port at once (above the transport's 16 handshakes at once)."""
TRICKLE = 2.0
"""Seconds between two bytes of a slow connection."""
RESCAN = 5.0
"""Seconds between two scans for the islands' listening ports."""


def listening(pids: Iterable[int], address: str) -> list[tuple[str, int]]:
    """(process name, port) of the listening TCP sockets of ``pids`` bound to ``address`` (an IPv4 address), read
    from ``/proc`` as ``ss -ltnp`` would show them."""
    want = socket.inet_aton(address)
    ports_of_inode: dict[str, int] = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        local, state, inode = cols[1], cols[3], cols[9]
        ip_hex, port_hex = local.split(":")
        if state == "0A" and bytes.fromhex(ip_hex)[::-1] == want:  # LISTEN; the kernel writes the IP little-endian
            ports_of_inode[inode] = int(port_hex, 16)
    found = set()
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:  # gone meanwhile
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in ports_of_inode:
                found.add((name, ports_of_inode[target[8:-1]]))
    return sorted(found)


def still_open(sock: socket.socket) -> bool:
    """Whether the other end has not closed ``sock`` (nothing is ever sent to the outsider that it must keep)."""
    try:
        sock.setblocking(False)
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


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
    by_process: dict[str, dict[str, float]] = field(default_factory=dict)
    """The slow connections by the process that listens on their port (``p2pd``: hivemind's DHT daemon; the
    islands' own transport is a Python process): opened, the longest one closed by it, open at the end."""

    def slow(self, process: str) -> dict[str, float]:
        return self.by_process.setdefault(process, {"opened": 0, "longest_s": 0.0, "open_at_end": 0})

    def as_dict(self) -> dict[str, object]:
        return {"ports": sorted(self.ports), "junk": self.junk, "oversized": self.oversized,
                "slow_opened": self.slow_opened, "refused": self.refused,
                "longest_slow_s": round(self.longest_slow_s, 1), "slow_open_at_end": self.slow_open_at_end,
                "by_process": {k: {n: round(v, 1) for n, v in d.items()} for k, d in sorted(self.by_process.items())}}


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
        self._process: dict[int, str] = {}

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
                found = dict((port, name) for name, port in listening(process_trees(self.roots()), self.address))
            except OSError:
                found = {}
            with self._lock:
                new = set(found) - self.counts.ports
                self.counts.ports |= new
                self._process.update(found)
            for port in new:
                for _ in range(SLOW_PER_PORT):
                    self._spawn(self._hold_slow, port)
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
                self._once(port, oversized=False)
                self._once(port, oversized=True)
            self._stop.wait(0.5)

    def _once(self, port: int, oversized: bool) -> None:
        """One connection of junk bytes, or (``oversized``) one that takes the greeting and then names the largest
        length a prefix can and trickles into it."""
        s = self._connect(port)
        if s is None:
            return
        with s:
            try:
                if oversized:
                    s.recv(256)  # the greeting, where the listener speaks first
                    s.sendall(b"\xff\xff\xff\xff" + os.urandom(1024))
                else:
                    s.sendall(os.urandom(256))
                s.recv(1024)
            except OSError:
                pass
        with self._lock:
            if oversized:
                self.counts.oversized += 1
            else:
                self.counts.junk += 1

    def _hold_slow(self, port: int) -> None:
        while not self._stop.is_set():
            s = self._connect(port)
            if s is None:
                self._stop.wait(TRICKLE)
                continue
            opened = time.monotonic()
            with self._lock:
                self.counts.slow_opened += 1
                by = self.counts.slow(self._process.get(port, "?"))
                by["opened"] += 1
            with s:
                closed = False
                while not self._stop.is_set() and not closed:
                    try:
                        s.send(os.urandom(1))
                    except OSError:
                        closed = True
                    self._stop.wait(TRICKLE)
                    closed = closed or not still_open(s)
            with self._lock:
                if closed:  # by the island, seen within one trickle
                    lived = time.monotonic() - opened
                    self.counts.longest_slow_s = max(self.counts.longest_slow_s, lived)
                    by["longest_s"] = max(by["longest_s"], lived)
                else:
                    self.counts.slow_open_at_end += 1
                    by["open_at_end"] += 1
