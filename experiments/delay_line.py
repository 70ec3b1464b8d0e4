"""A userspace delay line: latency, jitter, random loss, rate caps and NAT between emulated hosts.

The kernel's ``sch_netem`` is missing on many machines (containers, minimal VMs); this module does
what netem and tbf would do, in one Python process, so that :class:`experiments.netns.EmulatedNetwork`
can emulate links with latency and loss everywhere it can create TUN devices.

One **forwarder** process owns a TUN device ``tun0`` in each host's network namespace (IPv4, no
packet-info header) and lives itself in the network's hub namespace, so that killing every process of
the network's namespaces (``close()``, ``cleanup_stale()``) ends it too; it also exits when the process
that started it dies. A packet that host ``s`` writes to its ``tun0`` for host ``d``

1. leaves through ``s``'s **uplink**, a token bucket at ``s``'s up rate. The uplink behaves like a NIC:
   while it is more than a few milliseconds behind, the forwarder stops reading ``s``'s TUN, so the
   queue builds in ``s``'s own kernel (where TCP Small Queues keep it short), and the uplink drops nothing;
2. is lost with probability ``loss``, after it crossed the uplink;
3. travels ``rtt_ms / 2`` (± a uniform ``jitter_ms``, never reordering the packets from ``s`` to ``d``);
4. enters ``d``'s **downlink**, a token bucket at ``d``'s down rate with a queue of ``queue_ms``
   (tail drop, as tbf's ``latency``), and is written to ``d``'s TUN when the bucket lets it go.

A host marked ``nat`` cannot be reached by a new TCP connection (a SYN without ACK addressed to it is
dropped), while its own outward connections and their replies pass; other traffic passes as is. ``nat_kind``
says which SYNs it lets in after all:

- ``"cone"`` (the default): a NAT that keeps a connection's port on the way out, whatever its destination,
  and lets in what comes from an address and port it sent a SYN to within the last ``NAT_MAPPING_S`` (RFC 4787's
  endpoint-independent mapping with address- and port-dependent filtering, the commonest kind). Two hosts behind
  such NATs connect to each other when each sends a SYN to the other's port at about the same time (TCP hole
  punching, a simultaneous open);
- ``"symmetric"``: a NAT that gives every destination its own port, so that no peer ever learns the port a SYN
  would have to reach: no inbound SYN passes.

A host with a **firewall** (``open_ports``) is reached by a new TCP connection only on the ports listed (a SYN
without ACK for any other port is dropped); its own connections and their replies pass, as through a stateful
firewall that accepts inbound connections on those ports only.

A NAT also translates addresses, as real ones do: a host behind it has a private address on its own TUN device
(``private``), which no other host can reach (a packet for it is unroutable), and the forwarder rewrites it to the
host's public ``address`` on the way out and back on the way in (ports are kept, as Linux's masquerading keeps
them while they are free), fixing the IP and TCP/UDP checksums.  A peer therefore sees a NATed host's
connections come from its public address, and only an announced public address can be reached or punched.

Packet rates, not bytes, cost Python its time, so the TUN devices get a large MTU (``DEFAULT_MTU``):
the kernel hands over segments of up to that size and TCP acknowledges fewer of them. Pacing is exact
to the time the event loop wakes (``select`` with the next deadline as its timeout, microseconds).

This file imports nothing outside the standard library: the forwarder runs it as a script
(``python delay_line.py CONFIG_JSON``), from wherever the repository lies.
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import itertools
import json
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

TUN_NAME = "tun0"
DEFAULT_MTU = 16000
"""MTU of the TUN devices: 10x Ethernet's jumbo-free 1500 cuts the packet rate the forwarder handles by
10x at a given bit rate; the IP and TCP headers then cost 0.3% of a full segment instead of 3.5%."""

_CLONE_NEWNET = 0x40000000
_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_READY = "ready"
_READ_BATCH = 64  # packets read from one TUN per wake-up, so that no host starves the others
_PARENT_CHECK_S = 0.5
_STARTUP_TIMEOUT_S = 15.0
NAT_KINDS = ("cone", "symmetric")
NAT_MAPPING_S = 120.0
"""How long a cone NAT lets in SYNs from where its host last sent a SYN (Linux's conntrack keeps an unanswered
SYN that long)."""


def bucket_bytes(rate_bits: float, frame: int) -> int:
    """Size of a token bucket at ``rate_bits``: at least 5 ms of traffic (a timer's granularity) and a
    frame of ``frame`` bytes, so that a full-size packet always fits."""
    return max(int(rate_bits / 8 * 0.005), int(frame))


@dataclass(frozen=True)
class Endpoint:
    """One host as the forwarder sees it."""

    namespace: str  # the host's network namespace (a name under /var/run/netns)
    address: str  # its IPv4 address on its TUN device
    up_bits: float  # uplink rate, bits/s
    down_bits: float  # downlink rate, bits/s
    nat: bool = False  # behind NAT: accepts no inbound TCP connection (but see nat_kind)
    private: str = ""  # behind NAT: the address on its own TUN device, which its NAT rewrites to ``address``
    open_ports: tuple[int, ...] | None = None  # behind a firewall: the only ports new TCP connections reach (None: any)


@dataclass(frozen=True)
class DelayLineConfig:
    """What the forwarder emulates; the JSON form travels on its command line."""

    hub: str  # namespace the forwarder lives in
    hosts: tuple[Endpoint, ...]
    rtt_ms: float = 0.0
    jitter_ms: float = 0.0  # each one-way delay is rtt_ms/2 ± a uniform jitter_ms
    loss: float = 0.0  # probability that a packet is lost after it crossed the sender's uplink
    queue_ms: float = 50.0  # longest a packet waits in a downlink before it is dropped
    mtu: int = DEFAULT_MTU
    seed: int | None = None  # of jitter and loss; None: a fresh one
    nat_kind: str = "cone"  # which SYNs a host behind NAT lets in: see the module's docstring

    def to_json(self) -> str:
        """The config as one JSON string."""
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> DelayLineConfig:
        """The config written by :meth:`to_json`."""
        raw = json.loads(text)
        raw["hosts"] = tuple(Endpoint(**dict(h, open_ports=None if h.get("open_ports") is None else
                                             tuple(h["open_ports"]))) for h in raw["hosts"])
        return DelayLineConfig(**raw)


def _checksum_after(checksum: int, old: bytes, new: bytes) -> int:
    """A 16-bit one's-complement checksum once the 4 bytes ``old`` it covers became ``new`` (RFC 1624)."""
    total = ~checksum & 0xFFFF
    for i in (0, 2):
        total += (~int.from_bytes(old[i:i + 2], "big") & 0xFFFF) + int.from_bytes(new[i:i + 2], "big")
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def translate(pkt: bytes, at: int, new: bytes) -> bytes:
    """IPv4 packet ``pkt`` with the address at byte ``at`` (12: the source, 16: the destination) set to ``new``,
    its IP checksum and, in a first fragment, its TCP or UDP checksum (which cover both addresses) fixed."""
    out = bytearray(pkt)
    old = bytes(out[at:at + 4])
    out[at:at + 4] = new
    out[10:12] = _checksum_after(int.from_bytes(out[10:12], "big"), old, new).to_bytes(2, "big")
    ihl = (out[0] & 0x0F) * 4
    spot = {6: ihl + 16, 17: ihl + 6}.get(out[9])
    if spot is not None and not (out[6] & 0x1F or out[7]) and len(out) >= spot + 2:
        checksum = int.from_bytes(out[spot:spot + 2], "big")
        if out[9] == 6 or checksum:  # a UDP checksum of 0 means none
            fixed = _checksum_after(checksum, old, new)
            if out[9] == 17 and not fixed:
                fixed = 0xFFFF  # UDP writes a computed 0 as its one's complement twin
            out[spot:spot + 2] = fixed.to_bytes(2, "big")
    return bytes(out)


# --------------------------------------------------------------------------- namespaces and TUN devices

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _enter(namespace: str) -> None:
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        _setns(fd)
    finally:
        os.close(fd)


def open_tun(namespace: str, name: str = TUN_NAME) -> int:
    """Create TUN device ``name`` in ``namespace`` and return its non-blocking fd.

    The calling thread enters ``namespace`` only while it opens the device, then returns to its own
    namespace; the device lives as long as the fd (it vanishes when the process exits).
    """
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        _enter(namespace)
        try:
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(), _IFF_TUN | _IFF_NO_PI))
            except OSError:
                os.close(fd)
                raise
        finally:
            _setns(home)
    finally:
        os.close(home)
    os.set_blocking(fd, False)
    return fd


