"""Small-scale replications of the DiLoCo paper's ablations, each next to the paper's own numbers.

Three sweeps, each run on loopback (no link cap: they are about model quality, not speed):

* ``H``       inner steps between outer rounds, H ∈ {10, 50, 100, 500}, at a fixed number of steps per
              worker (paper: H=1000 costs +2.9 % perplexity against H=50 for 20× less communication);
* ``islands`` number of islands k ∈ {1, 2, 4, 8} at a fixed number of steps per island (paper: replicas
              1/4/8 → perplexity 16.23/15.18/15.02; k=1 is the single-worker baseline, plain AdamW);
* ``outer``   outer optimizer, Nesterov (lr 0.7, momentum 0.9) vs ``avg`` (FedAvg: SGD lr 1, no momentum)
              (paper: outer SGD is worse than Nesterov).

Each sweep writes ``<out>/<sweep>/results.md`` (a table with the paper's figures and one automatic
"agrees / differs" line), ``results.json``, ``<sweep>.png`` (held-out loss vs tokens per setting, and the
final perplexity per setting) and the runs' logs under ``runs/``.  The scale is printed honestly: a
~0.9M-parameter byte-level model for a few hundred steps on 2 CPU cores is not the paper's 150M model,
so absolute perplexities differ and only directions and rough sizes of effects can be compared.

Command line::

    python -m experiments.sweeps --sweep H|islands|outer|all --out experiments/results/sweeps \\
        [--steps T] [--islands K] [--values 10,50] [--section.key VALUE ...]
"""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco.command import ArgumentParser, run_command
from diloco.files import writable_folder
from diloco.config import Config, ConfigError
from diloco.config import loader as config_load
from diloco.config import schema as config_mod
from experiments.compare import curve_from_metrics
from experiments.islands import CompareError, launch_islands, variant
from experiments.report import format_bytes, markdown_table

# A ~0.9M-parameter model (the `small` preset) on 64-token sequences, batch 8 per island (0.05-0.2 s per step
# on one core, depending on what else runs).  Measured on 2 shared cores (load average 6-10 from other jobs):
# outer 7 min, islands 9 min, H 20 min (its H=10 run alone: 100 rounds, 10 min; `--steps 500` halves it).
SWEEP_DEFAULTS: dict[str, Any] = {
    "model.preset": "small",
    "model.seq_len": 64,
    "inner.batch_size": 8,
    "inner.warmup_steps": 30,
    "logging.eval_batches": 4,
    "logging.log_every": 25,
    "checkpoint.every": 0,
    "wandb.mode": "disabled",
    # a round starts as soon as all k islands are in (target_group_size = k); the long window only keeps
    # an island slowed down by the shared cores from being left out of a round
    "averaging.matchmaking_time": 20.0,
    "averaging.request_timeout": 5.0,
    "averaging.matchmaking_timeout": 60.0,  # bounds what a failed round costs
    "averaging.vote_timeout": 60.0,
    "averaging.startup_timeout": 60.0,
}


@dataclass
class SweepSpec:
    name: str
    key: str  # what is swept, for the table header
    values: list[Any]
    steps: int  # inner steps per worker
    islands: int  # for sweeps that do not sweep the island count
    H: int  # for sweeps that do not sweep H
    paper: dict[str, str] = field(default_factory=dict)  # value -> the paper's figure (as text)
    paper_note: str = ""


