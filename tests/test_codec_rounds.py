"""Low-bit codecs over real hivemind on loopback: encoded buckets all-gathered over the p2p daemon,
identical averages on every member, error feedback kept only by committed rounds, and islands end
to end per codec."""

from __future__ import annotations

import threading

import pytest
import torch

from diloco.config import DilocoConfig
from diloco.engine.metrics import RunStats, read_metrics
from diloco.engine.round import RoundSchedule
from diloco.launch.simulate import simulate
from diloco.model.checkpoint import list_checkpoints, load
from outer_optim.compression import ErrorFeedback, make_codec
from peers.aggregation import weighted_mean
from peers.averaging.sharded import ShardedAverager
from peers.discovery.dht import start_dht, visible_maddrs
from peers.group.averager import VerifiedAverager
from peers.result import RoundResult
from peers.settings import AveragerSettings, NetworkSettings, Scope
from peers.island.layout import CanonicalLayout
from peers.wire.encoded import part_bounds
from tests.conftest import tiny_config

FAST = dict(matchmaking_time=1.5, request_timeout=0.5, matchmaking_timeout=8.0, vote_timeout=4.0,
            allreduce_timeout=15.0, next_chunk_timeout=5.0, state_download_timeout=10.0)
NUMEL = 10_000


@pytest.fixture
def dhts(no_leaked_daemons):
    """A factory of n connected DHTs (and whatever the test registers for shutdown)."""
    made: list = []

    def make(n: int) -> list:
        first = start_dht(NetworkSettings())
        out = [first] + [start_dht(NetworkSettings(initial_peers=visible_maddrs(first))) for _ in range(n - 1)]
        made.extend(out)
        return out

    yield make, made
    for obj in reversed(made):
        obj.shutdown()


def _together(calls) -> list:
    """Run the callables at once (one thread each) and return their results in order."""
    out = [None] * len(calls)

    def go(i):
        out[i] = calls[i]()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("compression", ["int8", "int4", "sign", "topk"])
def test_members_decode_the_same_average_of_what_each_sent(dhts, compression):
    """3 members: top-k all-gathers (each sends its payload to the 2 others); the dense codecs
    reduce-scatter (each sends 2 of 3 parts, then its averaged part to 2: about 4/3 of a payload, not 2),
    re-encoding each averaged part once at its owner.  Every member ends with the same bits."""
    make, made = dhts
    settings = AveragerSettings(compression=compression, target_group_size=3, weighting="tokens", **FAST)
    avgs = [VerifiedAverager(d, [torch.zeros(NUMEL)], settings, Scope(prefix="c")) for d in make(3)]
    made.extend(avgs)
    # entropy coding (on by default) runs for the codecs whose bytes it shrinks, and only for them
    assert all(a._parts.entropy_coding == (compression in ("int8", "int4")) for a in avgs)
    codec = make_codec(compression)
    deltas = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    payloads = [codec.encode(d) for d in deltas]
    weights = [1.0, 2.0, 5.0]
    results = _together([lambda i=i: avgs[i].average([deltas[i]], weights[i], {"config_fingerprint": "x"}, "0",
                                                     encoded=payloads[i]) for i in range(3)])
    by_peer = {a.peer_id: (codec.decode(p, NUMEL), w) for a, p, w in zip(avgs, payloads, weights)}
    decoded = weighted_mean({p: v for p, (v, _) in by_peer.items()}, {p: w for p, (_, w) in by_peer.items()})
    for result, _ in results:
        assert result.ok, result.reason
    averages = [averaged[0] for _, averaged in results]
    assert all(torch.equal(a, averages[0]) for a in averages)  # bit-identical on every member
    if compression == "topk":  # what went on the wire: the payload to each of 2, not entropy-coded (it would
        assert torch.equal(averages[0], decoded)  # hardly shrink)
        assert [r.bytes_sent for r, _ in results] == [2 * len(p) for p in payloads]
    elif compression == "sign":  # the owner's second quantization keeps the sign of every averaged value
        assert torch.equal(averages[0] >= 0, decoded >= 0)
        assert all(1.2 * codec.nbytes(NUMEL) < r.bytes_sent < 1.45 * codec.nbytes(NUMEL) for r, _ in results)
    else:  # the owner's second quantization of the averaged part: within half a step of its block scale
        step = decoded.abs().max() / codec.qmax
        assert (averages[0] - decoded).abs().max() <= step
        # entropy coding takes the 4/3 of a payload below what the codec counts
        assert all(codec.nbytes(NUMEL) < r.bytes_sent < 4 / 3 * codec.nbytes(NUMEL) for r, _ in results)
    exact = sum(w * d for w, d in zip(weights, deltas)) / sum(weights)
    assert (averages[0] - exact).norm() < exact.norm()  # the codec kept the bulk of it


