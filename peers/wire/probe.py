"""The link between two servers, measured the way a round uses it: the round trip, the rate of one TCP stream
and of several side by side (a server's ranks each send their own part), the share of segments TCP had to
send again, and whether each side accepts connections (an island that cannot is behind a NAT or firewall).

One side listens (:func:`serve`, ``diloco probe --listen``); the other (:func:`probe`, ``diloco probe
--initial-peers ADDR``) drives every measurement and prints one JSON line, :class:`LinkProbe`, that
``diloco plan --probe`` reads.

Each connection opens with one command byte:

- ``P``: echo 8-byte pings until the caller closes (the round trip);
- ``S``: read until the caller closes, then answer the byte count and the seconds from first to last byte
  (the caller's sending rate, as the receiver saw it);
- ``B`` + a 2-byte port: connect back to the caller's address at that port within a few seconds, answer
  ``1`` or ``0`` (whether the caller accepts connections).
"""

from __future__ import annotations

import json
import socket
import statistics
import struct
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

PROBE_PORT = 29400
"""The port ``diloco probe --listen`` takes unless told another."""

_ANSWER = struct.Struct("!Qd")
# struct tcp_info (linux/tcp.h): offsets of tcpi_total_retrans (u32) and tcpi_segs_out (u32)
_TOTAL_RETRANS, _SEGS_OUT = 100, 136


@dataclass
class LinkProbe:
    """What one :func:`probe` measured, from the side that called."""

    rtt_ms: float
    """Median round trip of small messages over one open connection."""
    rate_1_mbit: float
    """Goodput of one TCP stream from the caller to the listener, in Mbit/s."""
    rate_n_mbit: float
    """Goodput of ``streams`` TCP streams side by side, all together, in Mbit/s."""
    streams: int
    """How many streams ``rate_n_mbit`` ran."""
    loss: float | None
    """Segments TCP sent again ÷ segments sent, over every stream (None: the kernel does not say)."""
    listener_accepts: bool
    """The listener took our connections (always true once a probe answers)."""
    caller_accepts: bool
    """The listener could connect back to us: False means we are behind a NAT or firewall
    (``--averaging.client_mode``)."""
    seconds: float
    """How long each rate was measured."""

    def line(self) -> str:
        """The one JSON line ``diloco plan --probe`` reads."""
        return json.dumps({"probe": 1, **asdict(self)})


class ProbeError(Exception):
    """The listener could not be reached or broke off: the message says which and what to check."""


def parse_address(addr: str) -> tuple[str, int]:
    """``host:port`` or a multiaddr ``/ip4/H/tcp/P[/...]`` (also ``/ip6``, ``/dns``, ``/dns4``) → (host, port)."""
    parts = addr.strip().split("/")
    if addr.startswith("/") and len(parts) >= 5 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6") \
            and parts[3] == "tcp" and parts[4].isdigit():
        return parts[2], int(parts[4])
    host, sep, port = addr.strip().rpartition(":")
    if sep and port.isdigit() and host:
        return host.strip("[]"), int(port)
    raise ValueError(f"{addr!r} is not an address to probe; give HOST:PORT or /ip4/HOST/tcp/PORT, as "
                     f"`diloco probe --listen` prints it")


def serve(host: str = "0.0.0.0", port: int = PROBE_PORT, ready: Callable[[str, int], None] | None = None,
          stop: threading.Event | None = None) -> None:
    """Answer probes on ``host:port`` until ``stop`` is set (forever without one); ``ready(host, port)`` is
    called once listening (with the port taken, when ``port`` is 0)."""
    try:
        listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise ProbeError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick a free port with --port") from None
    listener.settimeout(0.2)
    try:
        if ready is not None:
            ready(host, listener.getsockname()[1])
        while stop is None or not stop.is_set():
            try:
                conn, peer = listener.accept()
            except socket.timeout:
                continue
            threading.Thread(target=_answer, args=(conn, peer[0]), daemon=True).start()
    finally:
        listener.close()


def _answer(conn: socket.socket, peer_host: str) -> None:
    with conn:
        conn.settimeout(60)
        try:
            command = _read_exactly(conn, 1)
            if command == b"P":
                while (ping := _read_exactly(conn, 8, eof_ok=True)) is not None:
                    conn.sendall(ping)
            elif command == b"S":
                total, first, last = 0, 0.0, 0.0
                buf = bytearray(1 << 20)
                while n := conn.recv_into(buf):
                    last = time.perf_counter()
                    first = first or last
                    total += n
                conn.sendall(_ANSWER.pack(total, last - first))
            elif command == b"B":
                (back_port,) = struct.unpack("!H", _read_exactly(conn, 2))
                try:
                    socket.create_connection((peer_host, back_port), timeout=3).close()
                    conn.sendall(b"1")
                except OSError:
                    conn.sendall(b"0")
        except (OSError, ConnectionError):
            pass  # a caller that goes away ends only its own measurement


