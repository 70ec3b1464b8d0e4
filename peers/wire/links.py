"""The connections a rank sends on: a few to each rank it sends to, each carrying one message at a time from
its first byte to its acknowledgement.

A message waits for its acknowledgement on its connection, so several in flight to one rank need several
connections (``streams`` at most to a rank, made on first use); over a long round trip they also fill more of the
link than one TCP window does.  A connection that fails before the acknowledgement is dropped at once, so that a
message queued behind it opens a new one instead of failing on the dead one; the sender
(:meth:`peers.wire.transport.Transport.send`) sends the message again on it.  A connection left idle for
:data:`REUSE_IDLE` seconds is not used again but closed: its receiver ends connections idle for longer
(:data:`IDLE`), and a message written into one it just ended would have to be sent twice.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from peers.wire.secure import Link

Buffer = bytes | bytearray | memoryview

IDLE = 900.0
"""Seconds a receiver keeps a connection that carries nothing before it ends it."""
REUSE_IDLE = 600.0
"""Seconds after its last message that a sender still sends on a connection (less than :data:`IDLE`)."""


@dataclass
class _Slot:
    """One connection to a rank (made on first use, made again after a failure or a long idle time)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    link: Link | None = None
    used: float = 0.0


class Links:
    """This rank's connections to the ranks it sends to: ``dial(endpoint, deadline)`` makes a new one (after its
    handshake), ``streams`` at most to one endpoint."""

    def __init__(self, dial: Callable[[str, float], Link], streams: int):
        self.dial, self.streams = dial, max(1, streams)
        self._pools: dict[str, list[_Slot]] = {}
        self._turn = 0
        self._lock = threading.Lock()

    def deliver(self, endpoint: str, key: str, meta: bytes, payload: Buffer, deadline: float,
                fault: Callable[[str], bool] | None = None, tamper: Callable[[str], bool] | None = None) -> None:
        """Write one message to ``endpoint`` and wait for its acknowledgement, on a free connection (or a new one),
        by ``deadline``; OSError when the connection failed (it is dropped), or when none could be made.
        ``fault(key)`` True cuts the connection half-way through the payload, ``tamper(key)`` True flips a bit
        of it (tests; :meth:`peers.wire.secure.Link.write_frame`)."""
        slot = self._take(endpoint)
        try:
            now = time.monotonic()
            if slot.link is not None and now - slot.used > REUSE_IDLE:
                self._drop(slot)
            link = slot.link or self.dial(endpoint, deadline)
            slot.link = link
            link.sock.settimeout(max(0.05, deadline - time.monotonic()))
            link.tamper = tamper
            link.write_frame(key, meta, payload, cut=fault is not None and fault(key))
            link.read_ack()
            slot.used = time.monotonic()
        except OSError:
            # dropped before the lock is let go: a message queued behind this one on the same
            # connection opens a new one instead of failing on the dead one (and moving twice)
            self._drop(slot)
            raise
        finally:
            slot.lock.release()

    @staticmethod
    def _drop(slot: _Slot) -> None:
        if slot.link is not None:
            slot.link.sock.close()
            slot.link = None

    def _take(self, endpoint: str) -> _Slot:
        """One of this rank's connections to ``endpoint``, its lock held: a free one, else the next in turn once
        it is free."""
        n = self.streams
        with self._lock:
            pool = self._pools.setdefault(endpoint, [_Slot() for _ in range(n)])
            self._turn += 1
            turn = self._turn
        for slot in pool:
            if slot.lock.acquire(blocking=False):
                return slot
        slot = pool[turn % n]
        slot.lock.acquire()
        return slot

    def links(self) -> list[Link]:
        """The connections open now."""
        with self._lock:
            return [s.link for pool in self._pools.values() for s in pool if s.link is not None]

    def close(self) -> None:
        """End every connection (a message in flight on one fails)."""
        with self._lock:
            slots = [s for pool in self._pools.values() for s in pool]
        for slot in slots:
            link, slot.link = slot.link, None
            if link is not None:
                try:
                    link.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                link.sock.close()


__all__ = ["Links", "IDLE", "REUSE_IDLE"]
