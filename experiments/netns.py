"""Emulated slow links between "hosts" on one Linux machine.

Each host is a network namespace ``<prefix><run_id>-h<i>`` with one interface
``eth0`` (address ``10.77.<subnet>.<i+1>/24``) joined by a veth pair to a
bridge that lives in a dedicated hub namespace ``<prefix><run_id>-hub``.
Nothing is created in (or changed about) the root namespace: every veth pair
is created inside a host namespace with its peer moved straight into the hub,
so the root namespace's interfaces, addresses and routes are never touched.

Bandwidth is capped with a token-bucket filter (``tc ... tbf``) on both
directions of every host link: on the egress of the host-side ``eth0``
(host -> bridge) and on the egress of the bridge-side port ``v<i>``
(bridge -> host). So each host has a symmetric access link of ``rate``;
traffic from host A to host B crosses A's uplink and B's downlink, and
several flows leaving one host share its uplink, as on a real network.

Latency (``rtt_ms``), jitter, random loss and hosts behind NAT come from a
userspace delay line (:mod:`experiments.delay_line`) where the kernel has no
``sch_netem``, or where more than latency is asked: the hosts then have no veth
and no bridge but a TUN device ``tun0`` each (same addresses), and one
forwarder process in the hub namespace carries every packet between them,
pacing each host's uplink and downlink at ``rate`` as tbf would. Where netem
exists, a network with latency alone keeps the veth/bridge/tbf path and netem
adds a quarter of ``rtt_ms`` at each of the two egress points of a path and
direction. ``delay_line=True`` or ``False`` picks the path explicitly.

``partition(sides)`` cuts the running network in two or more sides: packets from one side to another vanish on
the sender's interface (connections time out, nothing is refused), as in a real network partition; ``heal()``
joins them again.

Typical use::

    ok, why = available()
    if not ok:
        print(why)                      # and fall back to loopback
    with EmulatedNetwork(4, rate="20mbit") as net:
        procs = [subprocess.Popen(net.wrap([sys.executable, "worker.py",
                 "--host", h.local_address], i)) for i, h in enumerate(net.hosts)]
        ...

``close()`` (also run by ``__exit__``, by SIGINT/SIGTERM/SIGHUP handlers
installed while the network exists, and at interpreter exit) kills every
process still running inside the network's namespaces (the delay line's
forwarder lives in the hub namespace, so it is one of them), then deletes the
namespaces (which removes their links). ``cleanup_stale()`` removes leftovers
of an earlier run that was SIGKILLed.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from experiments.delay_line import (
    DEFAULT_MTU,
    NAT_KINDS,
    TUN_NAME,
    DelayLineConfig,
    Endpoint,
    bucket_bytes,
    start_forwarder,
)
from peers.proctable import is_running, read_stat

DEFAULT_PREFIX = "dlc-"
FALLBACK_NOTE = "running on loopback without a bandwidth cap"
_REGISTRY = Path("/run/diloco-netns")  # owner pid of each live network
_HANDLED_SIGNALS = tuple(
    s for s in (getattr(signal, n, None) for n in ("SIGINT", "SIGTERM", "SIGHUP")) if s is not None
)
_CMD_TIMEOUT = 15.0
_CUT_DEVICE = "cut0"  # in a host of a partitioned network: where the packets beyond the cut vanish


class NetworkSetupError(RuntimeError):
    """An ``ip``/``tc`` command failed, or a requested feature is missing."""


# --------------------------------------------------------------------------- rates

_RATE_UNITS = {
    "": 1.0,
    "bit": 1.0,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "kibit": 2.0**10,
    "mibit": 2.0**20,
    "gibit": 2.0**30,
    "tibit": 2.0**40,
}
_RATE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e([+-]?[0-9]+))?\s*([a-z]*)(?:/s)?\s*$")


def parse_rate(rate: str | int | float) -> float:
    """Parse a link rate into bits per second.

    Accepts ``"20mbit"``, ``"1gbit"``, ``"500kbit"``, ``"1.5Mbit/s"``, ``"64kibit"``
    (case-insensitive, SI prefixes are powers of 1000 as in ``tc``), a bare number of
    bits/s (``"2e7"``, ``20_000_000``). Byte-based spellings (``"mbps"``, ``"MB"``) are
    rejected because ``tc`` reads ``mbps`` as megaBYTES per second: spell out ``bit``.
    """
    if isinstance(rate, bool):
        raise ValueError(f"invalid rate {rate!r}: expected e.g. '20mbit'")
    if isinstance(rate, (int, float)):
        value = float(rate)
    elif isinstance(rate, str):
        m = _RATE_RE.match(rate.lower())
        if not m:
            raise ValueError(
                f"invalid rate {rate!r}: expected a number and a unit such as '500kbit', '20mbit', '1gbit'"
            )
        mant, exp, unit = m.groups()
        if unit not in _RATE_UNITS:
            if unit.endswith(("bps", "b", "byte", "bytes")):
                raise ValueError(
                    f"ambiguous rate unit in {rate!r}: byte units ('MB', 'mbps') are ambiguous "
                    "(tc reads 'mbps' as megabytes/s); write bits explicitly, e.g. '20mbit'"
                )
            raise ValueError(
                f"unknown rate unit {unit!r} in {rate!r}: use one of bit, kbit, mbit, gbit, tbit, kibit, mibit, gibit"
            )
        value = float(mant) * (10.0 ** int(exp) if exp else 1.0) * _RATE_UNITS[unit]
    else:
        raise ValueError(f"invalid rate {rate!r}: expected a string like '20mbit' or a number of bits/s")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"invalid rate {rate!r}: must be a positive, finite number of bits/s")
    if value < 8000:
        raise ValueError(f"rate {rate!r} is below 8 kbit/s, too slow for a usable link")
    return value


# --------------------------------------------------------------------------- helpers


def _run(args: list[str], check: bool = True, timeout: float = _CMD_TIMEOUT) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(args, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        if check:
            raise NetworkSetupError(f"{' '.join(args)}: {e}") from e
        return subprocess.CompletedProcess(args, 255, "", str(e))
    if check and res.returncode != 0:
        raise NetworkSetupError(f"{' '.join(args)} failed: {(res.stderr or res.stdout).strip()}")
    return res


def list_namespaces(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Names of the network namespaces (``ip netns list``) that start with ``prefix``."""
    if shutil.which("ip") is None:
        return []
    res = _run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in res.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def _ns_pids(ns: str) -> list[int]:
    res = _run(["ip", "netns", "pids", ns], check=False)
    out = []
    for tok in res.stdout.split():
        if tok.isdigit() and int(tok) != os.getpid():
            out.append(int(tok))
    return out


