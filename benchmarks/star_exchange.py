"""The exchange of 3 islands' pseudo-gradients over the delay line, with two islands behind NAT: punched
(every island owns a part; the hidden islands connect to each other through their NATs), relayed (every
island owns a part; the reachable island passes the hidden islands' parts to each other), the star (the
hidden islands own none: :func:`peers.wire.encoded.part_owners`), and all islands reachable, side by side in
one run.  Not a test.

Each arm starts 3 processes, one in each host's namespace of :class:`experiments.netns.EmulatedNetwork`, each
with a real :class:`~peers.wire.transport.Transport`, and times ``--rounds`` calls of
:func:`peers.wire.encoded.average_encoded` on ``--numel`` fp32 values (rounds start together, by a file
barrier; the first round, which opens the connections, is left out of the median)::

    sudo python benchmarks/star_exchange.py --rate 50mbit --rtt 100

Writes ``experiments/results/star-exchange/`` (or ``--out``): ``results.json``, ``results.md`` and
``exchange_seconds.png``.  Needs root and TUN devices.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = {"all reachable": ((), "star"), "2 of 3 behind NAT, punched": ((1, 2), "punch"),
        "2 of 3 behind NAT, relayed": ((1, 2), "relay"), "2 of 3 behind NAT, star": ((1, 2), "star")}


def worker(index: int, n: int, host: str, public: str, reachable: bool, folder: Path, mode: str, rounds: int,
           numel: int, idle: float) -> None:
    """One island's rank, listening on ``host`` and announcing ``public`` (its NAT's address behind NAT): exchange
    ``rounds`` times with the others, print its seconds as JSON."""
    import torch

    from outer_optim.compression import make_codec
    from peers.wire.encoded import DirectChannel, average_encoded, part_owners
    from peers.wire.transport import Transport

    torch.set_num_threads(1)
    name = f"island{index}"
    transport = Transport(name, "key", host=host, advertise=public, reachable=reachable, punch=mode == "punch")
    (folder / f"{name}.endpoint").write_text(transport.endpoint)
    while len(list(folder.glob("*.endpoint"))) < n:
        time.sleep(0.05)
    endpoints = {p.stem: p.read_text() for p in folder.glob("*.endpoint")}
    codec = make_codec("none")
    channel = DirectChannel(transport, codec.nbytes(numel))
    channel.endpoints.update(endpoints)
    peers = sorted(endpoints)
    transport.reach([e for p, e in endpoints.items() if p != name])
    payload = codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(index)))
    owners = part_owners(peers, endpoints) if mode != "relay" else None
    seconds = []
    for r in range(rounds):
        time.sleep(idle)  # an island's inner steps: its connections idle between rounds
        (folder / f"{name}.{r}").write_text("")
        while len(list(folder.glob(f"*.{r}"))) < n:
            time.sleep(0.01)
        t0 = time.monotonic()
        out = average_encoded(channel, codec, f"x.round.{r}", name, peers, {p: 1.0 for p in peers}, payload,
                              numel, 60.0, owners=owners)
        seconds.append(time.monotonic() - t0)
        if out.mean is None:
            raise SystemExit(f"{name}: round {r} failed: {out.missing} missing")
    print(json.dumps({"island": name, "seconds": seconds}), flush=True)
    time.sleep(1.0)  # the others may still wait for our last acknowledgements
    transport.close()


def run_arm(nat: tuple[int, ...], mode: str, args: argparse.Namespace) -> list[float]:
    """Median seconds of each round after the first (the slowest island's)."""
    from experiments import netns

    with netns.EmulatedNetwork(3, rate=args.rate, rtt_ms=args.rtt, nat=nat, delay_line=True) as net:
        folder = tempfile.mkdtemp()
        procs = [net.popen([sys.executable, __file__, "--worker", str(i), net.host(i).local_address,
                            net.host(i).address, "0" if i in nat else "1", folder, mode, str(args.rounds),
                            str(args.numel), str(args.idle)], i,
                           stdout=subprocess.PIPE, text=True) for i in range(3)]
        outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1])["seconds"] for p in procs]
    return [max(o[r] for o in outs) for r in range(1, args.rounds)]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        i, host, public, reachable, folder, mode, rounds, numel, idle = sys.argv[2:11]
        worker(int(i), 3, host, public, reachable == "1", Path(folder), mode, int(rounds), int(numel), float(idle))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="50mbit")
    parser.add_argument("--rtt", type=float, default=100.0)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--numel", type=int, default=920_000, help="fp32 values per island (the small model's)")
    parser.add_argument("--idle", type=float, default=0.0,
                        help="seconds between rounds, as an island's inner steps leave its connections idle")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/star-exchange"))
    args = parser.parse_args()
    results = {}
    for arm, (nat, mode) in ARMS.items():
        results[arm] = run_arm(nat, mode, args)
        print(f"{arm}: {statistics.median(results[arm]):.2f} s", flush=True)
    base = statistics.median(results["all reachable"])
    payload_mb = args.numel * 4 / 1e6
    lines = [f"# The exchange of 3 islands, 2 behind NAT: {args.rate}, RTT {args.rtt:.0f} ms, "
             f"{payload_mb:.1f} MB of fp32 per island, {args.idle:g} s idle between rounds", "",
             "| arm | exchange s (median) | min | max | / all reachable |", "|---|---|---|---|---|"]
    for arm, secs in results.items():
        med = statistics.median(secs)
        lines.append(f"| {arm} | {med:.2f} | {min(secs):.2f} | {max(secs):.2f} | {med / base:.2f}x |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "seconds": results}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.boxplot(list(results.values()), tick_labels=list(results))
    ax.set_ylabel("exchange seconds (slowest island)")
    ax.set_title(f"3 islands, {args.rate}, RTT {args.rtt:.0f} ms")
    fig.tight_layout()
    fig.savefig(args.out / "exchange_seconds.png", dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
