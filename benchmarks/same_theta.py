"""θ_global of one short run per way of training, to compare two versions of the trainer.

Each case trains the `tiny` model for 3 rounds on the embedded corpus with the local averager, as ``diloco train``
(a ``torchrun`` job of 2 gloo processes for the dp2 and tp2 islands), and keeps the island's ``theta_global.pt``
under ``OUT/<case>.pt``.  Run it once with each version of the code on the path, then compare::

    PYTHONPATH=<old tree> python benchmarks/same_theta.py run /tmp/old
    PYTHONPATH=<new tree> python benchmarks/same_theta.py run /tmp/new
    python benchmarks/same_theta.py compare /tmp/old /tmp/new

Rounds in flight (delayed, eager) run on the training thread here: with the round thread, when a round in flight is
applied depends on which thread gets there first, and so does the trajectory.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = {
    "model.preset": "tiny", "diloco.inner_steps": 5, "diloco.outer_steps": 3, "inner.batch_size": 4,
    "inner.warmup_steps": 2, "logging.eval_batches": 2, "wandb.mode": "disabled", "averaging.backend": "local",
    "averaging.min_group_size": 1, "checkpoint.every": 0, "threads": 1, "data.max_bytes": 2_000_000,
}
INLINE = {"diloco.round_thread": False}
CASES: dict[str, tuple[int, dict]] = {  # name -> (processes, overrides)
    "blocking": (1, {}),
    "delayed": (1, {"diloco.overlap": "delayed", "diloco.overlap_steps": 2, **INLINE}),
    "eager": (1, {"diloco.overlap": "eager", "diloco.overlap_steps": 2, **INLINE}),
    "fragments": (1, {"diloco.fragments": 2, "diloco.inner_steps": 6, "diloco.overlap_steps": 1,
                      "diloco.merge_alpha": 0.5}),
    "fragments-delayed": (1, {"diloco.fragments": 2, "diloco.inner_steps": 6, "diloco.overlap": "delayed",
                              "diloco.overlap_steps": 1, **INLINE}),
    "tokens-budget": (1, {"diloco.sync_every": "1.28K"}),
    "dp2": (2, {"parallel.dp": 2, "averaging.bucket_numel": 15_000}),
    "tp2": (2, {"parallel.tp": 2, "averaging.bucket_numel": 15_000}),
    "tp2-eager": (2, {"parallel.tp": 2, "averaging.bucket_numel": 15_000, "diloco.overlap": "eager",
                      "diloco.overlap_steps": 1, **INLINE}),
}


def run(out: Path, only: list[str]) -> None:
    """Train every case (or those named) with the code on the path and keep its θ_global."""
    import tomli_w

    from diloco.config import to_dict
    from diloco.config.loader import load

    out.mkdir(parents=True, exist_ok=True)
    for name, (processes, overrides) in CASES.items():
        if only and name not in only:
            continue
        run_dir = Path(tempfile.mkdtemp(prefix=f"same-theta-{name}-"))
        cfg = load(None, {**COMMON, **overrides, "logging.run_dir": str(run_dir)})
        path = run_dir / "config.toml"
        path.write_text(tomli_w.dumps(to_dict(cfg)))
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", DILOCO_WARM_ISLANDS="0")
        cli = ["-m", "diloco.cli", "train", "--config", str(path)]
        cmd = [sys.executable, *cli] if processes == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes), *cli]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        (out / f"{name}.pt").write_bytes((run_dir / "theta_global.pt").read_bytes())
        print(f"{name}: done", flush=True)


def compare(a: Path, b: Path) -> float:
    """Print the largest difference of θ_global between the two versions, case by case; return the largest."""
    import torch

    worst = 0.0
    for name in CASES:
        if not (a / f"{name}.pt").is_file() or not (b / f"{name}.pt").is_file():
            print(f"{name:26s} missing")
            continue
        x, y = (torch.load(p / f"{name}.pt", weights_only=True) for p in (a, b))
        assert x.keys() == y.keys(), name
        diff = max(float((x[n] - y[n]).abs().max()) for n in x)
        worst = max(worst, diff)
        print(f"{name:26s} max |Δθ_global| = {diff:.3g}")
    print(f"largest difference: {worst:.3g}")
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("cases", nargs="*", help="only these cases")
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = parser.parse_args()
    if args.what == "run":
        run(args.out, args.cases)
    else:
        compare(args.a, args.b)


if __name__ == "__main__":
    main()
