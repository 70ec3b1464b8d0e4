"""The warm start every comparison continues from, and the one-worker run it is made with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diloco.config import Config
from experiments.compare_results import diloco_result
from experiments.islands import CompareError, launch_islands, variant
from experiments.report import RunResult

# The DiLoCo paper starts every run from a model pretrained for 24k steps; from scratch, 300 steps are the
# earliest phase of training, where the k×-batch baseline gains most (measured from scratch: DiLoCo +25%
# held-out loss).  The warm start is pretraining, at the package's default inner lr.
WARM_START_STEPS = 600
WARM_START_LR = 3e-3
"""Peak inner lr of the warm start (the runs after it use ``--inner.lr``)."""


def single_worker(cfg: Config, run_dir: Path, run_id: str, **items: Any) -> Config:
    """``cfg`` as one worker training alone: plain AdamW (an island averaging with nobody, whose FedAvg
    outer step is the identity)."""
    return variant(cfg, **{"logging.run_dir": str(run_dir), "averaging.backend": "local",
                            "averaging.min_group_size": 1, "averaging.target_group_size": 0,
                            "diloco.outer_optimizer": "avg", "averaging.run_id": run_id, **items})


def warm_start(cfg: Config, steps: int, run_dir: Path, progress: bool = True,
               lr: float | None = None) -> tuple[Path, RunResult]:
    """Train one worker ``steps`` AdamW steps (peak lr ``lr``, default ``cfg.inner.lr``) from the seeded
    initialisation; return its checkpoint directory (for ``--checkpoint.init_from``) and its result.  AdamW
    whatever ``--inner.optimizer`` says, so that runs of either inner optimizer start from the same point; one
    process whatever the islands' shape, whose checkpoint holds the whole θ_global that every shape starts from
    (a rank of a sharded island checkpoints its shards only)."""
    c = single_worker(cfg, run_dir, "warm-start", **{"diloco.inner_steps": steps, "diloco.outer_steps": 1,
                                                      "checkpoint.every": 1, "checkpoint.keep": 1,
                                                      "inner.lr": lr or cfg.inner.lr, "inner.optimizer": "adamw",
                                                      "parallel.dp": 1, "parallel.tp": 1, "parallel.pp": 1})
    out = launch_islands(c, 1, progress=progress)
    ckpt_dir = Path(out["run_dirs"][0]) / "checkpoints"
    if not list(ckpt_dir.glob("ckpt-*.pt")):
        raise CompareError(f"the warm-start run wrote no checkpoint in {ckpt_dir}; see its log in {run_dir}")
    return ckpt_dir, diloco_result("warm-start", "single", out)
