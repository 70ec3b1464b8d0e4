"""The outer step: its sign, FedAvg equivalence and Nesterov momentum."""

from __future__ import annotations

import torch

from diloco.data.batches import ShardedBatches
from diloco.data.corpus import load_corpus
from diloco.engine.island import Island
from diloco.model.inner import build_inner_optimizer
from diloco.model.transformer import build_model, lm_loss
from outer_optim import OuterOptimizer, checksum
from tests.conftest import tiny_config


def _island_losses(cfg) -> tuple[list[float], dict[str, torch.Tensor]]:
    island = Island(cfg)
    island.connect()
    losses = []
    for _ in range(cfg.diloco.outer_steps):
        for _ in range(cfg.diloco.inner_steps):
            losses.append(island.train_step())
        assert island.rounds.round().ok
    island.close()
    return losses, {n: p.detach().clone() for n, p in island.model.named_parameters()}


def _plain_adamw_losses(cfg) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(cfg.seed)
    corpus = load_corpus(cfg.data)
    batches = ShardedBatches(corpus.train, cfg.model.seq_len, cfg.inner.batch_size, 0, 1, cfg.seed)
    model = build_model(cfg.model, seed=cfg.seed)
    total = cfg.diloco.outer_steps * cfg.diloco.inner_steps
    opt, sched = build_inner_optimizer(model.named_parameters(), cfg.inner, total)
    losses = []
    for _ in range(total):
        x, y = batches.next_batch()
        loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.inner.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_one_island_with_fedavg_reproduces_plain_adamw(tmp_path):
    """Outer SGD with lr 1 and no momentum lands on θ_local: a sign error would show at once.

    θ_g − (θ_g − θ_l) equals θ_l up to one fp32 rounding where an entry crosses zero, hence 1e-6.
    """
    cfg = tiny_config(tmp_path, **{"diloco.outer_optimizer": "avg", "diloco.outer_steps": 4})
    diloco_losses, diloco_params = _island_losses(cfg)
    plain_losses, plain_params = _plain_adamw_losses(cfg)
    assert len(diloco_losses) == 20
    assert diloco_losses[:5] == plain_losses[:5]  # the first round is bit-identical
    torch.testing.assert_close(torch.tensor(diloco_losses), torch.tensor(plain_losses), rtol=1e-6, atol=0)
    for name, p in plain_params.items():
        torch.testing.assert_close(diloco_params[name], p, rtol=0, atol=1e-6)


def test_nesterov_outer_step_differs_from_fedavg_and_moves_towards_local(tmp_path):
    cfg = tiny_config(tmp_path, **{"diloco.outer_steps": 2})
    losses, params = _island_losses(cfg)
    _, plain = _plain_adamw_losses(cfg)
    assert losses[5] != _plain_adamw_losses(cfg)[0][5]  # rounds after the first start from a different θ
    assert any((params[n] - plain[n]).abs().max() > 1e-6 for n in plain)


def test_nesterov_matches_the_formula():
    """θ ← θ − lr·(Δ + μ·v) with v ← μ·v + Δ (PyTorch's Nesterov form), checked by hand."""
    theta = {"w": torch.tensor([1.0, -2.0])}
    opt = OuterOptimizer(theta, lr=0.7, momentum=0.9, nesterov=True)
    local = {"w": torch.tensor([0.5, -1.0])}
    d1 = opt.pseudo_gradient(local)
    assert torch.equal(d1["w"], torch.tensor([0.5, -1.0]))  # Δ = θ_global − θ_local
    opt.step(d1)
    v = d1["w"]
    expected = torch.tensor([1.0, -2.0]) - 0.7 * (d1["w"] + 0.9 * v)
    torch.testing.assert_close(opt.theta_global["w"].detach(), expected)
    d2 = {"w": torch.tensor([0.1, 0.1])}
    opt.step(d2)
    v2 = 0.9 * v + d2["w"]
    torch.testing.assert_close(opt.theta_global["w"].detach(), expected - 0.7 * (d2["w"] + 0.9 * v2))


def test_outer_state_round_trip():
    opt = OuterOptimizer({"w": torch.randn(3, 4)}, lr=0.7, momentum=0.9)
    opt.step({"w": torch.randn(3, 4)})
    other = OuterOptimizer({"w": torch.zeros(3, 4)}, lr=0.7, momentum=0.9)
    other.load_state_dict(opt.state_dict())
    assert checksum(opt.theta_global) == checksum(other.theta_global)
    d = {"w": torch.randn(3, 4)}
    opt.step(d)
    other.step(d)
    assert torch.equal(opt.theta_global["w"], other.theta_global["w"])


def test_a_step_that_would_overflow_theta_is_told_before_it_is_taken():
    opt = OuterOptimizer({"w": torch.tensor([1.0, -2.0])}, lr=1e38, momentum=0.9)
    assert opt.step_is_finite({"w": torch.tensor([0.1, 0.1])})
    assert not opt.step_is_finite({"w": torch.tensor([10.0, 0.1])})  # 1e38 * 19 overflows fp32
    opt.step({"w": torch.tensor([0.1, 0.1])})
    assert torch.isfinite(opt.theta_global["w"]).all()
    # the prediction agrees with taking the step, momentum included
    for d in (torch.tensor([0.5, 0.1]), torch.tensor([3.0, 0.1])):
        twin = OuterOptimizer({"w": torch.zeros(2)}, lr=1e38, momentum=0.9)
        twin.load_state_dict(opt.state_dict())
        twin.step({"w": d})
        assert opt.step_is_finite({"w": d}) == bool(torch.isfinite(twin.theta_global["w"]).all())


def test_the_overflow_check_takes_what_was_measured_after_a_commit_until_anything_writes_theta():
    """After a commit the magnitudes of θ_global and the momentum are measured beside training (two passes over θ
    off the next blocking round); any write since (a step, a download's copy, a checkpoint's load) leaves them
    unmeasured, and the check measures again: it never answers from a θ that is no longer there."""
    opt = OuterOptimizer({"w": torch.tensor([1.0, -2.0])}, lr=1e38, momentum=0.9)
    opt.step({"w": torch.tensor([0.1, 0.1])})
    opt.measure()
    assert set(opt._measured()) == {"w"}
    assert opt.step_is_finite({"w": torch.tensor([0.1, 0.1])})
    with torch.no_grad():
        opt.theta_global["w"].copy_(torch.tensor([3e38, 0.0]))  # as a download is installed
    assert opt._measured() == {}
    assert not opt.step_is_finite({"w": torch.tensor([1.0, 0.1])})  # from the old θ: 1 + 2e38, finite
    opt.measure()
    opt.step({"w": torch.zeros(2)})
    assert opt._measured() == {}
    opt.measure()
    opt.set_momentum_buffers([torch.tensor([1e30, 0.0])])
    assert opt._measured() == {}
