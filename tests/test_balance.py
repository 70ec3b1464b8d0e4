"""Where pipeline stages are cut (``--parallel.balance``): the exact partition, the three balances, the
config check, and real gloo islands (under torchrun) profiling a model whose output projection dominates."""

from __future__ import annotations

import itertools
import logging
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco.config import CHOICES, ConfigError, ModelConfig
from diloco.config.loader import load
from diloco.model.transformer import build_model
from pipeline.balance import (
    BALANCES,
    PROFILE_MIN_GAIN,
    PartCosts,
    StagePlan,
    idle_fraction,
    plan_stages,
    profiled_plan,
)
from pipeline.mesh import exit_worker
from pipeline.model_parts import ModelParts, check_split, cross_entropy_loss
from pipeline.pipeline_parallel import model_layer_costs, stage_layer_split
from pipeline.settings import ParallelSettings
from pipeline.stage_clock import MEASURED_STEPS, SKIP_STEPS

ROWS, SEQ, MICRO = 4, 16, 2
RUN_TIMEOUT_S = 240


def heavy_output_config() -> ModelConfig:
    """4 small blocks and a 16k vocabulary: the output projection and loss take about as long as 3 blocks
    (on this 2-core CPU; the split below holds from ~1.2 to ~6), while the parameter count puts the
    (cheap to look up) embedding on a par with it."""
    return ModelConfig(preset="tiny", dim=32, n_layers=4, n_heads=4, ffn_dim=64, seq_len=SEQ, vocab_size=16384)


# ------------------------------------------------------------------------------------ the partition
def _slowest(costs: list[float], sizes: list[int], first: float, last: float) -> float:
    return max(PartCosts(costs, first, last, "s").stage_costs(sizes))


