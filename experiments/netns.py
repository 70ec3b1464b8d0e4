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

Optional one-way latency needs the kernel's ``sch_netem``; half of
``latency_ms`` is added at each of the two egress points on a path, so one
way between two hosts costs ``latency_ms`` and a round trip ``2*latency_ms``.

Typical use::

    ok, why = available()
    if not ok:
        print(why)                      # and fall back to loopback
    with EmulatedNetwork(4, rate="20mbit") as net:
        procs = [subprocess.Popen(net.wrap([sys.executable, "worker.py",
                 "--host", h.address], i)) for i, h in enumerate(net.hosts)]
        ...

``close()`` (also run by ``__exit__``, by SIGINT/SIGTERM/SIGHUP handlers
installed while the network exists, and at interpreter exit) kills every
process still running inside the network's namespaces, then deletes the
namespaces (which removes their links). ``cleanup_stale()`` removes leftovers
of an earlier run that was SIGKILLed.
"""


from __future__ import annotations

import atexit
import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

from diloco.launch.proctable import read_stat
from experiments import netprobe
from experiments.namespaces import (  # noqa: F401 (the public names are this module's API too)
    _HANDLED_SIGNALS, _REGISTRY, DEFAULT_PREFIX, NetworkSetupError, _delete_namespaces,
    _kill_namespace_processes, _owner_file, _run, available, cleanup_stale, list_namespaces, parse_rate)

# --------------------------------------------------------------------------- network


SENDER_QUEUE_MS = 1000.0
"""Queue of each host's own egress: deep enough that TCP's packets are not dropped on the sending host
(on real paths the bottleneck queue is in the network, and a drop there is a retransmission that
crossed the sender's link twice: the kernel's ``bytes_sent`` then equals the link's count)."""


@dataclass(frozen=True)
class Host:
    index: int
    namespace: str
    address: str  # IPv4 address of the host's eth0 inside its namespace
    interface: str = "eth0"
    bridge_port: str = ""  # name of the peer veth in the hub namespace


class EmulatedNetwork:
    """N emulated hosts joined through a bridge by rate-capped links (see module doc).

    Building happens in the constructor; use as a context manager or call ``close()``.
    Raises ``NetworkSetupError`` when the kernel/tools cannot build it (check
    ``available()`` first to fall back gracefully).
    """

    def __init__(
        self,
        n_hosts: int,
        rate: str | int | float = "20mbit",
        latency_ms: float = 0,
        run_id: str | None = None,
        *,
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
        if run_id is None:
            run_id = secrets.token_hex(3)
        if not re.fullmatch(r"[A-Za-z0-9_.]{1,40}", run_id):
            raise ValueError(f"run_id must match [A-Za-z0-9_.]{{1,40}}, got {run_id!r}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,20}", prefix):
            raise ValueError(f"invalid prefix {prefix!r}")

        self.n_hosts = n_hosts
        self.rate = str(rate)
        self.rate_bits = parse_rate(rate)
        self.latency_ms = float(latency_ms)
        self.run_id = run_id
        self.prefix = prefix
        self.subnet = f"10.77.{int(subnet)}.0/24"
        self.queue_ms = float(queue_ms)
        self.kill_grace_s = float(kill_grace_s)
        self.base = f"{prefix}{run_id}"
        self.hub = f"{self.base}-hub"
        self.hosts = [
            Host(i, f"{self.base}-h{i}", f"10.77.{int(subnet)}.{i + 1}", "eth0", f"v{i}") for i in range(n_hosts)
        ]
        self._created: list[str] = []  # namespaces we created, in creation order
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.RLock()
        self._closed = False
        self._old_handlers: dict[int, object] = {}
        self._owner_pid = os.getpid()  # forked children inherit handlers but must not tear down

        if self.latency_ms > 0:
            ok, why = available(delay=True)
            if not ok:
                raise NetworkSetupError(
                    f"latency_ms={latency_ms} cannot be emulated: {why}"
                )
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

    def _shape(self, ns: str, dev: str, queue_ms: float = 0) -> None:
        """Cap ``dev``'s egress at the link rate with a queue of ``queue_ms`` (default: ``self.queue_ms``)."""
        rate_bytes = self.rate_bits / 8
        # bucket: >= 5 ms of traffic (timer granularity) and >= a couple of frames
        burst = max(int(rate_bytes * 0.005), 4096)
        tbf = ["tbf", "rate", f"{int(self.rate_bits)}bit", "burst", str(burst), "latency", f"{queue_ms or self.queue_ms:g}ms"]
        if self.latency_ms > 0:
            half = self.latency_ms / 2
            # netem must hold a full bandwidth-delay product in flight
            limit = max(1000, int(rate_bytes * (self.latency_ms / 1000) * 2 / 1000))
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                  "delay", f"{half:g}ms", "limit", str(limit)])
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf])
        else:
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf])

    def _build(self) -> None:
        self._add_ns(self.hub)
        _run(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge", "stp_state", "0"])
        _run(["ip", "-n", self.hub, "link", "set", "br0", "up"])
        plen = self.subnet.split("/")[1]
        for h in self.hosts:
            self._add_ns(h.namespace)
            for key in ("all", "default"):
                _run(["ip", "netns", "exec", h.namespace, "sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1"],
                     check=False)
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
        return netprobe.can_reach(self, src, dst, timeout)

    def measure_rate(self, src: int, dst: int, seconds: float = 2) -> float:
        """Achieved TCP goodput in bits/s from host ``src`` to host ``dst`` (:func:`experiments.netprobe.measure_rate`)."""
        return netprobe.measure_rate(self, src, dst, seconds)

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
        return f"EmulatedNetwork({self.n_hosts} hosts, rate={self.rate}, latency_ms={self.latency_ms:g}, {self.base}, {state})"
