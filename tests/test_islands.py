"""Islands end to end: separate processes averaging over real hivemind on loopback."""

from __future__ import annotations

import torch

from diloco.simulate import simulate
from diloco.trainer import Island
from peers.dht import visible_maddrs
from tests.conftest import assert_joined, tiny_config


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


def test_late_joiner_downloads_global_state(tmp_path, no_leaked_daemons):
    common = {"averaging.backend": "hivemind", "averaging.state_download_timeout": 15.0,
              "averaging.run_key": "test-run-key"}
    first = Island(tiny_config(tmp_path / "a", **common))
    first.connect()
    try:
        # pretend the run has made progress: three outer steps with some pseudo-gradient
        for _ in range(3):
            first.outer.step([torch.randn_like(t) * 0.01 for t in first.outer.master.values()])
        first.outer_step = 3
        first.averager.set_state_priority(3)
        first.membership.announce(3, averaging=False)
        joiner_cfg = tiny_config(tmp_path / "b", **common,
                                 **{"averaging.initial_peers": visible_maddrs(first.dht)})
        joiner = Island(joiner_cfg)
        joiner.connect()
        try:
            assert_joined(joiner, first, outer_step=3)
        finally:
            joiner.close()
    finally:
        first.close()