@pytest.mark.parametrize("group", [3, 2])
def test_owners_carry_what_re_encoding_the_average_dropped(dhts, group):
    """Owner feedback: in a reduce-scatter (3 members) each owner adds its carry to the average of its part
    before encoding it and keeps what that encoding dropped, on its part only, so that nothing is lost:
    applied average + the new carries == the exact average of what was sent + the old carries.  An
    all-gather (2 members) re-encodes nothing and hands each carry back untouched."""
    make, made = dhts
    settings = AveragerSettings(compression="sign", target_group_size=group, owner_feedback=True,
                                **FAST)
    avgs = [VerifiedAverager(d, [torch.zeros(NUMEL)], settings, Scope(prefix=f"o{group}")) for d in make(group)]
    made.extend(avgs)
    codec = make_codec("sign")
    deltas = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) for i in range(group)]
    carries = [0.3 * torch.randn(NUMEL, generator=torch.Generator().manual_seed(10 + i)) for i in range(group)]
    payloads = [codec.encode(d) for d in deltas]
    results = _together([lambda i=i: avgs[i].average([deltas[i]], 1.0, {"config_fingerprint": "x"}, "0",
                                                     encoded=payloads[i], carry=carries[i]) for i in range(group)])
    assert all(r.ok for r, _ in results), [r.reason for r, _ in results]
    applied = results[0][1][0]
    sent = sum(codec.decode(p, NUMEL) for p in payloads) / group
    if group == 2:
        assert torch.equal(applied, sent.float())
        assert all(torch.equal(r.carry, c) for (r, _), c in zip(results, carries))
        return
    bounds = dict(zip(sorted(a.peer_id for a in avgs), part_bounds(NUMEL, group, codec.block)))
    owned = torch.zeros(NUMEL)  # what each owner added: its carry on its part (the rest of a carry is dropped)
    for a, c, (r, _) in zip(avgs, carries, results):
        lo, hi = bounds[a.peer_id]
        owned[lo:hi] = c[lo:hi]
        assert not r.carry[:lo].any() and not r.carry[hi:].any()  # an owner carries its own part only
    torch.testing.assert_close(applied + sum(r.carry for r, _ in results), sent + owned, rtol=0, atol=1e-5)


def test_owners_feedback_is_kept_for_dense_codecs_with_error_feedback_unless_turned_off(dhts):
    make, made = dhts
    dht, = make(1)
    layout = CanonicalLayout.build([("w", (NUMEL,))], bucket_numel=4096)
    kept = {}
    for name, extra in [("sign", {}), ("int8", {}), ("topk", {}), ("sign", {"owner_feedback": False}),
                        ("sign", {"error_feedback": False})]:
        settings = AveragerSettings(compression=name, **{"owner_feedback": True, **extra},
                                    **FAST)
        avg = ShardedAverager(layout, {"w": torch.zeros(NUMEL)}, {"w": (0, 0, NUMEL)}, None, dht, settings,
                              Scope(prefix=f"k{len(kept)}"))
        made.append(avg)
        kept[(name, *extra)] = avg.carry is not None
    assert kept == {("sign",): True, ("int8",): True, ("topk",): False, ("sign", "owner_feedback"): False,
                    ("sign", "error_feedback"): False}


def test_a_wrong_payload_size_is_refused_and_the_round_fails_for_everyone(dhts):
    """An island whose bucket encodes to another size (another codec setting slipped through) is never
    averaged: its payload is refused and every member rolls the round back."""
    make, made = dhts
    settings = AveragerSettings(compression="topk", target_group_size=2, **FAST)
    pair = make(2)
    avgs = [VerifiedAverager(pair[0], [torch.zeros(NUMEL)], settings),
            VerifiedAverager(pair[1], [torch.zeros(NUMEL)], AveragerSettings(**{**settings.__dict__,
                                                                                 "topk_density": 0.5}))]
    made.extend(avgs)
    delta = torch.randn(NUMEL)
    results = _together([lambda i=i: avgs[i].average([delta], 1.0, {"config_fingerprint": "x"}, "0",
                                                     encoded=avgs[i].codec.encode(delta)) for i in range(2)])
    for result, averaged in results:
        assert not result.ok and averaged is None
        assert "did not send their encoded pseudo-gradient" in result.reason


