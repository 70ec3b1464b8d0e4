"""Checkpoints: atomic writes, exact resume, damaged files refused, nothing overwritten."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from diloco.engine.island import Island
from diloco.engine.metrics import read_metrics
from diloco.model import checkpoint
from diloco.model.checkpoint import CheckpointError
from tests.conftest import tiny_config


def _step_losses(run_dir) -> dict[int, float]:
    return {r["inner_step"]: r["loss"] for r in read_metrics(run_dir) if "inner_step" in r}


def test_round_trip_preserves_every_tensor(tmp_path):
    state = {"a": torch.randn(3, 3), "nested": {"b": [torch.arange(4), 5, "text"]}}
    path = checkpoint.save(state, tmp_path / "ckpt-000001.pt")
    back = checkpoint.load(path)
    assert torch.equal(back["a"], state["a"]) and torch.equal(back["nested"]["b"][0], torch.arange(4))
    assert back["nested"]["b"][1:] == [5, "text"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary file left behind"


def test_keep_limit_deletes_oldest(tmp_path):
    for step in range(1, 6):
        checkpoint.save({"step": step}, checkpoint.checkpoint_path(tmp_path, step), keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["ckpt-000004.pt", "ckpt-000005.pt"]


def _as_written_before_parts(state: dict) -> dict:
    """A checkpoint in the layout diloco wrote up to 9ecef41, before its parts had names of their own: the norm
    guard's history, the schedule (``overlap``) and the codec's residuals at the top level."""
    old = {k: v for k, v in state.items() if k not in ("norm_guard", "schedule", "codec_residuals")}
    old["norm_history"] = state["norm_guard"]["history"]
    old["overlap"] = state["schedule"]
    old["error_feedback"] = state["codec_residuals"]["feedback"]
    old["owner_feedback"] = state["codec_residuals"]["carry"]
    return old


@pytest.mark.parametrize("layout", ["parts", "before-parts"])
def test_resume_continues_with_the_same_losses(tmp_path, layout):
    """Stop after round 2 of 4, resume: rounds 3-4 match an uninterrupted run step for step, from a checkpoint of
    this version or of one before the stateful parts had names of their own."""
    common = {"diloco.outer_steps": 4, "checkpoint.every": 2, "logging.log_every": 1, "diloco.inner_steps": 4}
    full = tiny_config(tmp_path / "full", **common)
    Island(full).run()
    reference = _step_losses(tmp_path / "full")
    assert len(reference) == 16

    # the run that "crashed" after round 2: only its round-2 checkpoint survives
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "checkpoints").mkdir(parents=True)
    kept = tmp_path / "full" / "checkpoints" / "ckpt-000002.pt"
    if layout == "parts":
        shutil.copy(kept, resumed_dir / "checkpoints")
    else:
        checkpoint.save(_as_written_before_parts(checkpoint.load(kept)), resumed_dir / "checkpoints" / kept.name)
    resumed = tiny_config(resumed_dir, **common, **{"checkpoint.resume": "latest"})
    summary = Island(resumed).run()
    assert summary["outer_step"] == 4
    after = _step_losses(resumed_dir)
    assert sorted(after) == list(range(9, 17))
    assert [after[s] for s in range(9, 17)] == [reference[s] for s in range(9, 17)]


def _corrupt(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_damaged_checkpoint_is_refused_with_its_name(tmp_path, how):
    path = checkpoint.save({"w": torch.randn(1000)}, tmp_path / "ckpt-000003.pt")
    _corrupt(path, how)
    with pytest.raises(CheckpointError, match="ckpt-000003.pt is corrupted or truncated"):
        checkpoint.load(path)


def test_latest_skips_a_damaged_newest_checkpoint(tmp_path):
    checkpoint.save({"step": 1}, checkpoint.checkpoint_path(tmp_path, 1))
    newest = checkpoint.save({"step": 2}, checkpoint.checkpoint_path(tmp_path, 2))
    _corrupt(newest, "truncate")
    assert checkpoint.find_resume("latest", tmp_path).name == "ckpt-000001.pt"
    assert newest.exists(), "the damaged file is kept for inspection, not deleted"


def test_cli_refuses_corrupted_checkpoint_without_touching_it(tmp_path):
    cfg_dir = tmp_path / "run"
    path = checkpoint.save({"w": torch.zeros(10)}, cfg_dir / "checkpoints" / "ckpt-000001.pt")
    _corrupt(path, "flip")
    before = path.read_bytes()
    proc = subprocess.run(
        [sys.executable, "-m", "diloco.cli", "train", "--model.preset", "tiny", "--averaging.backend", "local",
         "--averaging.min_group_size", "1", "--wandb.mode", "disabled", "--logging.run_dir", str(cfg_dir),
         "--checkpoint.resume", str(path), "--data.max_bytes", "200000"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith(f"error: checkpoint {path} is corrupted or truncated")
    assert path.read_bytes() == before


def test_unwritable_directory_keeps_the_previous_checkpoint(tmp_path):
    previous = checkpoint.save({"step": 1}, checkpoint.checkpoint_path(tmp_path, 1))
    target = checkpoint.checkpoint_path(tmp_path, 2)
    # a directory where the temporary file should go makes the write fail as a full disk would
    target.with_name(f".{target.name}.tmp-{os.getpid()}").mkdir()
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*ckpt-000002.pt.*previous checkpoint"):
        checkpoint.save({"step": 2}, target)
    assert checkpoint.load(previous) == {"step": 1}
    assert not target.exists()


def test_init_from_starts_every_kind_of_run_from_the_same_parameters(tmp_path):
    """A warm start takes θ_global of a checkpoint (file or directory) or a plain state dict; the
    baseline worker's model and an island's model and θ_global all start from it."""
    donor = Island(tiny_config(tmp_path / "donor", **{"checkpoint.every": 1, "diloco.outer_steps": 2,
                                                     "diloco.outer_optimizer": "nesterov"}))
    donor.run()
    donor.close()
    theta = {n: t.clone() for n, t in donor.outer.theta_global.items()}
    ckpt_dir = tmp_path / "donor" / "checkpoints"
    plain = tmp_path / "plain.pt"
    torch.save(theta, plain)
    fresh = Island(tiny_config(tmp_path / "fresh"))
    assert any(not torch.equal(fresh.params[n].detach(), t) for n, t in theta.items())  # seeded init differs
    fresh.close()
    for spec in (ckpt_dir, checkpoint.checkpoint_path(ckpt_dir, 2), plain):
        island = Island(tiny_config(tmp_path / "warm", **{"checkpoint.init_from": str(spec)}))
        try:
            for n, t in theta.items():
                assert torch.equal(island.params[n].detach(), t), (spec, n)
                assert torch.equal(island.outer.theta_global[n], t)
            assert island.stats.outer_step == 0 and island.stats.inner_step == 0
        finally:
            island.close()


@pytest.mark.parametrize("problem", ["corrupted", "other-model", "not-a-state-dict", "empty-dir"])
def test_init_from_refuses_unusable_files_in_one_line(tmp_path, problem):
    target = tmp_path / "init.pt"
    if problem == "corrupted":
        checkpoint.save({"outer_optimizer": {"master": {}}}, target)
        data = bytearray(target.read_bytes())
        data[-5] ^= 0xFF
        target.write_bytes(bytes(data))
        expect = "checksum mismatch"
    elif problem == "other-model":
        bigger = Island(tiny_config(tmp_path / "big", **{"model.dim": 64}))
        torch.save({n: p.detach() for n, p in bigger.params.items()}, target)
        bigger.close()
        expect = "of shape"
    elif problem == "not-a-state-dict":
        target.write_text("hello")
        expect = "neither a diloco checkpoint nor a torch state dict"
    else:
        target = tmp_path / "empty"
        target.mkdir()
        expect = "without checkpoints"
    result = subprocess.run([sys.executable, "-m", "diloco.cli", "train", "--model.preset", "tiny",
                             "--checkpoint.init_from", str(target), "--averaging.backend", "local",
                             "--wandb.mode", "disabled", "--logging.run_dir", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expect in errors[0], result.stderr
    assert "Traceback" not in result.stderr
