"""Islands behind NAT: the same short DiLoCo run three times over emulated links, every island reachable, then
with some islands behind NAT (no inbound TCP connection reaches their host), once run with
``--averaging.client_mode true`` and once without it (they find it out themselves, when a reachable island
cannot connect back: :mod:`peers.wire.dial_back`), side by side.

The NAT'ed islands open every connection themselves; the others send them their bytes back over those lanes
(:mod:`peers.wire.transport`), and two or more NAT'ed islands average through the reachable ones, which own
every part of the reduce-scatter (:func:`peers.wire.encoded.part_owners`).  Reports, per
arm, the rounds committed, whether θ_global ended identical on every island, and the median round time (the
exchange, and the round as the last island to arrive sees it: the smallest ``allreduce_seconds`` of the
round's islands, since the others' also count their wait for it), as a table, JSON and a PNG::

    sudo python -m experiments.nat --islands 2 --nat 1 --rate 50mbit --rtt 100
    sudo python -m experiments.nat --islands 3 --nat 1,2 --rate 50mbit --rtt 100

Needs root and TUN devices (the delay line of :mod:`experiments.delay_line`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from diloco.config import Config, ConfigError
from diloco.config import loader as config_load
from diloco.engine.metrics import read_metrics
from experiments import netns
from experiments.islands import launch_islands, variant
from experiments.report import save_results

DEFAULTS: dict[str, Any] = {
    "model.preset": "small",
    "inner.batch_size": 8,
    "diloco.inner_steps": 20,
    "diloco.outer_steps": 4,
    "logging.eval_batches": 2,
    "logging.samples": 0,
    "checkpoint.every": 0,
    "averaging.matchmaking_time": 10.0,
    "averaging.request_timeout": 5.0,
    "averaging.matchmaking_timeout": 90.0,
    "averaging.vote_timeout": 30.0,
    "averaging.allreduce_timeout": 120.0,
    "averaging.startup_timeout": 60.0,
    "wandb.mode": "offline",
}


def round_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every round record of one island's ``metrics.jsonl``."""
    return [r for r in read_metrics(run_dir) if "round_ok" in r]


def round_records_so_far(run_dir: Path) -> list[dict[str, Any]]:
    """:func:`round_records` of an island still running: none while its file is not written yet, or a line of it
    is half written."""
    try:
        return round_records(run_dir)
    except (OSError, ValueError):
        return []


def round_seconds(rounds: list[list[dict[str, Any]]]) -> list[float]:
    """Each committed round's time as the last island to arrive sees it (the smallest ``allreduce_seconds`` of
    its islands: the others' also count their wait for it), in round order; ``rounds``: each island's records."""
    by_step: dict[int, list[float]] = {}
    for rs in rounds:
        for r in rs:
            if r.get("round_ok") and "allreduce_seconds" in r:
                by_step.setdefault(int(r["outer_step"]), []).append(float(r["allreduce_seconds"]))
    return [min(v) for _, v in sorted(by_step.items())]


