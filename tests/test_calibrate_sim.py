"""The calibration of the scale simulation (experiments.calibrate_sim), its logic alone: rounds are split at the
last inner step and charged the CPU sampled in between, the spread ignores an outlier round, and the messages the
model charges per island grow with the islands as the exchange and the vote do."""

from __future__ import annotations

import math
import statistics

from experiments.calibrate_sim import CpuTrace, model_messages, robust_sigma, round_cpu
from experiments.scale_sim import Settings


def test_rounds_are_split_at_the_last_inner_step() -> None:
    # CPU grows 1 s per wall second in the training process and 0.1 in its daemons
    trace = CpuTrace(times=[float(t) for t in range(40)], main=[float(t) for t in range(40)],
                     daemons=[0.1 * t for t in range(40)])
    records = [{"inner_step": 20, "time": 4.0}, {"round_ok": 1, "outer_step": 1, "time": 5.0},
               {"inner_step": 30, "time": 7.0}, {"inner_step": 40, "time": 10.0},
               {"round_ok": 1, "outer_step": 2, "time": 12.5},
               {"inner_step": 60, "time": 20.0}, {"round_ok": 1, "outer_step": 3, "time": 21.0}]
    rounds = round_cpu(records, trace, inner_steps=20)
    assert [r.round for r in rounds] == [2, 3]  # the first round has no start mark and is left out
    two = rounds[0]
    assert math.isclose(two.compute_main, 5.0) and math.isclose(two.compute_wall, 5.0)
    assert math.isclose(two.round_main, 2.5) and math.isclose(two.round_daemons, 0.25)


def test_spread_ignores_one_outlier() -> None:
    values = [1.0, 1.1, 0.9, 1.05, 0.95, 10.0]
    assert robust_sigma(values) < 0.2 < statistics.stdev(values)
    assert robust_sigma([3.0]) == 0.0


def test_model_messages_grow_with_the_islands() -> None:
    s = Settings(rounds=2, churn=0.0, rtt_ms="0.05", rate="20gbit", payload_mb=0.1, group_size=16)
    two, eight = model_messages(s, 2), model_messages(s, 8)
    assert two > 0 and eight > 3 * two  # the exchange and the vote reach every other member
