"""Data-parallel (FSDP2) islands through the whole engine, on gloo: a dp=2 island is one process accumulating two
batches; its checkpoints resume on islands of other shapes (dp=1, tp=2) and continue the same trajectory.  (dp x
pp x tp = 2x1x2 and 2x2x1 islands averaging with a single process: tests/test_parallel_island.py.)"""

from __future__ import annotations

from pathlib import Path

import torch

from diloco.config import Config
from diloco.engine.island import Island
from tests.conftest import tiny_config, torchrun_train

RUN_TIMEOUT_S = 240
TOLERANCE = 1e-5
"""Largest |Δθ| allowed between two ways of computing the same training (fp32 sums in another order)."""


def theta(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "theta_global.pt", weights_only=True)


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def island_config(run_dir: Path, **overrides) -> Config:
    return tiny_config(run_dir, **{"diloco.outer_steps": 3, "diloco.inner_steps": 3, "inner.batch_size": 4,
                                   "inner.grad_clip": 1.0, **overrides})


def test_a_dp2_island_is_one_process_accumulating_two_batches_and_its_checkpoints_reshard(tmp_path):
    """dp=2 x batch 4 against one process with grad_accum 2 (the same 8 sequences a step, as FSDP averages the
    replicas' gradients): θ_global after 3 rounds agrees to 1e-5.  The dp=2 island's checkpoint of round 2,
    resumed at dp=1 (one process) and at tp=2 with grad_accum 2, ends round 3 where the uninterrupted run did."""
    reference = tmp_path / "reference"
    Island(island_config(reference, **{"inner.grad_accum": 2})).run()

    dp2 = tmp_path / "dp2"
    torchrun_train(island_config(dp2, **{"parallel.dp": 2, "checkpoint.every": 1}), 2, tmp_path, RUN_TIMEOUT_S)
    assert max_difference(theta(dp2), theta(reference)) < TOLERANCE
    saved = dp2 / "checkpoints" / "rank1" / "ckpt-000002.pt"
    assert saved.is_file() and (dp2 / "checkpoints" / "rank0" / "ckpt-000002.pt").is_file()

    resumed = {"inner.grad_accum": 2, "checkpoint.dir": str(dp2 / "checkpoints"),
               "checkpoint.resume": str(dp2 / "checkpoints" / "rank0" / "ckpt-000002.pt")}
    one = tmp_path / "dp1"
    summary = Island(island_config(one, **resumed)).run()
    assert summary["outer_step"] == 3 and summary["inner_step"] == 9
    assert max_difference(theta(one), theta(reference)) < TOLERANCE

    tp2 = tmp_path / "tp2"
    log = torchrun_train(island_config(tp2, **resumed, **{"parallel.tp": 2}), 2, tmp_path, RUN_TIMEOUT_S)
    assert max_difference(theta(tp2), theta(reference)) < TOLERANCE
    assert "resharded the checkpoint of a dp=2 x pp=1 x tp=1 island onto a dp=1 x pp=1 x tp=2 one" in log.read_text()
    assert not list((dp2 / "checkpoints").glob("ckpt-*.pt")), "a resumed island with checkpoint.every 0 wrote one"
