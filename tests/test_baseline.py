"""The synchronous data-parallel baseline: real gloo process groups in separate worker processes."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch

from diloco.data.batches import ShardedBatches
from diloco.data.corpus import load_corpus
from diloco.engine.island import Island
from diloco.engine.metrics import read_metrics
from diloco.engine.trainer import EVALUATION_KEYS, SUMMARY_KEYS
from diloco.launch.baseline import BaselineError, run_baseline
from diloco.model.inner import build_inner_optimizer
from diloco.model.transformer import build_model, lm_loss
from peers.wire.counters import ring_allreduce_bytes
from tests.conftest import tiny_config


def _baseline_pids() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "-x", r".*-m diloco\.baseline --config .*"], capture_output=True,
                         text=True).stdout
    return {int(x) for x in out.split()}


def _reference(cfg, workers: int, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, one model, a batch k × grad_accum as large: the concatenation of the k workers' micro-batches."""
    corpus = load_corpus(cfg.data)
    m = cfg.model
    shards = [ShardedBatches(corpus.train, m.seq_len, cfg.inner.batch_size, r, workers, cfg.seed)
              for r in range(workers)]
    model = build_model(m, seed=cfg.seed)
    params = [p for p in model.parameters()]
    opt, sched = build_inner_optimizer(model.named_parameters(), cfg.inner, steps)
    losses = []
    for _ in range(steps):
        xs, ys = zip(*(s.next_batch() for s in shards for _ in range(cfg.inner.grad_accum)))
        loss = lm_loss(model(torch.cat(xs)), torch.cat(ys))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.inner.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("accum", [1, 2])
