"""Data-, tensor- and pipeline-parallel islands (package ``pipeline``) on real gloo process groups.

The distributed checks run this file as a script in 2 or 4 subprocesses (one gloo group per
group of checks) and compare what the ranks report with a single-process reference trained in the
test process on the same data and seed: per-step losses, gradient norms, evaluation loss and the
final parameters (each rank's local shard against the matching slice of the reference).  With
``dp = 2`` each replica trains on its half of every batch (FSDP2 shards the parameters over the two),
which must equal one process on the whole batch, i.e. on the two halves accumulated.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from diloco.config import InnerOptimConfig, ModelConfig
from diloco.model.inner import (
    build_inner_optimizer,
    multiplies_bf16_natively,
    newton_schulz_dtype,
    orthogonalize,
)
from diloco.model.transformer import build_model, lm_loss
from outer_optim import OuterOptimizer
from pipeline.mesh import exit_worker
from pipeline.model_parts import ModelParts, check_split
from pipeline.pipeline_parallel import (
    build_stage_modules,
    check_schedule,
    model_layer_costs,
    stage_layer_split,
)
from pipeline.settings import ParallelSettings
from pipeline.shards import ShardSpec, shard_spec_of
from pipeline.tensor_parallel import check_tensor_parallel
from tests.conftest import launch_ranks

STEPS = 10
BATCH, SEQ = 8, 16
LR, CLIP = 1e-2, 0.5
EVAL_SEED = 99
PROC_TIMEOUT_S = 200


def tiny_model_config() -> ModelConfig:
    return ModelConfig(preset="tiny", dim=32, n_layers=4, n_heads=4, ffn_dim=64, seq_len=SEQ, vocab_size=256)


def batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    """``n`` batches of learnable sequences ``(a + b t) mod 256`` with random ``a`` and ``b`` in 1..8
    per row (inputs are ``[:, :-1]``, targets ``[:, 1:]``)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(SEQ + 1)
    out = []
    for _ in range(n):
        a = torch.randint(0, 256, (BATCH, 1), generator=g)
        b = torch.randint(1, 9, (BATCH, 1), generator=g)
        out.append((a + b * t) % 256)
    return out


def make_optimizer(named_params, kind: str = "adamw", split: bool = True) -> torch.optim.Optimizer:
    """AdamW, or the island's Muon (on the blocks' matrices, AdamW on the rest) at a constant learning rate."""
    if kind == "muon":  # fp32 products: bf16's rounding would turn a TP sum's last bits into visible differences
        cfg = InnerOptimConfig(optimizer="muon", lr=LR, weight_decay=0.1, warmup_steps=0, min_lr_ratio=1.0,
                               muon_split=split, muon_dtype="fp32")
        return build_inner_optimizer(list(named_params), cfg, STEPS)[0]
    return torch.optim.AdamW([p for _, p in named_params], lr=LR, weight_decay=0.1, betas=(0.9, 0.95),
                             foreach=True)


# --------------------------------------------------------------------------------- single process
def test_stage_layer_split_balances_uniform_layers():
    assert stage_layer_split([10] * 4, 2) == [[0, 1], [2, 3]]
    assert stage_layer_split([10] * 4, 4) == [[0], [1], [2], [3]]
    assert stage_layer_split([10] * 5, 1) == [[0, 1, 2, 3, 4]]
    # Uneven: the extra layer goes to a later stage.
    assert stage_layer_split([10] * 5, 2) == [[0, 1], [2, 3, 4]]