def _kill_namespace_processes(namespaces: list[str], grace: float = 3.0) -> None:
    """SIGTERM every process inside ``namespaces``; SIGKILL whatever survives ``grace`` s."""
    pids = {p for ns in namespaces for p in _ns_pids(ns)}
    if not pids:
        return
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        pids = {p for p in pids if is_running(p)}
        if not pids:
            return
        time.sleep(0.05)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 2.0
    while pids and time.monotonic() < deadline:
        pids = {p for p in pids if is_running(p)}
        time.sleep(0.02)


def _delete_namespaces(namespaces: list[str], patience: float = 5.0) -> None:
    # a namespace whose last process is still on its way out can refuse deletion (busy): try again a while
    deadline = time.monotonic() + patience
    while left := sorted(set(namespaces) & set(list_namespaces(""))):
        for ns in left:
            _run(["ip", "netns", "delete", ns], check=False)
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)


def _owner_file(base: str) -> Path:
    return _REGISTRY / f"{base}.json"


def _owner_alive(base: str) -> bool:
    try:
        info = json.loads(_owner_file(base).read_text())
        pid = int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return is_running(pid) and (stat := read_stat(pid)) is not None and stat.start_time == info.get("start")


def cleanup_stale(prefix: str = DEFAULT_PREFIX, only_dead_owners: bool = True) -> list[str]:
    """Remove namespaces (and the processes inside them) left behind by crashed runs.

    A namespace is stale when its name starts with ``prefix`` and the process that
    created it is gone (tracked in ``/run/diloco-netns``). With
    ``only_dead_owners=False`` every namespace with the prefix is removed, including
    those of live runs. Returns the names of the namespaces removed.
    """
    if not prefix:
        raise ValueError("cleanup_stale needs a non-empty prefix")
    stale = []
    for ns in list_namespaces(prefix):
        base = re.sub(r"-(h\d+|hub)$", "", ns)
        if only_dead_owners and _owner_alive(base):
            continue
        stale.append(ns)
    if stale:
        _kill_namespace_processes(stale)
        _delete_namespaces(stale)
    if _REGISTRY.is_dir():
        for f in _REGISTRY.glob(f"{prefix}*.json"):
            if not (only_dead_owners and _owner_alive(f.stem)):
                try:
                    f.unlink()
                except OSError:
                    pass
    return stale


# --------------------------------------------------------------------------- availability

# what a probe checks: the veth/bridge/tbf path, the same with netem, or the delay line's TUN devices
_TBF, _NETEM, _TUN = "tbf", "netem", "tun"
_AVAILABLE_CACHE: dict[str, tuple[bool, str]] = {}


def _unavailable(detail: str) -> tuple[bool, str]:
    return False, f"emulated links need root and iproute2 (ip, tc) [{detail}]; {FALLBACK_NOTE}"


