"""What an island does with its devices: compute precision, compiled blocks, throughput metrics, the GPUs that
``simulate`` hands each island.  On CPU; the GPU figures are in benchmarks/gpu_island.py."""

from __future__ import annotations

import pytest
import torch

from diloco.config import ModelConfig
from diloco.engine.throughput import Throughput, peak_flops
from diloco.engine.runtime import pick_device
from diloco.launch.simulate import SimulationError, gpu_assignment
from diloco.model.transformer import build_model, flops_per_token, lm_loss
from pipeline import ModelParts, ParallelSettings
from pipeline.mesh import backend_for


def _parts(**settings) -> ModelParts:
    return ModelParts(build_model(ModelConfig(preset="tiny"), seed=0), None, ParallelSettings(**settings),
                      loss_fn=lm_loss, device="cpu")


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (2, 33), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def test_bf16_compute_runs_in_bf16_over_fp32_master_weights_gradients_and_loss():
    x, y = _batch()
    fp32, bf16 = _parts(param_dtype="fp32"), _parts(param_dtype="bf16")
    assert fp32.compute_dtype == torch.float32 and bf16.compute_dtype == torch.bfloat16
    assert _parts().compute_dtype == torch.float32, "auto is fp32 on CPU"
    seen = []
    hook = bf16.modules[0].layers["0"].feed_forward.w1.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    loss_32, loss_16 = fp32.train_step(x, y), bf16.train_step(x, y)
    hook.remove()
    assert seen == [torch.bfloat16], "the matrix products ran in fp32"
    assert abs(loss_16 - loss_32) < 0.02 * loss_32 and loss_16 != loss_32
    for (name, p32), (_, p16) in zip(fp32.named_parameters(), bf16.named_parameters()):
        assert p16.dtype == torch.float32 and p16.grad.dtype == torch.float32, name
        assert torch.equal(p32, p16), "the master weights are the same fp32 tensors before the optimizer step"
        cos = torch.nn.functional.cosine_similarity(p32.grad.flatten(), p16.grad.flatten(), dim=0)
        assert cos > 0.99, f"{name}: bf16 gradients point elsewhere (cosine {cos:.3f})"
    assert abs(bf16.eval_loss(x, y) - fp32.eval_loss(x, y)) < 0.02 * loss_32


def test_compiled_blocks_keep_names_and_match_eager_gradients(monkeypatch):
    # traced by dynamo and split into forward and backward graphs as on a GPU, run by aot_eager rather than
    # inductor, whose C++ code generation takes minutes on 2 cores (benchmarks/gpu_island.py runs inductor)
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_module(self, backend="aot_eager"))
    x, y = _batch()
    eager, compiled = _parts(), _parts(compile=True)
    assert all(b._compiled_call_impl is not None for b in compiled.modules[0].layers.values())
    assert [n for n, _ in eager.named_parameters()] == [n for n, _ in compiled.named_parameters()]
    assert eager.modules[0].state_dict().keys() == compiled.modules[0].state_dict().keys()
    assert abs(eager.train_step(x, y) - compiled.train_step(x, y)) < 1e-5
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_throughput_per_device_and_mfu_from_the_model_flops():
    cfg = ModelConfig(preset="tiny")
    t = Throughput(flops_per_token(cfg), devices=4, device=torch.device("cpu"), peak=2e12)
    rec = t.record(8000.0)
    assert rec["tokens_per_second_per_device"] == 2000.0
    assert rec["mfu"] == pytest.approx(2000.0 * flops_per_token(cfg) / 2e12)
    assert rec["peak_memory_gb"] > 0.05, "the peak resident set of this process"
    assert "mfu" not in Throughput(1.0, 1, torch.device("cpu"), None).record(1.0), "no peak, no MFU"
    assert peak_flops(torch.device("cpu"), torch.bfloat16) is None
    assert peak_flops(torch.device("cpu"), torch.bfloat16, override_tflops=100.0) == 1e14


