"""What sealing the direct transport's bytes costs, side by side with sending them in the clear.

Four measurements in one run:

1. the AEADs alone, on one core: GB/s sealing and opening 4 MiB records (the transport's record size) with
   AES-256-GCM (what the transport uses) and ChaCha20-Poly1305;
2. the tags alone, what a record sent in the clear (``encrypt=False``) still carries: GB/s tagging and checking
   4 MiB records with GMAC (AES-GCM over the record as associated data: what the transport uses) and
   HMAC-SHA256;
3. one message of a model's fp32 pseudo-gradient between two transports on loopback, encrypted and plain
   (tagged, in the clear), alternating;
4. whole rounds: two islands (each its own DHT and :class:`~peers.averaging.sharded.ShardedAverager`, in this
   process) average a pseudo-gradient of that size over encrypted and plain transports, alternating round by
   round so that both see the same machine load.

On loopback the bytes cost nothing to move and 2 cores run both ends, so (3) and (4) show the whole cost
of the cipher; over a real link it hides behind the link's rate.  Writes ``results.md`` and ``results.json``::

    python -m benchmarks.transport_crypto --numel 40000000 --rounds 3 --out experiments/results/transport-crypto
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305  # noqa: E402

from benchmarks.round_cost import run_round  # noqa: E402
from experiments.report import save_results  # noqa: E402
from peers.averaging.sharded import ShardedAverager  # noqa: E402
from peers.discovery.dht import start_dht, visible_maddrs  # noqa: E402
from peers.settings import AveragerSettings, NetworkSettings, Scope  # noqa: E402
from peers.island.layout import CanonicalLayout  # noqa: E402
from peers.identity import Identity, identity_of  # noqa: E402
from peers.wire.transport import Transport, tensor_bytes  # noqa: E402

RECORD = 1 << 22
FAST = dict(matchmaking_time=1.0, request_timeout=0.5, matchmaking_timeout=20.0, vote_timeout=10.0,
            allreduce_timeout=120.0, target_group_size=2)


def aead_rates(seconds: float = 1.0) -> dict[str, dict[str, float]]:
    """GB/s sealing and opening 4 MiB records, per cipher, on this thread."""
    data = os.urandom(RECORD)
    out: dict[str, dict[str, float]] = {}
    for name, cipher in (("AES-256-GCM", AESGCM), ("ChaCha20-Poly1305", ChaCha20Poly1305)):
        aead, nonce = cipher(os.urandom(32)), bytes(12)
        sealed = aead.encrypt(nonce, data, None)
        rates = {}
        for what, fn in (("seal", lambda: aead.encrypt(nonce, data, None)), ("open", lambda: aead.decrypt(nonce, sealed, None))):
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                fn()
                n += 1
            rates[what] = n * RECORD / (time.perf_counter() - t0) / 1e9
        out[name] = rates
    return out


def mac_rates(seconds: float = 1.0) -> dict[str, dict[str, float]]:
    """GB/s tagging and checking 4 MiB records sent in the clear, per MAC, on this thread."""
    data, key, nonce = memoryview(os.urandom(RECORD)), os.urandom(32), bytes(12)
    gmac = AESGCM(key)
    tag = gmac.encrypt(nonce, b"", data)
    macs = {"GMAC (AES-GCM tag)": (lambda: gmac.encrypt(nonce, b"", data), lambda: gmac.decrypt(nonce, tag, data)),
            "HMAC-SHA256": (lambda: hmac.new(key, data, hashlib.sha256).digest(),
                            lambda: hmac.compare_digest(hmac.new(key, data, hashlib.sha256).digest(), bytes(32)))}
    out: dict[str, dict[str, float]] = {}
    for name, (make, check) in macs.items():
        rates = {}
        for what, fn in (("tag", make), ("check", check)):
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                fn()
                n += 1
            rates[what] = n * RECORD / (time.perf_counter() - t0) / 1e9
        out[name] = rates
    return out


def one_message(numel: int, repeats: int) -> dict[str, list[float]]:
    """Seconds to deliver one fp32 message of ``numel`` values, encrypted and plain, alternating."""
    payload = tensor_bytes(torch.randn(numel))
    times: dict[str, list[float]] = {"encrypted": [], "plain": []}
    pairs = {mode: (Transport(Identity.generate(), "bench", encrypt=enc), Transport(Identity.generate(), "bench",
                                                                                   encrypt=enc))
             for mode, enc in (("encrypted", True), ("plain", False))}
    try:
        for i in range(repeats):
            for mode, (a, b) in pairs.items():
                t0 = time.perf_counter()
                a.send(b.endpoint, f"m{i}", payload, time.monotonic() + 120)
                times[mode].append(time.perf_counter() - t0)
                b.box.release(f"m{i}", drop=True)
    finally:
        for a, b in pairs.values():
            a.close()
            b.close()
    return times


def rounds(numel: int, n_rounds: int, bucket: int) -> dict[str, list[float]]:
    """Seconds per averaging round of two islands, encrypted and plain transports, alternating."""
    layout = CanonicalLayout.build([("w", (numel,))], bucket)
    dhts = [start_dht(NetworkSettings())]
    dhts.append(start_dht(NetworkSettings(initial_peers=visible_maddrs(dhts[0]))))
    made: list = []
    averagers = {}
    for mode, enc in (("encrypted", True), ("plain", False)):
        transports = [Transport(identity_of(d), "bench", encrypt=enc) for d in dhts]
        made += transports
        averagers[mode] = [ShardedAverager(layout, {"w": torch.zeros(numel)}, {"w": (0, 0, numel)}, None, d,
                                           AveragerSettings(**FAST), Scope(prefix=f"crypto-{mode}"), transport=t)
                           for d, t in zip(dhts, transports)]
    deltas = [{"w": torch.randn(numel, generator=torch.Generator().manual_seed(i))} for i in range(2)]
    times: dict[str, list[float]] = {"encrypted": [], "plain": []}
    try:
        for r in range(n_rounds):
            for mode, avgs in averagers.items():
                took, results = run_round(avgs, deltas, str(r), expected=2)
                if not all(res is not None and res.ok for res in results):
                    raise RuntimeError(f"a {mode} round failed: {[res.reason for res in results if res]}")
                times[mode].append(took)
                print(f"  round {r} {mode:9s} {took:6.2f} s", flush=True)
    finally:
        for avgs in averagers.values():
            for a in avgs:
                a.shutdown()
        for t in made:
            t.close()
        for d in dhts:
            d.shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=40_000_000, help="values of the fp32 pseudo-gradient")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (and messages) per mode")
    parser.add_argument("--bucket", type=int, default=4_000_000, help="values per bucket of the round's layout")
    parser.add_argument("--out", default="", help="folder for the table (Markdown and JSON)")
    args = parser.parse_args()

    aead = aead_rates()
    for name, r in aead.items():
        print(f"{name:18s} seal {r['seal']:.2f} GB/s  open {r['open']:.2f} GB/s (one core, 4 MiB records)")
    macs = mac_rates()
    for name, r in macs.items():
        print(f"{name:18s} tag {r['tag']:.2f} GB/s  check {r['check']:.2f} GB/s (one core, 4 MiB records)")
    message = one_message(args.numel, args.rounds)
    whole = rounds(args.numel, args.rounds, args.bucket)
    med = {k: {"message": statistics.median(message[k]), "round": statistics.median(whole[k])} for k in message}
    mb = args.numel * 4 / 1e6
    rows = ["| what | encrypted | plain | ratio |", "|---|---|---|---|"]
    for what, label in (("message", f"one message of {mb:.0f} MB"), ("round", f"a round of 2 islands, {mb:.0f} MB")):
        e, p = med["encrypted"][what], med["plain"][what]
        rows.append(f"| {label} (median of {args.rounds}) | {e:.3f} s | {p:.3f} s | {e / p:.2f}x |")
    table = "\n".join(rows)
    if args.out:
        save_results(Path(args.out), table, {"aead": aead, "mac": macs, "message": message, "rounds": whole,
                                             "numel": args.numel})
    else:
        print(table)


if __name__ == "__main__":
    main()
