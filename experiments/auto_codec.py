"""``--averaging.compression auto`` against fixed codecs over a link that slows down in the middle of the run.

Two islands of the ``small`` model train H steps a round (blocking, unless ``--diloco.overlap_steps`` lets rounds run
under the inner steps) over an emulated link capped at ``--fast``;
once island 0 has committed ``--switch`` rounds, the link drops to ``--slow`` in both directions (``tc tbf``,
:meth:`experiments.netns.EmulatedNetwork.set_rate`), and with ``--back N`` it returns to ``--fast`` once island 0
has committed N rounds.  The same run with each of ``--codecs`` (default: fp32, int4 and auto).  Per arm: the
codec of each round, the compute utilization of each stretch of the link (the inner steps' share of each round's
wall-clock), the held-out loss at the end and the bytes sent::

    sudo python -m experiments auto-codec [--fast 20mbit] [--slow 3mbit] [--switch 3] [--back 0] [--out DIR]

Writes ``results.md``, ``results.json`` and ``utilization.png``.  Needs root (links capped by ``tc tbf``).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

from diloco.command import ArgumentParser, run_command
from diloco.files import writable_folder
from diloco.config import Config, ConfigError
from diloco.config import loader as config_load
from experiments import netns
from experiments.islands import CompareError, launch_islands, require_emulation, variant
from experiments.nat import round_records, round_records_so_far
from experiments.report import markdown_table, save_results

DEFAULTS: dict[str, Any] = {
    "model.preset": "small", "inner.batch_size": 16, "inner.warmup_steps": 10, "threads": 1,
    "diloco.inner_steps": 25, "diloco.outer_steps": 8,
    "logging.eval_every": 1000, "logging.eval_batches": 4, "logging.samples": 0, "checkpoint.every": 0,
    "wandb.mode": "disabled", "averaging.matchmaking_time": 5.0, "averaging.request_timeout": 3.0,
    "averaging.matchmaking_timeout": 120.0, "averaging.vote_timeout": 30.0, "averaging.allreduce_timeout": 300.0,
    "averaging.next_chunk_timeout": 60.0,
}


def change_rate_after(network: netns.EmulatedNetwork, run_dir: Path, changes: list[tuple[int, str]],
                      done: threading.Event) -> threading.Thread:
    """A thread that sets the link to ``rate`` once island 0 under ``run_dir`` has committed ``rounds`` rounds,
    for each ``(rounds, rate)`` of ``changes`` in turn."""
    def watch() -> None:
        for rounds, rate in changes:
            while sum(bool(r.get("round_ok")) for r in round_records_so_far(run_dir / "island0")) < rounds:
                if done.wait(0.2):
                    return
            network.set_rate(rate)
            print(f"   link set to {rate} after round {rounds}", flush=True)

    thread = threading.Thread(target=watch, name="link-rate", daemon=True)
    thread.start()
    return thread


def utilization(records: list[dict[str, Any]]) -> float:
    """The inner steps' share of the wall-clock of these rounds: 1 − Σ stall ÷ Σ (time since the previous
    round's record)."""
    walls = [b["time"] - a["time"] for a, b in zip(records, records[1:])]
    stalls = [r["stall_seconds"] for r in records[1:]]
    return 1 - sum(stalls) / sum(walls) if walls and sum(walls) > 0 else float("nan")


def stretches(switch: int, back: int, rounds: int) -> list[tuple[str, slice]]:
    """The stretches of a run whose link changes after ``switch`` (and ``back``, 0: never) rounds: (which link,
    the round records it covers).  Record i closes round i + 1, whose wall-clock runs from record i − 1, so a
    stretch of rounds a+1 … b takes records a−1 … b−1."""
    ends = [switch, back, rounds] if back else [switch, rounds]
    names = ["fast", "slow", "fast again"]
    return [(names[i], slice(max(0, lo - 1), hi)) for i, (lo, hi) in enumerate(zip([0, *ends], ends)) if hi > lo]


def run_arm(cfg: Config, codec: str, fast: str, slow: str, switch: int, back: int, out: Path) -> dict[str, Any]:
    """One run of two islands with ``codec``; the link drops from ``fast`` to ``slow`` after ``switch`` rounds
    (and returns to ``fast`` after ``back``, unless 0)."""
    run_dir = out / "runs" / codec
    c = variant(cfg, **{"logging.run_dir": str(run_dir), "averaging.run_id": f"auto-codec-{codec}",
                        "averaging.compression": codec})
    done = threading.Event()
    with netns.EmulatedNetwork(2, rate=fast) as network:
        watcher = change_rate_after(network, run_dir, [(switch, slow)] + ([(back, fast)] if back else []), done)
        try:
            summaries = launch_islands(c, 2, network=network)["islands"]
        finally:
            done.set()
            watcher.join(5)
    records = [round_records(run_dir / f"island{i}") for i in range(2)]
    worst = {name: min(utilization(rs[phase]) for rs in records)
             for name, phase in stretches(switch, back, cfg.diloco.outer_steps)}
    return {"codec": codec, "codecs": [r["codec"] for r in records[0]], "utilization_fast": worst["fast"],
            "utilization_slow": worst["slow"], "utilization_fast_again": worst.get("fast again"),
            "utilization": min(s["compute_seconds"] / s["wall_seconds"] for s in summaries),
            "eval_loss": summaries[0]["eval_loss_end"], "wall_s": max(s["wall_seconds"] for s in summaries),
            "bytes_sent": summaries[0]["bytes_sent"], "rounds_ok": [s["rounds_ok"] for s in summaries],
            "per_round": [[1 - r["stall_seconds"] / (b["time"] - a["time"]) if b["time"] > a["time"] else None
                           for a, b, r in zip(rs, rs[1:], rs[1:])] for rs in records]}