def run_arm(cfg: Config, islands: int, nat: tuple[int, ...], rate: str, rtt_ms: float, out: Path,
            declared: bool = True, nat_kind: str = "cone", punch: bool = True) -> dict[str, Any]:
    """One run of ``islands`` islands, those in ``nat`` behind NATs of ``nat_kind`` (``declared``: started with
    ``--averaging.client_mode true``; ``punch``: with ``--averaging.hole_punch``); what :func:`main` reports."""
    with netns.EmulatedNetwork(islands, rate=rate, rtt_ms=rtt_ms, nat=nat, nat_kind=nat_kind,
                               delay_line=True) as network:
        def wrap(cmd: list[str], i: int) -> list[str]:
            hidden = (["--averaging.client_mode", "true"] if declared else []) + (
                [] if punch else ["--averaging.hole_punch", "false"])
            return network.wrap(cmd + (hidden if i in nat else []), i)

        c = variant(cfg, **{"logging.run_dir": str(out)})
        launched = launch_islands(c, islands, network, wrap=wrap)
    summaries = launched["islands"]
    rounds = [round_records(out / f"island{i}") for i in range(islands)]
    ok = [sum(1 for r in rs if r.get("round_ok")) for rs in rounds]
    took = round_seconds(rounds)

    def phase(name: str) -> float:
        values = [float(r[name]) for rs in rounds for r in rs if r.get("round_ok") and isinstance(r.get(name), (int, float))]
        return statistics.median(values) if values else float("nan")
    checksums = {s.get("theta_checksum") for s in summaries}
    sent = [s["payload_bytes_sent"] / max(1, s["rounds_ok"]) for s in summaries]
    relayed = [s.get("transport_relayed") for s in summaries]
    return {"nat": list(nat), "nat_kind": nat_kind, "hole_punch": punch, "rtt_ms": rtt_ms, "relayed": relayed, "rounds_committed": ok, "rounds_planned": cfg.diloco.outer_steps,
            "payload_bytes_per_round": max(sent) if sent else 0,
            "theta_identical": len(checksums) == 1 and None not in checksums,
            "behind_nat": [bool(s.get("behind_nat")) for s in summaries],
            "found_by_dial_back": [bool(s.get("behind_nat_found_by_dial_back")) for s in summaries],
            "round_seconds_median": statistics.median(took) if took else float("nan"),
            "exchange_seconds_median": phase("exchange_seconds"), "group_seconds_median": phase("group_seconds"),
            "vote_seconds_median": phase("vote_seconds"),
            "round_seconds": took}


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's repeated runs as one: the first run's facts, every round of every run, medians over all of
    them (the exchange's: the median of the runs' medians), and each run's median round."""
    if len(runs) == 1:
        return runs[0]
    took = [t for r in runs for t in r["round_seconds"]]
    out = dict(runs[0], round_seconds=took, round_seconds_median=statistics.median(took),
               rounds_committed=[sum(c) for c in zip(*(r["rounds_committed"] for r in runs))],
               rounds_planned=sum(r["rounds_planned"] for r in runs),
               theta_identical=all(r["theta_identical"] for r in runs),
               relayed=[sum(x) for x in zip(*(r["relayed"] for r in runs))] if all(
                   None not in r["relayed"] for r in runs) else [None],
               per_run_round_seconds_median=[r["round_seconds_median"] for r in runs])
    for name in ("exchange_seconds_median", "group_seconds_median", "vote_seconds_median"):
        out[name] = statistics.median(r[name] for r in runs)
    return out


def figure() -> tuple[Any, Any]:
    """A figure and its axes, drawn off screen, sized for the results folders."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(6, 3.5))


def save_figure(fig: Any, ax: Any, title: str, path: Path) -> None:
    """Title ``ax``, write ``fig`` to ``path`` (PNG) and free it."""
    import matplotlib.pyplot as plt

    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def link_parser(description: str, out: str) -> argparse.ArgumentParser:
    """The options the link experiments share: the islands, their link's rate and the results folder."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--islands", type=int, default=2)
    parser.add_argument("--rate", default="50mbit", help="every island's link (e.g. 50mbit)")
    parser.add_argument("--out", type=Path, default=Path(out),
                        help="where results.md, results.json and round_seconds.png go")
    return parser


def _plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    fig, ax = figure()
    for i, (arm, r) in enumerate(results.items()):
        ax.scatter([i] * len(r["round_seconds"]), r["round_seconds"], alpha=0.6)
        ax.hlines(r["round_seconds_median"], i - 0.25, i + 0.25, color="black")
    ax.set_xticks(range(len(results)), list(results))
    ax.set_ylabel("seconds per round (last island to arrive)")
    save_figure(fig, ax, title, path)