def _probe(what: str) -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return _unavailable(f"not Linux ({sys.platform})")
    if os.geteuid() != 0:
        return _unavailable("not running as root")
    missing = [t for t in (("ip",) if what == _TUN else ("ip", "tc")) if shutil.which(t) is None]
    if missing:
        return _unavailable(f"missing {', '.join(missing)}: apt-get install -y iproute2")
    if what == _TUN and not os.path.exists("/dev/net/tun"):
        return _unavailable("no /dev/net/tun for the delay line's TUN devices: modprobe tun")
    ns = f"{DEFAULT_PREFIX}probe{os.getpid()}x{secrets.token_hex(2)}"
    steps = [["ip", "netns", "add", ns]]
    if what == _TUN:
        steps.append(["ip", "-n", ns, "tuntap", "add", "dev", "t0", "mode", "tun"])
    else:
        steps += [
            ["ip", "-n", ns, "link", "add", "pa", "type", "veth", "peer", "name", "pb"],
            ["ip", "-n", ns, "link", "add", "br0", "type", "bridge"],
            ["ip", "-n", ns, "link", "set", "pb", "master", "br0"],
            ["tc", "-n", ns, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "1mbit", "burst", "4096", "latency",
             "50ms"],
        ]
    if what == _NETEM:
        steps.append(["tc", "-n", ns, "qdisc", "add", "dev", "pb", "root", "netem", "delay", "1ms"])
    try:
        for cmd in steps:
            res = _run(cmd, check=False)
            if res.returncode != 0:
                err = (res.stderr or res.stdout).strip().splitlines()
                if "netem" in cmd:
                    return False, "the kernel has no netem qdisc (sch_netem); the delay line can stand in for it"
                return _unavailable(f"'{' '.join(cmd[:6])} ...' failed: {err[-1] if err else res.returncode}")
    finally:
        _run(["ip", "netns", "delete", ns], check=False)
    return True, {_TBF: "network namespaces, veth, bridge and tbf work",
                  _NETEM: "network namespaces, veth, bridge, tbf and netem work",
                  _TUN: "network namespaces and TUN devices work (the userspace delay line)"}[what]


def _available(what: str, refresh: bool = False) -> tuple[bool, str]:
    if refresh or what not in _AVAILABLE_CACHE:
        _AVAILABLE_CACHE[what] = _probe(what)
    return _AVAILABLE_CACHE[what]


def available(delay: bool = False, refresh: bool = False) -> tuple[bool, str]:
    """Whether emulated links can be built here, with a one-line reason.

    ``delay=False``: rate-capped links; really creates (and deletes) a probe namespace with
    a veth pair, a bridge and a tbf qdisc. ``delay=True``: links with latency, jitter, loss
    or hosts behind NAT, which the userspace delay line can always emulate: root, ``ip`` and
    ``/dev/net/tun`` (the probe creates a TUN device in a namespace); netem is not needed.
    The result is cached per process unless ``refresh``.
    """
    return _available(_TUN if delay else _TBF, refresh)


def _check_link(rtt_ms: float, jitter_ms: float, loss: float, names: tuple[str, str, str]) -> None:
    """Raise ValueError, in one sentence naming the setting (``names``: how the caller spells rtt, jitter, loss),
    unless the values describe a link."""
    rtt_name, jitter_name, loss_name = names
    for name, value in ((rtt_name, rtt_ms), (jitter_name, jitter_ms)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a number of milliseconds >= 0, got {value!r}")
    if jitter_ms > rtt_ms / 2:
        raise ValueError(f"{jitter_name} must not exceed half of {rtt_name} (the one-way delay it varies), "
                         f"got {jitter_ms:g} against {rtt_ms:g}")
    if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not 0 <= loss < 1:
        raise ValueError(f"{loss_name} must be a fraction of packets in [0, 1), e.g. 0.01, got {loss!r}")


LINK_FLAGS = ("--rtt", "--jitter", "--loss")


def add_link_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--rtt``, ``--jitter`` and ``--loss`` (read them with :func:`link_arguments`)."""
    parser.add_argument("--rtt", default="0", metavar="MS",
                        help="round-trip time between emulated hosts in ms (with --rate; default 0)")
    parser.add_argument("--jitter", default="0", metavar="MS",
                        help="each one-way delay varies uniformly by up to this many ms, at most --rtt/2 "
                             "(packets of one flow keep their order; default 0)")
    parser.add_argument("--loss", default="0", metavar="FRACTION",
                        help="share of packets lost at random, e.g. 0.01 (with --rate; default 0)")


def link_arguments(args: argparse.Namespace, rate: str | None) -> dict[str, float]:
    """``rtt_ms``, ``jitter_ms`` and ``loss`` for :class:`EmulatedNetwork` from :func:`add_link_arguments`' flags;
    ValueError, in one sentence naming the flag, for a bad value or for any of them without a ``rate``."""
    values = []
    for flag in LINK_FLAGS:
        text = getattr(args, flag[2:])
        try:
            values.append(float(text))
        except ValueError:
            raise ValueError(f"{flag} must be a number, got {text!r}") from None
    _check_link(*values, names=LINK_FLAGS)
    if any(values) and not rate:
        raise ValueError("--rtt, --jitter and --loss shape the emulated links of --rate: give --rate too, "
                         "e.g. --rate 20mbit")
    return dict(zip(("rtt_ms", "jitter_ms", "loss"), values))


_RX_SCRIPT = r"""
import json, socket, sys, time
addr, limit = sys.argv[1], float(sys.argv[2])
s = socket.socket(); s.bind((addr, 0)); s.listen(1); s.settimeout(limit)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.settimeout(limit)
buf = bytearray(1 << 16); n = 0; t0 = t1 = None; end = time.monotonic() + limit
while time.monotonic() < end:
    k = c.recv_into(buf)
    if not k:
        break
    now = time.monotonic()
    if t0 is None:
        t0 = now          # the first chunk only starts the clock
    else:
        n += k
    t1 = now
print(json.dumps({"bytes": n, "seconds": (t1 - t0) if t0 is not None else 0.0}), flush=True)
"""

_TX_SCRIPT = r"""
import socket, sys, time
addr, port, seconds, max_bytes, sndbuf = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf); s.settimeout(seconds + 10)
s.connect((addr, port))
chunk = bytes(1 << 16); sent = 0; t = time.monotonic()
while time.monotonic() - t < seconds and sent < max_bytes:
    s.sendall(chunk); sent += len(chunk)
