"""The loss-per-byte frontier (MuLoCo, SparseLoCo): DiLoCo's held-out loss against the bytes a worker sends, for
each inner optimizer and codec, over several seeds, every arm against synchronous training (DDP) with the same
inner optimizer, seed and tokens::

    python -m experiments frontier [--islands 2,4] [--inner-steps 20,50] [--optimizers adamw,muon]
        [--seeds 0,1,2] [--rounds 18] [--codecs CODEC,...] [--rate 20mbit] [--out DIR] [--section.key VALUE ...]

A cell of the grid is one (k islands, H, inner optimizer, seed, codec arms): one ``compare`` run
(:func:`experiments.compare.run_compare`, without its single worker: DDP, fp32 DiLoCo and the codec arms, by
default those of :data:`CODECS`) in ``OUT/<optimizer>-k<k>-H<H>/seed<seed>[-<codec>...]/``.  Every cell of a
seed starts from that seed's one warm start (``OUT/warm-start/seed<seed>/``: AdamW, as compare's), so the optimizers differ from their first step
only.  A new cell of a seed whose DDP and fp32 DiLoCo already ran in another cell with the same settings and start
takes them from there (:func:`reusable_cell`; from one start they repeat to the last digit) and runs its codec arms
alone.  A cell whose ``results.json`` exists is read, not run again: the grid runs slice by slice (a seed, an
optimizer, a k or an H at a time, over days), and every command reports the whole frontier found under ``OUT``:
``results.md`` (each arm's bytes against DDP's, held-out loss over the seeds, and its gap to the DDP of the same
seed), ``results.json`` and ``frontier.png`` (mean over the seeds, bars from the lowest to the highest).
``--report-only`` runs nothing.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from diloco.command import ArgumentParser, run_command
from diloco.files import writable_folder
from diloco.config import Config, ConfigError
from diloco.config import loader as config_load
from experiments.compare import (
    CODEC_ARMS,
    COMPARE_DEFAULTS,
    codec_settings,
    run_compare,
    same_settings,
    unknown_codecs,
)
from experiments.islands import CompareError, variant
from experiments.report import format_bytes, markdown_table, save_results
from experiments.warm_start import WARM_START_LR, WARM_START_STEPS, warm_start

OPTIMIZERS = ("adamw", "muon")
CODECS: dict[str, tuple[str, ...]] = {
    "adamw": ("int4", "sign", "topk"),
    "muon": ("int4", "int2", "sign", "topk"),
}
"""Each inner optimizer's codec arms (beside fp32 DiLoCo and DDP), as issue 43's grid names them."""
DEFAULTS: dict[str, Any] = {**COMPARE_DEFAULTS, "diloco.inner_steps": 20, "diloco.outer_steps": 18,
                            "wandb.mode": "disabled"}
BYTES_GOAL, LOSS_GOAL = 1000.0, 1.0
"""The frontier's goal: an arm with at least this many times fewer bytes than DDP within this many percent of
its held-out loss."""
FP32, DDP = "fp32", "DDP"


@dataclass
class Arm:
    """One arm of the grid (an optimizer's DDP, fp32 DiLoCo or a codec, at one k and H) over the seeds found."""

    optimizer: str
    islands: int
    inner_steps: int
    name: str
    rounds: int
    losses: dict[int, float] = field(default_factory=dict)
    """Held-out loss at the end, by seed."""
    bytes: dict[int, float] = field(default_factory=dict)
    """Bytes a worker sent and received, by seed."""
    gaps: dict[int, float] = field(default_factory=dict)
    """Relative change of the held-out loss against the DDP run of the same cell (same seed), in percent."""
    reduction: dict[int, float] = field(default_factory=dict)
    """DDP's bytes ÷ this arm's, by seed."""
    by_start: dict[int, dict[float, float]] = field(default_factory=dict)
    """Held-out loss at the end by seed, then by the warm start's held-out loss (what tells two warm starts of one
    seed apart: a warm start made again elsewhere is not the same to the last bit, and 18 rounds from it can end
    0.7% away), from every cell read."""

    @property
    def group(self) -> str:
        return f"{self.optimizer} k={self.islands} H={self.inner_steps}"


def cell_dir(out: Path, optimizer: str, islands: int, inner_steps: int, seed: int, codecs: Sequence[str] = ()) -> Path:
    """Where one cell's compare run writes its report: named by its codec arms too, so that a slice of other
    codecs is a cell of its own beside one already run (whose DDP and fp32 DiLoCo it takes, :func:`reusable_cell`)."""
    return out / f"{optimizer}-k{islands}-H{inner_steps}" / "-".join([f"seed{seed}", *codecs])


def arm_name(run_name: str, islands: int, inner_steps: int) -> str | None:
    """The frontier's name of a compare run (``DDP``, ``fp32`` or the codec; None for the single worker)."""
    if run_name == f"baseline-ddp-{islands}":
        return DDP
    if run_name == f"diloco-{islands}x-H{inner_steps}":
        return FP32
    return run_name.removeprefix("diloco-codec-") if run_name.startswith("diloco-codec-") else None


def collect(out: Path) -> list[Arm]:
    """Every arm of every cell found under ``out`` (see :func:`cell_dir`), its seeds gathered; arms in the order
    optimizer, k, H, then DDP, fp32 and the codecs by bytes.  A seed's DDP and fp32 DiLoCo are in each of its cells
    (one per set of codec arms; run there or taken from an earlier cell of the same start): the last cell read counts,
    and each codec's gap is to its own cell's DDP."""
    arms: dict[tuple[str, int, int, str], Arm] = {}
    for path in sorted(out.glob("*-k*-H*/seed*/results.json")):
        data = json.loads(path.read_text())
        optimizer = data["config"]["inner"]["optimizer"]
        k, H = int(data["islands"]), int(data["config"]["diloco"]["inner_steps"])
        seed, rounds = int(data["config"]["seed"]), int(data["config"]["diloco"]["outer_steps"])
        runs = {arm_name(r["name"], k, H): r for r in data["runs"]}
        ddp = runs.get(DDP)
        for name, r in runs.items():
            if name is None or ddp is None:
                continue
            arm = arms.setdefault((optimizer, k, H, name), Arm(optimizer, k, H, name, rounds))
            arm.rounds = min(arm.rounds, rounds)
            arm.losses[seed], arm.bytes[seed] = r["final_eval_loss"], r["bytes_per_worker"]
            arm.by_start.setdefault(seed, {})[round(ddp["curve"][0]["eval_loss"], 6)] = r["final_eval_loss"]
            arm.gaps[seed] = (r["final_eval_loss"] - ddp["final_eval_loss"]) / ddp["final_eval_loss"] * 100
            arm.reduction[seed] = ddp["bytes_per_worker"] / max(r["bytes_per_worker"], 1.0)
    return sorted(arms.values(), key=lambda a: (a.optimizer, a.islands, a.inner_steps, a.name != DDP,
                                                -statistics.mean(a.bytes.values())))


def spread(values: dict[int, float], fmt: str) -> str:
    """``mean [lowest, highest]`` over the seeds (the mean alone for one seed)."""
    v = list(values.values())
    mean = fmt.format(statistics.mean(v))
    return mean if len(v) == 1 else f"{mean} [{fmt.format(min(v))}, {fmt.format(max(v))}]"


def against_spread(mine: list[float], theirs: list[float], name: str, other: str) -> str:
    """Whether the losses ``mine`` (of ``name``) lie below or above ``theirs`` (of ``other``) beyond the spread
    of the seeds, or within it."""
    if max(mine) < min(theirs):
        return f"below {other} beyond the spread of the seeds (every {name} seed under every {other} seed)"
    if max(theirs) < min(mine):
        return f"above {other} beyond the spread of the seeds"
    return f"level with {other} within the spread of the seeds (the ranges overlap)"


def table(arms: list[Arm]) -> str:
    """The frontier as a markdown table, one row per arm."""
    rows = []
    for a in arms:
        reduction = statistics.mean(a.reduction.values())
        rows.append([a.optimizer, a.islands, a.inner_steps, a.rounds, a.name, ",".join(map(str, sorted(a.losses))),
                     format_bytes(statistics.mean(a.bytes.values())),
                     "1×" if a.name == DDP else f"{reduction:,.0f}× fewer",
                     spread(a.losses, "{:.4f}"), "" if a.name == DDP else spread(a.gaps, "{:+.2f}%")])
    return markdown_table(["inner optimizer", "k", "H", "rounds", "arm", "seeds", "bytes / worker", "vs DDP's bytes",
                           "held-out loss: mean [lowest, highest]", "vs DDP of the same seed"], rows)


def verdicts(arms: list[Arm]) -> list[str]:
    """What the grid says about the issue's goals: Muon against AdamW (fp32 DiLoCo, beyond the spread of the
    seeds or not), and the arms with ≥ 1,000× fewer bytes than DDP within 1% of its loss on every seed."""
    lines = []
    fp32 = {(a.islands, a.inner_steps, a.optimizer): a for a in arms if a.name == FP32}
    for (k, H, opt), muon in sorted(fp32.items()):
        adamw = fp32.get((k, H, "adamw"))
        if opt != "muon" or adamw is None:
            continue
        # seed by seed, from one warm start: the first the two share
        pairs = {s: next((st for st in muon.by_start[s] if st in adamw.by_start[s]), None)
                 for s in sorted(set(muon.by_start) & set(adamw.by_start))}
        common = [s for s, st in pairs.items() if st is not None]
        apart = [s for s, st in pairs.items() if st is None]
        if not common:
            continue
        m = [muon.by_start[s][pairs[s]] for s in common]
        a = [adamw.by_start[s][pairs[s]] for s in common]
        verdict = against_spread(m, a, "Muon", "AdamW")
        paired = ", ".join(f"{(x - y) / y * 100:+.2f}%" for x, y in zip(m, a))
        lines.append(f"Muon vs AdamW, fp32 DiLoCo, k={k}, H={H}, {len(common)} seed(s): Muon "
                     f"{statistics.mean(m):.4f} [{min(m):.4f}, {max(m):.4f}], AdamW {statistics.mean(a):.4f} "
                     f"[{min(a):.4f}, {max(a):.4f}]: {verdict}; seed by seed (seeds {','.join(map(str, common))}, each "
                     f"pair from one warm start) Muon {paired}"
                     + (f"; seed(s) {','.join(map(str, apart))} left out: no warm start run under both" if apart else ""))
    within = [a for a in arms if a.name != DDP and max(a.gaps.values()) <= LOSS_GOAL]
    goal = [a for a in within if min(a.reduction.values()) >= BYTES_GOAL]
    if goal:
        lines += [f"frontier goal met by {a.group} {a.name}: {min(a.reduction.values()):,.0f}× fewer bytes than DDP, "
                  f"{max(a.gaps.values()):+.2f}% at worst over {len(a.gaps)} seed(s), {a.rounds} rounds"
                  + ("" if a.rounds >= 18 else " (fewer than the 18 rounds the goal asks for)") for a in goal]
    else:
        best = max(within, key=lambda a: min(a.reduction.values()), default=None)
        lines.append(f"frontier goal (≥ {BYTES_GOAL:,.0f}× fewer bytes than DDP within {LOSS_GOAL:g}% on every seed) "
                     "not met by any arm" + (f"; the most bytes saved within {LOSS_GOAL:g}%: {best.group} {best.name}, "
                                             f"{min(best.reduction.values()):,.0f}× at {max(best.gaps.values()):+.2f}% "
                                             f"at worst" if best else ""))
    return lines


def short_name(arm: str) -> str:
    """An arm's name for a plot: its own settings by key alone (``sparseloco outer_lr=4 topk_density=0.05``)."""
    name, *own = arm.split("@")
    return " ".join([name] + [f"{key.rsplit('.', 1)[-1]}={value}" for key, value in (i.split("=", 1) for i in own)])


def plot(arms: list[Arm], path: Path) -> None:
    """Left: held-out loss against bytes per worker; right: the gap to DDP against the bytes saved, with the goal's
    corner shaded.  Points at the mean over the seeds, bars from the lowest to the highest; the groups (optimizer,
    k, H) a little apart on the bytes axis, so that the bars of arms with equal bytes do not cover each other."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 5.2))
    FigureCanvasAgg(fig)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    groups = list(dict.fromkeys(a.group for a in arms))
    for a in arms:
        color = f"C{groups.index(a.group) % 10}"
        dodge = 1.06 ** (groups.index(a.group) - (len(groups) - 1) / 2)  # groups side by side at equal bytes
        x = statistics.mean(a.bytes.values()) * dodge
        for ax, xs, ys in ((left, x, a.losses), (right, statistics.mean(a.reduction.values()) * dodge, a.gaps)):
            if ax is right and a.name == DDP:
                continue
            v = list(ys.values())
            y = statistics.mean(v)
            ax.errorbar([xs], [y], yerr=[[y - min(v)], [max(v) - y]], fmt="s" if a.name == DDP else "o",
                        color=color, capsize=3, markersize=5, label=a.group if a.name == FP32 else None)
            ax.annotate(short_name(a.name), (xs, y), textcoords="offset points", xytext=(5, 4), fontsize=7.5, color=color)
    left.set_xscale("log")
    left.set_xlabel("bytes a worker sent and received (log)")
    left.set_ylabel("held-out loss at the end (nats/token)")
    left.set_title("Held-out loss against bytes (mean over seeds, bars: lowest–highest)")
    right.set_xscale("log")
    right.axvspan(BYTES_GOAL, max(BYTES_GOAL * 3, right.get_xlim()[1]), ymax=1, color="0.92", zorder=0)
    right.axhline(LOSS_GOAL, color="0.5", lw=0.8, ls="--")
    right.axhline(0, color="0.3", lw=0.8)
    right.set_xlabel("times fewer bytes than DDP (log); shaded: the goal's ≥ 1,000×")
    right.set_ylabel("held-out loss vs DDP of the same seed (%); dashed: +1%")
    right.set_title("The frontier: gap to DDP against bytes saved")
    for ax in (left, right):
        ax.grid(True, which="major", alpha=0.35)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(out: Path) -> list[Arm]:
    """Write (and print) the frontier of every cell found under ``out``."""
    arms = collect(out)
    if not arms:
        raise CompareError(f"no finished cell under {out} (a cell is {cell_dir(out, 'OPT', 2, 20, 0)}"
                           f"/results.json): run the grid first, without --report-only")
    lines = verdicts(arms)
    text = ("# The loss-per-byte frontier\n\n" + table(arms) + "\n\n" + "\n".join(f"- {v}" for v in lines) +
            "\n\n![frontier](frontier.png)")
    plot(arms, out / "frontier.png")
    save_results(out, text, {"arms": [vars(a) for a in arms], "verdicts": lines})
    return arms


def run_grid(cfg: Config, out: Path, islands: list[int], inner_steps: list[int], optimizers: list[str],
             seeds: list[int], codecs: list[str] | None, rate: str | None, warm_start_steps: int,
             warm_start_lr: float, link: dict[str, float]) -> None:
    """Run every cell of the grid that has no ``results.json`` yet (see the module's docstring)."""
    for seed in seeds:
        init = None
        for k in islands:
            for H in inner_steps:
                for opt in optimizers:
                    arms = list(codecs if codecs is not None else CODECS[opt])
                    cell = cell_dir(out, opt, k, H, seed, arms)
                    if (cell / "results.json").exists():
                        print(f"frontier: {cell} is done; kept", flush=True)
                        continue
                    if init is None and warm_start_steps and not cfg.checkpoint.init_from:
                        init = _warm_start(cfg, seed, out / "warm-start" / f"seed{seed}", warm_start_steps,
                                           warm_start_lr)
                    items = {"seed": seed, "inner.optimizer": opt, "diloco.inner_steps": H}
                    if init is not None:
                        items["checkpoint.init_from"] = str(init)
                    c = variant(cfg, **items)
                    reuse = reusable_cell(out, k, rate, c)
                    print(f"\nfrontier: cell {opt}, k={k}, H={H}, seed {seed} → {cell}"
                          + (f" (its DDP and fp32 DiLoCo: {reuse.parent.name}'s)" if reuse else ""), flush=True)
                    run_compare(c, k, rate, cell, **link, codecs=arms, single=False, reuse=reuse)


def reusable_cell(out: Path, islands: int, rate: str | None, cfg: Config) -> Path | None:
    """The ``results.json`` of a finished cell under ``out`` that ran with ``cfg`` (inner optimizer, H and seed
    included), ``islands`` and the link ``rate``: its DDP and fp32 DiLoCo stand for those of a new cell of other
    codecs."""
    group = out / f"{cfg.inner.optimizer}-k{islands}-H{cfg.diloco.inner_steps}"
    for path in sorted(group.glob("seed*/results.json")):
        if same_settings(json.loads(path.read_text()), cfg, islands, rate):
            return path
    return None


def _warm_start(cfg: Config, seed: int, run_dir: Path, steps: int, lr: float) -> Path:
    """The seed's warm start: the checkpoint it left, or a new one."""
    done = sorted(run_dir.glob("island0/checkpoints/ckpt-*.pt"))
    if done:
        return done[-1].parent
    print(f"\nfrontier: warm start of seed {seed}, {steps} AdamW steps → {run_dir}", flush=True)
    init, _ = warm_start(variant(cfg, seed=seed), steps, run_dir, lr=lr)
    return init


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError([f"{what} takes whole numbers separated by commas, got {text!r}"]) from None
    if not values:
        raise ConfigError([f"{what} is empty: give at least one value"])
    return values


def main(argv: list[str] | None = None) -> int:
    from experiments import netns

    parser = ArgumentParser(prog="python -m experiments frontier", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--islands", default="2", help="islands k of each cell, comma-separated (default 2)")
    parser.add_argument("--inner-steps", default="20", help="H of each cell, comma-separated (default 20)")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="inner optimizers (default adamw,muon)")
    parser.add_argument("--seeds", default="0,1,2", help="seeds, comma-separated (default 0,1,2)")
    parser.add_argument("--rounds", type=int, default=DEFAULTS["diloco.outer_steps"],
                        help="outer rounds of each run (default 18)")
    parser.add_argument("--codecs", default=None,
                        help="codec arms of every optimizer, each a name then any @section.key=value of its own "
                             "(sparseloco@diloco.outer_lr=4), or '' for fp32 DiLoCo and DDP alone (default: " +
                             "; ".join(f"{o}: {','.join(c)}" for o, c in CODECS.items()) + ")")
    parser.add_argument("--rate", default=None, help="cap every worker's link, e.g. 20mbit (needs root)")
    netns.add_link_arguments(parser)
    parser.add_argument("--warm-start-steps", type=int, default=WARM_START_STEPS)
    parser.add_argument("--warm-start-lr", type=float, default=WARM_START_LR)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/frontier"))
    parser.add_argument("--config", help="TOML config file (applied over this command's defaults)")
    parser.add_argument("--report-only", action="store_true", help="run nothing: report the cells found under --out")
    args, rest = parser.parse_known_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from diloco.data.corpus import DataError
    from diloco.launch.baseline import BaselineError
    from diloco.launch.simulate import SimulationError

    def body() -> int:
        if args.report_only and not collect(args.out):
            raise ConfigError([f"--report-only found no finished cell under {args.out} (a cell is "
                               f"{cell_dir(args.out, 'OPT', 2, 20, 0)}/results.json): run the grid first"])
        if not args.report_only:
            islands, steps = _ints(args.islands, "--islands"), _ints(args.inner_steps, "--inner-steps")
            seeds = _ints(args.seeds, "--seeds")
            optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
            unknown = [o for o in optimizers if o not in OPTIMIZERS] or ([] if optimizers else ["(none)"])
            if unknown:
                raise ConfigError([f"--optimizers {','.join(unknown)} is not a list of {', '.join(OPTIMIZERS)}"])
            codecs = None if args.codecs is None else [c.strip() for c in args.codecs.split(",") if c.strip()]
            bad = unknown_codecs(codecs or [])
            if bad:
                raise ConfigError([f"--codecs {','.join(bad)} is not one of {', '.join(CODEC_ARMS)} (then any "
                                   f"@section.key=value, e.g. sparseloco@diloco.outer_lr=4)"])
            if args.rounds < 1:
                raise ConfigError([f"--rounds must be at least 1, got {args.rounds}"])
            if args.warm_start_steps < 0 or not args.warm_start_lr > 0:
                raise ConfigError(["--warm-start-steps must be 0 or more and --warm-start-lr positive"])
            cfg = config_load.load(args.config, rest, defaults={**DEFAULTS, "diloco.outer_steps": args.rounds})
            for codec in codecs or []:  # an arm's wrong key says so now, not after the cells before it ran
                variant(cfg, **codec_settings(codec))
            rate = args.rate if args.rate and args.rate.lower() not in ("none", "off", "0") else None
            try:
                link = netns.link_arguments(args, rate)
            except ValueError as e:
                raise ConfigError([str(e)]) from None
            run_grid(cfg, writable_folder(args.out), islands, steps, optimizers, seeds, codecs, rate,
                     args.warm_start_steps, args.warm_start_lr, link)
        report(args.out)
        print(f"\nfrontier: {args.out}/ (results.md, results.json, frontier.png)")
        return 0

    return run_command(body, (CompareError, BaselineError, SimulationError, DataError, netns.NetworkSetupError),
                       "interrupted: every worker and emulated link was removed")


if __name__ == "__main__":
    sys.exit(main())