# --------------------------------------------------------------------------- the forwarder

_ARRIVE, _DELIVER = 0, 1  # event kinds: a packet reaches a downlink; a packet leaves it for the host


class Forwarder:
    """The event loop between the hosts' TUN fds (``fds[i]`` belongs to ``cfg.hosts[i]``)."""

    def __init__(self, cfg: DelayLineConfig, fds: list[int]):
        if len(fds) != len(cfg.hosts):
            raise ValueError(f"{len(cfg.hosts)} hosts need as many TUN fds, got {len(fds)}")
        self.cfg = cfg
        self.fds = fds
        self.rng = random.Random(cfg.seed)
        self.counts = {"forwarded": 0, "lost": 0, "queue_drops": 0, "nat_drops": 0, "firewall_drops": 0,
                       "unroutable": 0}

    def run(self, parent: int | None = None) -> None:
        """Forward packets until the process ``parent`` is gone (forever when ``None``)."""
        cfg, fds, rng, counts = self.cfg, self.fds, self.rng, self.counts
        n = len(fds)
        route = {socket.inet_aton(h.address): i for i, h in enumerate(cfg.hosts)}
        nat = [h.nat for h in cfg.hosts]
        public = [socket.inet_aton(h.address) for h in cfg.hosts]
        private = [socket.inet_aton(h.private) if h.private else None for h in cfg.hosts]
        cone = cfg.nat_kind == "cone"
        # the destination ports (as on the wire) each host's firewall lets new connections in on; None: every one
        firewall = [None if h.open_ports is None else {p.to_bytes(2, "big") for p in h.open_ports}
                    for h in cfg.hosts]
        # (host behind a cone NAT, its port, remote address, remote port) -> when it last sent a SYN there
        opened: dict[tuple[int, bytes, bytes, bytes], float] = {}
        up_bytes_s = [h.up_bits / 8 for h in cfg.hosts]
        down_bytes_s = [h.down_bits / 8 for h in cfg.hosts]
        up_burst_s = [bucket_bytes(h.up_bits, cfg.mtu) * 8 / h.up_bits for h in cfg.hosts]
        down_burst_s = [bucket_bytes(h.down_bits, cfg.mtu) * 8 / h.down_bits for h in cfg.hosts]
        # a NIC's ring: how far the uplink may run behind before the host's TUN is left unread; wide enough
        # that the link does not idle while the loop is late to wake
        backlog_s = [max(0.005, 2 * cfg.mtu * 8 / h.up_bits) for h in cfg.hosts]
        up_free = [0.0] * n  # virtual time at which each token bucket has sent all it was given
        down_free = [0.0] * n
        last_arrival = [[0.0] * n for _ in range(n)]  # per direction of a host pair: no reordering
        one_way = cfg.rtt_ms / 2000
        jitter = cfg.jitter_ms / 1000
        loss = cfg.loss
        queue_s = cfg.queue_ms / 1000
        mtu = cfg.mtu
        heap: list[tuple[float, int, int, int, bytes]] = []
        seq = itertools.count()
        fd_host = {fd: i for i, fd in enumerate(fds)}
        clock, read, write, push, pop = time.monotonic, os.read, os.write, heapq.heappush, heapq.heappop

        def downlink(t: float, dst: int, pkt: bytes, now: float) -> None:
            """Packet ``pkt`` reaches ``dst``'s downlink at ``t``: drop it, or deliver it now if it may leave by
            ``now`` (a time by which every earlier packet for ``dst`` has been delivered), else schedule it."""
            start = max(down_free[dst], t - down_burst_s[dst])
            if start - t > queue_s:
                counts["queue_drops"] += 1
                return
            free = start + len(pkt) / down_bytes_s[dst]
            down_free[dst] = free
            if free > now:
                push(heap, (free, next(seq), _DELIVER, dst, pkt))
            else:
                deliver(dst, pkt)

        def deliver(dst: int, pkt: bytes) -> None:
            try:
                write(fds[dst], pkt)
                counts["forwarded"] += 1
            except OSError:  # the host's device is down or its backlog full: the packet is lost there
                counts["queue_drops"] += 1

        readable: list[int] = []
        next_parent_check = 0.0
        while True:
            now = clock()
            # due events first: a packet read below may then go straight through without overtaking one
            while heap and heap[0][0] <= now:
                t, _, kind, dst, pkt = pop(heap)
                if kind == _ARRIVE:
                    # not by `now`: a delivery to dst due between t and now is still in the heap
                    downlink(t, dst, pkt, t)
                else:
                    deliver(dst, pkt)
            for fd in readable:
                src = fd_host[fd]
                for _ in range(_READ_BATCH):
                    if up_free[src] - now > backlog_s[src]:
                        break
                    try:
                        pkt = read(fd, mtu)
                    except BlockingIOError:
                        break
                    if len(pkt) < 20 or pkt[0] >> 4 != 4:
                        counts["unroutable"] += 1  # not IPv4 (hosts have IPv6 off)
                        continue
                    dst = route.get(pkt[16:20])
                    if dst is None or dst == src:
                        counts["unroutable"] += 1
                        continue
                    if private[src] is not None and pkt[12:16] == private[src]:  # out through its NAT
                        pkt = translate(pkt, 12, public[src])
                    if (nat[dst] or nat[src] and cone or firewall[dst] is not None) and pkt[9] == 6 and not (
                            pkt[6] & 0x1F or pkt[7]):
                        ihl = (pkt[0] & 0x0F) * 4  # TCP, first fragment
                        if len(pkt) > ihl + 13 and pkt[ihl + 13] & 0x02:  # a SYN
                            ports = pkt[ihl:ihl + 2], pkt[ihl + 2:ihl + 4]
                            if firewall[dst] is not None and not pkt[ihl + 13] & 0x10 and ports[1] not in firewall[dst]:
                                counts["firewall_drops"] += 1  # a new connection to a port the firewall keeps shut
                                continue
                            if nat[src] and cone:
                                opened[src, ports[0], pkt[16:20], ports[1]] = now
                                if len(opened) > 4096:
                                    opened = {k: t for k, t in opened.items() if now - t < NAT_MAPPING_S}
                            if nat[dst] and not pkt[ihl + 13] & 0x10 and not (
                                    cone and now - opened.get((dst, ports[1], pkt[12:16], ports[0]), -1e9)
                                    < NAT_MAPPING_S):  # a SYN without ACK, and no mapping lets it in
                                counts["nat_drops"] += 1
                                continue
                    if private[dst] is not None:  # in through its NAT
                        pkt = translate(pkt, 16, private[dst])
                    sent = max(up_free[src], now - up_burst_s[src]) + len(pkt) / up_bytes_s[src]
                    up_free[src] = sent
                    if loss and rng.random() < loss:
                        counts["lost"] += 1
                        continue
                    arrival = max(sent, now) + one_way + (rng.uniform(-jitter, jitter) if jitter else 0.0)
                    arrival = max(arrival, last_arrival[src][dst])
                    last_arrival[src][dst] = arrival
                    if arrival <= now:
                        downlink(arrival, dst, pkt, now)
                    else:
                        push(heap, (arrival, next(seq), _ARRIVE, dst, pkt))
            if parent is not None and now >= next_parent_check:
                if os.getppid() != parent:
                    return
                next_parent_check = now + _PARENT_CHECK_S
            # wait for packets from hosts whose uplink has room, or the next deadline
            wake = now + _PARENT_CHECK_S
            if heap:
                wake = min(wake, heap[0][0])
            listen = []
            for i, fd in enumerate(fds):
                if up_free[i] - now > backlog_s[i]:
                    wake = min(wake, up_free[i] - backlog_s[i])
                else:
                    listen.append(fd)
            readable = select.select(listen, [], [], max(0.0, wake - clock()))[0]