def main(argv: list[str] | None = None) -> int:
    from diloco.command import run_command

    parser = link_parser(__doc__, "experiments/results/nat")
    parser.add_argument("--nat", default="1", help="indices of the islands behind NAT, comma-separated")
    parser.add_argument("--rtt", type=float, default=100.0, help="round-trip time in ms")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the arms in turn this many times and pool their rounds (default 1)")
    parser.add_argument("--nat-kind", default="cone", choices=netns.NAT_KINDS,
                        help="cone: a NAT that keeps a connection's port (hole punching gets through); symmetric: "
                             "one that gives each destination its own port (it does not)")
    args, rest = parser.parse_known_args(argv)

    def body() -> int:
        try:
            nat = tuple(int(x) for x in args.nat.split(",") if x.strip())
        except ValueError:
            raise ConfigError([f"--nat must list island indices such as 1,2, got {args.nat!r}"]) from None
        if not nat or max(nat) >= args.islands or min(nat) < 0 or len(set(nat)) >= args.islands:
            raise ConfigError([f"--nat must name between 1 and {args.islands - 1} of the islands "
                               f"0..{args.islands - 1}, leaving one reachable, got {args.nat!r}"])
        if args.repeats < 1:
            raise ConfigError([f"--repeats must be at least 1, got {args.repeats}"])
        ok, why = netns.available(delay=True)
        if not ok:
            raise ConfigError([f"the emulated links need root and TUN devices: {why}"])
        cfg = config_load.load(None, rest, defaults=DEFAULTS)
        hidden_name = f"island{'s' if len(nat) > 1 else ''} {args.nat} behind NAT"
        if args.nat_kind != "cone":
            hidden_name = hidden_name.replace("NAT", f"{args.nat_kind} NAT")
        arms = [("all reachable", (), "open", True, True), (f"{hidden_name}, declared", nat, "nat", True, True),
                (f"{hidden_name}, found by dial-back", nat, "nat-found", False, True)]
        if len(nat) > 1:  # whether the islands behind NAT punch through to each other or average through a star
            arms.append((f"{hidden_name}, declared, no hole punching", nat, "nat-star", True, False))
        runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm, *_ in arms}
        for repeat in range(args.repeats):  # arms in turn: the machine's slow spells fall on all of them
            for arm, hidden, folder, declared, punch in arms:
                print(f"== {arm}{f' (repeat {repeat + 1})' if args.repeats > 1 else ''} ==", flush=True)
                runs[arm].append(run_arm(cfg, args.islands, hidden, args.rate, args.rtt, args.out / "runs" / (
                    folder + (str(repeat) if args.repeats > 1 else "")), declared=declared, nat_kind=args.nat_kind,
                    punch=punch))
                print(json.dumps({k: v for k, v in runs[arm][-1].items() if k != "round_seconds"}), flush=True)
        results = {arm: pooled(rs) for arm, rs in runs.items()}
        base = results["all reachable"]
        title = f"{args.islands} islands, {args.rate}, RTT {args.rtt:g} ms, {cfg.model.preset} model"
        rows = [f"# Islands behind NAT: {title}", "",
                "| arm | rounds committed | θ_global identical | behind NAT (found by dial-back) | messages relayed "
                "| round s (median) | exchange s (median) | round / all reachable |",
                "|---|---|---|---|---|---|---|---|"]
        for arm, r in results.items():
            hidden = ", ".join(f"island{i}{' (found)' if found else ''}"
                               for i, (behind, found) in enumerate(zip(r["behind_nat"], r["found_by_dial_back"]))
                               if behind) or "none"
            each = f" (runs: {', '.join(f'{x:.2f}' for x in r['per_run_round_seconds_median'])})" if (
                "per_run_round_seconds_median" in r) else ""
            relayed = "+".join(str(x) for x in r["relayed"]) if None not in r["relayed"] else "?"
            rows.append(f"| {arm} | {r['rounds_committed']} of {r['rounds_planned']} | {r['theta_identical']} | "
                        f"{hidden} | {relayed} | {r['round_seconds_median']:.2f}{each} | "
                        f"{r['exchange_seconds_median']:.2f} | "
                        f"{r['round_seconds_median'] / base['round_seconds_median']:.2f}x |")
        table = "\n".join(rows)
        save_results(args.out, table, results)
        _plot(results, args.out / "round_seconds.png", title)
        return 0

    return run_command(body, (netns.NetworkSetupError,))


if __name__ == "__main__":
    sys.exit(main())