SWEEPS: dict[str, SweepSpec] = {
    "H": SweepSpec("H", "H (inner steps per round)", [10, 50, 100, 500], steps=1000, islands=2, H=0,
                   paper={"50": "reference", "1000": "+2.9% ppl vs H=50"},
                   paper_note="paper (150M model, k=8, 88k steps): H=1000 costs +2.9% perplexity against H=50 "
                              "for 20× less communication; larger H → slightly worse perplexity"),
    "islands": SweepSpec("islands", "islands k", [1, 2, 4, 8], steps=300, islands=0, H=50,
                         paper={"1": "16.23", "4": "15.18 (−6.5%)", "8": "15.02 (−7.5%)", "16": "14.91 (−8.1%)",
                                "64": "14.96 (−7.8%)"},
                         paper_note="paper (150M model, H=500, fixed steps per replica): replicas 1/4/8/16/64 → "
                                    "perplexity 16.23/15.18/15.02/14.91/14.96 (k=1 is the single-worker baseline)"),
    "outer": SweepSpec("outer", "outer optimizer", ["nesterov", "avg"], steps=400, islands=4, H=50,
                       paper={"nesterov": "best (lr 0.7, momentum 0.9)", "avg": "worse (outer SGD)"},
                       paper_note="paper: outer SGD (lr 1, no momentum = FedAvg) and Adam are worse than Nesterov"),
}


def run_one(cfg: Config, islands: int, run_dir: Path, progress: bool = True) -> dict[str, Any]:
    """Train one setting (``islands`` == 1: a single worker, plain AdamW); return its figures."""
    items: dict[str, Any] = {"logging.run_dir": str(run_dir)}
    if islands == 1:
        items.update({"averaging.backend": "local", "averaging.min_group_size": 1, "averaging.target_group_size": 0,
                      "diloco.outer_optimizer": "avg"})
    else:
        items.update({"averaging.backend": "hivemind"})
    c = variant(cfg, **items)
    out = launch_islands(c, islands, progress=progress)
    s = out["islands"]
    first = s[0]
    return {
        "islands": islands, "H": c.diloco.inner_steps, "outer_optimizer": c.diloco.outer_optimizer,
        "steps_per_worker": first["inner_step"], "tokens": sum(x["tokens"] for x in s),
        "final_eval_loss": float(first["eval_loss_end"]), "perplexity": math.exp(float(first["eval_loss_end"])),
        "bytes_per_worker": max(x["payload_bytes_sent"] for x in s), "wall_seconds": max(x["wall_seconds"] for x in s),
        "rounds_ok": min(x["rounds_ok"] for x in s), "rounds_failed": max(x["rounds_failed"] for x in s),
        "curve": curve_from_metrics(Path(out["run_dirs"][0]), token_scale=islands),
    }


def verdict(sweep: str, rows: list[dict[str, Any]]) -> str:
    """One automatic line: does our sweep agree with the paper's direction of the effect?"""
    ppl = {str(r["value"]): r["perplexity"] for r in rows}
    if any(not math.isfinite(p) for p in ppl.values()):
        return "differs: a run did not produce a finite held-out loss"
    if sweep == "islands":
        ks = sorted(int(k) for k in ppl)
        seq = [ppl[str(k)] for k in ks]
        base = seq[0]
        rel = ", ".join(f"k={k} {100 * (ppl[str(k)] / base - 1):+.1f}%" for k in ks[1:])
        monotone = all(b <= a for a, b in zip(seq, seq[1:]))
        if monotone and seq[-1] < base:
            return (f"agrees: more islands give lower perplexity at the same steps per island ({rel} vs k={ks[0]}; "
                    f"paper k=4 −6.5%, k=8 −7.5% vs 1)")
        if seq[-1] < base:
            return f"partly agrees: the most islands beat one, but not monotonically ({rel}; paper: monotone to k=16)"
        return f"differs: more islands did not lower perplexity ({rel}; paper k=8 −7.5%)"
    if sweep == "H":
        hs = sorted(int(h) for h in ppl)
        ref = 50 if 50 in hs else hs[0]  # the paper's reference H
        base = ppl[str(ref)]
        rel = ", ".join(f"H={h} {100 * (ppl[str(h)] / base - 1):+.1f}%" for h in hs if h != ref)
        above = [h for h in hs if h >= ref]
        below = [h for h in hs if h < ref]
        extra = (f"; below the paper's range, H={'/'.join(map(str, below))} is worse than H={ref} "
                 f"(not tested in the paper)" if any(ppl[str(h)] > base for h in below) else "")
        if len(above) < 2:
            return f"n/a: need H={ref} and a larger H for the paper's comparison ({rel})"
        seq = [ppl[str(h)] for h in above]
        if seq[-1] > seq[0] and all(b >= a * 0.995 for a, b in zip(seq, seq[1:])):
            return (f"agrees: above H={ref}, larger H costs perplexity while communicating H× less ({rel} vs "
                    f"H={ref}; paper +2.9% at H=1000 vs 50, with ~90 rounds where ours has 2 at H=500, so our "
                    f"cost is larger){extra}")
        if seq[-1] > seq[0]:
            return f"partly agrees: the largest H is worst but not monotonically ({rel} vs H={ref}){extra}"
        return f"differs: larger H did not cost perplexity here ({rel} vs H={ref}; paper +2.9% at H=1000 vs 50){extra}"
    if sweep == "outer":
        n, a = ppl.get("nesterov"), ppl.get("avg")
        if n is None or a is None:
            return "n/a: both nesterov and avg are needed for a verdict"
        d = 100 * (a / n - 1)
        if n < a:
            return f"agrees: Nesterov beats FedAvg/SGD (avg is {d:+.1f}% perplexity vs Nesterov; paper: SGD worse)"
        return f"differs: FedAvg/SGD was not worse than Nesterov here ({d:+.1f}%; paper: SGD worse)"
    return ""


