"""Probes of an :class:`experiments.netns.EmulatedNetwork`: can one host reach another, and at what goodput.

Each probe runs a small Python helper inside each of the two hosts' namespaces.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
from typing import TYPE_CHECKING

from experiments.namespaces import NetworkSetupError, _run

if TYPE_CHECKING:
    from experiments.netns import EmulatedNetwork

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
    rx = net.popen([sys.executable, "-c", _PROBE_RX, d.address, str(timeout + 2)], dst,
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
    because tbf counts Ethernet/IP/TCP headers.
    """
    if src == dst:
        raise ValueError("measure_rate needs two different hosts")
    if not 0 < seconds <= 60:
        raise ValueError(f"seconds must be in (0, 60], got {seconds!r}")
    net.host(src)
    d = net.host(dst)
    limit = seconds + 15
    rx = net.popen([sys.executable, "-c", _RX_SCRIPT, d.address, str(limit)], dst,
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
