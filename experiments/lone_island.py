"""What an island alone in a run sends: one island joins a private run through a standalone bootstrap node
(hivemind's ``hivemind-dht``) and nobody else comes.  Its rounds cannot form a group of two; the island's
summary says what went over its links meanwhile (the kernel's counts for its peer daemons' connections).

    python -m experiments.lone_island                     # small model, 3 rounds, 20 s matchmaking windows
    python -m experiments.lone_island --rounds 2 --window 10

Before the island waited on the registry, hivemind's matchmaking asked the DHT for averagers without pause
while it was alone: 9.7 MB sent and 12.5 MB received in 3 rounds of 20 s (docs/faults-and-churn.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from diloco.config.loader import load
from diloco.launch.simulate import Cluster


def bootstrap_node() -> tuple[subprocess.Popen, str]:
    """A standalone ``hivemind-dht`` node on loopback and its multiaddr."""
    boot = subprocess.Popen([str(Path(sys.executable).with_name("hivemind-dht")), "--host_maddrs", "/ip4/127.0.0.1/tcp/0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        line = boot.stdout.readline()
        address = next((w for w in line.split() if w.startswith("/ip4/127.0.0.1/") and "/p2p/" in w), "")
        if address:
            return boot, address
    os.killpg(boot.pid, signal.SIGKILL)
    raise RuntimeError("the bootstrap node printed no address within 60 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=float, default=20.0, help="--averaging.matchmaking_timeout, seconds")
    args = ap.parse_args()
    boot, address = bootstrap_node()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load(None, {"model.preset": args.preset, "diloco.outer_steps": args.rounds, "diloco.inner_steps": 3,
                              "inner.batch_size": 4, "logging.run_dir": tmp, "wandb.mode": "disabled", "threads": 1,
                              "averaging.backend": "hivemind", "averaging.min_group_size": 2,
                              "averaging.target_group_size": 2, "averaging.run_key": "lone-island",
                              "averaging.initial_peers": [address], "averaging.matchmaking_timeout": args.window})
            cluster = Cluster(cfg, 1)
            try:
                cluster.start(0)
                cluster.wait(timeout=args.rounds * (args.window + 60) + 120)
                summary = cluster.summaries()[0]
            finally:
                cluster.stop_all()
    finally:
        os.killpg(boot.pid, signal.SIGKILL)
    print(json.dumps({k: summary[k] for k in ("rounds_ok", "rounds_failed", "bytes_sent", "bytes_received")}))
    print(f"an island alone for {args.rounds} rounds of {args.window:.0f} s: sent {summary['bytes_sent'] / 1e6:.2f} MB, "
          f"received {summary['bytes_received'] / 1e6:.2f} MB; last failure: {summary['failures'][-1]}")


if __name__ == "__main__":
    main()
