"""Does θ_global drift apart across islands over many rounds, per wire format?

    python -m experiments.codec_spread [--codecs none,fp16,int8,int4,sign,topk] [--rounds 120] [--islands 3]
           [--out experiments/results/codec-spread] [--section.key VALUE ...]

For each codec, ``--islands`` islands of the tiny model average ``--rounds`` rounds on loopback over real
hivemind, checkpointing every ``--every`` rounds; the spread is the largest absolute difference of
θ_global between any two islands at each checkpoint (read back from the islands' checkpoints).  A spread
that grows round after round would mean islands that slowly stop holding the same model.  Writes
``results.md`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from diloco.command import run_command
from diloco.config import ConfigError
from diloco.config import loader as config_load
from diloco.config import schema as config_mod
from diloco.model import checkpoint
from experiments.islands import CompareError, launch_islands, variant
from experiments.report import markdown_table
from outer_optim.compression import CODECS

DEFAULTS = {"model.preset": "tiny", "inner.batch_size": 4, "inner.warmup_steps": 2, "diloco.inner_steps": 5,
            "logging.eval_every": 1000, "logging.eval_batches": 2, "logging.samples": 0, "wandb.mode": "disabled",
            "averaging.backend": "hivemind", "averaging.min_group_size": 2, "averaging.matchmaking_time": 3.0,
            "averaging.request_timeout": 1.0, "averaging.matchmaking_timeout": 60.0, "data.max_bytes": 2_000_000,
            "threads": 1}


def spread_at(run_dirs: list[Path], step: int) -> float:
    """Largest |θ_global difference| between any island and island 0 in the checkpoints of ``step``."""
    masters = [checkpoint.load(checkpoint.checkpoint_path(d / "checkpoints", step))["outer_optimizer"]["master"]
               for d in run_dirs]
    return max((m[k] - masters[0][k]).abs().max().item() for m in masters[1:] for k in masters[0])


def run(cfg: config_mod.Config, codecs: list[str], rounds: int, every: int, islands: int, out: Path) -> Path:
    """Run every codec; write the table; return ``results.md``."""
    out.mkdir(parents=True, exist_ok=True)
    steps = list(range(every, rounds + 1, every))
    rows, data = [], {}
    for codec in codecs:
        print(f"\n== {codec}: {islands} islands, {rounds} rounds ==", flush=True)
        c = variant(cfg, **{"averaging.compression": codec, "logging.run_dir": str(out / "runs" / codec),
                            "averaging.run_id": f"spread-{codec}", "diloco.outer_steps": rounds,
                            "checkpoint.every": every, "checkpoint.keep": len(steps)})
        done = launch_islands(c, islands, progress=True)
        dirs = [Path(d) for d in done["run_dirs"]]
        spreads = [spread_at(dirs, s) for s in steps]
        ok = min(s["rounds_ok"] for s in done["islands"])
        data[codec] = {"rounds": steps, "spread": spreads, "rounds_ok_min": ok,
                       "eval_loss_end": done["islands"][0]["eval_loss_end"]}
        rows.append([codec, f"{ok}/{rounds}", *[f"{x:.1e}" if x else "0" for x in spreads],
                     f"{done['islands'][0]['eval_loss_end']:.4f}"])
    table = markdown_table(["codec", "rounds committed", *[f"spread @ {s}" for s in steps], "held-out loss"], rows)
    md = out / "results.md"
    md.write_text(f"# θ_global spread across {islands} islands over {rounds} rounds, per codec\n\n{table}\n\n"
                  f"Spread: the largest |θ_global difference| between islands in their checkpoints of that round "
                  f"(tiny model, H={cfg.diloco.inner_steps}, loopback, real hivemind).\n")
    (out / "results.json").write_text(json.dumps({"islands": islands, "rounds": rounds, "codecs": data}, indent=2) + "\n")
    print("\n" + table + f"\n\nreport: {md}", flush=True)
    return md


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m experiments.codec_spread", description=__doc__.split("\n\n")[0])
    parser.add_argument("--codecs", default=",".join(CODECS), help=f"comma-separated of {', '.join(CODECS)}")
    parser.add_argument("--rounds", type=int, default=120)
    parser.add_argument("--every", type=int, default=20, help="checkpoint (and measure) every this many rounds")
    parser.add_argument("--islands", type=int, default=3)
    parser.add_argument("--out", default="experiments/results/codec-spread")
    args, rest = parser.parse_known_args(argv)

    def body() -> int:
        cfg = config_load.load(None, rest, defaults=DEFAULTS)
        codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
        bad = [c for c in codecs if c not in CODECS]
        if bad or args.rounds < args.every or args.every < 1 or args.islands < 2:
            raise ConfigError([f"--codecs must be among {', '.join(CODECS)}, --rounds at least --every (≥ 1), "
                               f"--islands at least 2 (got {args.codecs}, {args.rounds}, {args.every}, {args.islands})"])
        run(cfg, codecs, args.rounds, args.every, args.islands, Path(args.out))
        return 0

    from diloco.launch.simulate import SimulationError

    return run_command(body, (CompareError, SimulationError), "interrupted: every island was stopped")


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
