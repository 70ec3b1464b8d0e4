"""Islands of unequal speed: fixed H against time-budgeted and adaptive rounds, next to a DDP baseline.

    python -m experiments hetero [--islands 3] [--slow-fraction 0.4] [--out DIR] [--section.key VALUE ...]

One island (the last) runs in a cpu cgroup capped at ``--slow-fraction`` of a core (:mod:`experiments.slowdown`;
where cgroups cannot be written the experiment says so and stops: a sleep in the code would not be real
slowness), the others uncapped, all on this machine's loopback.  Arms, each from the same seeded start
for the same number of rounds:

- ``fixed-H``: every island trains H steps per round, so every round waits for the slow island;
- ``time-budget``: ``--diloco.sync_every`` = the compute seconds a fast island needed for H steps in the
  fixed-H arm (measured there), so every island trains for that long and the fast ones do more steps;
- ``auto``: ``--diloco.sync_every auto`` (communication under ``--diloco.max_comm_fraction``);
- ``ddp``: synchronous data parallelism over the same workers, the same slow one among them: every step
  waits for it.

Reports each island's compute utilization, tokens and steps per round, the held-out loss against
wall-clock (``loss_vs_time.png``) and the loss every arm reached at the same wall-clock (the shortest
arm's), in ``results.md`` and ``results.json``.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

from diloco.command import ArgumentParser, run_command
from diloco.files import writable_folder
from diloco.config import Config, ConfigError
from diloco.config import loader as config_load
from diloco.config import schema as config_mod
from diloco.engine.metrics import read_metrics
from experiments.compare_results import baseline_result, diloco_result
from experiments.islands import CompareError, launch_islands, variant
from experiments.report import RunResult, write_report

HETERO_DEFAULTS: dict[str, Any] = {
    "model.preset": "small", "inner.batch_size": 16, "inner.warmup_steps": 10, "diloco.inner_steps": 30,
    "diloco.outer_steps": 6, "logging.eval_every": 1, "logging.samples": 0, "logging.eval_batches": 4,
    # a group waits (up to a minute) for all islands: with a fixed H every round waits for the slowest
    "checkpoint.every": 0, "wandb.mode": "offline", "averaging.matchmaking_time": 60.0,
    "averaging.request_timeout": 3.0, "averaging.matchmaking_timeout": 180.0, "averaging.vote_timeout": 30.0,
}


def loss_at(r: RunResult, seconds: float) -> float:
    """Held-out loss of ``r`` at ``seconds`` of wall-clock (linear between its evaluations)."""
    pts = [(p["seconds"], p["eval_loss"]) for p in r.curve if p.get("eval_loss") is not None]
    for (t0, l0), (t1, l1) in zip(pts, pts[1:]):
        if t0 <= seconds <= t1:
            return l0 + (l1 - l0) * (seconds - t0) / max(t1 - t0, 1e-9)
    return pts[-1][1] if pts and seconds >= pts[-1][0] else float("nan")


def island_lines(name: str, out: dict[str, Any]) -> tuple[list[str], list[float]]:
    """Per island of a DiLoCo arm: utilization, tokens, steps per round; and the utilizations."""
    lines, utils = [], []
    for i, (s, d) in enumerate(zip(out["islands"], out["run_dirs"])):
        steps = [r["inner_steps"] for r in read_metrics(Path(d)) if "round_ok" in r]
        util = 100 * s["compute_seconds"] / max(s["wall_seconds"], 1e-9)
        utils.append(util)
        lines.append(f"{name} island{i}: compute utilization {util:.1f}%, {s['tokens']:,} tokens, inner steps per "
                     f"round {steps}, {s['compute_seconds'] / max(s['inner_step'], 1) * 1e3:.0f} ms per step")
    return lines, utils


def run_hetero(cfg: Config, islands: int, slow_fraction: float, out: Path) -> Path:
    """Run the four arms with the last island slowed; write the report; return ``results.md``."""
    from diloco.launch.baseline import run_baseline
    from experiments.slowdown import cpu_limit

    out.mkdir(parents=True, exist_ok=True)
    runs, slow_i = out / "runs", islands - 1
    notes: list[str] = []
    results: list[RunResult] = []
    with cpu_limit(slow_fraction) as slow:
        if not slow.limited:
            raise CompareError(f"the hetero experiment slows an island with a cpu cgroup: {slow.description}")

        def wrap(cmd: list[str], i: int) -> list[str]:
            return slow.command(cmd) if i == slow_i else cmd

        notes.append(f"slow island: island{slow_i} (and DDP rank {slow_i}) in {slow.description}; the others "
                     f"uncapped; {islands} islands share this machine's cores")
        def arm(name: str, items: dict[str, Any]) -> dict[str, Any]:
            c = variant(cfg, **{"logging.run_dir": str(runs / name), "averaging.run_id": f"hetero-{name}",
                                "averaging.backend": "hivemind", **items})
            print(f"\n== {name}: {', '.join(f'{k}={v}' for k, v in items.items()) or 'H steps per round'} ==",
                  flush=True)
            done = launch_islands(c, islands, wrap=wrap)
            results.append(diloco_result(name, "diloco", done))
            lines, results[-1].extra["island_utilization"] = island_lines(name, done)
            notes.extend(lines)
            return done

        fixed = arm("fixed-H", {})
        fast = [s for i, s in enumerate(fixed["islands"]) if i != slow_i]
        per_step = sum(s["compute_seconds"] / max(s["inner_step"], 1) for s in fast) / len(fast)
        budget = f"{per_step * cfg.diloco.inner_steps:.2f}s"
        notes.append(f"time budget: {budget} of compute per round = H={cfg.diloco.inner_steps} steps of a fast "
                     f"island in the fixed-H arm")
        arm("time-budget", {"diloco.sync_every": budget})
        arm("auto", {"diloco.sync_every": "auto"})
        print("\n== ddp: synchronous data parallelism, every step waits for the slow worker ==", flush=True)
        c_ddp = variant(cfg, **{"logging.run_dir": str(runs / "ddp"), "averaging.run_id": "hetero-ddp"})
        results.append(baseline_result(f"ddp-{islands}", run_baseline(c_ddp, islands, wrap=wrap), runs / "ddp"))
    t_equal = min(r.wall_seconds for r in results)
    for r in results:
        r.extra["loss_at_equal_wall"] = loss_at(r, t_equal)
    notes.append(f"held-out loss at equal wall-clock ({t_equal:.0f} s, the shortest arm): "
                 + ", ".join(f"{r.name} {r.extra['loss_at_equal_wall']:.4f}" for r in results))
    md = write_report(results, out, reference=results[0].name, notes=notes,
                      title=f"Islands of unequal speed ({islands} islands, one at {slow_fraction:g} of a core)")
    payload = json.loads((out / "results.json").read_text())
    payload.update({"config": config_mod.to_dict(cfg), "islands": islands, "slow_fraction": slow_fraction,
                    "equal_wall_seconds": t_equal})
    (out / "results.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print("\n" + "\n".join(notes) + f"\n\nreport: {md}", flush=True)
    return md


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments hetero [--islands N] [--slow-fraction F] [--out DIR] [--section.key VALUE ...]``."""
    parser = ArgumentParser(prog="python -m experiments hetero", description=__doc__.split("\n\n")[0])
    parser.add_argument("--islands", type=int, default=3, help="islands (default 3; the last one is slowed)")
    parser.add_argument("--slow-fraction", type=float, default=0.4,
                        help="share of one core the slow island gets (default 0.4: about half the speed of the "
                             "others on 2 cores)")
    parser.add_argument("--out", default="experiments/results/hetero", help="output directory")
    parser.add_argument("--config", help="TOML config file (applied over this command's defaults)")
    args, rest = parser.parse_known_args(argv)
    # Ctrl-C must stop the experiment even when started from a shell that ignores SIGINT in background jobs
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def body() -> int:
        cfg = config_load.load(args.config, rest, defaults=HETERO_DEFAULTS)
        if args.islands < 2:
            raise ConfigError([f"--islands must be at least 2, got {args.islands}"])
        if not 0 < args.slow_fraction <= 1:
            raise ConfigError([f"--slow-fraction must be in (0, 1], got {args.slow_fraction}"])
        run_hetero(cfg, args.islands, args.slow_fraction, writable_folder(args.out))
        return 0

    from diloco.launch.baseline import BaselineError
    from diloco.launch.simulate import SimulationError

    return run_command(body, (CompareError, SimulationError, BaselineError),
                       "interrupted: every island and worker was stopped")


if __name__ == "__main__":
    sys.exit(main())