def plot_sweep(spec: SweepSpec, rows: list[dict[str, Any]], path: Path) -> Path:
    """Left: held-out loss vs tokens per setting; right: final perplexity per setting."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for i, r in enumerate(rows):
        pts = sorted((p["tokens"], p["eval_loss"]) for p in r["curve"])
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", color=f"C{i}",
                    label=f"{spec.name}={r['value']}")
    ax.set_xlabel("training tokens (all islands)")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title(f"{spec.name} sweep: held-out loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    labels = [str(r["value"]) for r in rows]
    bx.bar(labels, [r["perplexity"] for r in rows], color=[f"C{i}" for i in range(len(rows))])
    lo = min(r["perplexity"] for r in rows)
    hi = max(r["perplexity"] for r in rows)
    if math.isfinite(lo) and math.isfinite(hi):
        bx.set_ylim(lo - 0.15 * (hi - lo + 1e-3) - 0.05 * lo, hi + 0.15 * (hi - lo + 1e-3))
    for i, r in enumerate(rows):
        bx.text(i, r["perplexity"], f"{r['perplexity']:.3f}", ha="center", va="bottom", fontsize=8)
    bx.set_xlabel(spec.key)
    bx.set_ylabel("final held-out perplexity (bytes)")
    bx.set_title("final perplexity (lower is better)")
    bx.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def run_sweep(cfg: Config, sweep: str, out_dir: Path, *, steps: int | None = None, islands: int | None = None,
              values: list[str] | None = None, progress: bool = True) -> Path:
    """Run every setting of one sweep, write its table, verdict and PNG; return the markdown path."""
    if sweep not in SWEEPS:
        raise ConfigError([f"--sweep must be one of {', '.join(SWEEPS)} or all, got {sweep!r}"])
    spec = copy.deepcopy(SWEEPS[sweep])
    if values:
        spec.values = [v if sweep == "outer" else int(v) for v in values]
    if steps:
        spec.steps = steps
    if islands:
        spec.islands = islands
    out = Path(out_dir) / sweep
    out.mkdir(parents=True, exist_ok=True)
    say = print if progress else (lambda *a, **k: None)
    group = cfg.wandb.group or f"sweep-{sweep}-{time.strftime('%Y%m%d-%H%M%S')}"
    from experiments.compare import _param_count

    scale = (f"scale: model `{cfg.model.preset}` ({_param_count(cfg):,} parameters, {cfg.model.dim}d × "
             f"{cfg.model.n_layers} layers, byte-level, seq {cfg.model.seq_len}), batch {cfg.inner.batch_size} "
             f"sequences per island, {spec.steps} inner steps per island, inner lr {cfg.inner.lr:g}, "
             f"{'warm start from ' + repr(cfg.checkpoint.init_from) if cfg.checkpoint.init_from else 'from scratch'}, "
             f"data `{cfg.data.path}`, "
             f"{os.cpu_count()} CPU core(s), loopback; paper: 150M parameters, batch 512×1024 tokens, 88k steps — "
             f"compare directions and relative sizes, not absolute perplexities")
    say(f"\n=== sweep {sweep}: {spec.key} ∈ {spec.values} ===\n{scale}", flush=True)
    t0 = time.time()
    rows = []
    for v in spec.values:
        items: dict[str, Any] = {"wandb.group": group}
        k = spec.islands
        H = spec.H
        if sweep == "H":
            H = int(v)
        elif sweep == "islands":
            k = int(v)
        elif sweep == "outer":
            items["diloco.outer_optimizer"] = v
        if spec.steps % H:
            raise ConfigError([f"--steps {spec.steps} must be a multiple of H={H} for the {sweep} sweep"])
        items.update({"diloco.inner_steps": H, "diloco.outer_steps": spec.steps // H,
                      "averaging.run_id": f"{sweep}-{v}"})
        c = variant(cfg, **items)
        say(f"\n-- {sweep}={v}: {k} island(s), H={H}, {spec.steps // H} round(s), outer "
            f"{'avg (single worker: plain AdamW)' if k == 1 else c.diloco.outer_optimizer} --", flush=True)
        r = run_one(c, k, out / "runs" / f"{sweep}-{v}", progress=progress)
        r["value"] = v
        rows.append(r)
        say(f"   {sweep}={v}: final held-out loss {r['final_eval_loss']:.4f}, perplexity {r['perplexity']:.3f}, "
            f"{format_bytes(r['bytes_per_worker'])} sent per island, {r['wall_seconds']:.0f} s", flush=True)
    elapsed = time.time() - t0
    md_path = write_sweep_report(spec, rows, out, scale=scale, elapsed=elapsed, config=config_mod.to_dict(cfg))
    md = md_path.read_text(encoding="utf-8").split("\n- ")[0]
    say("\n" + md + f"\n{spec.paper_note}\n{scale}\nsweep took {elapsed:.0f} s; report: {md_path}",
        flush=True)
    return md_path


def _reference_value(sweep: str, rows: list[dict[str, Any]]) -> Any:
    """The setting the relative column compares with: the paper's reference where we ran it."""
    values = [r["value"] for r in rows]
    if sweep == "H" and 50 in [int(v) for v in values]:
        return next(v for v in values if int(v) == 50)
    return values[0]


