"""The planner against measurements: configurations of two islands over emulated links, each predicted by
``diloco plan``'s model from a calibration of the islands without a link and the link as ``diloco probe`` measured it, then run;
and the plan's pick against the default configuration at equal tokens over the slow link.

    sudo python -m experiments plan-check [--rates 5mbit,20mbit] [--out experiments/results/plan-check]

Per run, predicted against measured: compute utilization (compute ÷ wall-clock of the training loop), the
median round (as the last island to arrive sees it) and each island's tokens/s while it trains.  Writes
``results.md``, ``results.json`` and ``predicted_vs_measured.png``.  Needs root (links capped by ``tc tbf``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from diloco.command import ArgumentParser, run_command
from diloco.files import writable_folder
from diloco.config import Config, ConfigError
from diloco.config import loader as config_load
from experiments import netns
from experiments.islands import CompareError, launch_islands, require_emulation, variant
from experiments.nat import round_records, round_seconds
from experiments.plan import Inputs, Link, Model, Servers, make_plan, predict
from experiments.report import markdown_table, save_results
from peers.wire.probe import PROBE_PORT, read_probe

DEFAULTS: dict[str, Any] = {
    "model.preset": "small", "inner.batch_size": 16, "inner.warmup_steps": 10, "threads": 1,
    "logging.eval_every": 1000, "logging.eval_batches": 1, "logging.samples": 0, "checkpoint.every": 0,
    "wandb.mode": "disabled", "averaging.matchmaking_time": 5.0, "averaging.request_timeout": 3.0,
    "averaging.matchmaking_timeout": 120.0, "averaging.vote_timeout": 30.0, "averaging.allreduce_timeout": 300.0,
    "averaging.next_chunk_timeout": 60.0,
}
STEPS = 200
"""Inner steps of every island in every run (equal tokens)."""
SYNC_STEPS = 20
"""Steps of the synchronous baseline (each one all-reduces every gradient over the link)."""
CONFIGS: dict[str, list[tuple[int, str, str]]] = {
    # rate index → (H, codec, overlap); the first of the slow rate is the default configuration
    "slow": [(50, "none", "blocking"), (25, "int8", "blocking")],
    "fast": [(50, "none", "blocking"), (25, "none", "delayed")],
}


def calibrate(cfg: Config, out: Path) -> Path:
    """The two islands side by side with no link between them (each averages alone): their tokens/s, written as a
    ``benchmarks/gpu_island.py``-format file.  Side by side, because on this machine they share its cores in the
    runs too (on servers, each island has its own)."""
    c = variant(cfg, **{"logging.run_dir": str(out / "runs" / "calibration"), "averaging.backend": "local",
                        "averaging.min_group_size": 1, "diloco.inner_steps": 50, "diloco.outer_steps": 2})
    summaries = launch_islands(c, 2)["islands"]
    tokens_per_s = statistics.mean(s["tokens"] / s["compute_seconds"] for s in summaries)
    model = _model(cfg)
    path = out / "cpu-profile.json"
    rows = [{"section": "card", "device": "cpu (this machine, one thread per island)"},
            {"section": "inner", "preset": cfg.model.preset, "params": model.params, "row": "fp32, 1 thread",
             "batch": f"{cfg.inner.batch_size}x{model.seq}",
             "tokens_per_s": tokens_per_s, "peak_memory_gb": 0.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"calibration: {tokens_per_s:,.0f} tokens/s per island, no link -> {path}", flush=True)
    return path


def _model(cfg: Config) -> Model:
    return Model.of_preset(cfg.model.preset, 256)


def probe_link(network: netns.EmulatedNetwork) -> tuple[Link, str]:
    """``diloco probe`` from host 0 to a listener on host 1 over the emulated link."""
    listener = network.popen([sys.executable, "-m", "diloco.cli", "probe", "--listen", "--port", str(PROBE_PORT)], 1,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        address = f"{network.host(1).address}:{PROBE_PORT}"
        done = subprocess.run(network.wrap([sys.executable, "-m", "diloco.cli", "probe", "--initial-peers", address,
                                            "--seconds", "2", "--streams", "4"], 0),
                              capture_output=True, text=True, timeout=120)
    finally:
        network.reap(listener)
    if done.returncode != 0:
        raise CompareError(f"diloco probe over the emulated link failed: {done.stderr.strip()[-300:]}")
    line = done.stdout.strip().splitlines()[-1]
    return Link.from_probe(read_probe(line), "diloco probe over the emulated link"), line


def measure(cfg: Config, network: netns.EmulatedNetwork, H: int, codec: str, overlap: str, run_dir: Path) -> dict:
    """Run two islands with these settings; their utilization, median round and tokens/s."""
    c = variant(cfg, **{"logging.run_dir": str(run_dir), "averaging.run_id": f"plan-check-{run_dir.name}",
                        "diloco.inner_steps": H, "diloco.outer_steps": STEPS // H, "averaging.compression": codec,
                        "diloco.overlap": "none" if overlap == "blocking" else "delayed",
                        "diloco.fragments": 4 if overlap == "streaming" else 1})
    launched = launch_islands(c, 2, network=network)
    summaries = launched["islands"]
    rounds = round_seconds([round_records(run_dir / f"island{i}") for i in range(2)])
    return {"utilization": statistics.mean(s["compute_seconds"] / s["wall_seconds"] for s in summaries),
            "round_s": statistics.median(rounds) if rounds else float("nan"),
            "tokens_per_s": [s["tokens"] / s["compute_seconds"] for s in summaries],
            "wall_s": max(s["wall_seconds"] for s in summaries),
            "rounds_ok": [s["rounds_ok"] for s in summaries], "eval_loss": summaries[0]["eval_loss_end"]}


def measure_sync(cfg: Config, network: netns.EmulatedNetwork, run_dir: Path) -> dict:
    """The synchronous baseline (torch DDP) of two workers for ``SYNC_STEPS`` steps over the link."""
    from diloco.launch.baseline import run_baseline

    c = variant(cfg, **{"logging.run_dir": str(run_dir), "diloco.inner_steps": SYNC_STEPS // 2,
                        "diloco.outer_steps": 2})
    s = run_baseline(c, 2, network, progress=False)
    steps = s["inner_step"]
    return {"utilization": s["compute_seconds"] / s["wall_seconds"], "round_s": s["comm_seconds"] / steps,
            "tokens_per_s": [s["tokens"] / 2 / s["compute_seconds"]], "wall_s": s["wall_seconds"],
            "rounds_ok": [steps], "eval_loss": s["eval_loss_end"]}


def check(cfg: Config, rates: list[str], out: Path) -> Path:
    require_emulation("the plan check")
    profile = calibrate(cfg, out)
    model = _model(cfg)
    rows: list[dict[str, Any]] = []
    for rate, configs in zip(rates, CONFIGS.values()):
        with netns.EmulatedNetwork(2, rate=rate) as network:
            link, line = probe_link(network)
            print(f"\n== {rate}: {line} ==", flush=True)
            inputs = Inputs(model, Servers(2, 1, "cpu", price_per_gpu_hour=0.0), link,
                            tokens=2 * STEPS * cfg.inner.batch_size * model.seq,
                            batch_tokens=cfg.inner.batch_size * model.seq, max_loss_penalty=0.01,
                            compute_file=profile)
            runs = [(f"{rate} H={H} {codec} {overlap}", H, codec, overlap) for H, codec, overlap in configs]
            if rate == rates[0]:
                plan = make_plan(inputs, choices={"H": (25, 50, 100)})
                pick = plan.best[0]
                runs.append((f"{rate} plan's pick: H={pick.H} {pick.codec} {pick.overlap}", pick.H, pick.codec,
                             pick.overlap))
                runs.append((f"{rate} DDP, {SYNC_STEPS} steps (the plan's synchronous row)", 0, "none", "sync"))
            for name, H, codec, overlap in runs:
                predicted = predict(inputs, H, codec, overlap)
                if H == 0:  # per step: what the all-reduce leaves exposed after the backward pass
                    predicted.round_s = max(0.0, predicted.round_s - 2 / 3 * predicted.shape.step_s)
                print(f"-- {name}: predicted utilization {predicted.utilization:.1%}, round "
                      f"{predicted.round_s:.2f} s --", flush=True)
                slug = name.split(" (")[0].replace(" ", "-").replace("'", "").replace("=", "").replace(":", "")
                slug = slug.replace(",", "")
                measured = (measure_sync(cfg, network, out / "runs" / slug) if H == 0 else
                            measure(cfg, network, H, codec, overlap, out / "runs" / slug))
                rows.append({"run": name, "rate": rate, "H": H, "codec": codec, "overlap": overlap,
                             "probe": json.loads(line), "predicted": {
                                 "utilization": predicted.utilization, "round_s": predicted.round_s,
                                 "tokens_per_s": predicted.tokens_per_s, "wall_s": predicted.wall_s,
                                 "loss_penalty": predicted.loss_penalty},
                             "measured": measured, "pick": "pick" in name, "default": (H, codec, overlap) ==
                             CONFIGS["slow"][0] and rate == rates[0]})
                print(f"   measured utilization {measured['utilization']:.1%}, round {measured['round_s']:.2f} s, "
                      f"tokens/s {measured['tokens_per_s'][0]:,.0f}", flush=True)
    return write(rows, out, cfg)


def _err(p: float, m: float) -> str:
    return f"{(p - m) / m:+.1%}" if m else "n/a"


def write(rows: list[dict[str, Any]], out: Path, cfg: Config) -> Path:
    table = markdown_table(
        ["run", "utilization predicted", "measured", "error", "round predicted", "measured", "error",
         "tokens/s per island predicted", "measured (island 0 / 1)", "error (worst)", "wall s measured"],
        [[r["run"], f"{r['predicted']['utilization']:.1%}", f"{r['measured']['utilization']:.1%}",
          _err(r["predicted"]["utilization"], r["measured"]["utilization"]),
          f"{r['predicted']['round_s']:.2f} s", f"{r['measured']['round_s']:.2f} s",
          _err(r["predicted"]["round_s"], r["measured"]["round_s"]),
          f"{r['predicted']['tokens_per_s']:,.0f}",
          " / ".join(f"{t:,.0f}" for t in r["measured"]["tokens_per_s"]),
          max((_err(r["predicted"]["tokens_per_s"], t) for t in r["measured"]["tokens_per_s"]),
              key=lambda e: abs(float(e.rstrip('%')))),
          f"{r['measured']['wall_s']:.0f}"] for r in rows])
    default = next((r for r in rows if r["default"]), None)
    pick = next((r for r in rows if r["pick"]), None)
    lines = [f"# The plan against measurements: 2 islands of `{cfg.model.preset}`, {STEPS} inner steps each", "",
             "`sudo python -m experiments plan-check` — predictions from a calibration of the islands without "
             "a link (`cpu-profile.json`) and the link as `diloco probe` measured it; runs over links capped by `tc tbf`.",
             "", table, ""]
    if default and pick:
        d, p = default["measured"]["wall_s"], pick["measured"]["wall_s"]
        lines.append(f"The plan's pick ({pick['run']}) took {p:.0f} s against the default's {d:.0f} s at equal "
                     f"tokens ({(d - p) / d:+.0%} of the default's wall-clock saved; predicted "
                     f"{pick['predicted']['wall_s']:.0f} s vs {default['predicted']['wall_s']:.0f} s).")
    lines += ["", "The DDP row's round is per step: the time the step waited for the all-reduce after its backward "
              "pass (predicted: the all-reduce less the ⅔ of a step it hides under; measured: `comm_seconds` of "
              "the baseline, DDP's exposed wait plus the loss's all-reduce).", "",
              "![predicted vs measured](predicted_vs_measured.png)", ""]
    save_results(out, "\n".join(lines), rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    for ax, (key, label) in zip(axes, (("utilization", "compute utilization"), ("round_s", "round (s)"),
                                       ("tokens_per_s", "tokens/s per island"))):
        for r in rows:
            measured = r["measured"][key]
            for m in (measured if isinstance(measured, list) else [measured]):
                ax.scatter(m, r["predicted"][key], marker="s" if r["pick"] else "o",
                           color="tab:red" if r["pick"] else "tab:blue")
        values = [v for r in rows for v in ([r["predicted"][key]] + (r["measured"][key] if isinstance(
            r["measured"][key], list) else [r["measured"][key]]))]
        lo, hi = min(values) * 0.9, max(values) * 1.1
        ax.plot([lo, hi], [lo, hi], "k--", linewidth=0.8)
        ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="grey", alpha=0.15)
        ax.set_xlabel(f"measured {label}")
        ax.set_ylabel(f"predicted {label}")
        ax.grid(True, alpha=0.3)
    fig.suptitle("diloco plan against 2 islands over emulated links (band: ±10%; square: the plan's pick)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "predicted_vs_measured.png", dpi=110)
    plt.close(fig)
    return out / "results.md"


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments plan-check [--rates SLOW,FAST] [--out DIR] [--section.key VALUE ...]``."""
    parser = ArgumentParser(prog="python -m experiments plan-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="5mbit,20mbit", help="the slow and the fast link rate")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/plan-check"), help="output directory")
    parser.add_argument("--config", help="TOML config file (applied over this command's defaults)")
    args, rest = parser.parse_known_args(argv)

    def body() -> int:
        rates = [r.strip() for r in args.rates.split(",") if r.strip()]
        if len(rates) != 2:
            raise ConfigError([f"--rates must name two rates, the slow then the fast, got {args.rates!r}"])
        for r in rates:
            try:
                netns.parse_rate(r)
            except ValueError as e:
                raise ConfigError([f"--rates: {e}"]) from None
        cfg = config_load.load(args.config, rest, defaults=DEFAULTS)
        writable_folder(args.out)
        check(cfg, rates, args.out)
        return 0

    from diloco.launch.simulate import SimulationError

    return run_command(body, (CompareError, SimulationError, netns.NetworkSetupError),
                       "interrupted: every island and emulated link was removed")


if __name__ == "__main__":
    sys.exit(main())
