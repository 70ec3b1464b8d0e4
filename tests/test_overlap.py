"""Rounds in flight (delayed, eager) and Streaming DiLoCo fragments, against hand computations on one
island (a group of one: the average is the island's own Δ)."""

from __future__ import annotations

import pytest
import torch

from diloco.config import ConfigError
from diloco.data.batches import ShardedBatches
from diloco.data.corpus import load_corpus
from diloco.engine.island import Island
from diloco.model.inner import build_inner_optimizer
from diloco.model.transformer import build_model, lm_loss
from outer_optim import OuterOptimizer
from outer_optim.fragments import split_into_fragments
from peers.island.layout import CanonicalLayout
from tests.conftest import tiny_config


def _run(cfg) -> tuple[Island, dict[str, torch.Tensor]]:
    """Train one island through its real loop; returns it and θ_global."""
    island = Island(cfg)
    island.run()
    return island, {n: t.detach().clone() for n, t in island.outer.theta_global.items()}


class HandLoop:
    """The island's inner training replayed by hand: same data, same AdamW, same clipping."""

    def __init__(self, cfg):
        torch.manual_seed(cfg.seed)
        corpus = load_corpus(cfg.data)
        self.cfg = cfg
        self.batches = ShardedBatches(corpus.train, cfg.model.seq_len, cfg.inner.batch_size, 0, 1, cfg.seed)
        self.model = build_model(cfg.model, seed=cfg.seed)
        total = cfg.diloco.outer_steps * cfg.diloco.inner_steps
        self.opt, self.sched = build_inner_optimizer(self.model.named_parameters(), cfg.inner, total)
        self.params = dict(self.model.named_parameters())
        d = cfg.diloco
        self.outer = OuterOptimizer.from_config(self.params, d.outer_optimizer, d.outer_lr, d.outer_momentum)

    @torch.enable_grad()
    def step(self) -> None:
        x, y = self.batches.next_batch()
        lm_loss(self.model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.inner.grad_clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    def snapshot(self, names=None) -> dict[str, torch.Tensor]:
        return {n: self.params[n].detach().clone() for n in (names or self.params)}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=atol, msg=n)


def test_blocking_loop_equals_send_then_apply_by_hand(tmp_path):
    """``overlap none`` (τ=0, one fragment) is plain DiLoCo: θ_global ← Nesterov(θ_global, θ_global − θ_local)
    every H steps, the island restarting from θ_global."""
    cfg = tiny_config(tmp_path)
    _, theta = _run(cfg)
    hand = HandLoop(cfg)
    with torch.no_grad():
        for _ in range(cfg.diloco.outer_steps):
            for _ in range(cfg.diloco.inner_steps):
                hand.step()
            hand.outer.step(hand.outer.pseudo_gradient(hand.params))
            hand.outer.copy_to(hand.params)
    _close(theta, hand.outer.theta_global)


@pytest.mark.parametrize("mode, tau", [("delayed", 0), ("delayed", 2), ("eager", 2)])
def test_rounds_in_flight_equal_the_delayed_and_eager_updates_by_hand(tmp_path, mode, tau, arrives_on_time):
    """With one island every result arrives at once, so round r's Δ is applied after τ more inner steps,
    keeping the progress made since: θ_local ← θ_global' + (θ_local − θ_local at sending).  ``delayed``
    trains those steps from its own parameters; ``eager`` from θ_global stepped with its own whole Δ as a
    proxy for the average, which the true average then replaces."""
    cfg = tiny_config(tmp_path, **{"diloco.overlap": mode, "diloco.overlap_steps": tau})
    island, theta = _run(cfg)
    hand = HandLoop(cfg)
    H, rounds = cfg.diloco.inner_steps, cfg.diloco.outer_steps
    with torch.no_grad():
        for r in range(rounds):
            for _ in range(H - (tau if r else 0)):  # the τ steps after a send count towards the next round
                hand.step()
            delta = hand.outer.pseudo_gradient(hand.params)
            if r == rounds - 1:  # nothing left to train: the last round is applied at once
                hand.outer.step(delta)
                break
            if mode == "eager":
                for n, theta_proxy in hand.outer.peek(delta).items():
                    hand.params[n].copy_(theta_proxy)
            anchor = hand.snapshot()
            for _ in range(tau):
                hand.step()
            hand.outer.step(delta)
            for n, p in hand.params.items():
                p.add_(hand.outer.theta_global[n] - anchor[n])
    _close(theta, hand.outer.theta_global)
    assert island.stats.rounds_ok == rounds