def write(rows: list[dict[str, Any]], out: Path, cfg: Config, fast: str, slow: str, switch: int, back: int,
          command: str) -> Path:
    """``results.md``, ``results.json`` and ``utilization.png`` of the arms' ``rows``; ``command``: what ran them."""
    again = [f"back to {fast}"] if back else []
    table = markdown_table(
        ["codec", "codec of each round", f"utilization at {fast}", f"after the drop to {slow}", *again, "whole run",
         "held-out loss", "bytes sent (island 0)", "wall s"],
        [[r["codec"], " ".join(r["codecs"]), f"{r['utilization_fast']:.1%}", f"{r['utilization_slow']:.1%}",
          *([f"{r['utilization_fast_again']:.1%}"] if back else []),
          f"{r['utilization']:.1%}", f"{r['eval_loss']:.4f}", f"{r['bytes_sent'] / 1e6:.1f} MB",
          f"{r['wall_s']:.0f}"] for r in rows])
    returns = f", and returns to {fast} once it committed round {back}" if back else ""
    d = cfg.diloco
    rounds = ("blocking rounds" if d.overlap == "none" and not d.overlap_steps else
              f"rounds in flight (`--diloco.overlap {d.overlap} --diloco.overlap_steps {d.overlap_steps}`)")
    lines = [f"# `--averaging.compression auto` over a link that slows down: 2 islands of `{cfg.model.preset}`, "
             f"H={d.inner_steps}, {d.outer_steps} {rounds}", "",
             f"`{command}`: the link drops from {fast} to {slow} once island 0 committed "
             f"round {switch}{returns}. Utilization: the worse island's "
             f"share of compute in the rounds' wall-clock, on each stretch of the link; `auto` may let communication "
             f"take `--diloco.max_comm_fraction` ({cfg.diloco.max_comm_fraction:g}) of a round.", "", table, "",
             "![utilization per round](utilization.png)", ""]
    save_results(out, "\n".join(lines), rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for r in rows:
        per = [min(v for v in vals if v is not None) for vals in zip(*r["per_round"])]
        ax.plot(range(2, len(per) + 2), per, marker="o", label=r["codec"])
    ax.set_xticks(range(2, cfg.diloco.outer_steps + 1))
    ax.axvline(switch + 0.5, color="grey", linestyle="--", linewidth=0.8)
    ax.text(switch + 0.6, 0.05, f"{fast} → {slow}", fontsize=8, color="grey")
    if back:
        ax.axvline(back + 0.5, color="grey", linestyle="--", linewidth=0.8)
        ax.text(back + 0.6, 0.05, f"{slow} → {fast}", fontsize=8, color="grey")
    ax.set_xlabel("round")
    ax.set_ylabel("compute utilization (worse island)")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "utilization.png", dpi=110)
    plt.close(fig)
    return out / "results.md"


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments auto-codec [--fast R] [--slow R] [--switch N] [--back N] [--codecs A,B] [--out DIR]``."""
    parser = ArgumentParser(prog="python -m experiments auto-codec", description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", default="20mbit", help="the link's rate at the start")
    parser.add_argument("--slow", default="3mbit", help="its rate once --switch rounds committed")
    parser.add_argument("--switch", type=int, default=3, help="rounds committed before the link slows down")
    parser.add_argument("--back", type=int, default=0,
                        help="rounds committed before the link returns to --fast (0: it stays slow)")
    parser.add_argument("--codecs", default="none,int4,auto", help="the arms: codecs, or auto")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/auto-codec"), help="output directory")
    parser.add_argument("--config", help="TOML config file (applied over this command's defaults)")
    args, rest = parser.parse_known_args(argv)

    def body() -> int:
        problems = []
        for r in (args.fast, args.slow):
            try:
                netns.parse_rate(r)
            except ValueError as e:
                problems.append(f"--fast/--slow: {e}")
        cfg = config_load.load(args.config, rest, defaults=DEFAULTS)
        if not 0 < args.switch < cfg.diloco.outer_steps:
            problems.append(f"--switch must be between 1 and --diloco.outer_steps − 1 ({cfg.diloco.outer_steps - 1}), "
                            f"got {args.switch}")
        if args.back and not args.switch < args.back < cfg.diloco.outer_steps:
            problems.append(f"--back must be between --switch + 1 ({args.switch + 1}) and --diloco.outer_steps − 1 "
                            f"({cfg.diloco.outer_steps - 1}), or 0 for a link that stays slow; got {args.back}")
        codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
        for c in codecs:
            try:
                variant(cfg, **{"averaging.compression": c})
            except ConfigError as e:
                problems += e.problems
        if problems:
            raise ConfigError(problems)
        require_emulation("auto-codec")
        writable_folder(args.out)
        rows = []
        for codec in codecs:
            print(f"\n== {codec}: {args.fast}, then {args.slow} after round {args.switch}"
                  f"{f', {args.fast} after round {args.back}' if args.back else ''} ==", flush=True)
            rows.append(run_arm(cfg, codec, args.fast, args.slow, args.switch, args.back, args.out))
        command = " ".join(["sudo python -m experiments auto-codec", *(sys.argv[1:] if argv is None else argv)])
        write(rows, args.out, cfg, args.fast, args.slow, args.switch, args.back, command)
        return 0

    from diloco.launch.simulate import SimulationError

    return run_command(body, (CompareError, SimulationError, netns.NetworkSetupError),
                       "interrupted: every island and emulated link was removed")


if __name__ == "__main__":
    sys.exit(main())
