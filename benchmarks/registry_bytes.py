"""What the run's registry costs each island on the wire, at several numbers of islands, without training.

Starts ``n`` real DHT nodes of the product (``peers.discovery.dht.start_dht``, a private run), each with a
:class:`peers.discovery.membership.Membership` registered the way an island registers (its endpoint, its
multiaddrs, the digest of its θ_global).  Bytes are the kernel's counts of what the DHT daemons (``p2pd``) sent
on their TCP connections.  Three figures per count:

- one store: every island refreshes its record once (a heartbeat);
- one read: every island reads the whole registry once;
- waiting: for ``--seconds``, every island beats and asks what an island waiting for its round's group asks
  (whether the run moved past its round and who is live, about once a second; the registry, twice a second):
  bytes per island per second.

    python -m benchmarks.registry_bytes --counts 4,8,16,32 --out experiments/results/registry-bytes

hivemind answers every look-up that passes a node holding a key with the key's whole value, stores included (they
look for the nodes to store at first), so one store or one read of the registry costs bytes in proportion to the
islands.  Run it from another checkout (``PYTHONPATH=/other/checkout``) to measure an older version the same way.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from experiments.many_islands import sent_by_connection
from experiments.report import format_bytes, markdown_table, save_results
from peers.discovery import membership
from peers.discovery.dht import start_dht, visible_maddrs
from peers.discovery.membership import Membership
from peers.fingerprints import digest
from peers.settings import NetworkSettings

RUN_KEY = "registry-bytes-benchmark-key-0123456789"


def daemons_sent() -> int:
    """Bytes sent so far on the open TCP connections of this process's DHT daemons."""
    return sum(sent for name, sent in sent_by_connection([os.getpid()]).values() if name == "p2pd")


def forget_read(m: Membership) -> None:
    """Make ``m``'s next question read the registry (an older version keeps its last read in ``_read``)."""
    if hasattr(m, "forget_read"):
        m.forget_read()
    else:
        m._read = None


def measure(n: int, seconds: float) -> dict[str, float]:
    """Start ``n`` registered DHT nodes and measure a store, a read and ``seconds`` of waiting (see the module)."""
    dhts = [start_dht(NetworkSettings(run_key=RUN_KEY))]
    try:
        dhts += [start_dht(NetworkSettings(initial_peers=visible_maddrs(dhts[0]), run_key=RUN_KEY))
                 for _ in range(n - 1)]
        held = digest([0.5] * 3 * 400)
        members = []
        for i, dht in enumerate(dhts):
            m = Membership(dht, "bench")
            m.maddrs, m.endpoint = visible_maddrs(dht), f"127.0.0.1:{41000 + i}"
            m.announce(3, averaging=False, held=held)
            members.append(m)
        time.sleep(2.0)
        sent = daemons_sent()
        for m in members:
            m.announce()
        time.sleep(1.0)
        store, sent = (daemons_sent() - sent) / n, daemons_sent()
        for m in members:
            forget_read(m)
            seen = len(m.islands())
        time.sleep(1.0)
        read, sent = (daemons_sent() - sent) / n, daemons_sent()
        for m in members:
            m.start_heartbeat()
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            for m in members:
                m.moved_past(3)
                m.company()
                m.others()
            time.sleep(0.5)
        waiting = (daemons_sent() - sent) / n / (time.monotonic() - started)
        return dict(islands=n, seen=seen, store=store, read=read, waiting_per_s=waiting,
                    heartbeat_s=members[0].period,
                    fresh_s=getattr(members[0], "fresh", membership.FRESH))
    finally:
        for dht in dhts:
            dht.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="4,8,16,32", help="numbers of islands, comma-separated")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds of waiting measured per count")
    parser.add_argument("--out", default="", help="folder for results.md and results.json")
    args = parser.parse_args()
    rows = []
    for n in [int(c) for c in args.counts.split(",")]:
        row = measure(n, args.seconds)
        print(row, flush=True)
        rows.append(row)
    table = markdown_table(
        ["islands", "records read", "one store / island", "one read / island", "waiting / island / s",
         "heartbeat s", "a read answers for s"],
        [[r["islands"], r["seen"], format_bytes(r["store"]), format_bytes(r["read"]),
          format_bytes(r["waiting_per_s"]), f"{r['heartbeat_s']:.1f}", f"{r['fresh_s']:.1f}"] for r in rows])
    table = (f"# The registry's bytes\n\n`python -m benchmarks.registry_bytes --counts {args.counts} "
             f"--seconds {args.seconds:g}`\n\n{table}\n\n- bytes the DHT daemons sent (the kernel's counts), per "
             "island; waiting: every island beating and asking what a round's wait asks, per second")
    if args.out:
        save_results(Path(args.out), table, rows)
    else:
        print(table)


if __name__ == "__main__":
    main()