def _read_exactly(conn: socket.socket, n: int, eof_ok: bool = False) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            if eof_ok and not data:
                return None
            raise ConnectionError("the other side closed the connection mid-message")
        data += chunk
    return data


def probe(host: str, port: int, seconds: float = 3.0, streams: int = 8, pings: int = 20,
          connect_timeout: float = 5.0) -> LinkProbe:
    """Measure the link to a listener at ``host:port`` (see the module's docstring); raises :class:`ProbeError`."""
    address = (host, port)
    try:
        rtt = _round_trip(address, pings, connect_timeout)
        one, sockets_1 = _send_rate(address, 1, seconds, connect_timeout)
        many, sockets_n = _send_rate(address, streams, seconds, connect_timeout)
        accepts = _accepts_connections(address, connect_timeout)
    except OSError as e:
        raise ProbeError(f"the probe listener at {host}:{port} could not be reached or broke off ({e}); start "
                         f"`diloco probe --listen` there and open its port") from None
    sent = sum(s[1] for s in sockets_1 + sockets_n)
    resent = sum(s[0] for s in sockets_1 + sockets_n)
    return LinkProbe(rtt_ms=rtt * 1e3, rate_1_mbit=one / 1e6, rate_n_mbit=many / 1e6, streams=streams,
                     loss=resent / sent if sent else None, listener_accepts=True, caller_accepts=accepts,
                     seconds=seconds)


def _round_trip(address: tuple[str, int], pings: int, timeout: float) -> float:
    with socket.create_connection(address, timeout=timeout) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(30)
        conn.sendall(b"P")
        times = []
        for i in range(pings):
            t0 = time.perf_counter()
            conn.sendall(struct.pack("!Q", i))
            _read_exactly(conn, 8)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _send_rate(address: tuple[str, int], streams: int, seconds: float,
               timeout: float) -> tuple[float, list[tuple[int, int]]]:
    """Bits/s of ``streams`` connections sending for ``seconds``, as the listener received them, and each
    socket's (segments sent again, segments sent)."""
    conns = [socket.create_connection(address, timeout=timeout) for _ in range(streams)]
    results: list[tuple[int, float]] = [(0, 0.0)] * streams
    counts: list[tuple[int, int]] = [(0, 0)] * streams
    errors: list[BaseException] = []
    block = b"\0" * (1 << 20)
    deadline = time.perf_counter() + seconds

    def run(i: int, conn: socket.socket) -> None:
        try:
            conn.settimeout(seconds + 60)
            conn.sendall(b"S")
            while time.perf_counter() < deadline:
                conn.sendall(block)
            counts[i] = _retransmits(conn)
            conn.shutdown(socket.SHUT_WR)
            results[i] = _ANSWER.unpack(_read_exactly(conn, _ANSWER.size))
        except OSError as e:
            errors.append(e)
        finally:
            conn.close()

    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    span = max(s for _, s in results)
    return (8 * sum(n for n, _ in results) / span if span > 0 else 0.0), counts


def _retransmits(conn: socket.socket) -> tuple[int, int]:
    try:
        info = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        return struct.unpack_from("I", info, _TOTAL_RETRANS)[0], struct.unpack_from("I", info, _SEGS_OUT)[0]
    except (OSError, AttributeError, struct.error):  # not Linux: no tcp_info
        return 0, 0


def _accepts_connections(address: tuple[str, int], timeout: float) -> bool:
    """Whether the listener can open a connection to us (we listen on a fresh port of every interface)."""
    with socket.create_server(("", 0)) as back, socket.create_connection(address, timeout=timeout) as conn:
        back.settimeout(5)
        conn.settimeout(10)
        conn.sendall(b"B" + struct.pack("!H", back.getsockname()[1]))
        accepted = threading.Thread(target=lambda: _accept_one(back), daemon=True)
        accepted.start()
        answer = _read_exactly(conn, 1)
        accepted.join(5)
        return answer == b"1"


def _accept_one(listener: socket.socket) -> None:
    try:
        listener.accept()[0].close()
    except OSError:
        pass


def read_probe(text: str) -> LinkProbe:
    """A :class:`LinkProbe` from the JSON line :meth:`LinkProbe.line` printed (raises ValueError if it is not one)."""
    try:
        record = json.loads(text)
        if not isinstance(record, dict) or record.pop("probe", None) != 1:
            raise ValueError
        return LinkProbe(**record)
    except (ValueError, TypeError):
        raise ValueError(f"{text[:80]!r} is not a line printed by `diloco probe`") from None