# --------------------------------------------------------------------------- process


def start_forwarder(cfg: DelayLineConfig) -> subprocess.Popen:
    """Start the forwarder for ``cfg`` as a child process and return once every TUN device exists.

    The devices are created down and without addresses: the caller configures them (``ip -n``).
    Raises ``RuntimeError`` with the forwarder's one-line reason if it cannot start.
    """
    # -I: the standard library only, never a module of this folder that happens to share a name with one of it
    p = subprocess.Popen([sys.executable, "-I", str(Path(__file__).resolve()), cfg.to_json()],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        ready = select.select([p.stdout], [], [], _STARTUP_TIMEOUT_S)[0]
        line = p.stdout.readline().strip() if ready else ""
    except BaseException:
        _stop(p)
        raise
    if line != _READY:
        _stop(p)
        raise RuntimeError(f"the delay line did not start: {line or 'no answer'}")
    return p


def _stop(p: subprocess.Popen) -> None:
    p.kill()
    p.wait()
    if p.stdout is not None:
        p.stdout.close()


def main(argv: list[str]) -> int:
    """Forwarder process: join the hub, open a TUN in every host, say ``ready``, forward until the parent dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the parent's to handle; it ends us
    parent = os.getppid()
    try:
        cfg = DelayLineConfig.from_json(argv[0])
        _enter(cfg.hub)
        fds = [open_tun(h.namespace) for h in cfg.hosts]
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        print(f"error: {e}", flush=True)
        return 1
    print(_READY, flush=True)
    sys.stdout.close()
    Forwarder(cfg, fds).run(parent)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