def _brute_force(costs: list[float], n_stages: int, first: float, last: float) -> float:
    """The least slowest stage over every contiguous split."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), n_stages - 1):
        bounds = (0, *cuts, len(costs))
        best = min(best, _slowest(costs, [b - a for a, b in zip(bounds, bounds[1:])], first, last))
    return best


def _sizes(costs: list[float], n_stages: int, first: float = 0.0, last: float = 0.0) -> list[int]:
    return [len(run) for run in stage_layer_split(costs, n_stages, None, first, last)]


@pytest.mark.parametrize("costs, n_stages, first, last, want", [
    ([1, 1, 1, 9, 1, 1], 2, 0, 0, [3, 3]),          # a heavy block alone is no better than with the tail
    ([4, 1, 1, 1, 1, 4], 3, 0, 0, [1, 4, 1]),       # the heavy ends get stages of their own
    ([2.0, 2.0, 2.0, 2.0], 2, 0.5, 7.0, [3, 1]),    # an expensive output projection pulls blocks forward
    ([3, 3, 3, 3, 3, 3], 3, 6, 1, [1, 3, 2]),       # and an expensive embedding pushes them back
    ([1, 10, 1, 10, 1], 5, 0, 0, [1, 1, 1, 1, 1]),  # one block per stage
])
def test_the_partition_is_optimal_on_hand_made_costs(costs, n_stages, first, last, want):
    got = _sizes(costs, n_stages, first, last)
    assert _slowest(costs, got, first, last) == _brute_force(costs, n_stages, first, last)
    assert got == want


def test_the_partition_is_optimal_on_random_costs():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 8)
        costs = [rng.uniform(0.1, 10.0) for _ in range(n)]
        stages = rng.randint(1, n)
        first, last = rng.uniform(0, 20), rng.uniform(0, 20)
        got = _sizes(costs, stages, first, last)
        assert sum(got) == n and min(got) >= 1
        assert _slowest(costs, got, first, last) == pytest.approx(_brute_force(costs, stages, first, last), rel=1e-12)


def test_predicted_idle_is_one_minus_mean_over_max_per_rank():
    assert idle_fraction([3.0, 1.0]) == pytest.approx(1 - 2 / 3)
    assert idle_fraction([0.0, 0.0]) == 0.0
    plan = StagePlan("profile", [1, 1, 1, 1], PartCosts([1.0, 2.0, 3.0, 4.0], 0.0, 0.0, "s"), pp=2)
    assert plan.rank_costs() == [4.0, 6.0]  # interleaved: rank 0 holds stages 0 and 2
    assert plan.predicted_idle == pytest.approx(1 - 5 / 6)


def test_profile_keeps_the_params_split_unless_it_gains_more_than_noise():
    params = PartCosts([10.0] * 4, 40.0, 40.0, "params")  # 2,2 by parameters
    noisy = PartCosts([1.0, 1.02, 0.97, 1.01], 0.05, 0.1, "s")  # equal blocks timed with a little noise
    assert profiled_plan(noisy, params, 2, 2).sizes == [2, 2]
    heavy = PartCosts([1.0, 1.02, 0.97, 1.01], 0.05, 3.0, "s")  # the output projection costs 3 blocks
    plan = profiled_plan(heavy, params, 2, 2)
    assert plan.sizes == [3, 1] and plan.by_params == [2, 2]
    assert max(plan.rank_costs()) < (1 - PROFILE_MIN_GAIN) * max(plan.rank_costs([2, 2]))


# --------------------------------------------------------------------------- the balances, one process
def _plan(model: torch.nn.Module, **settings) -> StagePlan:
    return plan_stages(model, ParallelSettings(microbatches=MICRO, **settings), None, torch.device("cpu"),
                       cross_entropy_loss, (ROWS // MICRO, SEQ))


def test_params_balance_is_todays_split_and_layers_balance_counts_blocks():
    model = build_model(ModelConfig(preset="tiny", dim=32, n_layers=5, n_heads=4, ffn_dim=64, seq_len=SEQ,
                                    vocab_size=8192))
    costs, first, last = model_layer_costs(model)
    by_params = _plan(model, pp=2)
    assert by_params.sizes == [len(run) for run in stage_layer_split(costs, 2, None, first, last)]
    assert by_params.costs.unit == "params" and by_params.by_params is None
    assert _plan(model, pp=2, balance="layers").sizes == [2, 3]
    assert _plan(model, pp=4, balance="layers").sizes == [1, 1, 1, 2]
    # an explicit split wins over every balance
    assert _plan(model, pp=2, balance="profile", layers_per_stage=[4, 1]).sizes == [4, 1]
    assert _plan(model, pp=2, balance="layers", layers_per_stage=[1, 4]).sizes == [1, 4]


def test_a_bad_balance_is_one_clear_config_error_line():
    assert BALANCES == CHOICES["parallel.balance"]
    with pytest.raises(ConfigError) as e:
        load(None, ["--parallel.pp", "2", "--parallel.balance", "time"])
    assert str(e.value).splitlines() == ["--parallel.balance is 'time' but must be one of params, layers, profile"]
    assert load(None, ["--parallel.pp", "2", "--parallel.balance", "profile"]).parallel.balance == "profile"
    assert check_split(ParallelSettings(pp=2, microbatches=2, balance="time"), 4, 4, 32, 64, 256) == [
        "--parallel.balance is 'time' but must be one of params, layers, profile"]


# ------------------------------------------------------------------- a real island under torchrun
def _worker(out_dir: str, tp: int, pp: int) -> None:
    """One rank of a tp x pp island balanced by profile (this file run under torchrun)."""
    from pipeline.mesh import destroy_island, init_island_mesh

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stdout)
    rank = int(os.environ["RANK"])
    mesh = init_island_mesh(tp, pp, "cpu", timeout_s=60)
    try:
        settings = ParallelSettings(tp=tp, pp=pp, microbatches=MICRO, balance="profile")
        parts = ModelParts(build_model(heavy_output_config()), mesh, settings, profile_shape=(ROWS // MICRO, SEQ))
        gen = torch.Generator().manual_seed(0)
        x = torch.randint(0, heavy_output_config().vocab_size, (ROWS, SEQ + 1), generator=gen)
        for _ in range(SKIP_STEPS + MEASURED_STEPS):
            parts.train_step(x[:, :-1], x[:, 1:])
            parts.zero_grad()
        plan = parts.plan
        torch.save(dict(sizes=plan.sizes, by_params=plan.by_params, costs=plan.costs, measured=parts.clock.measured,
                        slowest=max(plan.rank_costs()), params_slowest=max(plan.rank_costs(plan.by_params)),
                        blocks=[list(m.layers.keys()) for m in parts.modules]), Path(out_dir) / f"rank{rank}.pt")
    finally:
        destroy_island()


def _torchrun(script: Path, nproc: int, args: list[str], log: Path) -> int:
    """Run ``script`` under ``torchrun --standalone``; on timeout kill the whole process group."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(script.resolve().parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                                 "--nproc-per-node", str(nproc), str(script), *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _launch(tmp_path: Path, tp: int, pp: int) -> tuple[list[dict], str]:
    log = tmp_path / "island.log"
    assert _torchrun(Path(__file__), tp * pp, [str(tmp_path), str(tp), str(pp)], log) == 0, log.read_text()[-4000:]
    runs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(tp * pp)]
    for run in runs:  # every rank holds the same costs (the island's maximum) and so the same split
        assert run["sizes"] == runs[0]["sizes"] and run["costs"] == runs[0]["costs"]
        busy, wall = run["measured"]  # each PP group measured the busy time of both its ranks
        assert len(busy) == pp and all(b > 0 for b in busy) and wall > 0
    sizes = runs[0]["sizes"]
    # ranks are (pp, tp) row-major: the first tp ranks hold stage 0, the others the last stage
    assert [run["blocks"] for run in runs] == [[[str(i) for i in range(sizes[0])]]] * tp + \
        [[[str(i) for i in range(sizes[0], 4)]]] * tp
    text = log.read_text()
    assert text.count("pipeline stages balanced by profile: layers per stage") == 1, text[-4000:]
    assert text.count(f"pipeline measured over steps {SKIP_STEPS + 1}-{SKIP_STEPS + MEASURED_STEPS}") == 1
    return runs, text


@pytest.mark.alone  # the split follows measured times: a busy second core made both stages look alike in a .ci/run
def test_profile_moves_blocks_off_an_expensive_output_and_both_stages_agree(tmp_path):
    runs, text = _launch(tmp_path, tp=1, pp=2)
    costs, first, last = model_layer_costs(build_model(heavy_output_config()))
    by_params = [len(run) for run in stage_layer_split(costs, 2, None, first, last)]
    assert by_params == [2, 2]  # the embedding's parameters balance the output's
    assert all(run["by_params"] == by_params for run in runs)
    assert runs[0]["sizes"] == [3, 1]
    assert runs[0]["slowest"] < runs[0]["params_slowest"]
    assert "layers per stage 3,1" in text


def test_every_rank_of_a_tp2_pp2_island_gets_the_same_profiled_split(tmp_path):
    # under TP on gloo the blocks' all-reduces are timed too, so the split itself depends on the machine
    _launch(tmp_path, tp=2, pp=2)


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    exit_worker(0)
