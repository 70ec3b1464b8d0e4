"""How much of a lossy-codec run's gap is progress the islands trained but never sent?

With error feedback in the parameters, an island's parameters after a committed round are
θ_global − e_i, e_i being what its codec left unsent.  This reads the newest checkpoint that every
island of a finished run wrote (``--checkpoint.every 1``) and prints the held-out loss, on the run's
own evaluation batches, of θ_global, of θ_global − mean(e_i) (the mean of the islands' parameters:
θ_global as if a last, lossless round had sent what is still waiting) and of each island's own
parameters.

Command line::

    python -m experiments.unsent RUN_DIR     # RUN_DIR holds island0/, island1/, ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from diloco.config.loader import from_dict
from diloco.data.batches import heldout_batches
from diloco.data.corpus import load_corpus
from diloco.model import checkpoint
from diloco.model.transformer import build_model
from diloco.model.weights import load_parameters


def last_common_states(run_dir: Path) -> list[dict]:
    """Every island's checkpoint of the newest outer step all of them saved."""
    by_island = {d: {int(p.stem.split("-")[1]): p for p in (d / "checkpoints").glob("ckpt-*.pt")}
                 for d in sorted(run_dir.glob("island*"))}
    common = set.intersection(*(set(steps) for steps in by_island.values())) if by_island else set()
    if not common:
        raise SystemExit(f"error: {run_dir} holds no outer step checkpointed by every island; run with "
                         f"--checkpoint.every 1 and point at the run's folder (the one holding island0/)")
    step = max(common)
    return [checkpoint.load(steps[step]) for steps in by_island.values()]


def losses(run_dir: Path) -> dict[str, float]:
    """Held-out loss of θ_global, of the islands' mean parameters, and of each island's parameters."""
    states = last_common_states(run_dir)
    cfg = from_dict(states[0]["config"])
    theta, _ = load_parameters(run_dir / "island0" / "checkpoints")
    model = build_model(cfg.model, seed=0).eval()
    batches = heldout_batches(load_corpus(cfg.data).heldout, cfg.model.seq_len, cfg.inner.batch_size,
                              cfg.logging.eval_batches)

    def loss_of(params: dict[str, torch.Tensor]) -> float:
        model.load_state_dict({**model.state_dict(), **params})
        with torch.no_grad():
            return float(np.mean([float(torch.nn.functional.cross_entropy(
                model(x).flatten(0, 1), y.flatten())) for x, y in batches]))

    mean = {n: torch.stack([s["model"][n].float() for s in states]).mean(0) for n in theta}
    out = {"outer_step": float(states[0]["outer_step"]), "theta_global": loss_of(theta),
           "theta_global_minus_mean_unsent": loss_of(mean)}
    for i, s in enumerate(states):
        out[f"island{i}"] = loss_of({n: s["model"][n] for n in theta})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.unsent", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run's folder, holding island0/, island1/, ...")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        print(f"error: {args.run_dir} is not a folder; pass the run's folder (the one holding island0/)",
              file=sys.stderr)
        return 2
    for name, value in losses(args.run_dir).items():
        print(f"{name:32s} {value:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
