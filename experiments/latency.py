"""Round time against the link's round trip: the same short DiLoCo run over emulated links of one rate and
several RTTs, side by side, against what the bytes alone take.

For each RTT, two islands train over the userspace delay line (:mod:`experiments.delay_line`); the report
gives the median round time (matchmaking, exchange and vote, as the last island to arrive sees it), the bytes one island sends per round ÷ the rate, the budget ``bytes ÷ rate + 6 RTT + 0.5 s``, and the
round trips the protocol adds (the round time above the RTT-0 run, divided by the RTT)::

    sudo python -m experiments.latency --rate 50mbit --rtts 0,100,250

Needs root and TUN devices.
"""

from __future__ import annotations

import sys
from pathlib import Path

from diloco.config import ConfigError
from diloco.config import loader as config_load
from experiments import netns
from experiments.nat import DEFAULTS, figure, link_parser, run_arm, save_figure
from experiments.report import save_results


def _plot(rows: list[dict], path: Path, title: str) -> None:
    fig, ax = figure()
    rtts = [r["rtt_ms"] for r in rows]
    ax.plot(rtts, [r["round_seconds_median"] for r in rows], "o-", label="round (median)")
    ax.plot(rtts, [r["budget_seconds"] for r in rows], "--", label="bytes ÷ rate + 6 RTT + 0.5 s")
    ax.plot(rtts, [r["bytes_seconds"] for r in rows], ":", label="bytes ÷ rate")
    ax.set_xlabel("round-trip time (ms)")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    save_figure(fig, ax, title, path)


def main(argv: list[str] | None = None) -> int:
    from diloco.command import run_command

    parser = link_parser(__doc__, "experiments/results/latency")
    parser.add_argument("--rtts", default="0,100,250", help="round-trip times in ms, comma-separated")
    args, rest = parser.parse_known_args(argv)

    def body() -> int:
        try:
            rtts = [float(x) for x in args.rtts.split(",") if x.strip()]
        except ValueError:
            raise ConfigError([f"--rtts must list milliseconds such as 0,100,250, got {args.rtts!r}"]) from None
        if not rtts or min(rtts) < 0:
            raise ConfigError([f"--rtts must list round-trip times of 0 ms or more, got {args.rtts!r}"])
        ok, why = netns.available(delay=True)
        if not ok:
            raise ConfigError([f"the emulated links need root and TUN devices: {why}"])
        cfg = config_load.load(None, rest, defaults=DEFAULTS)
        rate_bits = netns.parse_rate(args.rate)
        rows = []
        for rtt in rtts:
            print(f"== RTT {rtt:g} ms ==", flush=True)
            r = run_arm(cfg, args.islands, (), args.rate, rtt, args.out / "runs" / f"rtt{rtt:g}")
            r["bytes_seconds"] = r["payload_bytes_per_round"] * 8 / rate_bits
            r["budget_seconds"] = r["bytes_seconds"] + 6 * rtt / 1000 + 0.5
            rows.append(r)
        base = rows[0]["round_seconds_median"] if rtts[0] == 0 else float("nan")
        payload = max(r["payload_bytes_per_round"] for r in rows) / 1e6
        title = f"{args.islands} islands, {args.rate}, {payload:.1f} MB sent per island per round"
        table = [f"# Round time against RTT: {title}", "",
                 "| RTT ms | rounds committed | θ identical | round s (median) | bytes ÷ rate s | budget s | "
                 "within budget | round trips added |", "|---|---|---|---|---|---|---|---|"]
        phases = ("group", "exchange", "vote")
        for r in rows:
            added = (r["round_seconds_median"] - base) / (r["rtt_ms"] / 1000) if r["rtt_ms"] else float("nan")
            r["round_trips_added"] = added
            table.append(f"| {r['rtt_ms']:g} | {r['rounds_committed']} of {r['rounds_planned']} | "
                         f"{r['theta_identical']} | {r['round_seconds_median']:.2f} | {r['bytes_seconds']:.2f} | "
                         f"{r['budget_seconds']:.2f} | {r['round_seconds_median'] <= r['budget_seconds']} | "
                         f"{'' if added != added else f'{added:.1f}'} |")
        table += ["", "Where the round trips go (median seconds of each phase over both islands' committed rounds; "
                  "round trips: above the RTT-0 run, divided by the RTT):", "",
                  "| RTT ms | " + " | ".join(f"{p} s (round trips)" for p in phases) + " |",
                  "|---|" + "---|" * len(phases)]
        for r in rows:
            cells = []
            for p in phases:
                v, v0 = r[f"{p}_seconds_median"], rows[0][f"{p}_seconds_median"]
                trips = f" ({(v - v0) / (r['rtt_ms'] / 1000):.1f})" if r["rtt_ms"] and rtts[0] == 0 else ""
                cells.append(f"{v:.2f}{trips}")
            table.append(f"| {r['rtt_ms']:g} | " + " | ".join(cells) + " |")
        text = "\n".join(table)
        save_results(args.out, text, rows)
        _plot(rows, args.out / "round_seconds.png", title)
        return 0

    return run_command(body, (netns.NetworkSetupError,))


if __name__ == "__main__":
    sys.exit(main())