def test_one_fragment_without_overlap_steps_is_plain_diloco(tmp_path):
    """Streaming with P=1, τ=0 and α=0 is the same run as the blocking default."""
    _, plain = _run(tiny_config(tmp_path / "plain"))
    _, streaming = _run(tiny_config(tmp_path / "streaming", **{"diloco.fragments": 1, "diloco.overlap_steps": 0}))
    _close(plain, streaming, atol=0)


def test_fragments_are_synced_in_turn_with_merge_alpha(tmp_path):
    """P=2, τ=1, α=0.5 by hand: every H/2 steps one fragment (whole blocks) is sent; one step later its
    θ_global takes the outer step and its parameters become α·θ_local + (1−α)·θ_global; the other
    fragment's θ_global and parameters are left alone."""
    over = {"diloco.fragments": 2, "diloco.overlap_steps": 1, "diloco.merge_alpha": 0.5,
            "diloco.inner_steps": 4, "diloco.outer_steps": 2}
    cfg = tiny_config(tmp_path, **over)
    island, theta = _run(cfg)
    hand = HandLoop(cfg)
    groups = split_into_fragments(list(hand.params), 2)
    total = cfg.diloco.outer_steps * 2
    with torch.no_grad():
        for r in range(total):
            for _ in range(2 - (1 if r else 0)):
                hand.step()
            names = groups[r % 2]
            delta = hand.outer.pseudo_gradient(hand.params, names)
            if r < total - 1:
                hand.step()
            hand.outer.step(delta)
            for n in names:
                hand.params[n].mul_(0.5).add_(0.5 * hand.outer.theta_global[n])
    _close(theta, hand.outer.theta_global)
    assert island.stats.rounds_ok == total
    # round 1 averaged fragment 0 and round 2 fragment 1: both appear in the metrics
    from diloco.engine.metrics import read_metrics
    assert [r["fragment"] for r in read_metrics(cfg.logging.run_dir) if "round_ok" in r] == [0, 1, 0, 1]


def test_fragments_are_whole_blocks_with_embeddings_first_and_output_last():
    names = ["tok_embeddings.weight"] + [f"layers.{i}.{k}" for i in range(4) for k in ("a", "b")] + \
            ["norm.weight", "output.weight"]
    groups = split_into_fragments(names, 3)
    assert groups[0][0] == "tok_embeddings.weight" and groups[-1][-2:] == ["norm.weight", "output.weight"]
    assert [n for g in groups for n in g] == names
    assert {n.split(".")[1] for n in groups[1] if n.startswith("layers")} == {"2"}
    with pytest.raises(ValueError, match="whole blocks"):
        split_into_fragments(names, 5)
    # buckets never straddle two fragments, so a fragment's round averages exactly its buckets
    layout = CanonicalLayout.build([(n, (3, 5)) for n in names], 7, groups)
    for g, group in enumerate(groups):
        covered = sum(layout.buckets[b].numel for b in layout.group_buckets(g))
        assert covered == 15 * len(group)


@pytest.mark.parametrize("override, words", [
    ({"diloco.overlap": "soon"}, "--diloco.overlap"),
    ({"diloco.fragments": 0}, "between 1 and --diloco.inner_steps"),
    ({"diloco.fragments": 5, "diloco.inner_steps": 5}, "layers"),
    ({"diloco.overlap_steps": 6}, "between 0 and H / fragments"),
    ({"diloco.merge_alpha": 1.0}, "[0, 1)"),
    ({"diloco.merge_alpha": 0.5, "diloco.overlap": "eager"}, "overlap none only"),
])
def test_bad_overlap_settings_say_what_to_change(tmp_path, override, words):
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        tiny_config(tmp_path, **override)


