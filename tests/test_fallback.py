"""The torch.distributed fallback: a hierarchical all-reduce equal to the hivemind path, and ``auto``.

Runs this file as a script in 3 gloo ranks (see tests/test_sharded.py): island A = ranks 0, 1 and
island B = rank 2 share one torch.distributed world *and* a hivemind DHT each.
"""

from __future__ import annotations

import sys
import time

import pytest
import torch

from pipeline.mesh import exit_worker
from tests.test_sharded import (
    BUCKET,
    FAST,
    PARAMS,
    WEIGHTS,
    Rank,
    check_no_leaks,
    expected_average,
    launch,
    load,
    local_delta,
    reassemble,
    save,
)

ISLANDS = [[0, 1], [2]]
pytestmark = pytest.mark.alone  # hivemind's group of two and the torch fallback's timeouts, side by side


def run_cases(out_dir: str) -> None:
    from peers.averaging.fallback import HierarchicalAllReduce
    from peers.averaging.sharded import ShardedAverager
    from peers.settings import AveragerSettings, Scope
    from peers.island.layout import CanonicalLayout

    t0 = time.monotonic()
    me = Rank()
    layout = CanonicalLayout.build(PARAMS, BUCKET)
    made = []

    def run(name: str, averager, rid: str, deltas=None, cfg: str = "cfg", retry: bool = False):
        deltas = deltas if deltas is not None else local_delta(me.island, me.island_rank, rid)
        result, averaged = averager.average(deltas, WEIGHTS[me.island], {"config_fingerprint": cfg}, rid)
        if retry and result.retryable:  # as the island engine does: a part lost under load goes round again
            print(f"rank {me.rank}: {name} retried: {result.reason}", flush=True)
            result, averaged = averager.average(deltas, WEIGHTS[me.island], {"config_fingerprint": cfg}, rid + ".retry")
        save(out_dir, name, me, result, averaged)
        print(f"rank {me.rank}: {name} after {time.monotonic() - t0:.1f} s: round {result.seconds:.1f} s, "
              f"ok={result.ok}, backend={result.backend!r}, {result.reason} {result.fallback_reason}", flush=True)

    try:
        deltas = local_delta(me.island, me.island_rank, "0")
        har = HierarchicalAllReduce(layout, deltas, me.specs, ISLANDS, min_group_size=2, timeout=me.timeout)
        group = har.island_group
        # time enough to meet on a loaded machine (two test workers on 2 cores); a group that forms is at once
        two = AveragerSettings(min_group_size=2, target_group_size=2, weighting="tokens",
                               **{**FAST, "matchmaking_timeout": 15.0})
        auto = ShardedAverager(layout, deltas, me.specs, group, me.dht, two, Scope(prefix="fb"), backend="auto",
                               fallback=har)
        made.append(auto)
        run("auto_hivemind", auto, "0", retry=True)  # hivemind works: auto takes it
        run("torch_direct", har, "0")
        torch_only = ShardedAverager(layout, deltas, me.specs, group, None, two, Scope(prefix="fb"), backend="torch",
                                     fallback=har)
        run("torch_backend", torch_only, "0")
        # a group formed and rejected the round (islands run different configs): never retried over torch
        run("veto", auto, "1", cfg=f"cfg-{me.island}")
        # an island with a NaN sits out with weight 0; alone, the other is below min_group_size
        bad = local_delta(me.island, me.island_rank, "2")
        if me.rank == 1:
            bad["wo"][0, 0] = float("nan")
        run("nan", har, "2", deltas=bad)
        # hivemind cannot form a group of 3 from 2 islands: auto falls back to torch for this round
        three = AveragerSettings(min_group_size=3, target_group_size=3, weighting="tokens",
                                 **{**FAST, "matchmaking_timeout": 3.0})
        auto3 = ShardedAverager(layout, deltas, me.specs, group, me.dht, three, Scope(prefix="fbthree"),
                                backend="auto", fallback=har)
        made.append(auto3)
        run("auto_torch", auto3, "3")
    finally:
        for avg in made:
            avg.shutdown()
        me.close(out_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fallback")
    launch(__file__, [], out, stand_in="lazy")  # collectives placed as on a CUDA island (tests/collective_audit.py)
    check_no_leaks(out)
    return out


def full_results(ranks: list[dict]) -> tuple[dict, dict]:
    a = reassemble([(r["specs"], r["averaged"]) for r in ranks[:2]])
    b = reassemble([(ranks[2]["specs"], ranks[2]["averaged"])])
    return a, b


def test_torch_fallback_equals_the_hivemind_path(runs):
    hivemind = load(runs, "auto_hivemind")
    expected = expected_average("0")
    for r in hivemind:
        assert r["ok"] and r["backend"] == "hivemind", r["reason"]
    ha, hb = full_results(hivemind)
    for case in ("torch_direct", "torch_backend"):
        ranks = load(runs, case)
        for r in ranks:
            assert r["ok"], r["reason"]
            assert r["backend"] == "torch" and r["group_size"] == 2 and r["total_weight"] == pytest.approx(4.0)
        ta, tb = full_results(ranks)
        for n, _ in PARAMS:
            torch.testing.assert_close(ta[n], expected[n], rtol=1e-5, atol=1e-6)
            assert (ta[n] - tb[n]).abs().max() == 0, n  # one all-reduce: bit-identical on every island
            assert (ta[n] - ha[n]).abs().max() <= 1e-6, n
            assert (hb[n] - tb[n]).abs().max() <= 1e-6, n
    # the slow-link traffic of the torch path is spread over island A's ranks too
    ranks = load(runs, "torch_direct")
    assert ranks[0]["bytes_sent"] > 0 and ranks[1]["bytes_sent"] > 0


def test_auto_falls_back_to_torch_when_hivemind_forms_no_group(runs):
    ranks = load(runs, "auto_torch")
    expected = expected_average("3")
    for r in ranks:
        assert r["ok"], r["reason"]
        assert r["backend"] == "torch"
        why = r["fallback_reason"]
        assert any(s in why for s in ("no roster came", "below", "could lead")), why
    a, b = full_results(ranks)
    for n, _ in PARAMS:
        torch.testing.assert_close(a[n], expected[n], rtol=1e-5, atol=1e-6)
        assert torch.equal(a[n], b[n])


def test_a_rejected_group_is_not_retried_over_torch(runs):
    for r in load(runs, "veto"):
        assert not r["ok"] and r["averaged"] is None
        assert r["backend"] == "" and r["fallback_reason"] == ""
        assert "different model or training configs" in r["reason"], r["reason"]


def test_an_island_with_nan_sits_out_and_the_round_fails_everywhere(runs):
    ranks = load(runs, "nan")
    for r in ranks:
        assert not r["ok"] and r["averaged"] is None
    assert all("not finite" in r["reason"] for r in ranks[:2])
    assert "below --averaging.min_group_size 2" in ranks[2]["reason"]


if __name__ == "__main__":
    run_cases(sys.argv[2])
    exit_worker(0)