def write_sweep_report(spec: SweepSpec, rows: list[dict[str, Any]], out: Path, *, scale: str, elapsed: float,
                       config: dict[str, Any]) -> Path:
    """``results.md`` (table, verdict, notes), ``results.json`` and ``<sweep>.png`` of one finished sweep."""
    sweep = spec.name
    line = verdict(sweep, rows)
    ref_value = _reference_value(sweep, rows)
    ref = next(r for r in rows if r["value"] == ref_value)["perplexity"]
    headers = [spec.key, "islands", "H", "outer", "rounds ok/failed", "final held-out loss", "perplexity",
               f"ppl vs {sweep}={ref_value}", "bytes / island", "wall (s)", "paper"]
    table_rows = [[str(r["value"]), str(r["islands"]), str(r["H"]),
                   r["outer_optimizer"] if r["islands"] > 1 else "— (AdamW)",
                   f"{r['rounds_ok']}/{r['rounds_failed']}", f"{r['final_eval_loss']:.4f}", f"{r['perplexity']:.3f}",
                   f"{100 * (r['perplexity'] / ref - 1):+.2f}%", format_bytes(r["bytes_per_worker"]),
                   f"{r['wall_seconds']:.0f}", spec.paper.get(str(r["value"]), "—")] for r in rows]
    md = [f"# Sweep: {spec.key}", "", markdown_table(headers, table_rows, align=["l"] * 4 + ["r"] * 6 + ["l"]), "",
          f"**{line}**", "", f"- {spec.paper_note}", f"- {scale}",
          "- perplexity here is exp(held-out loss) per byte; the paper's is per word-piece token, so only relative "
          "changes are comparable",
          "- rounds ok/failed is the worst island's count; a failed round (rolled back by the verified averager) "
          "leaves every island on its own parameters until the next round",
          f"- whole sweep took {elapsed:.0f} s", "", f"![{sweep} sweep]({sweep}.png)", ""]
    md_path = out / "results.md"
    md_path.write_text("\n".join(md), encoding="utf-8")
    (out / "results.json").write_text(json.dumps({"sweep": sweep, "verdict": line, "scale": scale,
                                                  "paper_note": spec.paper_note, "seconds": elapsed,
                                                  "config": config, "runs": rows},
                                                 indent=2, default=str) + "\n")
    plot_sweep(spec, rows, out / f"{sweep}.png")
    return md_path