def test_stage_layer_split_counts_embedding_and_output():
    # A heavy embedding pushes layers off the first stage, a heavy output off the last.
    assert stage_layer_split([10] * 6, 2, first_cost=20) == [[0, 1], [2, 3, 4, 5]]
    assert stage_layer_split([10] * 6, 2, last_cost=20) == [[0, 1, 2, 3], [4, 5]]
    split = stage_layer_split([10] * 6, 3, first_cost=10, last_cost=10)
    assert [len(s) for s in split] in ([2, 2, 2], [1, 3, 2], [2, 3, 1])  # all cost at most 30 per stage
    # Heterogeneous layer costs: minimise the largest stage (3 and 11 rather than 12 and 2).
    assert stage_layer_split([1, 1, 1, 9, 1, 1], 2) == [[0, 1, 2], [3, 4, 5]]
    # Among the splits with the same largest stage, the most even one.
    assert stage_layer_split([5] * 12, 4, first_cost=1, last_cost=2) == [
        [0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


def test_stage_layer_split_explicit_and_errors():
    assert stage_layer_split([10] * 4, 2, [3, 1]) == [[0, 1, 2], [3]]
    with pytest.raises(ValueError, match="has only 4 layers"):
        stage_layer_split([10] * 4, 5)
    with pytest.raises(ValueError, match="sums to 3"):
        stage_layer_split([10] * 4, 2, [2, 1])
    with pytest.raises(ValueError, match="lists 3 stages"):
        stage_layer_split([10] * 4, 2, [2, 1, 1])
    with pytest.raises(ValueError, match="at least one layer"):
        stage_layer_split([10] * 4, 2, [4, 0])


def test_stage_layer_split_on_the_model_balances_parameters():
    model = build_model(tiny_model_config())
    costs, first, last = model_layer_costs(model)
    assert len(costs) == 4 and first == 256 * 32 and last == 32 + 256 * 32
    assert sum(costs) + first + last == sum(p.numel() for p in model.parameters())
    assert [len(s) for s in stage_layer_split(costs, 2, None, first, last)] == [2, 2]


def test_tensor_parallel_divisibility_errors():
    assert check_tensor_parallel(4, 32, 64, 256, 2) == []
    assert check_tensor_parallel(6, 48, 64, 256, 4) == ["--model.n_heads (6) must be divisible by --parallel.tp (4)"]
    problems = check_tensor_parallel(4, 32, 66, 250, 4)
    assert "--model.ffn_dim (66) must be divisible by --parallel.tp (4)" in problems
    assert "--model.vocab_size (250) must be divisible by --parallel.tp (4)" in problems
    assert check_tensor_parallel(4, 32, 64, 256, 0) == ["--parallel.tp must be at least 1, got 0"]


def test_island_settings_errors():
    ok = dict(n_layers=4, n_heads=4, dim=32, ffn_dim=64, vocab_size=256)
    assert check_split(ParallelSettings(tp=2, pp=2, microbatches=4), **ok) == []
    assert check_split(ParallelSettings(pp=5, microbatches=8), **ok) == [
        "--parallel.pp (5) must not exceed --model.n_layers (4)"]
    assert check_split(ParallelSettings(pp=2, schedule="interleaved-1f1b", virtual_stages=3, microbatches=4), **ok) == [
        "--parallel.pp * --parallel.virtual_stages (6) must not exceed --model.n_layers (4) for interleaved-1f1b"]
    # virtual_stages only matters for the interleaved schedule.
    assert check_split(ParallelSettings(pp=2, schedule="1f1b", virtual_stages=3, microbatches=4), **ok) == []
    assert check_split(ParallelSettings(pp=4, schedule="1f1b", microbatches=2), **ok) == [
        "the 1f1b schedule needs --parallel.microbatches (2) to be at least --parallel.pp (4)"]
    assert check_split(ParallelSettings(pp=2, schedule="zb"), **ok)[0].startswith("--parallel.schedule is 'zb'")
    assert check_schedule("interleaved-1f1b", 4, 10) == []
    assert check_split(ParallelSettings(tp=3), **ok) == [
        "--model.n_heads (4) must be divisible by --parallel.tp (3)",
        "--model.ffn_dim (64) must be divisible by --parallel.tp (3)",
        "--model.vocab_size (256) must be divisible by --parallel.tp (3)"]
    with pytest.raises(ValueError, match="the mesh is dp=1 x pp=1 x tp=1"):
        ModelParts(build_model(tiny_model_config()), None, ParallelSettings(tp=2))


def test_the_trainer_config_section_is_the_island_settings():
    """One definition: ``--parallel.*`` is :class:`ParallelSettings` itself, read from the command line."""
    from diloco.config import ParallelConfig
    from diloco.config.loader import load

    assert ParallelConfig is ParallelSettings
    cfg = load(None, ["--parallel.tp", "2", "--parallel.pp", "2", "--parallel.schedule", "interleaved-1f1b",
                      "--parallel.microbatches", "8", "--parallel.layers_per_stage", "1,1,1,1",
                      "--model.n_layers", "4", "--model.preset", "tiny"]).parallel
    assert cfg == ParallelSettings(tp=2, pp=2, schedule="interleaved-1f1b", microbatches=8, virtual_stages=2,
                                   layers_per_stage=[1, 1, 1, 1])
    assert cfg.local_stages == 2
    assert ParallelSettings().local_stages == 1  # 1f1b ignores virtual_stages


def test_build_stage_modules_keeps_names_and_copies_only_owned_parts():
    model = build_model(tiny_model_config())
    full = dict(model.named_parameters())
    seen: dict[str, torch.Tensor] = {}
    for rank in range(2):
        for stage, module in build_stage_modules(model, rank, 2, virtual_stages=2):
            assert stage in (rank, rank + 2)
            assert list(module.layers.keys()) == [str(stage)]
            assert (module.tok_embeddings is not None) == (stage == 0)
            assert (module.norm is not None) == (module.output is not None) == (stage == 3)
            for name, p in module.named_parameters():
                assert name not in seen
                assert p.data_ptr() != full[name].data_ptr()
                torch.testing.assert_close(p, full[name], rtol=0, atol=0)
                seen[name] = p
    assert set(seen) == set(full)
    assert len(model.layers) == 4 and model.output is not None  # the original is untouched


def test_stages_compose_to_the_full_model():
    model = build_model(tiny_model_config())
    x = batches(1)[0][:, :-1]
    h = x
    for _, module in sorted((s for r in range(2) for s in build_stage_modules(model, r, 2, 1, [1, 3])),
                            key=lambda s: s[0]):
        h = module(h)
    torch.testing.assert_close(h, model(x))


def test_island_rank_layout_puts_tp_innermost():
    from pipeline.mesh import island_coords, island_ranks

    assert island_ranks(tp=2, pp=3) == [[0, 1], [2, 3], [4, 5]]
    assert [island_coords(r, tp=2, pp=3) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    with pytest.raises(ValueError, match="outside an island"):
        island_coords(6, tp=2, pp=3)


def test_shard_spec_of_plain_tensor_is_the_whole_tensor():
    spec = shard_spec_of(torch.zeros(6, 4))
    assert spec == ShardSpec((6, 4), 0, 0, 6, True)
    assert spec.local_shape == (6, 4)
    full = torch.arange(24.0).view(6, 4)
    assert ShardSpec((6, 4), 1, 2, 2, False).slice_of(full).tolist() == full[:, 2:4].tolist()


def test_single_process_island_matches_plain_training():
    cfg = tiny_model_config()
    ref = build_model(cfg)
    island = ModelParts(build_model(cfg), None, ParallelSettings(activation_checkpointing=True))
    opt, ref_opt = make_optimizer(island.named_parameters()), make_optimizer(ref.named_parameters())
    for x in batches(3):
        loss = island.train_step(x[:, :-1], x[:, 1:])
        norm = island.clip_grad_norm_(CLIP)
        opt.step()
        island.zero_grad()
        ref_loss = lm_loss(ref(x[:, :-1]), x[:, 1:])
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss == pytest.approx(ref_loss.item(), rel=1e-6)
        assert norm == pytest.approx(ref_norm.item(), rel=1e-5)
    for name, p in island.local_named_parameters().items():
        torch.testing.assert_close(p, dict(ref.named_parameters())[name].detach())


def test_muon_takes_the_blocks_matrices_and_orthogonalises_their_update():
    """Muon steps the blocks' 2-D weights with an orthogonalised update (singular values near 1, whatever the
    gradient's scale) and AdamW the rest; it trains the tiny model, along another path than AdamW."""
    g = torch.randn(24, 64, generator=torch.Generator().manual_seed(0)) * 1e3
    singular = torch.linalg.svdvals(orthogonalize(g))
    assert 0.5 < singular.min() and singular.max() < 1.5, singular
    assert orthogonalize(g.T).shape == (64, 24)
    # bf16 products (the paper's; `auto` takes them where the device multiplies bf16 natively) land on the same
    # matrix as fp32's, to bf16's precision, and hand back the input's dtype
    fp32, bf16 = orthogonalize(g, precision="fp32"), orthogonalize(g, precision="bf16")
    assert bf16.dtype == torch.float32 and 0 < (bf16 - fp32).abs().max() < 0.05
    assert newton_schulz_dtype("auto", "cuda") == torch.bfloat16 and newton_schulz_dtype("fp32", "cuda") == torch.float32
    assert newton_schulz_dtype("auto", "cpu") == (torch.bfloat16 if multiplies_bf16_natively("cpu") else torch.float32)
    model = build_model(tiny_model_config())
    opt = make_optimizer(model.named_parameters(), "muon")
    muon = {id(p) for group in opt.param_groups if group["muon"] for p in group["params"]}
    taken = sorted(n for n, p in model.named_parameters() if id(p) in muon)
    assert taken == sorted(n for n, p in model.named_parameters() if p.dim() == 2 and n.startswith("layers."))
    assert len(taken) == 7 * 4  # wq wk wv wo w1 w2 w3 of each block; not the embeddings, the head or the norms
    muon_run, adamw_run = reference_run("muon"), reference_run("adamw")
    assert muon_run["losses"][-1] < muon_run["losses"][0] - 0.2
    assert abs(muon_run["losses"][-1] - adamw_run["losses"][-1]) > 1e-3


# ----------------------------------------------------------------------------- distributed checks
# host_staged: the stages send and receive through host memory, as on ranks that share a GPU (gloo cannot send a
# GPU's tensors point to point): TP's DTensors between stages, and one such group per data-parallel replica
CASES_4 = [  # tp=2 x pp=2, one case per schedule (4 layers: interleaved runs 4 one-layer stages)
    dict(name="tp2-pp2-gpipe", tp=2, pp=2, schedule="gpipe", microbatches=4, host_staged=True),
    dict(name="tp2-pp2-1f1b", tp=2, pp=2, schedule="1f1b", microbatches=4, activation_checkpointing=True),
    dict(name="tp2-pp2-interleaved-1f1b", tp=2, pp=2, schedule="interleaved-1f1b", microbatches=4,
         virtual_stages=2),
    dict(name="dp2-tp2", dp=2, tp=2, pp=1, schedule="1f1b", microbatches=1),
    dict(name="dp2-pp2", dp=2, tp=1, pp=2, schedule="1f1b", microbatches=2, host_staged=True),
    # Muon orthogonalises whole matrices: gathered from FSDP's and TP's shards of one parameter at once, each
    # by one of the 4 ranks in turn
    dict(name="dp2-tp2-muon", dp=2, tp=2, pp=1, schedule="1f1b", microbatches=1, optimizer="muon"),
]
CASES_2 = [
    dict(name="dp2", dp=2, tp=1, pp=1, schedule="1f1b", microbatches=1, activation_checkpointing=True),
    dict(name="tp2-muon", tp=2, pp=1, schedule="1f1b", microbatches=1, optimizer="muon"),
    dict(name="tp2-muon-unsplit", tp=2, pp=1, schedule="1f1b", microbatches=1, optimizer="muon", muon_split=False),
    dict(name="dp2-bf16", dp=2, tp=1, pp=1, schedule="1f1b", microbatches=1, param_dtype="bf16"),
    dict(name="tp2", tp=2, pp=1, schedule="1f1b", microbatches=1, activation_checkpointing=True),
    dict(name="pp2-1f1b", tp=1, pp=2, schedule="1f1b", microbatches=2, layers_per_stage=[3, 1]),
    dict(name="pp2-interleaved-1f1b", tp=1, pp=2, schedule="interleaved-1f1b", microbatches=2, virtual_stages=2),
]


def _run_case(case: dict, out_dir: Path, rank: int) -> None:
    """Train one island for STEPS steps and save what this rank sees."""
    from pipeline.mesh import init_island_mesh

    settings = ParallelSettings(**{k: v for k, v in case.items()
                                   if k not in ("name", "optimizer", "muon_split", "host_staged")})
    mesh = init_island_mesh(settings.tp, settings.pp, "cpu", timeout_s=60, dp=settings.dp)
    island = ModelParts(build_model(tiny_model_config()), mesh, settings, host_staged=case.get("host_staged"))
    result = {"stage_group": type(island.stages[0].group).__name__ if island.stages else None}
    opt = make_optimizer(island.named_parameters(), case.get("optimizer", "adamw"), case.get("muon_split", True))
    losses, norms = [], []

    def mine(x: torch.Tensor) -> torch.Tensor:  # this data-parallel replica's rows
        return x.chunk(settings.dp)[island.dp_rank]

    outer = OuterOptimizer(island.local_named_parameters())
    for x in map(mine, batches(STEPS)):
        losses.append(island.train_step(x[:, :-1], x[:, 1:]))
        norms.append(island.clip_grad_norm_(CLIP))
        dtypes = sorted({str(t.dtype) for p in island.parameters() for t in (p, p.grad)})
        opt.step()
        island.zero_grad()
    trained = {k: v.clone() for k, v in island.local_named_parameters().items()}
    moved = max(float(d.abs().max()) for d in outer.pseudo_gradient(island.local_named_parameters()).values())
    outer.copy_to(island.local_named_parameters())  # θ_global back into the (fp32 master) shards: exactly
    back = max(float(d.abs().max()) for d in outer.pseudo_gradient(island.local_named_parameters()).values())
    for k, v in island.local_named_parameters().items():
        v.copy_(trained[k])
    ev = batches(1, EVAL_SEED)[0]
    # Evaluation may use another batch size than training; training works again afterwards.
    eval_loss = island.eval_loss(ev[:4, :-1], ev[:4, 1:])
    after_eval = island.train_step(mine(ev)[:, :-1], mine(ev)[:, 1:])
    island.zero_grad()
    full = island.full_parameters()  # collective: every rank gets the whole model
    result.update(losses=losses, norms=norms, eval_loss=eval_loss, after_eval=after_eval, dtypes=dtypes,
                  round_trip=(moved, back), orthogonalized=getattr(opt, "orthogonalized", None),
                  local={k: v.clone() for k, v in island.local_named_parameters().items()},
                  specs=island.shard_specs(), full=full if rank == 0 else None)
    # Writing through local_named_parameters updates the model; load_full_parameters restores it.
    saved = {k: v.clone() for k, v in island.local_named_parameters().items()}
    for v in island.local_named_parameters().values():
        v.zero_()
    result["zeroed"] = all(float(_local(p).abs().sum()) == 0 for p in island.parameters())
    island.load_full_parameters(full)
    result["restored"] = all(torch.equal(saved[k], v) for k, v in island.local_named_parameters().items())
    if settings.pp > 1:  # batches the pipeline cannot run are refused on every rank alike
        for key, rows in (("microbatch_error", 3), ("shape_error", BATCH // settings.dp // 2)):
            try:
                island.train_step(ev[:rows, :-1], ev[:rows, 1:])
                result[key] = None
            except ValueError as e:
                result[key] = str(e)
    torch.save(result, out_dir / f"{case['name']}-rank{rank}.pt")


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (p.to_local() if isinstance(p, DTensor) else p).detach()


def _worker(cases: list[dict], out_dir: str) -> None:
    """Entry point of one rank (this file run as a script)."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    try:
        for case in cases:
            _run_case(case, Path(out_dir), rank)
    finally:
        from pipeline.mesh import destroy_island

        destroy_island()


def launch(cases: list[dict], world: int, out_dir: Path) -> None:
    """Run ``cases`` on a fresh gloo group of ``world`` ranks (this file run as a script)."""
    launch_ranks(__file__, [json.dumps(cases), str(out_dir)], world, out_dir, PROC_TIMEOUT_S)


def reference_run(kind: str) -> dict:
    """The single-process run every island stepping with the optimizer ``kind`` must reproduce."""
    torch.set_num_threads(1)
    model = build_model(tiny_model_config())
    opt = make_optimizer(model.named_parameters(), kind)
    losses, norms = [], []
    for x in batches(STEPS):
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    ev = batches(1, EVAL_SEED)[0]
    with torch.no_grad():
        eval_loss = lm_loss(model(ev[:4, :-1]), ev[:4, 1:]).item()
        full_batch_loss = lm_loss(model(ev[:, :-1]), ev[:, 1:]).item()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return dict(losses=losses, norms=norms, eval_loss=eval_loss, full_batch_loss=full_batch_loss, params=params,
                orthogonalized=getattr(opt, "orthogonalized", None))


@pytest.fixture(scope="module")
def reference() -> dict[str, dict]:
    return {kind: reference_run(kind) for kind in ("adamw", "muon")}


@pytest.fixture(scope="module")
def results_4(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("island4")
    launch(CASES_4, 4, out)
    return out


@pytest.fixture(scope="module")
def results_2(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("island2")
    launch(CASES_2, 2, out)
    return out


def check_case(case: dict, world: int, out: Path, references: dict[str, dict]) -> None:
    ref = references[case.get("optimizer", "adamw")]
    seen: dict[str, list[ShardSpec]] = {}
    counts = []
    for rank in range(world):
        r = torch.load(out / f"{case['name']}-rank{rank}.pt", weights_only=False)
        counts.append(r["orthogonalized"])
        for step, (got, want) in enumerate(zip(r["losses"], ref["losses"], strict=True)):
            assert got == pytest.approx(want, rel=1e-4), f"{case['name']} rank {rank} step {step} loss"
        for step, (got, want) in enumerate(zip(r["norms"], ref["norms"], strict=True)):
            assert got == pytest.approx(want, rel=1e-3), f"{case['name']} rank {rank} step {step} grad norm"
        assert r["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-4)
        assert r["after_eval"] == pytest.approx(ref["full_batch_loss"], rel=1e-4)
        for name, local in r["local"].items():
            spec = r["specs"][name]
            assert tuple(spec.full_shape) == tuple(ref["params"][name].shape)
            assert tuple(local.shape) == spec.local_shape
            torch.testing.assert_close(local, spec.slice_of(ref["params"][name]), rtol=1e-3, atol=1e-4,
                                       msg=lambda m, n=name: f"{case['name']} rank {rank} {n}: {m}")
            seen.setdefault(name, []).append(spec)
        if r["full"] is not None:
            assert set(r["full"]) == set(ref["params"])
            for name, p in r["full"].items():
                torch.testing.assert_close(p, ref["params"][name], rtol=1e-3, atol=1e-4)
        assert r["zeroed"] and r["restored"]
        assert r["stage_group"] == ("HostStagedGroup" if case.get("host_staged") else
                                    "ProcessGroup" if case["pp"] > 1 else None)
        if case["pp"] > 1:
            assert r["microbatch_error"] == ("the batch of 3 sequences does not split into "
                                             f"--parallel.microbatches ({case['microbatches']}) equal micro-batches")
            rows = BATCH // case.get("dp", 1)
            assert r["shape_error"] == (f"pipeline training batches must keep the shape of the first one ({rows}, 16), "
                                        f"got ({rows // 2}, 16)")
    # The shards of every parameter tile it exactly once; a TP-replicated one (a norm weight) is held alike by
    # the tp ranks of one data-parallel replica, whole without FSDP, halved over dp with it.
    assert set(seen) == set(ref["params"])
    if case.get("optimizer") == "muon":  # the same update, whoever made it: split, each matrix made by one rank
        assert ref["orthogonalized"] > 0
        if case.get("muon_split", True):
            assert sum(counts) == ref["orthogonalized"] and max(counts) < ref["orthogonalized"], counts
        else:
            assert counts == [ref["orthogonalized"]] * world, counts
    dp, tp = case.get("dp", 1), case["tp"]
    for name, specs in seen.items():
        pieces = sorted({(s.dim, s.offset, s.length) for s in specs})
        assert len({dim for dim, _, _ in pieces}) == 1, f"{name}: pieces on several dims {pieces}"
        assert [(o, o + n) for _, o, n in pieces] == [(i * pieces[0][2], (i + 1) * pieces[0][2])
                                                      for i in range(len(pieces))], name
        assert pieces[-1][1] + pieces[-1][2] == specs[0].full_shape[specs[0].dim], name
        if specs[0].replicated:
            assert all(s.replicated for s in specs) and len(pieces) == dp and len(specs) == tp * dp
        else:
            assert len(pieces) == len(specs) == dp * tp


def test_dp2_bf16_gathers_bf16_over_fp32_shards_that_round_trip_exactly(results_2, reference):
    """FSDP's mixed precision: blocks compute on bf16 copies gathered from fp32 shards, the gradients are reduced
    and kept in fp32, and θ_global written back into the shards reads back bit for bit (Δ = 0)."""
    for rank in range(2):
        r = torch.load(results_2 / f"dp2-bf16-rank{rank}.pt", weights_only=False)
        assert r["dtypes"] == ["torch.float32"]
        moved, back = r["round_trip"]
        assert moved > 1e-3 and back == 0.0
        for got, want in zip(r["losses"], reference["adamw"]["losses"], strict=True):
            assert got == pytest.approx(want, rel=0.02)  # bf16 matrix products: close, not equal
        assert r["losses"] != pytest.approx(reference["adamw"]["losses"], rel=1e-6)


@pytest.mark.parametrize("case", CASES_4, ids=[c["name"] for c in CASES_4])
def test_tp2_pp2_island_trains_like_one_process(case, results_4, reference):
    check_case(case, 4, results_4, reference)


@pytest.mark.parametrize("case", [c for c in CASES_2 if "param_dtype" not in c], ids=lambda c: c["name"])
def test_tp_or_pp_island_trains_like_one_process(case, results_2, reference):
    check_case(case, 2, results_2, reference)


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]), sys.argv[2])
    exit_worker(0)