def test_fragments_that_do_not_divide_h_sync_at_rounded_steps(tmp_path):
    """P=3 fragments over H=5 steps: rounds after steps 2, 4 and 5 of every H (the multiples of H/P
    rounded up), each fragment once per H, and the run trains exactly outer_steps × H steps."""
    cfg = tiny_config(tmp_path, **{"model.n_layers": 3, "diloco.fragments": 3, "diloco.outer_steps": 2})
    island, _ = _run(cfg)
    from diloco.engine.metrics import read_metrics
    rounds = [r for r in read_metrics(cfg.logging.run_dir) if "round_ok" in r]
    assert [r["fragment"] for r in rounds] == [0, 1, 2, 0, 1, 2]
    assert island.stats.inner_step == 10 and island.stats.rounds_ok == 6


def test_an_island_that_adopts_a_state_sends_its_next_round_with_the_island_that_served_it(tmp_path):
    """An island 200 inner steps in adopts a state served 23 steps into the server's H = 50 cycle: its
    next round falls due 27 steps later, when the server's does, not H steps later (it would trail the
    run by 23 steps round after round); the phase survives a checkpoint."""
    island = Island(tiny_config(tmp_path, **{"diloco.inner_steps": 50, "diloco.outer_steps": 10}))
    ov = island.schedule
    island.stats.inner_step = 200
    ov.adopted(phase=23)

    def steps_to_next_round() -> int:
        for n in range(1, 200):
            island.stats.inner_step += 1
            if ov.sync_due():
                return n
        raise AssertionError("no round fell due")

    assert ov.phase() == 23
    assert steps_to_next_round() == 27 and ov.phase() == 0
    assert steps_to_next_round() == 50  # and every H steps from then on
    restored = Island(tiny_config(tmp_path / "b", **{"diloco.inner_steps": 50, "diloco.outer_steps": 10}))
    restored.schedule.load_state_dict(ov.state_dict())
    restored.stats.inner_step = island.stats.inner_step + 10
    assert restored.schedule.phase() == 10
    island.stats.inner_step = 300
    ov.adopted()  # no phase served (a peer of an older version): the island keeps its own schedule
    assert ov.phase() == 23 and steps_to_next_round() == 27


def test_a_budget_of_seconds_counts_from_when_the_group_formed(tmp_path):
    """An island that sent its round 4 s of compute before the group formed (it trained on meanwhile) sends
    its next one a budget of compute after the group formed, not after its own send: otherwise it would
    send that early again every round and wait as long, its rounds in flight staying stale."""
    island = Island(tiny_config(tmp_path, **{"diloco.sync_every": "10s", "diloco.overlap": "delayed"}))
    ov, stats = island.schedule, island.stats

    def due_at(compute: float) -> bool:
        island.stats.inner_step += 1
        stats.compute_seconds = compute
        return ov.sync_due()

    island.stats.inner_step, stats.compute_seconds = 20, 100.0
    ov.restart_budget()  # the island sends at 100 s of compute
    stats.compute_seconds = 106.0  # the result of the round sent at step 20 arrives and is applied
    ov.aligned(20, compute_at_formed=104.0)
    assert not due_at(112.0) and due_at(114.0)
    restored = Island(tiny_config(tmp_path / "b", **{"diloco.sync_every": "10s", "diloco.overlap": "delayed"}))
    restored.schedule.load_state_dict(ov.state_dict())
    assert restored.schedule.skew == 4.0
    ov.restart_budget()  # the next round is sent: it counts from its own group again
    assert ov.skew == 0.0
    ov.aligned(island.stats.inner_step, compute_at_formed=None)  # the group's last (or saw no stage): nothing to skip
    assert ov.skew == 0.0 and due_at(124.5)
