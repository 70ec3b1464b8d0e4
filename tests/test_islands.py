"""Islands end to end: separate processes averaging over real hivemind on loopback."""

from __future__ import annotations

from diloco.simulate import simulate
from tests.conftest import tiny_config


def test_three_islands_train_and_end_in_sync(tmp_path, no_leaked_daemons):
    cfg = tiny_config(tmp_path, **{
        "averaging.backend": "hivemind", "averaging.min_group_size": 2,
        "averaging.request_timeout": 1.0, "averaging.matchmaking_timeout": 60.0,
        "averaging.matchmaking_time": 5.0, "diloco.outer_steps": 3,
        "diloco.inner_steps": 8, "checkpoint.every": 0})
    result = simulate(cfg, 3)
    islands = result["islands"]
    assert len(islands) == 3
    for s in islands:
        assert s["rounds_ok"] == 3 and s["rounds_failed"] == 0, s["failures"]
        assert s["eval_loss_end"] < s["eval_loss_start"] - 0.5
        assert s["bytes_sent"] > 0
    assert result["theta_global_max_abs_diff"] < 1e-5
    # all islands evaluate the same θ_global on the same held-out batches
    assert len({round(s["eval_loss_end"], 6) for s in islands}) == 1  # evaluated on the same θ_global
