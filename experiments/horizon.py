"""Does the gap of a DiLoCo variant to blocking fp32 DiLoCo close as the run gets longer?

    python -m experiments horizon [--arms delayed,eager,topk,sparseloco] [--rounds 18] [--islands 4]
           [--at 6,12,18] [--out experiments/results/horizon] [--section.key VALUE ...]

The compare command runs 6 rounds of H=50: enough to rank the arms, too few to tell a variant that is
slower to start (rounds in flight train one round on stale parameters; top-k with error feedback sends
2% of Δ a round and catches up through its buffer) from one that ends worse.  This command runs blocking
fp32 DiLoCo and each arm (a name of :data:`experiments.compare.ARMS` or :data:`~experiments.compare.CODEC_ARMS`,
or both joined by ``+``; settings of its own after ``@``: ``sparseloco@averaging.topk_density=0.01@diloco.outer_lr=0.5``,
for a sweep) for ``--rounds`` rounds on loopback (quality only: no link cap), all from the
compare's shared warm start, and reports the held-out loss of θ_global of every arm after every round and
its gap to blocking DiLoCo at the rounds of ``--at``.  An arm whose run in ``--out`` already went all
``--rounds`` rounds (an earlier run of the command was interrupted after it) is read back, not run again.
Writes ``results.md``, ``results.json``,
``horizon.png`` (loss per round, and the gap per round) and the runs' logs under ``runs/``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from diloco.command import ArgumentParser, run_command
from diloco.files import writable_folder
from diloco.config import Config, ConfigError
from diloco.config import loader as config_load
from diloco.engine.metrics import read_metrics
from experiments.compare import (
    ARMS,
    CODEC_ARMS,
    COMPARE_DEFAULTS,
    arm_settings,
    malformed_own,
    matched_budget,
    own_settings,
    run_name,
    unknown_arms,
)
from experiments.islands import CompareError, island_summaries, launch_islands, variant
from experiments.report import markdown_table
from experiments.warm_start import WARM_START_LR, WARM_START_STEPS, warm_start

REFERENCE = "blocking"


def settings_of(arm: str) -> dict[str, Any]:
    """The config items of ``arm``: blocking fp32 DiLoCo, an overlapped arm, a codec, or ``mode+codec``, each
    followed by any ``@section.key=value`` of its own."""
    name, own = own_settings(arm)
    items = {} if name == REFERENCE else CODEC_ARMS[name] if name in CODEC_ARMS else arm_settings(name)
    return {**items, **own}


def unknown(arms: list[str]) -> list[str]:
    """The names of ``arms`` that :func:`settings_of` cannot read (an ``@`` item without ``=`` included)."""
    names = [a.split("@")[0] for a in arms]
    bad = {n for n in unknown_arms(names) if n != REFERENCE and n not in CODEC_ARMS}
    return [a for a, n in zip(arms, names) if n in bad or malformed_own(a)]


def losses_per_round(run_dir: Path, fragments: int = 1) -> list[float]:
    """Held-out loss of θ_global before the first round (index 0) and after each round of H steps, from the
    metrics of the islands under ``run_dir``: an island that committed the round says (one that caught up
    past a round did not evaluate it, one that rolled it back kept the θ_global before it); NaN where none
    committed.  With ``fragments`` P a round is P syncs (outer steps P, 2P, …)."""
    per_round: dict[int, float] = {}
    for island in sorted(run_dir.glob("island*")):
        for r in read_metrics(island):
            step = r.get("outer_step")
            if "eval/loss" in r and step is not None and step % fragments == 0 and (step == 0 or r.get("round_ok")):
                per_round.setdefault(int(step) // fragments, float(r["eval/loss"]))
    return [per_round.get(r, float("nan")) for r in range(max(per_round, default=-1) + 1)]


def tokens_of(run_dir: Path) -> int:
    """Tokens all islands under ``run_dir`` trained (their summaries; 0 before any finished)."""
    return sum(s.get("tokens", 0) for s in island_summaries(run_dir))


def run_horizon(cfg: Config, arms: list[str], islands: int, rounds: int, at: list[int], out: Path, *,
                warm_start_steps: int = WARM_START_STEPS) -> Path:
    """Run blocking DiLoCo and every arm for ``rounds`` rounds; write the report; return ``results.md``."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = variant(cfg, **{"diloco.outer_steps": rounds, "averaging.backend": "hivemind"})
    if not cfg.checkpoint.init_from and warm_start_steps:
        print(f"== warm start: one worker, {warm_start_steps} steps ==", flush=True)
        init, _ = warm_start(cfg, warm_start_steps, out / "runs" / "warm_start", lr=WARM_START_LR)
        cfg = variant(cfg, **{"checkpoint.init_from": str(init)})
    curves: dict[str, list[float]] = {}
    tokens: dict[str, int] = {}
    for arm in [REFERENCE] + [a for a in arms if a != REFERENCE]:
        run_dir = out / "runs" / run_name(arm)
        fragments = settings_of(arm).get("diloco.fragments", cfg.diloco.fragments)
        kept = losses_per_round(run_dir, fragments)
        if len(kept) == rounds + 1 and all(x == x for x in kept):  # an earlier, interrupted run of this command finished this arm
            print(f"\n== {arm}: finished in {run_dir} already, its curve is reused ==", flush=True)
            curves[arm], tokens[arm] = kept, tokens_of(run_dir)
            continue
        print(f"\n== {arm}: {islands} islands, {rounds} rounds of H={cfg.diloco.inner_steps} ==", flush=True)
        items = matched_budget(settings_of(arm), out / "runs" / REFERENCE)
        c = variant(cfg, **{"logging.run_dir": str(run_dir), "averaging.run_id": f"horizon-{run_name(arm)}",
                            **items})
        launch_islands(c, islands)
        curves[arm], tokens[arm] = losses_per_round(run_dir, fragments), tokens_of(run_dir)
        print(f"{arm}: held-out loss per round " + " ".join(f"{x:.4f}" for x in curves[arm]), flush=True)
    (out / "results.json").write_text(json.dumps({"islands": islands, "rounds": rounds, "H": cfg.diloco.inner_steps,
                                                  "start": cfg.checkpoint.init_from, "loss_per_round": curves,
                                                  "tokens": tokens}, indent=2) + "\n")
    _plot(curves, out / "horizon.png")
    return _write_report(curves, at, islands, cfg, out, tokens)


