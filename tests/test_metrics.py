"""Metrics reach metrics.jsonl and an offline W&B run with the documented names."""

from __future__ import annotations

from diloco.metrics import METRIC_NAMES, read_metrics, resolve_wandb_mode
from diloco.trainer import Island
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
    cfg = tiny_config(tmp_path, **{"wandb.mode": "offline", "diloco.outer_steps": 2})
    summary = Island(cfg).run()
    records = read_metrics(tmp_path)
    seen = set().union(*records)
    expected = set(METRIC_NAMES)
    assert expected <= seen, expected - seen
    assert summary["eval_loss_end"] < summary["eval_loss_start"]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb")), "the offline run holds no data file"