def rewrite_report(out_dir: Path, sweep: str) -> Path:
    """Rebuild a sweep's report from its ``results.json`` (after changing the table or verdict code)."""
    data = json.loads((Path(out_dir) / sweep / "results.json").read_text())
    spec = copy.deepcopy(SWEEPS[sweep])
    rows = data["runs"]
    spec.values = [r["value"] for r in rows]
    return write_sweep_report(spec, rows, Path(out_dir) / sweep, scale=data["scale"], elapsed=data["seconds"],
                              config=data["config"])


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments.sweeps --sweep H|islands|outer|all --out DIR [--section.key VALUE ...]``."""
    parser = ArgumentParser(
        prog="python -m experiments.sweeps", description="DiLoCo ablations (H, islands, outer optimizer) "
        "next to the paper's numbers.",
        epilog="Defaults of this command: " + ", ".join(f"{k}={v}" for k, v in SWEEP_DEFAULTS.items())
        + "; any config key can follow as --section.key VALUE.")
    parser.add_argument("--sweep", default="all", help="H, islands, outer or all (default all)")
    parser.add_argument("--out", default="experiments/results/sweeps", help="output directory")
    parser.add_argument("--steps", type=int, help="inner steps per island (default: per sweep, 1000/300/400)")
    parser.add_argument("--islands", type=int, help="islands for the H and outer sweeps (default 2 and 4)")
    parser.add_argument("--values", help="comma-separated values to sweep instead of the defaults")
    parser.add_argument("--config", help="TOML config file (applied over this command's defaults)")
    parser.add_argument("--report-only", action="store_true",
                        help="rebuild results.md and the PNG from an earlier run's results.json, train nothing")
    args, rest = parser.parse_known_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C stops every island, even from a background job
    from diloco.data.corpus import DataError
    from diloco.launch.simulate import SimulationError

    def body() -> int:
        cfg = config_load.load(args.config, rest, defaults=SWEEP_DEFAULTS)
        names = list(SWEEPS) if args.sweep == "all" else [args.sweep]
        if args.report_only:
            for name in names:
                md = rewrite_report(Path(args.out), name)
                print(md.read_text(encoding="utf-8").split("\n- ")[0] + f"\nreport: {md}")
            return 0
        values = [v.strip() for v in args.values.split(",") if v.strip()] if args.values else None
        for name in names:
            run_sweep(cfg, name, writable_folder(args.out), steps=args.steps, islands=args.islands, values=values)
        return 0

    return run_command(body, (CompareError, SimulationError, DataError, ValueError),
                       "interrupted: every island was stopped")


__all__ = ["run_sweep", "write_sweep_report", "rewrite_report", "SWEEPS", "SWEEP_DEFAULTS", "verdict", "main"]


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
