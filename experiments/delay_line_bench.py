"""How much the userspace delay line (:mod:`experiments.delay_line`) carries, and what it costs.  Not a test.

Two emulated hosts behind the delay line, links of ``--rate`` (default 200 Mbit/s) each way; TCP goodput
from one host to the other with 1 stream and with 4 parallel streams, in two settings:

(a) 0 ms RTT, the kernel's default socket buffers: what the forwarder can carry;
(b) ``--rtt`` (default 100 ms) with ``net.ipv4.tcp_rmem``/``tcp_wmem`` capped at ``--buffer`` (default 1 MB)
    inside the hosts: one stream is window-limited (about buffer / RTT) and parallel streams fill the link,
    as DiLoCo's all-reduce does over many connections.

Each case sends for ``--seconds`` after a warm-up of 1.5 s (slow start) and reports the receiver's goodput
over that window, and the forwarder's CPU (user + system time of its process, which includes the
receiving kernel's work on each packet it writes, over the case's wall-clock; 100% = one core).

    sudo python -m experiments.delay_line_bench [--rate 200mbit] [--rtt 100] [--buffer 1048576] [--seconds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.netns import EmulatedNetwork, available, parse_rate

WARMUP_S = 1.5

_RECEIVER = r"""
import json, selectors, socket, sys, time
addr, streams, warmup, window = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
s = socket.socket(); s.bind((addr, 0)); s.listen(streams); s.settimeout(30)
print(s.getsockname()[1], flush=True)
sel = selectors.DefaultSelector()
for _ in range(streams):
    c, _ = s.accept(); c.setblocking(False); sel.register(c, selectors.EVENT_READ)
buf = bytearray(1 << 20); start = None; counted = 0; open_ = streams
while open_:
    for key, _ in sel.select(timeout=30):
        n = key.fileobj.recv_into(buf)
        now = time.monotonic()
        if start is None:
            start = now
        if not n:
            sel.unregister(key.fileobj); key.fileobj.close(); open_ -= 1
        elif start + warmup <= now < start + warmup + window:
            counted += n
print(json.dumps({"bits_per_second": counted * 8 / window}), flush=True)
"""

_SENDER = r"""
import socket, sys, threading, time
addr, port, streams, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
conns = [socket.create_connection((addr, port), timeout=30) for _ in range(streams)]
chunk = bytes(1 << 16); end = time.monotonic() + seconds
def send(c):
    while time.monotonic() < end:
        c.sendall(chunk)
    c.close()
threads = [threading.Thread(target=send, args=(c,)) for c in conns]
for t in threads: t.start()
for t in threads: t.join()
"""


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds that process ``pid`` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def goodput(net: EmulatedNetwork, streams: int, seconds: float) -> tuple[float, float]:
    """TCP goodput (bits/s) of ``streams`` parallel streams from host 0 to host 1, and the forwarder's CPU
    use meanwhile (cores)."""
    dst = net.hosts[1].address
    rx = net.popen([sys.executable, "-c", _RECEIVER, dst, str(streams), str(WARMUP_S), str(seconds)], 1,
                   stdout=subprocess.PIPE, text=True)
    try:
        line = rx.stdout.readline() if select.select([rx.stdout], [], [], 10)[0] else ""
        if not line.strip().isdigit():
            raise RuntimeError("the receiver did not start")
        cpu0, t0 = _cpu_seconds(net.forwarder.pid), time.monotonic()
        subprocess.run(net.wrap([sys.executable, "-c", _SENDER, dst, line.strip(), str(streams),
                                 str(WARMUP_S + seconds + 0.5)], 0), check=True, timeout=seconds + 60)
        out, _ = rx.communicate(timeout=60)
        cpu = (_cpu_seconds(net.forwarder.pid) - cpu0) / (time.monotonic() - t0)
    finally:
        net.reap(rx)
    return json.loads(out.strip().splitlines()[-1])["bits_per_second"], cpu


def cap_buffers(net: EmulatedNetwork, max_bytes: int) -> None:
    """Cap TCP's receive and send buffers at ``max_bytes`` inside every host (per-namespace sysctls)."""
    for i in range(net.n_hosts):
        for key, default in (("tcp_rmem", 131072), ("tcp_wmem", 16384)):
            subprocess.run(net.wrap(["sysctl", "-qw", f"net.ipv4.{key}=4096 {min(default, max_bytes)} {max_bytes}"],
                                    i), check=True)


def main(argv: list[str] | None = None) -> int:
    """Run the four cases (two settings × 1 and 4 streams) and print a table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="200mbit", help="every host's uplink and downlink (default 200mbit)")
    parser.add_argument("--rtt", type=float, default=100.0, help="RTT of setting (b) in ms (default 100)")
    parser.add_argument("--buffer", type=int, default=1 << 20, help="TCP buffer cap of setting (b) in bytes")
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per case, after the warm-up")
    args = parser.parse_args(argv)
    try:
        rate = parse_rate(args.rate)
    except ValueError as e:
        print(f"error: --rate: {e}", file=sys.stderr)
        return 2
    ok, why = available(delay=True)
    if not ok:
        print(f"error: {why}", file=sys.stderr)
        return 2
    settings = [("0 ms RTT, default buffers", 0.0, 0),
                (f"{args.rtt:g} ms RTT, buffers ≤ {args.buffer / 2**20:g} MiB", args.rtt, args.buffer)]
    print(f"delay line, {rate / 1e6:g} Mbit/s links, {os.cpu_count()} CPU cores; "
          f"goodput over {args.seconds:g} s after a {WARMUP_S:g} s warm-up")
    print("| setting | streams | goodput Mbit/s | share of the cap | forwarder CPU |\n| --- | --- | --- | --- | --- |")
    for name, rtt, buffer in settings:
        with EmulatedNetwork(2, rate=args.rate, rtt_ms=rtt, delay_line=True) as net:
            if buffer:
                cap_buffers(net, buffer)
            for streams in (1, 4):
                bps, cpu = goodput(net, streams, args.seconds)
                print(f"| {name} | {streams} | {bps / 1e6:.1f} | {bps / rate:.0%} | {cpu:.0%} |", flush=True)
    if args.rtt:
        print(f"\none stream's window bound at {args.rtt:g} ms: {args.buffer} B / RTT = "
              f"{args.buffer * 8 / (args.rtt / 1000) / 1e6:.0f} Mbit/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