def test_error_feedback_is_kept_only_by_committed_rounds(dhts):
    """Two single-process islands averaging through ShardedAverager with int4: what the codec dropped
    enters the buffers only on commit, one buffer per bucket, and a reset forgets them."""
    make, made = dhts
    layout = CanonicalLayout.build([("w", (NUMEL,))], bucket_numel=4096)
    settings = AveragerSettings(compression="int4", target_group_size=2, **FAST)
    feedback = [{}, {}]
    avgs = [ShardedAverager(layout, {"w": torch.zeros(NUMEL)}, {"w": (0, 0, NUMEL)}, None, d, settings,
                            feedback=f) for d, f in zip(make(2), feedback)]
    made.extend(avgs)
    deltas = [{"w": torch.randn(NUMEL, generator=torch.Generator().manual_seed(i))} for i in range(2)]

    def start(i):
        return avgs[i].start(deltas[i], 1.0, {"config_fingerprint": "x"}, "0")

    pendings = _together([lambda i=i: start(i) for i in range(2)])
    outcomes = _together([lambda i=i: avgs[i].finish(pendings[i]) for i in range(2)])
    assert all(r.ok for r, _ in outcomes), [r.reason for r, _ in outcomes]
    assert feedback == [{}, {}]  # nothing is carried before the island commits
    avgs[0].commit(pendings[0])
    ef = ErrorFeedback(make_codec("int4"))
    assert sorted(feedback[0]) == [b.index for b in layout.buckets] and feedback[1] == {}
    for bucket in layout.buckets:
        part = deltas[0]["w"][bucket.start:bucket.end]
        _, sent, rest = ef.prepare(part, None)
        assert torch.equal(feedback[0][bucket.index], rest) and rest.abs().max() > 0
        torch.testing.assert_close(sent + rest, part)


def test_auto_codec_is_the_groups_choice_and_its_error_feedback_carries_across_codecs(dhts):
    """Two single-process islands under ``--averaging.compression auto``.  Round 0: no link measured yet, both
    pick the fewest bytes (sign), whose dropped part enters the buffers on commit.  Round 1: a budget far
    above what the measured link needs, both pick fp32, which sends what sign had dropped: the buffers empty,
    and what was averaged is the exact mean of Δ + e.  Round 2: one member's budget is tiny, and the group
    takes the smallest budget: sign again, on both."""
    make, made = dhts
    layout = CanonicalLayout.build([("w", (NUMEL,))], bucket_numel=4096)
    settings = AveragerSettings(compression="auto", target_group_size=2, error_feedback_in="buffer", **FAST)
    feedback = [{}, {}]
    avgs = [ShardedAverager(layout, {"w": torch.zeros(NUMEL)}, {"w": (0, 0, NUMEL)}, None, d, settings,
                            feedback=f) for d, f in zip(make(2), feedback)]
    made.extend(avgs)

    def round_(rnd: int, budgets: tuple[float, float]):
        deltas = [{"w": torch.randn(NUMEL, generator=torch.Generator().manual_seed(10 * rnd + i))} for i in range(2)]
        carried = [torch.cat([feedback[i][b.index] for b in layout.buckets]) if feedback[i] else torch.zeros(NUMEL)
                   for i in range(2)]
        pendings = _together([lambda i=i: avgs[i].start(deltas[i], 1.0, {"config_fingerprint": "x",
                                                                          "hide_seconds": budgets[i]}, str(rnd))
                              for i in range(2)])
        outcomes = _together([lambda i=i: avgs[i].finish(pendings[i]) for i in range(2)])
        assert all(r.ok for r, _ in outcomes), [r.reason for r, _ in outcomes]
        assert torch.equal(outcomes[0][1]["w"], outcomes[1][1]["w"])  # bit-identical on both members
        for a, p in zip(avgs, pendings):
            a.commit(p)
        codecs = {r.codec for r, _ in outcomes}
        assert len(codecs) == 1
        return codecs.pop(), deltas, carried, outcomes[0][1]["w"]

    assert round_(0, (1e6, 1e6))[0] == "sign"
    assert all(len(f) == len(layout.buckets) and max(t.abs().max() for t in f.values()) > 0 for f in feedback)
    assert all(a.link.fitted() is not None for a in avgs)  # each island (its rank 0) measured its exchange
    codec, deltas, carried, averaged = round_(1, (1e6, 1e6))
    assert codec == "none"
    torch.testing.assert_close(averaged, (deltas[0]["w"] + carried[0] + deltas[1]["w"] + carried[1]) / 2)
    assert all(max(t.abs().max() for t in f.values()) == 0 for f in feedback)  # fp32 sent all that waited
    assert round_(2, (1e6, 1e-9))[0] == "sign"


