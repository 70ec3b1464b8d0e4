"""How many ports other islands must reach on an island's server: count them on running islands.

Starts two islands of the tiny model over real hivemind (a ``tp = 2`` island and a ``dp = 2 x tp = 2`` one),
each listening on its own loopback address (127.0.0.2, 127.0.0.3) so that its ports can be told apart from
torchrun's and the in-island process groups' (which listen on 127.0.0.1 or all addresses).  Once both have
committed a round, lists with ``ss`` every listening TCP socket of each island's process tree on the
island's address, by process (``p2pd``: a DHT daemon; ``python``: the transport)::

    python -m benchmarks.island_ports --out experiments/results/island-ports

Run it from another checkout (``PYTHONPATH=/other/checkout``) to count an older version the same way.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from diloco.config.loader import load
from diloco.launch.simulate import Cluster
from experiments.outsider import listening
from experiments.report import save_results
from peers.proctable import descendants

SHAPES = [("tp=2", dict(tp=2)), ("dp=2 x tp=2", dict(dp=2, tp=2))]
ADDRESSES = ["127.0.0.2", "127.0.0.3"]


def _committed(run_dir: Path) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and any(json.loads(line).get("round_ok") for line in metrics.read_text().splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="", help="folder for results.md and results.json")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load(None, {
            "model.preset": "tiny", "inner.batch_size": 4, "inner.warmup_steps": 2, "logging.run_dir": tmp,
            "logging.eval_batches": 1, "logging.samples": 0, "wandb.mode": "disabled", "threads": 1,
            "data.max_bytes": 2_000_000, "checkpoint.every": 0, "averaging.backend": "hivemind",
            "averaging.min_group_size": 2, "averaging.matchmaking_time": 3.0, "averaging.request_timeout": 1.0,
            "averaging.matchmaking_timeout": 60.0, "diloco.inner_steps": 5, "diloco.outer_steps": 40})
        cluster = Cluster(cfg, 2, host_addresses=ADDRESSES)
        for i, (_, shape) in enumerate(SHAPES):
            cluster.configs[i]["parallel"].update(shape)
        rows = []
        try:
            cluster.start_all(startup_timeout=150)
            deadline = time.monotonic() + args.timeout
            while not all(_committed(d) for d in cluster.run_dirs) and time.monotonic() < deadline:
                time.sleep(1)
            if not all(_committed(d) for d in cluster.run_dirs):
                raise SystemExit("error: the islands committed no round in time; see their train.log files")
            for i, (name, _) in enumerate(SHAPES):
                pids = {cluster.procs[i].pid, *descendants(cluster.procs[i].pid)}
                ports = listening(pids, ADDRESSES[i])
                rows.append({"island": name, "ranks": cluster.island_size(i), "processes": len(pids),
                             "ports": len(ports), "by_process": [f"{n}:{p}" for n, p in ports]})
        finally:
            cluster.stop_all()
    table = ["| island | ranks | ports other islands reach | which |", "|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['island']} | {r['ranks']} | {r['ports']} | {', '.join(r['by_process'])} |")
    text = "\n".join(table)
    if args.out:
        save_results(Path(args.out), text, rows)
    else:
        print(text)


if __name__ == "__main__":
    main()