def gap(curves: dict[str, list[float]], arm: str, r: int) -> float:
    """Relative held-out loss of ``arm`` against blocking DiLoCo after round ``r`` (NaN: not reached)."""
    a, b = curves[arm], curves[REFERENCE]
    return a[r] / b[r] - 1 if r < len(a) and r < len(b) else float("nan")


def _write_report(curves: dict[str, list[float]], at: list[int], islands: int, cfg: Config, out: Path,
                  tokens: dict[str, int] | None = None) -> Path:
    header = ["arm"] + [f"round {r}" for r in at]
    rows = [[arm] + [f"{curves[arm][r]:.4f}" + ("" if arm == REFERENCE else f" ({100 * gap(curves, arm, r):+.2f}%)")
                     if r < len(curves[arm]) else "—" for r in at] for arm in curves]
    lines = [f"# How the gap to blocking DiLoCo changes with the length of the run ({islands} islands, "
             f"H={cfg.diloco.inner_steps})", "",
             f"Held-out loss of θ_global after the round of H steps (in brackets: against blocking fp32 DiLoCo after "
             f"the same round; tokens differ only under a budget other than steps, as said below). Model "
             f"`{cfg.model.preset}`, batch {cfg.inner.batch_size}×{cfg.model.seq_len} tokens per island, "
             f"inner lr {cfg.inner.lr:g}, outer {cfg.diloco.outer_optimizer} lr "
             f"{cfg.diloco.outer_lr:g} momentum {cfg.diloco.outer_momentum:g}, on loopback; start "
             f"{cfg.checkpoint.init_from or 'the seeded initialisation'}.", "",
             markdown_table(header, rows), "", "![loss and gap per round](horizon.png)", ""]
    for arm in curves:
        if arm != REFERENCE:
            first, last = at[0], min(at[-1], len(curves[arm]) - 1)
            trained = (tokens or {}).get(arm, 0), (tokens or {}).get(REFERENCE, 0)
            lines.append(f"- {arm}: {100 * gap(curves, arm, first):+.2f}% after round {first}, "
                         f"{100 * gap(curves, arm, last):+.2f}% after round {last}"
                         + (f"; {100 * (trained[0] / trained[1] - 1):+.1f}% tokens against blocking"
                            if all(trained) else ""))
    md = out / "results.md"
    md.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n" + "\n".join(lines), flush=True)
    return md