def test_auto_budget_leaves_out_what_a_round_spends_beside_its_exchange():
    """``auto``'s budget is the exchange's: what the island's last committed round spent forming the group and
    voting is taken off the share of the round it may communicate (not the stall around it: waiting for the
    others' compute is no link's)."""
    stats = RunStats()
    schedule = RoundSchedule(DilocoConfig(inner_steps=10, max_comm_fraction=0.05), None, stats,
                             CanonicalLayout.build([("w", (NUMEL,))], bucket_numel=4096), ["w"])
    stats.inner_step, stats.compute_seconds = 10, 19.0  # 1.9 s a step: 5% of the round's wall is 1.0 s
    assert schedule.report()["hide_seconds"] == pytest.approx(1.0)
    schedule.finished(RoundResult(True, seconds=0.7, exchange_seconds=0.3), stall=2.5)  # 0.4 s beside the bytes
    assert schedule.report()["hide_seconds"] == pytest.approx(0.6)
    schedule.finished(RoundResult(False, "no group", seconds=5.0), stall=5.0)  # a failed round says nothing
    assert schedule.report()["hide_seconds"] == pytest.approx(0.6)
    schedule.finished(RoundResult(True, seconds=3.0, exchange_seconds=0.1), stall=3.0)  # more than the share
    assert schedule.report()["hide_seconds"] == 0.0


@pytest.mark.parametrize("compression,kept_in,budget", [("topk", "buffer", ""), ("topk", "params", ""),
                                                         ("sign", "params", "1.024K")])
def test_three_islands_with_a_codec_commit_every_round_in_sync(tmp_path, no_leaked_daemons, compression, kept_in,
                                                               budget):
    """End to end over the all-gather (topk) and the reduce-scatter (sign, with --averaging.owner_feedback:
    the owners' feedback is checkpointed too, and never enters the parameters).  The part of Δ the codec
    left unsent waits in the buffer, the island training on from θ_global; or in the island's parameters,
    which then sit exactly at θ_global − e after every committed round.  The sign case runs under a budget
    of tokens (8 steps' worth), where Δ travels per million tokens: e, kept in the parameters, is in their
    units (it was once in the travelling units, about 1000× too large here, and training diverged)."""
    cfg = tiny_config(tmp_path, **{
        "averaging.backend": "hivemind", "averaging.min_group_size": 2, "averaging.target_group_size": 3,
        "averaging.request_timeout": 1.0, "averaging.matchmaking_timeout": 60.0, "averaging.matchmaking_time": 5.0,
        "averaging.compression": compression, "diloco.outer_steps": 3, "diloco.inner_steps": 8,
        "averaging.owner_feedback": compression == "sign", "diloco.sync_every": budget,
        "averaging.error_feedback_in": kept_in, "checkpoint.every": 3})
    result = simulate(cfg, 3)
    islands = result["islands"]
    codec = make_codec(compression)
    for s in islands:
        assert s["rounds_ok"] == 3 and s["rounds_failed"] == 0, s["failures"]
        assert s["eval_loss_end"] < s["eval_loss_start"] - 0.5
    assert result["theta_global_max_abs_diff"] == 0.0  # every island decoded the same bits
    assert codec.nbytes(1000) < 1000 * 4
    for i in range(3):
        state = load(list_checkpoints(tmp_path / f"island{i}" / "checkpoints")[-1])
        flat = [torch.cat([t.reshape(-1) for t in part.values()])
                for part in (state["model"], state["outer_optimizer"]["master"])]
        residuals = state["codec_residuals"]
        unsent = torch.cat([residuals["feedback"][b] for b in sorted(residuals["feedback"])])
        assert unsent.abs().max() > 0
        expected = flat[1] - unsent if kept_in == "params" else flat[1]
        torch.testing.assert_close(flat[0], expected, rtol=0, atol=1e-6)
        rounds = [r for r in read_metrics(tmp_path / f"island{i}") if r.get("round_ok")]
        assert rounds[-1]["unsent_norm"] == pytest.approx(float(unsent.norm()), rel=1e-5)
        if kept_in == "params":  # e is what the codec left of Δ (which carries the e before it): never more
            assert all(r["unsent_norm"] <= r["pseudo_grad_norm"] for r in rounds), rounds
        carried = residuals["carry"]
        assert (sum(float(t.abs().sum()) for t in carried.values()) > 0) == (compression == "sign")