def test_simulate_gives_each_island_gpus_of_its_own_or_refuses():
    assert gpu_assignment([2, 2], ["0", "1", "2", "3"], "auto") == ["0,1", "2,3"]
    assert gpu_assignment([1, 1, 1], ["4", "5", "6", "7"], "cuda") == ["4", "5", "6"], "CUDA_VISIBLE_DEVICES kept"
    assert gpu_assignment([2, 2], [], "auto") == [None, None], "no GPU: CPU islands"
    assert gpu_assignment([1, 1], ["0"], "cuda", share=True) == ["0", "0"], "two islands take turns on one GPU"
    assert gpu_assignment([2, 1], ["0", "1"], "auto", share=True) == ["0,1", "0"]
    with pytest.raises(SimulationError, match="needs 2 GPUs of its own"):
        gpu_assignment([2], ["0"], "cuda", share=True)
    assert gpu_assignment([2, 2], ["0"], "cpu") == [None, None]
    with pytest.raises(SimulationError, match="need 4 GPUs.*has 3"):
        gpu_assignment([2, 2], ["0", "1", "2"], "auto")
    with pytest.raises(SimulationError, match="--device cuda"):
        gpu_assignment([1, 1], ["0", "1"], "cuda:1")


def test_a_skeleton_materialises_the_seeded_model_one_parameter_at_a_time():
    """The island builds its model on the meta device and each rank draws only its own pieces: the values are
    those of the seeded model, whatever order the parameters are drawn in, and the skeleton holds no memory."""
    from diloco.model.transformer import initial_model

    cfg = ModelConfig(preset="tiny")
    skeleton, initial = initial_model(cfg, seed=7)
    assert all(p.is_meta for p in skeleton.parameters()) and not skeleton.rope_cos.is_meta
    reference = dict(build_model(ModelConfig(preset="tiny"), seed=7).named_parameters())
    assert list(initial) == list(reference)
    for name in reversed(list(initial)):  # any order: each parameter has its own generator
        assert torch.equal(initial[name], reference[name]), name
    parts = ModelParts(skeleton, None, ParallelSettings(), loss_fn=lm_loss, device="cpu", init=initial)
    for name, p in parts.named_parameters():
        assert not p.is_meta and torch.equal(p, reference[name]), name
    assert torch.equal(parts.modules[0].rope_sin, build_model(ModelConfig(preset="tiny")).rope_sin)
    x, y = _batch()
    assert parts.train_step(x, y) == pytest.approx(lm_loss(build_model(ModelConfig(preset="tiny"), seed=7)(x), y).item())
    with pytest.raises(ValueError, match="needs init"):
        ModelParts(initial_model(cfg, seed=7)[0], None, ParallelSettings(), loss_fn=lm_loss, device="cpu")


def test_ranks_that_share_gpus_take_them_in_turn_over_gloo():
    # no GPU is touched: where each rank goes and which backend its island's groups take
    assert [pick_device("cuda", r).index for r in range(4)] == [0, 1, 2, 3], "one GPU per rank"
    assert [pick_device("cuda", r, gpus=2).index for r in range(4)] == [0, 1, 0, 1]
    assert [pick_device("cuda", r, gpus=1).index for r in range(3)] == [0, 0, 0]
    assert backend_for("cuda") == "nccl" and backend_for("cuda", shared_gpu=True) == "gloo"
    assert backend_for("cpu") == backend_for("cpu", shared_gpu=True) == "gloo"


def test_simulate_hands_an_island_only_the_gpus_its_ranks_take(tmp_path):
    from diloco.config.loader import load
    from diloco.launch.simulate import Cluster

    cfg = load(overrides={"model.preset": "tiny", "parallel.tp": 2, "parallel.gpus": 1,
                          "averaging.backend": "local", "logging.run_dir": str(tmp_path)})
    cluster = Cluster(cfg, 2)
    assert [cluster.island_size(i) for i in range(2)] == [2, 2]
    assert [cluster.island_gpus(i) for i in range(2)] == [1, 1]
    assert gpu_assignment([cluster.island_gpus(i) for i in range(2)], ["0", "1"], "cuda") == ["0", "1"]