def _plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_gap) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (arm, ys) in enumerate(curves.items()):  # an arm keeps its colour in both plots
        ax.plot(range(len(ys)), ys, marker=".", label=arm, color=f"C{i}")
        if arm != REFERENCE:
            ax_gap.plot(range(1, len(ys)), [100 * gap(curves, arm, r) for r in range(1, len(ys))], marker=".",
                        label=arm, color=f"C{i}")
    ax.set(xlabel="outer round", ylabel="held-out loss of θ_global", title="loss per round")
    ax_gap.axhline(0, color="grey", lw=0.8)
    ax_gap.set(xlabel="outer round", ylabel="% against blocking fp32 DiLoCo", title="gap per round")
    for a in (ax, ax_gap):
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments horizon [--arms A,B] [--rounds R] [--at 6,12,R] [--section.key VALUE ...]``."""
    parser = ArgumentParser(prog="python -m experiments horizon", description=__doc__.split("\n")[0],
                                     epilog="Any config key can follow as --section.key VALUE (the compare "
                                            "command's defaults apply).")
    parser.add_argument("--arms", default="delayed,eager,topk,sparseloco",
                        help=f"arms run next to blocking DiLoCo: {', '.join(ARMS)}, {', '.join(CODEC_ARMS)}, or mode+codec")
    parser.add_argument("--rounds", type=int, default=18, help="outer rounds per arm (default 18)")
    parser.add_argument("--at", default="", help="rounds to report the gap at (default: 6, 12, …, --rounds)")
    parser.add_argument("--islands", type=int, default=4, help="islands per arm (default 4)")
    parser.add_argument("--warm-start-steps", type=int, default=WARM_START_STEPS,
                        help=f"steps of the shared warm start (default {WARM_START_STEPS}; ignored with "
                             f"--checkpoint.init_from)")
    parser.add_argument("--out", default="experiments/results/horizon", help="output directory")
    parser.add_argument("--config", help="TOML config file (applied over this command's defaults)")
    args, rest = parser.parse_known_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from diloco.launch.simulate import SimulationError

    def body() -> int:
        arms = [a.strip() for a in args.arms.split(",") if a.strip()]
        problems = [f"--arms {','.join(unknown(arms))} is not one of blocking, {', '.join(ARMS)}, "
                    f"{', '.join(CODEC_ARMS)} (or mode+codec, then any @section.key=value)"] if unknown(arms) else []
        if args.rounds < 1 or args.islands < 2:
            problems.append(f"--rounds must be at least 1 and --islands at least 2, got {args.rounds} and {args.islands}")
        try:
            at = [int(x) for x in args.at.split(",") if x.strip()] or list(range(6, args.rounds, 6)) + [args.rounds]
        except ValueError:
            at = []
        if not at or any(not 1 <= r <= args.rounds for r in at):
            problems.append(f"--at must list rounds between 1 and --rounds {args.rounds}, got {args.at!r}")
        if problems:
            raise ConfigError(problems)
        cfg = config_load.load(args.config, rest, defaults=COMPARE_DEFAULTS)
        for arm in arms:  # an arm's own setting that cannot work is told now, not after the arms before it ran
            variant(cfg, **settings_of(arm))
        run_horizon(cfg, arms, args.islands, args.rounds, sorted(set(at)), writable_folder(args.out),
                    warm_start_steps=args.warm_start_steps)
        return 0

    return run_command(body, (CompareError, SimulationError), "interrupted: every island was stopped")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