def test_islands_under_auto_pick_the_same_codec_every_round_and_end_in_sync(tmp_path, no_leaked_daemons):
    """``--averaging.compression auto`` end to end: every island records the same codec for each round (the
    fewest bytes first, before any link was measured), θ_global stays bit-identical, and after a round in fp32
    nothing waits unsent."""
    from outer_optim.compression import AUTO_CODECS

    cfg = tiny_config(tmp_path, **{
        "averaging.backend": "hivemind", "averaging.min_group_size": 2, "averaging.target_group_size": 2,
        "averaging.request_timeout": 1.0, "averaging.matchmaking_timeout": 60.0, "averaging.matchmaking_time": 5.0,
        "averaging.compression": "auto", "diloco.outer_steps": 4, "diloco.inner_steps": 8,
        "diloco.max_comm_fraction": 0.9})
    result = simulate(cfg, 2)
    assert result["theta_global_max_abs_diff"] == 0.0
    rounds = [[r for r in read_metrics(tmp_path / f"island{i}") if "round_ok" in r] for i in range(2)]
    assert all(s["rounds_ok"] == 4 for s in result["islands"]), [s["failures"] for s in result["islands"]]
    codecs = [[r["codec"] for r in island] for island in rounds]
    assert codecs[0] == codecs[1] and codecs[0][0] == "sign" and set(codecs[0]) <= set(AUTO_CODECS), codecs
    for island in rounds:
        assert island[0]["unsent_norm"] > 0
        assert all(r["unsent_norm"] == 0 for r in island if r["codec"] == "none"), island


@pytest.mark.parametrize("args, words", [
    (["--averaging.compression", "zip"], "--averaging.compression is 'zip' but must be one of"),
    (["--averaging.compression", "topk", "--averaging.topk_density", "0"], "--averaging.topk_density must be in (0, 1]"),
    (["--averaging.compression", "topk", "--averaging.topk_density", "1.5"], "--averaging.topk_density must be in (0, 1]"),
    (["--averaging.compression", "topk", "--averaging.topk_bits", "3"], "--averaging.topk_bits must be 2 or 4"),
    (["--averaging.compression", "int8", "--averaging.error_feedback_decay", "0"], "error_feedback_decay"),
    (["--averaging.compression", "int4", "--averaging.backend", "torch"], "travels over hivemind"),
    (["--averaging.compression", "auto", "--averaging.backend", "torch"], "travels over hivemind"),
    (["--averaging.compression", "auto", "--averaging.auto_codecs", "int4,zip"], "--averaging.auto_codecs must list"),
    (["--averaging.compression", "auto", "--averaging.owner_feedback", "true"], "owner_feedback takes a fixed codec"),
    (["--diloco.outer_optimizer", "sparseloco"], "sparseloco needs error feedback on a lossy codec"),
    (["--averaging.compression", "topk", "--averaging.error_feedback_in", "param"],
     "--averaging.error_feedback_in must be buffer or params, got 'param'"),
])
def test_bad_codec_settings_are_one_line_and_a_non_zero_exit(capsys, args, words):
    from diloco import cli
    from tests.test_bad_input import TINY, _one_error_line

    assert cli.main(["train", *TINY, *args]) == 2
    assert words in _one_error_line(capsys)


def test_islands_with_different_codecs_refuse_each_other(tmp_path):
    """A mixed run is refused at join: the codec and its top-k settings are part of the config fingerprint."""
    from diloco.config import config_fingerprint

    base = {"averaging.backend": "hivemind", "averaging.compression": "topk"}
    prints = {config_fingerprint(tiny_config(tmp_path, **{**base, **extra})) for extra in
              ({}, {"averaging.compression": "int8"}, {"averaging.topk_density": 0.05}, {"averaging.topk_bits": 4})}
    assert len(prints) == 4
    assert config_fingerprint(tiny_config(tmp_path, **base)) == \
        config_fingerprint(tiny_config(tmp_path, **base, **{"averaging.error_feedback_decay": 0.9}))


def test_reduce_scatter_parts_tile_the_bucket_at_block_boundaries():
    from peers.wire.encoded import part_bounds, reduce_scatters

    for numel, parts, align in [(10_000, 3, 256), (100, 4, 128), (1, 3, 256), (4096, 4, 128)]:
        bounds = part_bounds(numel, parts, align)
        assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == numel
        assert all(a <= b and b == c for (a, b), (c, _) in zip(bounds, bounds[1:]))
        assert all(a % align == 0 for a, _ in bounds)
    assert reduce_scatters(make_codec("int8"), 3) and not reduce_scatters(make_codec("int8"), 2)
    assert not reduce_scatters(make_codec("topk"), 4)
