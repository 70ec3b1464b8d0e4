"""Metrics reach metrics.jsonl and an offline W&B run with the documented names."""

from __future__ import annotations

import json
import time

import pytest

from diloco.engine.island import Island
from diloco.engine.metrics import (
    METRIC_NAMES,
    MetricsLogger,
    read_metrics,
    resolve_wandb_mode,
)
from diloco.model.transformer import flops_per_token
from tests.conftest import tiny_config


def test_online_without_key_falls_back_to_offline(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_wandb_mode("online") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_wandb_mode("online") == "online"
    assert resolve_wandb_mode("disabled") == "disabled"


def test_island_logs_documented_metrics_to_jsonl_and_offline_wandb(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = tiny_config(tmp_path, **{"wandb.mode": "offline", "diloco.outer_steps": 3, "parallel.peak_tflops": 0.5,
                                   "logging.sample_every": 2})
    summary = Island(cfg).run()
    records = read_metrics(tmp_path)
    seen = set().union(*records)
    expected = set(METRIC_NAMES)
    assert expected <= seen, expected - seen
    for r in (r for r in records if "mfu" in r):  # per device: the island is one process here
        assert r["tokens_per_second_per_device"] == r["tokens_per_second"]
        assert r["mfu"] == pytest.approx(r["tokens_per_second"] * flops_per_token(cfg.model) / 0.5e12)
    assert summary["eval_loss_end"] < summary["eval_loss_start"]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb")), "the offline run holds no data file"
    # samples of fixed held-out prompts every --logging.sample_every rounds and after the last, in samples.jsonl
    # and as a W&B table
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["outer_step"] for s in samples] == [2, 2, 3, 3]
    assert samples[0]["prompt"] == samples[2]["prompt"] and all(s["continuation"] for s in samples)
    assert list(runs[0].glob("files/media/table/samples_*.table.json")), "no samples table in the W&B run"


def test_a_new_run_moves_earlier_records_aside_and_a_summary_is_strict_json(tmp_path):
    first = MetricsLogger(tmp_path)
    first.log({"loss": 1.0, "tokens": 1})
    first.close()
    resumed = MetricsLogger(tmp_path, resume=True)
    resumed.log({"loss": 0.5, "tokens": 2})
    resumed.close()
    assert [r["loss"] for r in read_metrics(tmp_path)] == [1.0, 0.5], "a resumed run appends"
    fresh = MetricsLogger(tmp_path)
    fresh.log({"loss": 3.0, "tokens": 1})
    fresh.summary({"eval_loss_start": float("nan"), "nested": [float("inf"), 1.0]})
    fresh.close()
    assert [r["loss"] for r in read_metrics(tmp_path)] == [3.0], "a new run starts its own records"
    earlier = list(tmp_path.glob("metrics.*.jsonl"))
    assert len(earlier) == 1 and len(earlier[0].read_text().splitlines()) == 2, "nothing is lost"
    summary = json.loads((tmp_path / "summary.json").read_text(), parse_constant=lambda c: pytest_fail(c))
    assert summary == {"eval_loss_start": None, "nested": [None, 1.0]}


def pytest_fail(constant: str):
    raise AssertionError(f"summary.json holds {constant}, which is not JSON")


def test_compute_seconds_count_every_evaluation_and_step(tmp_path, monkeypatch):
    """Evaluations are compute, the first one too (as in the baseline's accounting): the island's
    compute_seconds hold at least the time measured inside every step and every evaluation."""
    inside = {"seconds": 0.0, "evaluations": 0}
    evaluate, train_step = Island.evaluate, Island.train_step

    def slow_evaluate(self):
        t = time.perf_counter()
        time.sleep(0.3)  # so that leaving out one evaluation cannot hide in the slack of the others
        try:
            return evaluate(self)
        finally:
            inside["seconds"] += time.perf_counter() - t
            inside["evaluations"] += 1

    def timed_step(self):
        t = time.perf_counter()
        try:
            return train_step(self)
        finally:
            inside["seconds"] += time.perf_counter() - t

    monkeypatch.setattr(Island, "evaluate", slow_evaluate)
    monkeypatch.setattr(Island, "train_step", timed_step)
    summary = Island(tiny_config(tmp_path, **{"wandb.mode": "disabled", "diloco.outer_steps": 2})).run()
    assert inside["evaluations"] >= 2
    assert summary["compute_seconds"] >= inside["seconds"], (summary["compute_seconds"], inside)
    assert summary["compute_seconds"] <= summary["wall_seconds"]


def test_an_empty_wandb_mode_in_the_environment_counts_as_unset(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "")
    logger = MetricsLogger(tmp_path, wandb_mode="offline")
    logger.log({"loss": 1.0, "tokens": 1})
    logger.close()
    assert list((tmp_path / "wandb").glob("offline-run-*")), "no offline W&B run"
