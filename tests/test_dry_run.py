"""``diloco train --dry-run``: an island's memory per rank from a fake process group and fake tensors, checked
against a real step of the same shape, and refusals in one sentence.  (An island of several ranks against a real
gloo island: benchmarks/dry_run_check.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

SMALL = ["--model.preset", "small", "--device", "cpu", "--inner.batch_size", "4"]


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "diloco.cli", "train", "--dry-run", *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=300)


def _answer(*args: str) -> dict:
    done = _dry_run(*args)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_each_rank_holds_its_share_and_the_largest_batch_fits_the_budget():
    whole = _answer(*SMALL)
    split = _answer(*SMALL, "--parallel.dp", "2", "--parallel.tp", "2", "--memory-gb", "0.05")
    assert split["ranks"] == 4 and split["parameters"] == whole["parameters"]
    # a quarter of the parameters, a little more: the norms are whole on every TP rank
    assert whole["params"] / 4 <= split["params"] < whole["params"] / 3
    for r in (whole, split):
        assert r["params"] == 4 * r["outer"] / 8, "θ_global and the outer momentum, fp32, of the rank's own shard"
        assert r["gradients"] == pytest.approx(r["params"], rel=0.01)
        assert r["optimizer"] == pytest.approx(2 * r["params"], rel=0.01), "AdamW: two fp32 moments a parameter"
        assert r["peak"] > r["params"] + r["optimizer"] and r["per_sequence"] > 0
    # fewer activations a rank: TP splits the blocks' widths (FSDP does not split activations)
    assert split["per_sequence"] < whole["per_sequence"]
    budget, b = 0.05e9, split["largest_batch"]
    at = lambda n: split["peak"] + (n - split["batch"]) * split["per_sequence"]  # noqa: E731
    assert b >= 1 and at(b) <= budget < at(b + 1)


def test_the_dry_run_peak_is_what_a_real_step_allocates():
    """One process, fp32 on the CPU: the dry run's peak against torch's profiler over a real inner step."""
    from diloco.config.loader import load
    from diloco.config.schema import resolve_model
    from diloco.launch.dry_run import allocated_peak
    from diloco.model.inner import build_inner_optimizer
    from diloco.model.transformer import build_model, lm_loss
    from pipeline import ModelParts

    predicted = _answer(*SMALL)
    cfg = load(None, SMALL)
    resolve_model(cfg.model)
    cfg.model.vocab_size = cfg.model.vocab_size or 256
    parts = ModelParts(build_model(cfg.model), None, cfg.parallel, loss_fn=lm_loss, device="cpu")
    opt, _ = build_inner_optimizer(list(parts.named_parameters()), cfg.inner, total_steps=10)
    x = torch.randint(0, 256, (4, cfg.model.seq_len), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        parts.train_step(x, x)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    held = [*parts.parameters(), *(t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))]
    real = allocated_peak(step, held)
    assert predicted["peak"] == pytest.approx(real, rel=0.10), (predicted["peak"], real)


@pytest.mark.parametrize("args, sentence", [
    (["--parallel.pp", "2"], "--dry-run covers islands of --parallel.dp x --parallel.tp ranks; pipeline stages"),
    (["--parallel.tp", "3"], "--model.n_heads (4) must be divisible by --parallel.tp (3)"),
    (["--memory-gb", "0"], "--memory-gb must be a positive number of GB per GPU, got 0.0"),
])
def test_a_shape_the_dry_run_cannot_take_is_refused_in_one_sentence(args, sentence, capsys):
    from diloco import cli

    assert cli.main(["train", "--dry-run", *SMALL, *args]) != 0
    err = capsys.readouterr().err
    assert sentence in err and "Traceback" not in err, err
