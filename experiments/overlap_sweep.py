"""Compute utilization and wall-clock of DiLoCo against the link rate, for blocking rounds and for rounds
in flight (delayed, eager, Streaming DiLoCo fragments), next to the one-line model of each.

    python -m experiments overlap --rates 2mbit,5mbit,20mbit,100mbit [--islands 2] [--out DIR]
           [--modes blocking,delayed,eager,streaming] [--section.key VALUE ...]

For every rate the islands run on emulated hosts behind links capped at that rate (needs root; see
:mod:`experiments.netns`), once per mode, from the same seeded start with the same data and steps.  The
model next to each measurement: wall ≈ compute + what the link could not hide, where a round's transfer
(its payload ÷ the rate) hides under the inner steps trained while it is in flight (none for blocking
rounds; the steps until the next sync for ``delayed``/``eager``; τ steps for ``streaming``), i.e.
wall ≈ compute + Σ_rounds max(0, transfer − hidden compute).  Writes ``results.md``, ``results.json``
and ``utilization.png`` to ``--out``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from diloco.command import ArgumentParser, run_command
from diloco.files import writable_folder
from diloco.config import Config, ConfigError
from diloco.config import loader as config_load
from diloco.engine.metrics import read_metrics
from experiments.compare import ARMS
from experiments.compare_results import diloco_result
from experiments.islands import CompareError, launch_islands, require_emulation, variant
from experiments.report import format_bytes, json_safe, markdown_table

MODES: dict[str, dict[str, Any]] = {"blocking": {}, **ARMS}

SWEEP_DEFAULTS: dict[str, Any] = {
    "model.preset": "small", "inner.batch_size": 16, "inner.warmup_steps": 10, "diloco.inner_steps": 40,
    "diloco.outer_steps": 4, "logging.eval_every": 100, "logging.samples": 0, "logging.eval_batches": 2,
    "checkpoint.every": 0, "wandb.mode": "disabled", "averaging.matchmaking_time": 10.0,
    "averaging.request_timeout": 3.0, "averaging.matchmaking_timeout": 120.0, "averaging.vote_timeout": 30.0,
    "averaging.allreduce_timeout": 300.0, "averaging.next_chunk_timeout": 60.0,
}


def predicted_wall(run_dir: Path, compute: float, steps: int, rate_bits: float, hidden_steps: int) -> float:
    """compute + Σ_rounds max(0, payload ÷ rate − compute of the ``hidden_steps`` trained meanwhile)."""
    sent = [int(r["payload_bytes_sent"]) for r in read_metrics(run_dir) if "round_ok" in r]
    per_step = compute / max(steps, 1)
    unhidden = sum(max(0.0, (b - a) * 8 / rate_bits - hidden_steps * per_step) for a, b in zip([0] + sent, sent))
    return compute + unhidden


def sweep(cfg: Config, rates: list[str], modes: list[str], islands: int, out: Path) -> Path:
    """Run every mode at every rate; write the table, JSON and plot; return ``results.md``."""
    from experiments import netns

    require_emulation("the overlap sweep")
    rows: list[dict[str, Any]] = []
    for rate in rates:
        network = netns.EmulatedNetwork(islands, rate=rate)
        try:
            measured = network.measure_rate(0, 1, seconds=2)
            print(f"\n== {rate}: {measured / 1e6:.2f} Mbit/s TCP goodput measured ==", flush=True)
            for mode in modes:
                c = variant(cfg, **{"logging.run_dir": str(out / "runs" / f"{rate}-{mode}"),
                                     "averaging.run_id": f"overlap-{rate}-{mode}",
                                     "averaging.target_group_size": islands, **MODES[mode]})
                print(f"-- {mode} --", flush=True)
                r = diloco_result(f"{mode}@{rate}", "diloco", launch_islands(c, islands, network=network))
                d = c.diloco
                hidden = 0 if mode == "blocking" else (d.overlap_steps if d.overlap == "none"
                                                       else d.inner_steps // d.fragments)
                steps = r.extra["inner_steps_per_worker"]
                model = max(predicted_wall(Path(o), r.compute_seconds, steps, measured, hidden)
                            for o in (out / "runs" / f"{rate}-{mode}").glob("island*"))
                rows.append({"rate": rate, "mode": mode, "measured_mbit": measured / 1e6,
                             "utilization": r.compute_seconds / r.wall_seconds, "wall_s": r.wall_seconds,
                             "model_wall_s": model, "compute_s": r.compute_seconds,
                             "stall_s": r.extra["stall_seconds"], "peak_sync_bytes": r.extra["peak_sync_bytes"],
                             "eval_loss": r.final_eval_loss, "spread": r.extra["theta_global_max_abs_diff"]})
                print(f"{mode}@{rate}: utilization {rows[-1]['utilization']:.1%}, wall {r.wall_seconds:.0f} s "
                      f"(model {model:.0f} s)", flush=True)
        finally:
            network.close()
    return write(rows, out, cfg, islands)


def write(rows: list[dict[str, Any]], out: Path, cfg: Config, islands: int) -> Path:
    """``results.md`` (table), ``results.json`` and ``utilization.png`` (utilization and wall against rate)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(
        ["rate", "mode", "utilization", "wall s", "model wall s", "stall s", "largest sync", "held-out loss", "θ spread"],
        [[r["rate"], r["mode"], f"{r['utilization']:.1%}", f"{r['wall_s']:.0f}", f"{r['model_wall_s']:.0f}",
          f"{r['stall_s']:.1f}", format_bytes(r["peak_sync_bytes"]), f"{r['eval_loss']:.4f}", f"{r['spread']:.2g}"]
         for r in rows])
    md = out / "results.md"
    md.write_text(f"# Rounds in flight against the link rate\n\n`python -m experiments overlap` — {islands} islands, "
                  f"model `{cfg.model.preset}`, H={cfg.diloco.inner_steps}, {cfg.diloco.outer_steps} rounds, "
                  f"every mode from the same seeded start.\n\nutilization = compute ÷ wall-clock of the training "
                  f"loop; model wall = compute + Σ over rounds of max(0, payload ÷ measured rate − compute of the "
                  f"steps trained while the round is in flight).\n\n{table}\n\n![utilization](utilization.png)\n",
                  encoding="utf-8")
    (out / "results.json").write_text(json.dumps(json_safe(rows), indent=2) + "\n")
    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax_u, ax_w = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for mode in dict.fromkeys(r["mode"] for r in rows):
        pts = sorted((r["measured_mbit"], r) for r in rows if r["mode"] == mode)
        xs = [x for x, _ in pts]
        ax_u.plot(xs, [100 * r["utilization"] for _, r in pts], marker="o", label=mode)
        line, = ax_w.plot(xs, [r["wall_s"] for _, r in pts], marker="o", label=f"{mode} measured")
        ax_w.plot(xs, [r["model_wall_s"] for _, r in pts], linestyle="--", color=line.get_color(),
                  label=f"{mode} model")
    rates = sorted({r["measured_mbit"] for r in rows})
    for ax, label in ((ax_u, "compute utilization (%)"), (ax_w, "wall-clock (s)")):
        ax.set_xscale("log")
        ax.set_xticks(rates, [f"{x:.3g}" for x in rates])
        ax.minorticks_off()
        ax.set_xlabel("link rate (Mbit/s, measured goodput)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    ax_u.legend()
    ax_w.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "utilization.png", dpi=110)
    print("\n" + table + f"\n\nreport: {md}", flush=True)
    return md


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments overlap [--rates ...] [--modes ...] [--islands N] [--out DIR] [--section.key VALUE ...]``."""
    parser = ArgumentParser(prog="python -m experiments overlap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="2mbit,5mbit,20mbit,100mbit", help="link rates, comma-separated")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated of {', '.join(MODES)}")
    parser.add_argument("--islands", type=int, default=2, help="islands (default 2)")
    parser.add_argument("--out", default="experiments/results/overlap", help="output directory")
    parser.add_argument("--config", help="TOML config file (applied over this command's defaults)")
    args, rest = parser.parse_known_args(argv)

    def body() -> int:
        from experiments.netns import parse_rate

        cfg = config_load.load(args.config, rest, defaults=SWEEP_DEFAULTS)
        rates = [r.strip() for r in args.rates.split(",") if r.strip()]
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        problems = [f"--modes {m} is not one of {', '.join(MODES)}" for m in modes if m not in MODES]
        for r in rates:
            try:
                parse_rate(r)
            except ValueError as e:
                problems.append(f"--rates: {e}")
        if args.islands < 2:
            problems.append(f"--islands must be at least 2, got {args.islands}")
        if problems or not rates or not modes:
            raise ConfigError(problems or ["--rates and --modes must each name at least one"])
        sweep(cfg, rates, modes, args.islands, writable_folder(args.out))
        return 0

    from diloco.launch.simulate import SimulationError
    from experiments.netns import NetworkSetupError

    return run_command(body, (CompareError, SimulationError, NetworkSetupError),
                       "interrupted: every island and emulated link was removed")


if __name__ == "__main__":
    sys.exit(main())
