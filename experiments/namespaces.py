"""The plumbing under :mod:`experiments.netns`: link rates, running ``ip``/``tc`` commands, listing,
emptying and deleting namespaces, leftovers of SIGKILLed runs, and whether this machine can emulate
links at all (root, iproute2, veth, bridge, tbf; netem for latency)."""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from diloco.launch.proctable import is_running, read_stat

DEFAULT_PREFIX = "dlc-"
FALLBACK_NOTE = "running on loopback without a bandwidth cap"
_REGISTRY = Path("/run/diloco-netns")  # owner pid of each live network
_HANDLED_SIGNALS = tuple(
    s for s in (getattr(signal, n, None) for n in ("SIGINT", "SIGTERM", "SIGHUP")) if s is not None
)
_CMD_TIMEOUT = 15.0


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


def _delete_namespaces(namespaces: list[str]) -> None:
    existing = set(list_namespaces(""))
    for ns in namespaces:
        if ns in existing:
            _run(["ip", "netns", "delete", ns], check=False)


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

_AVAILABLE_CACHE: dict[bool, tuple[bool, str]] = {}


def _unavailable(detail: str) -> tuple[bool, str]:
    return False, f"emulated links need root and iproute2 (ip, tc) [{detail}]; {FALLBACK_NOTE}"


def _probe(delay: bool) -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return _unavailable(f"not Linux ({sys.platform})")
    if os.geteuid() != 0:
        return _unavailable("not running as root")
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return _unavailable(f"missing {', '.join(missing)}: apt-get install -y iproute2")
    ns = f"{DEFAULT_PREFIX}probe{os.getpid()}x{secrets.token_hex(2)}"
    steps = [
        ["ip", "netns", "add", ns],
        ["ip", "-n", ns, "link", "add", "pa", "type", "veth", "peer", "name", "pb"],
        ["ip", "-n", ns, "link", "add", "br0", "type", "bridge"],
        ["ip", "-n", ns, "link", "set", "pb", "master", "br0"],
        ["tc", "-n", ns, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "1mbit", "burst", "4096", "latency", "50ms"],
    ]
    if delay:
        steps.append(["tc", "-n", ns, "qdisc", "add", "dev", "pb", "root", "netem", "delay", "1ms"])
    try:
        for cmd in steps:
            res = _run(cmd, check=False)
            if res.returncode != 0:
                err = (res.stderr or res.stdout).strip().splitlines()
                if "netem" in cmd:
                    return False, ("latency emulation needs the kernel's netem qdisc (sch_netem), which is missing "
                                   "here; the bandwidth cap works without it (use latency_ms=0)")
                return _unavailable(f"'{' '.join(cmd[:6])} ...' failed: {err[-1] if err else res.returncode}")
    finally:
        _run(["ip", "netns", "delete", ns], check=False)
    return True, "network namespaces, veth, bridge and tbf" + (" and netem" if delay else "") + " work"


def available(delay: bool = False, refresh: bool = False) -> tuple[bool, str]:
    """Whether emulated links can be built here, with a one-line reason.

    Really creates (and deletes) a probe namespace with a veth pair, a bridge and a
    tbf qdisc. ``delay=True`` additionally requires netem (for ``latency_ms > 0``).
    The result is cached per process unless ``refresh``.
    """
    if refresh or delay not in _AVAILABLE_CACHE:
        _AVAILABLE_CACHE[delay] = _probe(delay)
    return _AVAILABLE_CACHE[delay]