def test_two_workers_match_one_worker_with_twice_the_batch(tmp_path, accum):
    """torch DDP, with the reduction in the last micro-batch only when accumulating."""
    before = _baseline_pids()
    cfg = tiny_config(tmp_path / "ddp", **{"diloco.inner_steps": 3, "diloco.outer_steps": 2,
                                           "inner.grad_clip": 0.5, "inner.grad_accum": accum})
    summary = run_baseline(cfg, 2, progress=False)
    steps = 6
    ref_losses, ref_params = _reference(cfg, 2, steps)

    assert summary["workers"] == 2 and summary["inner_step"] == steps
    assert len(summary["losses"]) == steps
    for got, want in zip(summary["losses"], ref_losses):
        assert abs(got - want) < 1e-5, (summary["losses"], ref_losses)
    params = torch.load(tmp_path / "ddp" / "params.pt", weights_only=True)
    worst = max((params[n] - t).abs().max().item() for n, t in ref_params.items())
    assert worst < 1e-5, worst

    # accounting: tokens over both workers, ring all-reduce bytes per step, curves every H steps
    numel = sum(t.numel() for t in ref_params.values())
    assert summary["bytes_per_step"] == ring_allreduce_bytes(4 * numel, 2) == 4 * numel
    assert "torch DDP" in summary["comm_method"] and 0 <= summary["comm_seconds"] < summary["wall_seconds"]
    assert summary["payload_bytes_sent"] == steps * summary["bytes_per_step"]
    # the kernel's count of this worker's connections: the payload plus headers and gloo's handshakes
    assert summary["payload_bytes_sent"] <= summary["bytes_sent"] <= 2 * summary["payload_bytes_sent"] + 10**6
    assert summary["tokens"] == steps * 2 * accum * cfg.inner.batch_size * cfg.model.seq_len
    assert summary["eval_loss_end"] < summary["eval_loss_start"]
    for key in ("eval_loss_start", "eval_loss_end", "bytes_sent", "compute_seconds", "comm_seconds",
                "wall_seconds"):
        assert math.isfinite(summary[key]), key
    assert json.loads((tmp_path / "ddp" / "summary.json").read_text())["theta_checksum"] == summary["theta_checksum"]
    evals = [r for r in read_metrics(tmp_path / "ddp") if "eval/loss" in r]
    assert [r["outer_step"] for r in evals] == [0, 1, 2]
    assert [r["tokens"] for r in evals] == [0, summary["tokens"] // 2, summary["tokens"]]
    assert all("compute_utilization" in r for r in evals[1:])
    assert _baseline_pids() <= before  # every worker process is gone


def test_failing_worker_stops_the_others(tmp_path):
    before = _baseline_pids()
    cfg = tiny_config(tmp_path / "bad", **{"diloco.inner_steps": 2, "diloco.outer_steps": 1})

    def wrap(cmd: list[str], rank: int) -> list[str]:
        # rank 1 gets a bogus config key and exits at once; rank 0 must not hang in the rendezvous
        return cmd + (["--model.no_such_key", "1"] if rank == 1 else [])

    with pytest.raises(BaselineError, match="worker 1 exited"):
        run_baseline(cfg, 2, wrap=wrap, progress=False, timeout_s=60)
    assert _baseline_pids() <= before


def test_hsdp_over_two_servers_of_two_matches_one_worker_with_four_times_the_batch(tmp_path):
    """``--parallel.dp 2`` makes the baseline HSDP: FSDP2 inside each server of 2 workers, the 2 servers'
    replicas all-reducing their shards' gradients, and only a shard's gradients crossing the servers' link."""
    cfg = tiny_config(tmp_path / "hsdp", **{"diloco.inner_steps": 2, "diloco.outer_steps": 2, "inner.grad_clip": 0.5,
                                            "inner.grad_accum": 2, "parallel.dp": 2})
    summary = run_baseline(cfg, 4, progress=False)
    steps = 4
    ref_losses, ref_params = _reference(cfg, 4, steps)
    for got, want in zip(summary["losses"], ref_losses, strict=True):
        assert abs(got - want) < 1e-5, (summary["losses"], ref_losses)
    params = torch.load(tmp_path / "hsdp" / "params.pt", weights_only=True)
    assert params.keys() == ref_params.keys()
    worst = max((params[n] - t).abs().max().item() for n, t in ref_params.items())
    assert worst < 1e-5, worst
    numel = sum(t.numel() for t in ref_params.values())
    assert summary["hsdp_shard"] == 2 and "HSDP" in summary["comm_method"]
    assert summary["bytes_per_step"] == ring_allreduce_bytes(4 * numel // 2, 2) == 2 * numel
    assert summary["eval_loss_end"] < summary["eval_loss_start"]

    with pytest.raises(BaselineError, match="servers of 2 workers, which 3 workers do not fill"):
        run_baseline(cfg, 3, progress=False)


def test_the_baseline_and_an_island_record_evaluations_and_summaries_alike(tmp_path):
    """Both trainers stand on one trainer core: their evaluations are the same records computed the same way
    (the same θ_0 on the same held-out batches gives the same first evaluation, in bits per byte too, its
    perplexity capped as a diverged run's would be), every later evaluation carries the round's progress alike, and
    their summaries hold the same keys besides their sync's own figures."""
    common = {"diloco.inner_steps": 2, "diloco.outer_steps": 2}
    base = run_baseline(tiny_config(tmp_path / "ddp", **common), 2, progress=False)
    island = Island(tiny_config(tmp_path / "island", **common)).run()
    evals = {run: [r for r in read_metrics(tmp_path / run) if "eval/loss" in r] for run in ("ddp", "island")}
    first = {run: records[0] for run, records in evals.items()}
    assert set(first["ddp"]) == set(first["island"]) == {*EVALUATION_KEYS, "time"}
    for key in ("eval/loss", "eval/perplexity", "eval/bits_per_byte"):
        assert first["ddp"][key] == pytest.approx(first["island"][key], rel=1e-6), key
    round_keys = {*EVALUATION_KEYS, "loss", "compute_utilization"}
    for run, records in evals.items():
        assert [r["outer_step"] for r in records] == [0, 1, 2], run
        for r in records:
            assert r["eval/perplexity"] == pytest.approx(math.exp(min(r["eval/loss"], 50)))
            assert r["eval/bits_per_byte"] == pytest.approx(r["eval/loss"] / math.log(2))  # a byte per token
        assert all(round_keys <= set(r) for r in records[1:]), run
    shared = set(SUMMARY_KEYS)
    assert set(base) - shared == {"workers", "bytes_per_step", "compute_seconds_per_rank", "comm_seconds_per_rank",
                                  "losses", "comm_method", "hsdp_shard", "launcher_wall_seconds"}
    assert set(island) - shared == {"behind_nat", "behind_nat_found_by_dial_back", "transport_relayed", "transport_forged",
                                     "out_of_sync"}
    assert base["eval_loss_start"] == pytest.approx(island["eval_loss_start"], rel=1e-6)


@pytest.mark.parametrize("spec", ["cuda", "auto"])
def test_a_gpu_worker_gets_its_own_gpu_by_index(tmp_path, monkeypatch, spec):
    """``torch.cuda.set_device`` refuses ``cuda`` without an index: worker 3 on a server of 2 GPUs takes GPU 1."""
    from diloco.launch.baseline import device_for

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = tiny_config(tmp_path, device=spec)
    assert device_for(cfg, 3) == torch.device("cuda", 1)
    assert device_for(cfg, 0) == torch.device("cuda", 0)
    assert device_for(tiny_config(tmp_path, device="cuda:1"), 0) == torch.device("cuda", 1)
