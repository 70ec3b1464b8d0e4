"""Bytes on the wire, as the kernel counted them, for the TCP connections of this island's peer daemons.

hivemind's traffic (all-reduce parts, votes, DHT records, state downloads) all goes through the libp2p
daemons (``p2pd``) that our DHT processes start.  The kernel keeps per-connection counters in
``tcp_info`` (bytes sent, retransmissions included, bytes received, segments each way); we read them
over netlink (``sock_diag``, the interface ``ss -ti`` uses) for every TCP socket those daemons hold.
Each segment's headers are added (IPv4 or IPv6, TCP with its timestamp option, Ethernet), so the sum
is what a counter of the island's link sees of its peer traffic (a packet the sending host's own
queue drops before the link would be counted too: servers' NIC queues rarely do).

A connection closed between two readings keeps the counts of its last reading: the bytes it moved
after that are missed (libp2p keeps connections between live peers open, so this is rare).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

from peers.proctable import descendants, process_sockets

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_DONE, NLMSG_ERROR = 3, 2
INET_DIAG_INFO = 2
ALL_TCP_STATES = 0xFFFFFFFF
ETHERNET_HEADER = 14
TCPI_OPT_TIMESTAMPS = 1
# offsets in struct tcp_info (linux/tcp.h); bytes_sent exists since Linux 4.19
_OPTIONS, _BYTES_RECEIVED, _SEGS_OUT, _SEGS_IN, _BYTES_SENT = 5, 128, 136, 140, 200
_DIAG_MSG = 72  # sizeof(struct inet_diag_msg)


@dataclass(frozen=True)
class WireBytes:
    """Bytes of Ethernet frames sent and received (payload plus every segment's headers)."""

    sent: int = 0
    received: int = 0

    def __add__(self, other: WireBytes) -> WireBytes:
        return WireBytes(self.sent + other.sent, self.received + other.received)

    def __sub__(self, other: WireBytes) -> WireBytes:
        return WireBytes(self.sent - other.sent, self.received - other.received)


@dataclass(frozen=True)
class Traffic:
    """An island's slow-link traffic over some stretch of a run, summed over its ranks: what went on the wire (the
    kernel's counts, see :class:`WireBytes`) and the pseudo-gradient payload alone."""

    bytes_sent: int = 0
    bytes_received: int = 0
    payload_bytes_sent: int = 0
    payload_bytes_received: int = 0


def _frame_bytes(family: int, info: bytes) -> WireBytes:
    """Frame bytes of one connection from its ``tcp_info``."""
    if len(info) < _BYTES_SENT + 8:
        raise OSError("this kernel's tcp_info has no bytes_sent (Linux 4.19 or newer is needed)")
    tcp = 20 + (12 if info[_OPTIONS] & TCPI_OPT_TIMESTAMPS else 0)
    header = ETHERNET_HEADER + (20 if family == socket.AF_INET else 40) + tcp
    received, = struct.unpack_from("=Q", info, _BYTES_RECEIVED)
    segs_out, segs_in = struct.unpack_from("=II", info, _SEGS_OUT)
    sent, = struct.unpack_from("=Q", info, _BYTES_SENT)
    return WireBytes(sent + segs_out * header, received + segs_in * header)


def tcp_connections(family: int) -> dict[int, WireBytes]:
    """Frame bytes of every TCP socket of one address family visible to us, by socket inode."""
    out: dict[int, WireBytes] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
        req = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), ALL_TCP_STATES)
        req += bytes(48)  # inet_diag_sockid: any
        nl.send(struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + req)
        while True:
            data = nl.recv(1 << 20)
            pos = 0
            while pos + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, pos)
                if kind == NLMSG_DONE:
                    return out
                if kind == NLMSG_ERROR:
                    raise OSError("the kernel refused the socket statistics query (sock_diag)")
                msg = data[pos + 16:pos + length]
                inode, = struct.unpack_from("=I", msg, 68)
                apos = _DIAG_MSG
                while apos + 4 <= len(msg):
                    alen, atype = struct.unpack_from("=HH", msg, apos)
                    if alen < 4:
                        break
                    if atype == INET_DIAG_INFO:
                        out[inode] = _frame_bytes(family, msg[apos + 4:apos + alen])
                    apos += (alen + 3) & ~3
                pos += (length + 3) & ~3


def daemons(root: int, name: str = "p2pd") -> list[int]:
    """Processes called ``name`` among the descendants of ``root`` (from every process's parent in ``/proc``:
    the kernel's lists of children can miss some while other processes start and exit)."""
    return sorted(pid for pid, stat in descendants(root).items() if stat.name == name)


class WireCounter:
    """Bytes moved over the TCP connections of the ``p2pd`` daemons under process ``root`` (a hivemind
    DHT's process), or with ``own=True`` of this process itself (gloo), and over the sockets ``extra()``
    names (a :class:`peers.wire.transport.Transport`'s), since those connections opened.

    ``take()`` returns ``None`` where the kernel cannot tell (not Linux, no sock_diag): callers then
    fall back to what the exchange computed it sent, and say so."""

    def __init__(self, root: int | None = None, own: bool = False, sample_every: float = 1.0,
                 extra: Callable[[], set[int]] | None = None):
        self.own = own
        self.pids = (lambda: [os.getpid()]) if own else (lambda: daemons(root if root is not None else os.getpid()))
        self.extra = extra
        self._last: dict[int, WireBytes] = {}
        self._closed = self._taken = WireBytes()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if sample_every > 0:  # so that a connection closed between two takes loses at most this much
            threading.Thread(target=self._sample, args=(sample_every,), daemon=True, name="wire-counter").start()

    def _sample(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                with self._lock:
                    self._total()
            except OSError:
                return

    def close(self) -> None:
        """Stop sampling in the background."""
        self._stop.set()

    def _total(self) -> WireBytes:
        mine = process_sockets(self.pids())
        if not self.own:
            # a daemon started after this process opened its process group's connections holds them too (they
            # are inherited down the DHT's fork): an island of several ranks counted its in-server gloo
            # traffic as slow-link bytes, 200x the round's
            mine -= process_sockets([os.getpid()])
        mine |= self.extra() if self.extra is not None else set()
        now: dict[int, WireBytes] = {}
        for family in (socket.AF_INET, socket.AF_INET6):
            now.update({i: b for i, b in tcp_connections(family).items() if i in mine})
        for inode, seen in self._last.items():
            if inode not in now:
                self._closed += seen
        self._last = now
        return sum(now.values(), self._closed)

    def take(self) -> WireBytes | None:
        """Frame bytes sent and received since the previous ``take`` (``None``: not available here)."""
        try:
            with self._lock:
                total = self._total()
        except OSError:
            return None
        new, self._taken = total - self._taken, total
        return new


def ring_allreduce_bytes(num_bytes: int, workers: int) -> int:
    """Bytes one worker sends (and receives) in a ring all-reduce of ``num_bytes``: 2·(k−1)/k of it."""
    if workers <= 1:
        return 0
    return int(2 * num_bytes * (workers - 1) / workers)
