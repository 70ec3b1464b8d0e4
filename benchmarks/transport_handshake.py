"""What proving peer ids adds to a direct-transport connection: the handshake with its signatures, side by side
with the same handshake whose signatures are neither made nor checked.

Both ends of :func:`peers.wire.secure.greet` / :func:`~peers.wire.secure.call` sign the transcript with their
hivemind identity (RSA-2048, PSS) and check the other's signature and that its public key hashes to the peer id
it names.  Three measurements in one run, the two modes alternating so that both see the same machine load:

1. the RSA operations alone: one signature, one check (each end does one of each);
2. the handshake alone, over a fresh loopback TCP connection each time (listener in a thread);
3. a whole new connection of :class:`~peers.wire.transport.Transport`: connect, hand-over slot, handshake, a
   one-byte message and its acknowledgement (the sender's connections dropped before each).

On loopback on 2 cores both ends run on this machine, so (2) and (3) count both ends' CPU; between two servers
each end pays about half, and the network round trips come on top of both modes alike::

    python -m benchmarks.transport_handshake --connections 200 --out experiments/results/transport-handshake
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from experiments.report import save_results  # noqa: E402
from peers.wire import secure  # noqa: E402
from peers.identity import Identity, proves  # noqa: E402
from peers.wire.transport import Transport  # noqa: E402

MODES = ("proven", "unproven")


@contextlib.contextmanager
def mode(name: str) -> Iterator[None]:
    """``proven``: the handshake as it is; ``unproven``: signatures neither made nor checked (the handshake
    before peer ids were proven, but for the bytes of the keys and signatures it still sends)."""
    if name == "proven":
        yield
        return
    sign, check = Identity.sign, secure.proves
    Identity.sign = lambda self, data: b""  # type: ignore[method-assign]
    secure.proves = lambda *args: True  # type: ignore[assignment]
    try:
        yield
    finally:
        Identity.sign, secure.proves = sign, check  # type: ignore[method-assign]


def rsa_ms(identity: Identity, n: int) -> dict[str, float]:
    """Milliseconds per signature and per check of one."""
    data = os.urandom(600)
    t0 = time.perf_counter()
    for _ in range(n):
        signature = identity.sign(data)
    signing = (time.perf_counter() - t0) / n * 1e3
    t0 = time.perf_counter()
    for _ in range(n):
        assert proves(identity.public, identity.peer_id, data, signature)
    return {"sign": signing, "check": (time.perf_counter() - t0) / n * 1e3}


def handshake_seconds(listener: Identity, caller: Identity) -> float:
    """Seconds of one handshake on a fresh loopback connection (connect excluded)."""
    server = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            secure.greet(conn, b"bench", True, listener, time.monotonic() + 10)
            done.wait(10)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    sock = socket.create_connection(server.getsockname())
    try:
        t0 = time.perf_counter()
        secure.call(sock, b"bench", True, caller, "", secure.FRAMES, time.monotonic() + 10)
        took = time.perf_counter() - t0
    finally:
        done.set()
        sock.close()
        thread.join(10)
        server.close()
    return took


def connection_seconds(a: Transport, b: Transport, i: int) -> float:
    """Seconds for ``a`` to open a new connection to ``b`` and deliver one byte on it."""
    a.links.close()  # the next send opens a new connection
    t0 = time.perf_counter()
    a.send(b.endpoint, f"m{i}", b"x", time.monotonic() + 30)
    took = time.perf_counter() - t0
    b.box.release(f"m{i}", drop=True)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=200, help="handshakes (and connections) per mode")
    parser.add_argument("--out", default="", help="folder for the table (Markdown and JSON)")
    args = parser.parse_args()

    ids = [Identity.generate(), Identity.generate()]
    rsa = rsa_ms(ids[0], args.connections)
    print(f"RSA-2048 PSS: sign {rsa['sign']:.3f} ms, check {rsa['check']:.3f} ms", flush=True)
    shakes: dict[str, list[float]] = {m: [] for m in MODES}
    whole: dict[str, list[float]] = {m: [] for m in MODES}
    a, b = Transport(ids[0], "bench"), Transport(ids[1], "bench")
    try:
        for i in range(args.connections):
            for m in MODES:
                with mode(m):
                    shakes[m].append(handshake_seconds(ids[1], ids[0]))
                    whole[m].append(connection_seconds(a, b, i))
    finally:
        a.close()
        b.close()
    med = {m: {"handshake": statistics.median(shakes[m]) * 1e3, "connection": statistics.median(whole[m]) * 1e3}
           for m in MODES}
    rows = ["| what (median of %d, both ends on this machine) | proven | unproven | added | ratio |" % args.connections,
            "|---|---|---|---|---|"]
    for what, label in (("handshake", "the handshake alone"), ("connection", "a new connection and one message")):
        p, u = med["proven"][what], med["unproven"][what]
        rows.append(f"| {label} | {p:.2f} ms | {u:.2f} ms | {p - u:+.2f} ms | {p / u:.2f}x |")
    rows.append(f"| RSA-2048 PSS, one signature / one check | {rsa['sign']:.2f} / {rsa['check']:.2f} ms | | | |")
    table = "\n".join(rows)
    if args.out:
        save_results(Path(args.out), table, {"rsa_ms": rsa, "handshake_s": shakes, "connection_s": whole,
                                             "median_ms": med})
    else:
        print(table)


if __name__ == "__main__":
    main()