s.shutdown(socket.SHUT_WR); s.recv(1); s.close()
"""

_PROBE_RX = r"""
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1); s.settimeout(float(sys.argv[2]))
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.sendall(b"ok"); c.close()
"""

_PROBE_TX = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
assert c.recv(2) == b"ok"
"""


def can_reach(net: EmulatedNetwork, src: int, dst: int, timeout: float = 3.0) -> bool:
    """Whether a TCP connection from host ``src`` to host ``dst`` succeeds."""
    d = net.host(dst)
    rx = net.popen([sys.executable, "-c", _PROBE_RX, d.local_address, str(timeout + 2)], dst,
                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        port = _read_port(rx, timeout + 2)
        tx = _run(net.wrap([sys.executable, "-c", _PROBE_TX, d.address, str(port), str(timeout)], src),
                  check=False, timeout=timeout + 5)
        return tx.returncode == 0
    finally:
        net.reap(rx)


def measure_rate(net: EmulatedNetwork, src: int, dst: int, seconds: float = 2) -> float:
    """Achieved TCP goodput in bits/s from host ``src`` to host ``dst``.

    Sends zeros for ``seconds`` (at most ~2x the configured rate's worth of bytes)
    and times them at the receiver. Goodput is ~4-5% under the configured rate
    because tbf counts Ethernet/IP/TCP headers (~0.3% behind the delay line, whose
    packets are up to its 16000-byte MTU and carry no Ethernet header).
    """
    if src == dst:
        raise ValueError("measure_rate needs two different hosts")
    if not 0 < seconds <= 60:
        raise ValueError(f"seconds must be in (0, 60], got {seconds!r}")
    net.host(src)
    d = net.host(dst)
    limit = seconds + 15
    rx = net.popen([sys.executable, "-c", _RX_SCRIPT, d.local_address, str(limit)], dst,
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = _read_port(rx, 10)
        max_bytes = int(net.rate_bits / 8 * seconds * 2) + (1 << 20)
        sndbuf = int(min(max(net.rate_bits / 8 * 0.05, 1 << 16), 4 << 20))
        tx = _run(net.wrap([sys.executable, "-c", _TX_SCRIPT, d.address, str(port), str(seconds),
                            str(max_bytes), str(sndbuf)], src), check=False, timeout=limit)
        if tx.returncode != 0:
            raise NetworkSetupError(f"rate-measurement sender failed: {tx.stderr.strip()[-500:]}")
        out, err = rx.communicate(timeout=limit)
    except subprocess.TimeoutExpired as e:
        raise NetworkSetupError(f"rate measurement from host {src} to {dst} timed out") from e
    finally:
        net.reap(rx)
    try:
        res = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError) as e:
        raise NetworkSetupError(f"rate-measurement receiver failed: {err.strip()[-500:]}") from e
    if res["seconds"] <= 0:
        raise NetworkSetupError("rate measurement received too little data to time")
    return res["bytes"] * 8 / res["seconds"]


def _read_port(p: subprocess.Popen, timeout: float) -> int:
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    line = p.stdout.readline() if ready else ""
    if not line.strip().isdigit():
        raise NetworkSetupError("helper process in namespace did not start listening")
    return int(line)


SENDER_QUEUE_MS = 1000.0
"""Queue of each host's own egress: deep enough that TCP's packets are not dropped on the sending host
(on real paths the bottleneck queue is in the network, and a drop there is a retransmission that
crossed the sender's link twice: the kernel's ``bytes_sent`` then equals the link's count)."""


@dataclass(frozen=True)
class Host:
    index: int
    namespace: str
    address: str  # IPv4 address other hosts reach this one at (on its eth0, or its tun0 behind the delay line)
    interface: str = "eth0"  # the device that address is on
    bridge_port: str = ""  # name of the peer veth in the hub namespace ("" behind the delay line)
    private: str = ""  # behind NAT: the address on its own device, which its NAT rewrites to ``address``

    @property
    def local_address(self) -> str:
        """The address this host has on its own device, to listen on: its private one behind NAT."""
        return self.private or self.address


class EmulatedNetwork:
    """N emulated hosts joined by rate-capped links, through a bridge or the delay line (see module doc).

    ``rtt_ms`` is the round-trip time between any two hosts; each one-way delay varies uniformly
    by up to ``jitter_ms`` (at most ``rtt_ms / 2``); ``loss`` is the probability that a packet
    is lost; the hosts whose indices are in ``nat`` accept no inbound TCP connection, except, behind a ``"cone"``
    NAT (``nat_kind``), one from where they just sent a SYN (hole punching; ``"symmetric"``: none at all); they
    listen on a private address (``Host.local_address``, in ``10.78.*``) that their NAT rewrites to their public
    one (``Host.address``) and that no other host can reach. ``firewall`` maps host indices to the only TCP ports
    new connections reach on that host (a stateful firewall: its own connections and their replies pass).
    ``latency_ms`` is the deprecated one-way spelling of ``rtt_ms / 2``. ``delay_line``: None
    picks the path (the delay line unless only a rate, or a rate and latency on a kernel with
    netem, is asked), True or False forces it. ``tun_mtu`` is the delay line's MTU.

    Building happens in the constructor; use as a context manager or call ``close()``.
    Raises ``NetworkSetupError`` when the kernel/tools cannot build it (check
    ``available()``, or ``available(delay=True)`` for latency, loss or NAT, first to fall
    back gracefully).
    """

    def __init__(
        self,
        n_hosts: int,
        rate: str | int | float = "20mbit",
        latency_ms: float = 0,
        run_id: str | None = None,
        *,
        rtt_ms: float = 0,
        jitter_ms: float = 0,
        loss: float = 0.0,
        nat: tuple[int, ...] | list[int] = (),
        nat_kind: str = "cone",
        firewall: dict[int, tuple[int, ...]] | None = None,
        delay_line: bool | None = None,
        tun_mtu: int = DEFAULT_MTU,
        prefix: str = DEFAULT_PREFIX,
        subnet: int = 0,
        queue_ms: float = 50.0,
        kill_grace_s: float = 3.0,
    ):
        if not isinstance(n_hosts, int) or not 1 <= n_hosts <= 253:
            raise ValueError(f"n_hosts must be an int in 1..253, got {n_hosts!r}")
        if not 0 <= int(subnet) <= 255:
            raise ValueError(f"subnet must be in 0..255, got {subnet!r}")
        if not math.isfinite(latency_ms) or latency_ms < 0:
            raise ValueError(f"latency_ms must be >= 0, got {latency_ms!r}")
        if latency_ms and rtt_ms:
            raise ValueError("give rtt_ms or latency_ms (its deprecated one-way alias), not both")
        rtt_ms = rtt_ms or 2 * latency_ms
        _check_link(rtt_ms, jitter_ms, loss, names=("rtt_ms", "jitter_ms", "loss"))
        if isinstance(nat, (str, bytes)) or not all(isinstance(i, int) and 0 <= i < n_hosts for i in nat):
            raise ValueError(f"nat must list host indices in 0..{n_hosts - 1}, got {nat!r}")
        firewall = dict(firewall or {})
        if not all(isinstance(i, int) and 0 <= i < n_hosts for i in firewall):
            raise ValueError(f"firewall must map host indices in 0..{n_hosts - 1} to ports, got {firewall!r}")
        if not all(isinstance(p, int) and 0 < p < 65536 for ports in firewall.values() for p in ports):
            raise ValueError(f"firewall must list TCP ports in 1..65535, got {firewall!r}")
        if nat_kind not in NAT_KINDS:
            raise ValueError(f"nat_kind must be one of {', '.join(NAT_KINDS)}, got {nat_kind!r}")
        if not isinstance(tun_mtu, int) or not 576 <= tun_mtu <= 65535:
            raise ValueError(f"tun_mtu must be an int in 576..65535, got {tun_mtu!r}")
        beyond_netem = bool(jitter_ms or loss or nat or firewall)  # what only the delay line emulates
        if delay_line is False and beyond_netem:
            raise ValueError("jitter, loss, NAT and firewalls need the delay line: leave delay_line unset or set it "
                             "True")
        if run_id is None:
            run_id = secrets.token_hex(3)
        if not re.fullmatch(r"[A-Za-z0-9_.]{1,40}", run_id):
            raise ValueError(f"run_id must match [A-Za-z0-9_.]{{1,40}}, got {run_id!r}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,20}", prefix):
            raise ValueError(f"invalid prefix {prefix!r}")

        self.n_hosts = n_hosts
        self.rate = str(rate)
        self.rate_bits = parse_rate(rate)
        self.rtt_ms = float(rtt_ms)
        self.latency_ms = self.rtt_ms / 2  # one way, as the deprecated parameter meant
        self.jitter_ms = float(jitter_ms)
        self.loss = float(loss)
        self.nat = tuple(sorted(set(nat)))
        self.nat_kind = nat_kind
        self.firewall = {i: tuple(sorted(set(ports))) for i, ports in sorted(firewall.items())}
        self.tun_mtu = tun_mtu
        if delay_line is None:
            delay_line = beyond_netem or (self.rtt_ms > 0 and not _available(_NETEM)[0])
        self.delay_line = bool(delay_line)
        self.forwarder: subprocess.Popen | None = None  # the delay line's process
        self.run_id = run_id
        self.prefix = prefix
        self.subnet = f"10.77.{int(subnet)}.0/24"
        self.queue_ms = float(queue_ms)
        self.kill_grace_s = float(kill_grace_s)
        self.base = f"{prefix}{run_id}"
        self.hub = f"{self.base}-hub"
        self.hosts = [
            Host(i, f"{self.base}-h{i}", f"10.77.{int(subnet)}.{i + 1}",
                 *((TUN_NAME, "") if self.delay_line else ("eth0", f"v{i}")),
                 private=f"10.78.{int(subnet)}.{i + 1}" if i in self.nat else "")
            for i in range(n_hosts)
        ]
        self._created: list[str] = []  # namespaces we created, in creation order
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.RLock()
        self._closed = False
        self._old_handlers: dict[int, object] = {}
        self._owner_pid = os.getpid()  # forked children inherit handlers but must not tear down
        self.sides: list[list[int]] = []  # the partition in force (see partition(); empty: the network is whole)
        self._cut_hosts: set[int] = set()  # hosts whose interface drops what it sends beyond the cut
        self._blackholes: set[int] = set()  # hosts that hold the device the cut packets go into

        if self.delay_line or self.rtt_ms > 0:
            ok, why = _available(_TUN if self.delay_line else _NETEM)
            if not ok:
                raise NetworkSetupError(f"links with {self.impairments or 'the delay line'} cannot be built: {why}")
        existing = set(list_namespaces(self.base))
        clash = existing & {self.hub, *(h.namespace for h in self.hosts)}
        if clash:
            raise NetworkSetupError(
                f"namespaces {sorted(clash)} already exist: another run uses run_id {run_id!r} "
                f"(or call cleanup_stale({prefix!r}))"
            )

        self._install_handlers()
        atexit.register(self._atexit_close)
        try:
            self._register_owner()
            self._build()
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------- building

    def _add_ns(self, ns: str) -> None:
        self._created.append(ns)  # before creation: a half-made one is still removed
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _shape(self, ns: str, dev: str, queue_ms: float = 0, verb: str = "add") -> None:
        """Cap ``dev``'s egress at the link rate with a queue of ``queue_ms`` (default: ``self.queue_ms``);
        ``verb`` "change": a cap already there takes the rate of now."""
        rate_bytes = self.rate_bits / 8
        burst = bucket_bytes(self.rate_bits, 4096)  # a couple of Ethernet frames
        tbf = ["tbf", "rate", f"{int(self.rate_bits)}bit", "burst", str(burst), "latency", f"{queue_ms or self.queue_ms:g}ms"]
        if self.rtt_ms > 0:
            quarter = self.rtt_ms / 4  # two egress points per direction
            # netem must hold a full bandwidth-delay product in flight
            limit = max(1000, int(rate_bytes * (self.rtt_ms / 1000) / 1000))
            if verb == "add":
                _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                      "delay", f"{quarter:g}ms", "limit", str(limit)])
            _run(["tc", "-n", ns, "qdisc", verb, "dev", dev, "parent", "1:1", "handle", "10:", *tbf])
        else:
            _run(["tc", "-n", ns, "qdisc", verb, "dev", dev, "root", *tbf])

    def set_rate(self, rate: str | int | float) -> None:
        """Change the rate of every host's link at once, in both directions, while the network runs (a link that
        slows down or speeds up in the middle of a run).  Only the bridge path (``delay_line=False``)."""
        if self.delay_line:
            raise NetworkSetupError("changing a running network's rate needs the bridge path, not the delay line")
        with self._lock:
            self.rate, self.rate_bits = str(rate), parse_rate(rate)
            for h in self.hosts:
                self._shape(h.namespace, h.interface, queue_ms=SENDER_QUEUE_MS, verb="change")
                self._shape(self.hub, h.bridge_port, verb="change")

    def _add_host_ns(self, h: Host) -> None:
        self._add_ns(h.namespace)
        for key in ("all", "default"):
            _run(["ip", "netns", "exec", h.namespace, "sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1"],
                 check=False)

    def _build(self) -> None:
        if self.delay_line:
            self._build_delay_line()
        else:
            self._build_bridge()

    def _build_delay_line(self) -> None:
        self._add_ns(self.hub)  # the forwarder's home: whatever kills the network's processes ends it too
        for h in self.hosts:
            self._add_host_ns(h)
        cfg = DelayLineConfig(
            hub=self.hub,
            hosts=tuple(Endpoint(h.namespace, h.address, self.rate_bits, self.rate_bits, h.index in self.nat,
                                 h.private, self.firewall.get(h.index)) for h in self.hosts),
            rtt_ms=self.rtt_ms, jitter_ms=self.jitter_ms, loss=self.loss, queue_ms=self.queue_ms, mtu=self.tun_mtu,
            nat_kind=self.nat_kind)
        try:
            self.forwarder = start_forwarder(cfg)
        except RuntimeError as e:
            raise NetworkSetupError(str(e)) from None
        self._procs.append(self.forwarder)
        plen = self.subnet.split("/")[1]
        for h in self.hosts:
            _run(["ip", "-n", h.namespace, "link", "set", "dev", h.interface, "mtu", str(self.tun_mtu)])
            _run(["ip", "-n", h.namespace, "addr", "add", f"{h.local_address}/{plen}", "dev", h.interface])
            _run(["ip", "-n", h.namespace, "link", "set", h.interface, "up"])
            if h.private:  # the public hosts lie beyond its NAT
                _run(["ip", "-n", h.namespace, "route", "add", self.subnet, "dev", h.interface])

    def _build_bridge(self) -> None:
        self._add_ns(self.hub)
        _run(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge", "stp_state", "0"])
        _run(["ip", "-n", self.hub, "link", "set", "br0", "up"])
        plen = self.subnet.split("/")[1]
        for h in self.hosts:
            self._add_host_ns(h)
            _run(["ip", "-n", h.namespace, "link", "add", h.interface, "type", "veth",
                  "peer", "name", h.bridge_port, "netns", self.hub])
            _run(["ip", "-n", self.hub, "link", "set", h.bridge_port, "master", "br0"])
            _run(["ip", "-n", self.hub, "link", "set", h.bridge_port, "up"])
            _run(["ip", "-n", h.namespace, "addr", "add", f"{h.address}/{plen}", "dev", h.interface])
            _run(["ip", "-n", h.namespace, "link", "set", h.interface, "up"])
            # one frame per segment, as on a real link (veth would pass TSO/GSO super-packets, which
            # tbf shapes and the link counters count with one set of headers for many segments)
            _run(["ip", "-n", h.namespace, "link", "set", "dev", h.interface, "gso_max_segs", "1"], check=False)
            _run(["ip", "-n", self.hub, "link", "set", "dev", h.bridge_port, "gso_max_segs", "1"], check=False)
            # host -> bridge: a deep queue, so that a host drops nothing itself (as a server's NIC in front
            # of a slow path); congestion drops happen on the way into the receiving host
            self._shape(h.namespace, h.interface, queue_ms=SENDER_QUEUE_MS)
            self._shape(self.hub, h.bridge_port)  # bridge -> host

    def _register_owner(self) -> None:
        try:
            _REGISTRY.mkdir(parents=True, exist_ok=True)
            info = {"pid": os.getpid(), "start": read_stat(os.getpid()).start_time,
                    "namespaces": [self.hub, *(h.namespace for h in self.hosts)]}
            _owner_file(self.base).write_text(json.dumps(info))
        except OSError:
            pass  # only used by cleanup_stale to spare live runs

    # ----------------------------------------------------------------- signals

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in _HANDLED_SIGNALS:
            try:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
            except (ValueError, OSError):
                pass

    def _restore_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in list(self._old_handlers.items()):
            try:
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, old if old is not None else signal.SIG_DFL)
            except (ValueError, OSError, TypeError):
                pass
            self._old_handlers.pop(sig, None)

    def _atexit_close(self) -> None:
        if os.getpid() == self._owner_pid:
            self.close()

    def _on_signal(self, signum, frame) -> None:
        old = self._old_handlers.get(signum, signal.SIG_DFL)
        if os.getpid() == self._owner_pid:
            self.close()  # also restores the previous handlers
        else:  # a forked child (e.g. multiprocessing worker): behave as if we were not here
            try:
                signal.signal(signum, old if old is not None else signal.SIG_DFL)
            except (ValueError, OSError, TypeError):
                pass
        if callable(old):
            old(signum, frame)  # e.g. default_int_handler raises KeyboardInterrupt
        elif old == signal.SIG_IGN:
            return
        else:  # SIG_DFL (or unknown): die of the same signal
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    # ----------------------------------------------------------------- API

    def __enter__(self) -> "EmulatedNetwork":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def namespaces(self) -> list[str]:
        return [self.hub, *(h.namespace for h in self.hosts)]

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def impairments(self) -> str:
        """What the links add to the rate cap, e.g. ``"100 ms RTT ±5 ms, 1% loss"`` ("" for none)."""
        parts = []
        if self.rtt_ms:
            parts.append(f"{self.rtt_ms:g} ms RTT" + (f" ±{self.jitter_ms:g} ms" if self.jitter_ms else ""))
        if self.loss:
            parts.append(f"{100 * self.loss:g}% loss")
        if self.nat:
            parts.append(f"host{'s' if len(self.nat) > 1 else ''} {', '.join(map(str, self.nat))} behind "
                         + ("NAT" if self.nat_kind == "cone" else f"{self.nat_kind} NAT"))
        for i, ports in self.firewall.items():
            parts.append(f"host {i} behind a firewall open on TCP {', '.join(map(str, ports)) or 'no port'}")
        return ", ".join(parts)

    def host(self, host: int) -> Host:
        """Host ``host`` (an index into :attr:`hosts`), checked."""
        if self._closed:
            raise RuntimeError("EmulatedNetwork is closed")
        if not isinstance(host, int) or not 0 <= host < self.n_hosts:
            raise IndexError(f"host must be in 0..{self.n_hosts - 1}, got {host!r}")
        return self.hosts[host]

    def wrap(self, cmd: list[str], host: int) -> list[str]:
        """``cmd`` prefixed so that it runs inside host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.host(host).namespace, *cmd]

    def popen(self, cmd: list[str], host: int, **kwargs) -> subprocess.Popen:
        """``subprocess.Popen(self.wrap(cmd, host), **kwargs)``, killed by ``close()``."""
        p = subprocess.Popen(self.wrap(cmd, host), **kwargs)
        self._procs.append(p)
        return p

    def can_reach(self, src: int, dst: int, timeout: float = 3.0) -> bool:
        """Whether a TCP connection from host ``src`` to host ``dst`` succeeds."""
        return can_reach(self, src, dst, timeout)

    def measure_rate(self, src: int, dst: int, seconds: float = 2) -> float:
        """Achieved TCP goodput in bits/s from host ``src`` to host ``dst`` (:func:`experiments.netns.measure_rate`)."""
        return measure_rate(self, src, dst, seconds)

    def partition(self, sides: list[list[int]] | tuple[tuple[int, ...], ...]) -> None:
        """Cut the network into ``sides`` (disjoint lists of host indices): from now on every packet a host of one side
        sends to a host of another vanishes, as in a real partition (connections time out; nothing is refused, no
        ICMP comes back).  A host named in no side keeps reaching every host.  Replaces any cut made before; the
        links' rates stay as they are.  :meth:`heal` joins the sides again.

        Each host drops on its own egress what it addresses to the other sides: a clsact qdisc on its interface
        (beside the rate cap) with one u32 filter per address beyond the cut, which redirects the packet into a
        device of its own whose qdisc is ``blackhole`` (this machine's kernel has tc's ``mirred`` action but not
        ``gact``'s ``drop``)."""
        named = [h for side in sides for h in side]
        if len(sides) < 2 or any(not side for side in sides):
            raise ValueError(f"a partition needs at least two non-empty sides, got {sides!r}")
        for h in named:
            self.host(h)
        if len(set(named)) != len(named):
            raise ValueError(f"the sides of a partition must not share a host, got {sides!r}")
        with self._lock:
            self.heal()
            for j, side in enumerate(sides):
                beyond = [self.hosts[h].address for k, other in enumerate(sides) if k != j for h in other]
                for h in side:
                    self._cut(self.hosts[h], beyond)
            self.sides = [list(side) for side in sides]

    def heal(self) -> None:
        """Join the sides of :meth:`partition` again (nothing happens when the network is whole)."""
        with self._lock:
            for h in self.hosts:
                if h.index in self._cut_hosts:
                    _run(["tc", "-n", h.namespace, "qdisc", "del", "dev", h.interface, "clsact"])
            self._cut_hosts.clear()
            self.sides = []

    def _cut(self, h: Host, addresses: list[str]) -> None:
        """Drop every IPv4 packet host ``h`` sends to ``addresses``."""
        if h.index not in self._blackholes:
            _run(["ip", "-n", h.namespace, "link", "add", _CUT_DEVICE, "type", "veth", "peer", "name", f"{_CUT_DEVICE}p"])
            _run(["ip", "-n", h.namespace, "link", "set", _CUT_DEVICE, "up"])
            _run(["tc", "-n", h.namespace, "qdisc", "add", "dev", _CUT_DEVICE, "root", "blackhole"])
            self._blackholes.add(h.index)
        _run(["tc", "-n", h.namespace, "qdisc", "add", "dev", h.interface, "clsact"])
        self._cut_hosts.add(h.index)
        for address in addresses:
            _run(["tc", "-n", h.namespace, "filter", "add", "dev", h.interface, "egress", "protocol", "ip", "prio", "1",
                  "u32", "match", "ip", "dst", f"{address}/32", "action", "mirred", "egress", "redirect", "dev",
                  _CUT_DEVICE])

    def reap(self, p: subprocess.Popen) -> None:
        """Stop a process started with :meth:`popen` and forget it."""
        if p.poll() is None:
            p.kill()
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for f in (p.stdout, p.stderr, p.stdin):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        if p in self._procs:
            self._procs.remove(p)

    def close(self) -> None:
        """Kill processes in the network, delete its namespaces and links. Idempotent."""
        with self._lock:
            if self._closed:
                return
            created = list(self._created)
            # processes first, or a namespace would outlive its name
            for p in list(self._procs):
                if p.poll() is None:
                    try:
                        p.terminate()
                    except OSError:
                        pass
            _kill_namespace_processes(created, grace=self.kill_grace_s)
            for p in list(self._procs):
                self.reap(p)
            # hosts first, then the hub: deleting a namespace deletes its veth ends
            _delete_namespaces([ns for ns in reversed(created)])
            try:
                _owner_file(self.base).unlink()
            except OSError:
                pass
            self._closed = True
            self._restore_handlers()
            try:
                atexit.unregister(self._atexit_close)
            except Exception:
                pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        path = "delay line" if self.delay_line else "bridge"
        extra = f", {self.impairments}" if self.impairments else ""
        return f"EmulatedNetwork({self.n_hosts} hosts, rate={self.rate}{extra}, {path}, {self.base}, {state})"


