"""Islands of any shape in one engine: FSDP islands over TP and over a pipeline (torchrun jobs of 4 gloo
ranks) and a single-process island average over the same canonical buckets on real hivemind and end with the
same θ_global; config errors for splits the model does not allow; islands counted once however many ranks
they have."""

from __future__ import annotations

import json
import math
import os
import re
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import tomli_w
import torch

from diloco import cli
from diloco.config import ConfigError, to_dict
from diloco.config.loader import load
from diloco.engine.island import Island
from diloco.engine.metrics import read_metrics
from diloco.launch.simulate import Cluster, SimulationError, simulate, theta_spread
from peers.discovery.dht import visible_maddrs
from peers.discovery.membership import Membership
from peers.proctable import process_table
from tests.conftest import assert_joined, real_failures, tiny_config, torchrun_train

RUN_TIMEOUT_S = 240


@pytest.mark.alone  # 9 ranks and 3 DHTs starting at once: a second busy core pushes past the startup timeout
def test_islands_of_three_shapes_end_with_the_same_theta(tmp_path, no_leaked_daemons):
    """Three islands over real hivemind, averaging 2 Streaming DiLoCo fragments with the rounds in flight:
    dp x pp x tp = 2x1x2 (FSDP over TP, ``delayed``), 2x2x1 (FSDP over a pipeline, ``eager``: θ_global moves
    alike under both) and one process.  Every rank averages its own FSDP piece of each bucket."""
    cfg = tiny_config(tmp_path, **{
        "averaging.backend": "hivemind", "averaging.min_group_size": 3,
        "averaging.request_timeout": 1.0, "averaging.matchmaking_time": 3.0, "averaging.matchmaking_timeout": 90.0,
        "averaging.bucket_numel": 15_000,  # the tiny model is ~37k parameters: 4 buckets over 2 fragments
        "diloco.outer_steps": 3, "diloco.inner_steps": 4, "parallel.microbatches": 2,
        "diloco.fragments": 2, "diloco.overlap": "delayed", "checkpoint.every": 3})
    cluster = Cluster(cfg, 3)
    cluster.configs[0]["parallel"].update(dp=2, tp=2)
    cluster.configs[1]["parallel"].update(dp=2, pp=2)
    cluster.configs[1]["diloco"].update(overlap="eager")
    assert [cluster.island_size(i) for i in range(3)] == [4, 4, 1]
    t0 = time.time()
    try:
        cluster.start_all(startup_timeout=150)
        cluster.wait(timeout=RUN_TIMEOUT_S)
    finally:
        cluster.stop_all()
    elapsed = time.time() - t0
    summaries = cluster.summaries()
    for s in summaries:
        # hivemind may lose an all-reduce part (~1 round in 40 on 2 cores): the vote rejects that round
        # on every island alike, which keeps θ_global in sync; any other failure is a bug
        assert not real_failures(s), s["failures"]
        assert s["rounds_ok"] + s["rounds_failed"] == 6 and s["rounds_ok"] >= 4, s["failures"]
        assert s["eval_loss_end"] < s["eval_loss_start"] - 0.3
        assert s["bytes_sent"] > 0
    # θ_global: gathered from the four ranks of islands 0 and 1, whole on island 2
    assert cluster.theta_spread() < 1e-6, cluster.theta_spread()
    theta = torch.load(cluster.run_dirs[0] / "theta_global.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in theta.values())
    assert max(s["eval_loss_end"] for s in summaries) - min(s["eval_loss_end"] for s in summaries) < 1e-3
    rounds = [r for r in read_metrics(cluster.run_dirs[0]) if "round_ok" in r]
    assert [r["averaging_backend"] for r in rounds if r["round_ok"]] == ["hivemind"] * summaries[0]["rounds_ok"]
    assert all(r["num_peers"] == 3 for r in rounds)
    assert [r["fragment"] for r in rounds] == [0, 1] * 3
    # each rank of a 4-process island checkpoints its own shards; rank 0 alone writes the island's files
    for island in range(2):
        for rank in range(4):
            assert (cluster.run_dirs[island] / "checkpoints" / f"rank{rank}" / "ckpt-000006.pt").is_file()
        log = cluster.logs[island].read_text()
        assert log.count("round 6/6 ") == 1, "only rank 0 prints the island's progress"
    print(f"three islands (2x1x2, 2x2x1, one process), 6 fragment rounds: {elapsed:.0f} s")


@pytest.mark.parametrize("overlap", ["none", "eager"])
def test_two_tp2_islands_in_one_torch_world_average_with_torch_all_reduce(tmp_path, overlap, monkeypatch):
    if overlap == "none":  # under torchrun itself, as users launch it; the suite's other groups start warm
        monkeypatch.setenv("DILOCO_WARM_ISLANDS", "0")
    cfg = tiny_config(tmp_path, **{
        "averaging.backend": "torch", "averaging.min_group_size": 2, "averaging.bucket_numel": 15_000,
        "parallel.tp": 2, "diloco.outer_steps": 2, "diloco.inner_steps": 3, "diloco.overlap": overlap,
        "diloco.overlap_steps": 0 if overlap == "none" else 1})
    torchrun_train(cfg, 4, tmp_path, RUN_TIMEOUT_S)
    dirs = [tmp_path / f"island{k}" for k in range(2)]
    summaries = [json.loads((d / "summary.json").read_text()) for d in dirs]
    assert [s["rounds_ok"] for s in summaries] == [2, 2]
    assert summaries[0]["theta_checksum"] == summaries[1]["theta_checksum"]
    assert theta_spread([d / "theta_global.pt" for d in dirs]) < 1e-6
    rounds = [r for r in read_metrics(dirs[1]) if "round_ok" in r]
    assert [r["averaging_backend"] for r in rounds] == ["torch", "torch"]


def test_a_warm_group_whose_rank_dies_ends_as_torchrun_would(tmp_path):
    """The suite's stand-in for torchrun (diloco/launch/warm.py) ends the other ranks when one dies and exits
    non-zero, leaving no rank behind."""
    from diloco.launch import warm

    cfg = tiny_config(tmp_path, **{"parallel.tp": 2, "diloco.outer_steps": 3})
    path = tmp_path / "config.toml"
    path.write_text(tomli_w.dumps(to_dict(cfg)))
    group = warm.start_group(["train", "--config", str(path)], 2,
                             {**os.environ, "DILOCO_FAULTS": "kill@inner:2", "OMP_NUM_THREADS": "1"}, tmp_path / "log")
    assert group.wait(timeout=RUN_TIMEOUT_S) == 1
    log = (tmp_path / "log").read_text()
    assert "rank exited with code -9" in log
    ranks = [int(pid) for pid in re.search(r"\[warm agent\] ranks ([\d ]+)", log)[1].split()]
    assert len(ranks) == 2 and not set(ranks) & set(process_table())


def test_late_joiner_downloads_theta_bucket_by_bucket_over_the_transport(tmp_path, no_leaked_daemons):
    common = {"averaging.backend": "hivemind", "averaging.bucket_numel": 15_000,
              "averaging.state_download_timeout": 15.0, "averaging.run_key": "test-run-key"}
    first = Island(tiny_config(tmp_path / "a", **common))
    first.connect()
    try:
        assert first.peers.averager.owned_buckets == [0, 1, 2]  # one process owns all three buckets
        for _ in range(3):  # pretend the run has made progress
            first.outer.step({n: torch.randn_like(t) * 0.01 for n, t in first.outer.theta_global.items()})
        first.stats.outer_step = 3
        first.peers.membership.announce(3, averaging=False)
        joiner = Island(tiny_config(tmp_path / "b", **common,
                                            **{"averaging.initial_peers": visible_maddrs(first.peers.dht)}))
        joiner.connect()
        try:
            assert_joined(joiner, first, outer_step=3)
            # resync downloads only a state matching the majority's fingerprint
            target = first.rounds.theta_fingerprint()
            assert joiner.rounds.theta_fingerprint() == target
            assert joiner.transfer.download(target) is not None
            wrong = list(target)
            wrong[3 * 4 * 2] += 1.0  # bucket 2's first sum
            assert joiner.transfer.download(wrong) is None
        finally:
            joiner.close()
    finally:
        first.close()


def test_a_joiner_refuses_theta_its_witnesses_deny_though_it_has_the_runs_sums(tmp_path, no_leaked_daemons):
    """Three islands of a run hold θ_global at outer step 3 (two caught up from the first); then the first serves one
    with every chunk's values reversed, which keeps the per-chunk sums the registry vouches for.  A fourth island
    joining takes the others' θ_global, whichever island it asks first: the liar's state is denied by both honest
    witnesses, and the liar alone cannot deny an honest donor's (real islands over hivemind and the transport).
    Nothing in the registry vouches for a θ_global here (as right after a commit): without the witnesses, a joiner
    asking the liar first took its state."""
    from peers import CHUNKS_PER_BUCKET

    common = {"averaging.backend": "hivemind", "averaging.bucket_numel": 15_000,
              "averaging.state_download_timeout": 10.0, "averaging.run_key": "test-run-key"}
    islands: list[Island] = []
    try:
        first = Island(tiny_config(tmp_path / "a", **common))
        islands.append(first)
        first.connect()
        for _ in range(3):
            first.outer.step({n: torch.randn_like(t) * 0.01 for n, t in first.outer.theta_global.items()})
        first.stats.outer_step = 3
        first.peers.membership.announce(3, averaging=False)
        peers = {"averaging.initial_peers": visible_maddrs(first.peers.dht)}
        for name in ("b", "c"):
            islands.append(Island(tiny_config(tmp_path / name, **common, **peers)))
            islands[-1].connect()
            assert_joined(islands[-1], first, outer_step=3)
        honest = {n: t.clone() for n, t in first.outer.theta_global.items()}
        layout = first.layout
        flat = torch.cat([honest[p.name].reshape(-1) for p in layout.params])
        reversed_chunks = first.exchange.scatter({b.index: torch.cat([c.flip(0) for c in torch.tensor_split(
            flat[b.start:b.end], CHUNKS_PER_BUCKET)]) for b in layout.buckets})
        server = first.peers._server
        serves = server.provide

        def lying():
            meta, _, momentum = serves()
            return meta, reversed_chunks, momentum
        server.provide = lying
        joiner = Island(tiny_config(tmp_path / "d", **common, **peers))
        islands.append(joiner)
        joiner.connect()
        assert joiner.transfer.join_from_peers() and joiner.stats.outer_step == 3
        for name, t in honest.items():
            assert torch.equal(joiner.outer.theta_global[name], t)
        assert not any(torch.equal(reversed_chunks[n], t) for n, t in honest.items() if t.numel() > 1)
        liar = first.peers.membership.island
        assert set(joiner.transfer._refused) <= {liar}
        # the liar asked first: both honest witnesses deny its state, and it is asked to witness no more
        joiner.transfer._refused = {i.peers.membership.island: (3, 3) for i in islands[1:3]}
        assert joiner.transfer.download() is None and joiner.transfer._discredited == {liar: (3, 3)}
    finally:
        for island in reversed(islands):
            island.close()


def test_indivisible_heads_fail_with_one_clear_line(capsys):
    code = cli.main(["train", "--parallel.tp", "3"])  # the small preset has 4 heads
    err = capsys.readouterr().err
    assert code == 2
    assert "error: --model.n_heads (4) must be divisible by --parallel.tp (3)" in err.splitlines()
    with pytest.raises(ConfigError, match="must not exceed --model.n_layers"):
        load(None, {"model.preset": "tiny", "parallel.pp": 3})
    with pytest.raises(ConfigError, match="--inner.batch_size \\(6\\) must be divisible by --parallel.microbatches"):
        load(None, {"model.preset": "tiny", "parallel.pp": 2, "inner.batch_size": 6})
    with pytest.raises(ConfigError, match="bucket_numel must be at least 1"):
        load(None, {"averaging.bucket_numel": 0})
    assert load(None, {"model.preset": "tiny", "parallel.tp": 2, "parallel.pp": 2}).parallel.tp == 2


def test_launch_errors_name_the_command_to_use(tmp_path):
    from diloco.errors import TrainingError

    cfg = tiny_config(tmp_path, **{"parallel.tp": 2})
    with pytest.raises(TrainingError, match="torchrun --nproc-per-node 2"):
        Island(cfg)
    with pytest.raises(SimulationError, match="one torchrun world"):
        simulate(tiny_config(tmp_path, **{"averaging.backend": "torch"}), 2)


class _FakeDHT:
    """Just enough of a DHT for Membership's queries: a fixed registry."""

    def __init__(self, peer_id: str, registry: dict[str, dict]):
        self.peer_id = peer_id
        self.registry = registry

    def is_alive(self) -> bool:
        return True

    def get(self, key, latest=True, return_future=False, **kwargs):
        return _done(SimpleNamespace(value={k: SimpleNamespace(value=v) for k, v in self.registry.items()}))

    def store(self, key, subkey, value, expiration_time, return_future=False):
        self.registry[subkey] = value
        return _done(True)


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


@pytest.fixture
def unsigned_registry(monkeypatch):
    """The registry's records as :class:`_FakeDHT` keeps them: unsigned, under the fake peer ids (the owner's
    signature is tested on real DHTs in tests/test_membership.py; these tests are about counting islands), and every
    question read afresh (these tests change the registry between two questions)."""
    import peers.discovery.membership as membership

    monkeypatch.setattr(membership, "FRESH", 0.0)
    monkeypatch.setattr(membership, "READ_PACE", math.inf)  # however many records: no read answers a second question
    monkeypatch.setattr(membership, "store_owned", lambda dht, key, value, expiration_time, timeout: dht.store(
        key, dht.peer_id, value, expiration_time).result())
    monkeypatch.setattr(membership, "owned_items", lambda found, key: {
        str(k): (getattr(item, "value", None), 0.0) for k, item in (found.value or {}).items()})


def test_membership_counts_islands_not_ranks(unsigned_registry):
    registry: dict[str, dict] = {}
    a0 = Membership(_FakeDHT("A0", registry), "run")
    a1 = Membership(_FakeDHT("A1", registry), "run", island="A0", rank=1)
    b = Membership(_FakeDHT("B", registry), "run")
    a0.announce(4)
    a1.announce(4, averaging=True)
    b.announce(2)
    assert registry["A1"]["island"] == "A0" and registry["A1"]["rank"] == 1
    assert a0.live_count() == b.live_count() == 2
    assert [(m.peer_id, m.outer_step, m.averaging) for m in b.others()] == [("A0", 4, True)]
    assert [m.peer_id for m in a1.others()] == ["B"] and a1.furthest() == (0, 2)
    assert b.furthest() == (0, 4) and b.averaging_round(4)
    a1.leave()
    a0.leave()
    assert b.live_count() == 1 and b.others() == []
    assert json.dumps(registry)  # plain values only


def test_one_read_of_the_registry_answers_every_question_of_a_second(unsigned_registry, monkeypatch):
    """A read fetches every island's record from every DHT node it visits: the island's threads share one a second
    (16 islands sent 25 MB each a round, reading on their own), and a record of its own it changed is read again."""
    import peers.discovery.membership as membership

    monkeypatch.setattr(membership, "FRESH", 60.0)
    registry: dict[str, dict] = {}
    dht = _FakeDHT("A", registry)
    reads = []
    get = dht.get
    dht.get = lambda *args, **kwargs: reads.append(1) or get(*args, **kwargs)
    a, b = Membership(dht, "run"), Membership(_FakeDHT("B", registry), "run")
    a.announce(2)
    b.announce(3)
    assert [m.outer_step for m in a.others()] == [3] and a.live_count() == 2 and a.furthest() == (0, 3)
    assert len(reads) == 1
    b.announce(5)  # another island's change waits for the next read
    assert a.furthest() == (0, 3) and len(reads) == 1
    a.announce(4)  # our own does not
    assert a.furthest() == (0, 5) and len(reads) == 2


def test_islands_behind_nat_count_the_reachable_ones(unsigned_registry):
    registry: dict[str, dict] = {}
    hidden = Membership(_FakeDHT("A", registry), "run")
    other_hidden = Membership(_FakeDHT("B", registry), "run")
    hidden.endpoint, other_hidden.endpoint = "lane:10.0.0.1:4000", "lane:10.0.0.2:4000"
    hidden.announce(1)
    other_hidden.announce(1)
    assert hidden.reachable_others() == 0
    public = Membership(_FakeDHT("C", registry), "run")
    public.endpoint = "10.0.0.3:4000"
    public.announce(1)
    assert hidden.reachable_others() == 1 and public.reachable_others() == 0
    public.leave()
    assert hidden.reachable_others() == 0


def test_an_island_that_ends_serves_an_island_whose_last_round_rolled_back(unsigned_registry):
    """At the end, an island at the same outer step with one round fewer committed (its last round rolled back while
    the others committed theirs) is behind: the others serve θ_global for it a while (32 islands: one ended alone on
    a stale θ_global, and every other island's end check failed on it)."""
    from diloco.engine.metrics import RunStats
    from diloco.engine.state_transfer import StateTransfer

    registry: dict[str, dict] = {}
    mine, late = Membership(_FakeDHT("A", registry), "run"), Membership(_FakeDHT("B", registry), "run")
    late.committed_rounds = lambda: 9
    late.announce(10)
    mine.announce(10)
    peers = SimpleNamespace(membership=mine)
    transfer = StateTransfer(SimpleNamespace(), stats=RunStats(outer_step=10), peers=peers,
                             rt=None, outer=SimpleNamespace(step_count=10), params={},
                             exchange=SimpleNamespace(layout=None), schedule=None, forget_unsent=lambda: False,
                             fingerprint="")
    mine.silent = lambda m: False  # the fake registry's records carry no expiry
    assert transfer._behind(0.0) == 1
    late.committed_rounds = lambda: 10
    late.announce(10)  # it caught up
    assert transfer._behind(5.0) == 0


def test_a_run_that_ends_out_of_sync_says_so(unsigned_registry):
    from diloco.engine.state_transfer import StateTransfer

    registry: dict[str, dict] = {}
    mine, theirs = Membership(_FakeDHT("A", registry), "run"), Membership(_FakeDHT("B", registry), "run")
    from diloco.engine.metrics import RunStats

    stats = RunStats(outer_step=7)
    peers = SimpleNamespace(membership=mine, alone=SimpleNamespace(since=None), averager=None)
    transfer = StateTransfer(SimpleNamespace(vote_timeout=1.0, strikes=2, matchmaking_timeout=1.0), stats=stats, peers=peers,
                             rt=SimpleNamespace(lockstep=False, is_main=True, bcast=lambda x: x),
                             outer=None, params={}, exchange=SimpleNamespace(layout=None), schedule=None,
                             forget_unsent=lambda: False, fingerprint="")
    from peers import digest

    state = [1.0, 1.0, 1.0] * 4
    theirs.final = {"outer_step": 7, "state": digest(state)}
    theirs.leave()  # an island that finished before us: its record keeps what it ended with (a digest)
    assert transfer.check_in_sync(state, stopping=False) == ""
    assert registry["A"]["final"] == {"outer_step": 7, "state": digest(state)}
    theirs.final = {"outer_step": 7, "state": digest([1.5, 1.5, 1.5] * 4)}
    theirs.leave()
    problem = transfer.check_in_sync(state, stopping=False)
    assert problem.startswith("the run ended out of sync: θ_global of 1 of the 1 other island(s)"), problem
    assert "this island holds one half's" in problem, problem  # 1 against 1: neither side is the majority
    # two more islands end on this island's θ_global: it holds the majority's, and the one that differs says so itself
    # (48 islands: one cut off in the last rounds made the 47 others, on one θ_global, exit with an error)
    others = [Membership(_FakeDHT(name, registry), "run") for name in ("C", "D")]
    for other in others:
        other.final = {"outer_step": 7, "state": digest(state)}
        other.leave()
    assert transfer.check_in_sync(state, stopping=False) == ""
    assert transfer.check_in_sync([1.5, 1.5, 1.5] * 4, stopping=False).startswith(
        "the run ended out of sync: θ_global of 2 of the 3 other island(s)")  # the one that differs: the minority's
    for other in others:
        other.final = {"outer_step": 6, "state": digest(state)}
        other.leave()
    theirs.final = {"outer_step": 6, "state": [9.0] * 12}  # ended earlier (stopped): not comparable
    theirs.leave()
    assert transfer.check_in_sync(state, stopping=False) == ""
    # nothing to compare with, but the others averaged our last round without us: that may be a split
    stats.behind = True
    problem = transfer.check_in_sync(state, stopping=False)
    assert problem.startswith("the other islands averaged this island's last round without it"), problem
    # nothing to compare with because the island could not reach the live islands it knew: a split
    stats.behind, peers.alone.since = False, 12.0
    problem = transfer.check_in_sync(state, stopping=False)
    assert problem.startswith("this island ended alone: the islands of the run it knew stopped answering"), problem
    # stopped by its user (Ctrl-C, SIGTERM) rather than at the run's end: a warning, not an error (it can resume)
    assert transfer.check_in_sync(state, stopping=True) == ""
    # nothing to compare with, its last round failed, and it had committed rounds with others: that may be a split
    # (48 islands: one ended so with exit 0 on a θ_global nobody else held)
    peers.alone.since, stats.failed_in_a_row = None, 1
    assert transfer.check_in_sync(state, stopping=False) == ""  # never committed a round with another island
    peers.averager = SimpleNamespace(committed=["A", "B", "C"])
    problem = transfer.check_in_sync(state, stopping=False)
    assert problem.startswith("this island's last round did not commit and none of the 2 island(s)"), problem
    stats.failed_in_a_row = 0
    assert transfer.check_in_sync(state, stopping=False) == ""  # its last round committed: nothing says it differs


def test_catch_up_takes_only_a_state_the_run_has_not_moved_past():
    """The decisions of a catch-up (narrow unit test of the logic; the downloads are tested end to end
    above): a state that a commit overtook during its download is downloaded again, never adopted.  States are
    compared by position, (rounds committed, outer step): here every round committed, so both are the step."""
    from diloco.engine.state_transfer import NOWHERE, StateTransfer

    def at(step: int) -> tuple[int, int]:
        return step, step

    run = SimpleNamespace(furthest=at(4), averaging={}, dead=0)  # outer step -> how many other islands average it
    membership = SimpleNamespace(
        furthest=lambda beating_only=False: run.furthest, averaging_round=lambda s: run.averaging.get(s, 0) > 0,
        others=lambda: [SimpleNamespace(averaging=True, outer_step=s, alive=i >= run.dead)
                        for s, n in run.averaging.items() for i in range(n)],
        beating=lambda m: m.alive)
    from diloco.engine.metrics import RunStats

    outer = SimpleNamespace(step_count=2)
    transfer = StateTransfer(SimpleNamespace(min_group_size=2), stats=RunStats(outer_step=2),
                             peers=SimpleNamespace(membership=membership), rt=None, outer=outer, params={},
                             exchange=SimpleNamespace(layout=None), schedule=None, forget_unsent=lambda: False,
                             fingerprint="")
    later = time.monotonic() + 60
    assert transfer._verdict(at(3), at(3), later, False) == "moving"  # round 4 committed while we downloaded step 3
    assert transfer._verdict(at(4), at(3), later, False) == "adopt"
    run.averaging = {4: 2}
    assert transfer._verdict(at(4), at(4), later, False) == "moving"  # the round of that state is in flight: wait
    assert transfer._verdict(at(4), at(3), later, False) == "adopt"  # ...but only for the round in flight then
    run.averaging = {4: 1}  # a lone island averaging cannot commit without partners: take its state and join it
    assert transfer._verdict(at(4), at(4), later, False) == "adopt"
    run.averaging, run.dead = {4: 2}, 1  # one of the two was killed mid-round: its record still says averaging
    assert transfer._verdict(at(4), at(4), later, False) == "adopt"
    run.dead = 0
    assert transfer._verdict(at(2), None, later, False) == "keep"  # not ahead of us
    assert transfer._verdict(NOWHERE, None, later, False) == "unreachable"  # others are ahead: ask again
    # an island that left round 2 out waits for the others to finish it, then takes their result
    run.furthest, run.averaging = at(2), {2: 2}
    assert transfer._verdict(at(2), None, later, True) == "moving"
    run.furthest, run.averaging = at(3), {}
    assert transfer._verdict(at(3), at(3), later, True) == "adopt"
    assert transfer._verdict(at(3), at(3), time.monotonic() - 1, False) == "adopt"  # past the deadline: the freshest
    # cut off from the run's majority, this island rolled back rounds 3 to 7 while the majority committed 3 to 5:
    # the majority's state is ahead though its outer step is lower, and a state of as few rounds committed is not
    transfer.stats.outer_step, run.furthest = 7, (5, 5)
    assert transfer._verdict((5, 5), (5, 5), later, False) == "adopt"
    assert transfer._verdict((2, 6), None, later, False) == "keep"


def test_a_catch_up_downloads_from_an_island_at_the_runs_position_not_from_one_that_claims_more():
    """A member that announces a position nobody else holds is not the donor: θ_global comes from an island at the
    furthest position at least half the run reached (narrow unit test of the choice)."""
    from diloco.engine.state_transfer import StateTransfer

    def member(pid: str, position: tuple[int, int]) -> SimpleNamespace:
        return SimpleNamespace(peer_id=pid, island=pid, committed=position[0], outer_step=position[1],
                               position=position, averaging=False, serving=True)

    others = [member("liar", (10**9, 10**9)), member("b", (5, 5)), member("c", (5, 5)), member("d", (4, 4))]
    membership = SimpleNamespace(others=lambda: others, silent=lambda m: False,
                                 endpoints=lambda pid: [f"{pid}:1"], vouched_state=lambda position, others=None: (None, 0))
    transfer = StateTransfer(SimpleNamespace(), stats=None, peers=SimpleNamespace(membership=membership), rt=None,
                             outer=None, params={}, exchange=SimpleNamespace(layout=None), schedule=None,
                             forget_unsent=lambda: False, fingerprint="")
    assert transfer._donor()[:3] == (["b:1"], "b", (5, 5))
    others[1:3] = [member("b", (10**9, 10**9)), member("c", (10**9, 10**9))]  # now a majority is there: it counts
    assert transfer._donor()[:3] == (["b:1"], "b", (10**9, 10**9))
    transfer._refused["b"] = (10**9, 10**9)  # b served a state the run does not vouch for: c is asked instead
    assert transfer._donor()[:2] == (["c:1"], "c")


def test_a_catch_up_refuses_a_state_the_run_does_not_vouch_for(monkeypatch):
    """Two islands at the run's position vouch for one θ_global in their signed records; the first donor in order
    serves another one (a member that lies, or a corrupt state).  Its download is refused and remembered, and the
    next download asks the other island and takes its state.  Without the check, the first download was adopted
    (narrow unit test of the download's decision: the transport, the layout and the ranks are stand-ins)."""
    import diloco.engine.state_transfer as state_transfer
    from peers import Downloaded, digest, fingerprint

    honest = torch.linspace(-1.0, 1.0, 12)
    served = {"b:1": honest + 0.5, "c:1": honest.clone()}

    def member(pid: str) -> SimpleNamespace:
        return SimpleNamespace(peer_id=pid, island=pid, committed=5, outer_step=5, position=(5, 5), averaging=False,
                               serving=True, left=False)

    membership = SimpleNamespace(others=lambda: [member("b"), member("c")], silent=lambda m: False,
                                 endpoints=lambda pid: [f"{pid}:1"],
                                 vouched_state=lambda position, others=None: (digest(fingerprint([honest], 4)), 2))
    meta = {"outer_step": 5, "committed_rounds": 5, "config_fingerprint": "F", "layout_fingerprint": "L", "phase": 0}
    monkeypatch.setattr(state_transfer, "download_state", lambda transport, donor, buckets, timeout, tag: (
        {0: Downloaded(dict(meta), served[donor[0]], torch.zeros(12))}, ""))
    _witnesses_hold(monkeypatch, {"b": honest + 0.5, "c": honest}, meta)
    transfer = _transfer(membership)
    assert transfer.download() is None  # b's state is not the one the run holds at (5, 5)
    assert transfer._refused == {"b": (5, 5)} and transfer.checked_digest is None
    got = transfer.download()  # c is asked now
    assert got is not None and got[0]["outer_step"] == 5 and torch.equal(got[1][0], honest)
    # what the island vouches for once it adopted: the digest it checked, with no collective to compute it again
    assert transfer.checked_digest == pytest.approx(digest(fingerprint([honest], 4)), rel=1e-6)


def _transfer(membership: SimpleNamespace, numel: int = 12):
    """A one-rank island's state transfer over stand-ins (one bucket of ``numel`` elements, parameter ``w``)."""
    from diloco.engine.metrics import RunStats
    from diloco.engine.state_transfer import StateTransfer

    layout = SimpleNamespace(buckets=[SimpleNamespace(numel=numel)], fingerprint=lambda: "L")
    return StateTransfer(
        SimpleNamespace(state_download_timeout=1.0, strikes=0), stats=RunStats(outer_step=3),
        peers=SimpleNamespace(membership=membership, transport=None, averager=None),
        rt=SimpleNamespace(bcast=lambda x: x, is_main=True, gather_all=lambda x: [x]),
        outer=SimpleNamespace(names=["w"]), params={},
        exchange=SimpleNamespace(layout=layout, owned=[0], scatter=lambda buckets: {"w": buckets[0]}),
        schedule=None, forget_unsent=lambda: False, fingerprint="F")


def _witnesses_hold(monkeypatch, held: dict[str, torch.Tensor], meta: dict, liars: set[str] = frozenset()) -> list:
    """Witness islands (by the host of their endpoint) that confirm a download when it is the θ_global they hold, and
    ``liars`` that deny any (a stand-in for :func:`peers.wire.state_share.witness`, tested on real transports in
    tests/test_state_share.py).  Returns the list of islands asked, call by call."""
    import diloco.engine.state_transfer as state_transfer

    asked = []

    def witness(transport, islands, theta, timeout, tag):
        names = [endpoints[0].split(":")[0] for endpoints in islands]
        asked.append(names)
        return [([dict(meta)], n not in liars and torch.equal(theta[0], held[n])) for n in names]

    monkeypatch.setattr(state_transfer, "witness_state", witness)
    return asked


def test_a_catch_up_refuses_a_state_crafted_to_the_registrys_sums_and_one_lying_witness_refuses_nothing(
        monkeypatch):
    """A donor (b) serves θ_global with each chunk's values permuted: the per-chunk sums the registry vouches for
    match, so only the witnesses' keyed prints catch it, and b is refused at that position (and asked to witness no
    more).  The next donor (c) is honest, and of its two witnesses one (e) lies, denying every state: one confirmation
    against one denial, the state stands.  Right after a commit, with no record vouching for any θ_global yet, the
    witnesses are still asked (narrow unit test of the decision: the transport, the layout and the ranks are
    stand-ins)."""
    import diloco.engine.state_transfer as state_transfer
    from peers import Downloaded, digest, fingerprint

    honest = torch.linspace(-1.0, 1.0, 12)
    permuted = torch.cat([c.flip(0) for c in torch.tensor_split(honest, 4)])
    served = {"b:1": permuted, "c:1": honest.clone(), "d:1": honest.clone(), "e:1": honest.clone()}
    vouched = [digest(fingerprint([honest], 4))]

    def member(pid: str) -> SimpleNamespace:
        return SimpleNamespace(peer_id=pid, island=pid, committed=5, outer_step=5, position=(5, 5), averaging=False,
                               serving=True, left=False)

    membership = SimpleNamespace(others=lambda: [member(i) for i in "bcde"], silent=lambda m: False,
                                 endpoints=lambda pid: [f"{pid}:1"],
                                 vouched_state=lambda position, others=None: (vouched[0], 4))
    meta = {"outer_step": 5, "committed_rounds": 5, "config_fingerprint": "F", "layout_fingerprint": "L", "phase": 0}
    monkeypatch.setattr(state_transfer, "download_state", lambda transport, donor, buckets, timeout, tag: (
        {0: Downloaded(dict(meta), served[donor[0]], torch.zeros(12))}, ""))
    asked = _witnesses_hold(monkeypatch, {i: served[f"{i}:1"] for i in "bcde"}, meta, liars={"b", "e"})
    transfer = _transfer(membership)
    assert transfer.download() is None  # the registry's sums match; c and d deny it
    assert asked == [["c", "d"]] and transfer._refused == {"b": (5, 5)}
    got = transfer.download()  # c serves; d confirms, e lies
    assert asked[-1] == ["d", "e"] and got is not None and torch.equal(got[1][0], honest)
    vouched[0] = None  # right after a commit: no record vouches for a θ_global at (5, 5) yet
    transfer._refused.clear()
    assert transfer.download() is None and transfer._refused == {"b": (5, 5)} and asked[-1] == ["c", "d"]


def test_a_first_comer_compares_as_soon_as_the_islands_it_waits_for_asked_to_join(unsigned_registry,
                                                                                   monkeypatch):
    """A blocking round's first comer waits for the islands still training to announce the θ_global they enter the
    round with (a stale island then leaves the round before its roster forms).  A read of the registry answers its
    questions for a while; an island that asked to join the round said in its join the digest it enters with, so the
    first comer compares at once instead of at its next read (the last comer waited for that read: 0.76 s of a 9M
    round's 1.16 s, beside torchft's 0.16 s)."""
    import peers.discovery.membership as membership
    from peers import digest

    monkeypatch.setattr(membership, "FRESH", 1e9)  # a read answers every later question, unless forgotten
    old, new = [1.0, 4.0, 10.0], [2.0, 5.0, 10.0]
    registry: dict[str, dict] = {}
    a, b = Membership(_FakeDHT("A", registry), "run"), Membership(_FakeDHT("B", registry), "run")
    a.announce(3)  # still training towards round 3
    b.announce(3, averaging=True, held=digest(new))
    assert [(m.island, m.averaging) for m in b.others()] == [("A", False)]  # the read b keeps
    a.announce(3, averaging=True, held=digest(old))  # A reached the round, from another θ_global
    assert not b.outvoted(3, new, 1.0)  # the kept read shows A training until the wait ends: nobody to compare with
    # A asked to join with its digest: B compares at once (one against one: the side of the smallest id, A's, stands)
    assert b.outvoted(3, new, 1.0, arrived=lambda: {"A": digest(old)})
    assert not b.outvoted(3, new, 1.0, arrived=lambda: {"A": digest(new)})


def test_an_island_shows_the_state_of_its_ranks_at_its_newest_round(unsigned_registry):
    """Rank 1 of island A has not stored its new record yet: it still shows round 2 and the state it entered
    round 2 with.  Island A is entering round 3 with rank 0's state, whatever order the DHT lists them in (a
    stale state made another island believe its θ_global differed and resynchronize for nothing)."""
    from peers import digest

    old, new = [1.0, 4.0, 10.0], [2.0, 5.0, 10.0]  # (sum, sum of squares, count) of θ_global entering rounds 2 and 3
    for order in (("A1", "A0"), ("A0", "A1")):
        registry: dict[str, dict] = {}
        ranks = {"A0": Membership(_FakeDHT("A0", registry), "run"),
                 "A1": Membership(_FakeDHT("A1", registry), "run", island="A0", rank=1)}
        b = Membership(_FakeDHT("B", registry), "run")
        for pid in order:
            ranks[pid].announce(3 if pid == "A0" else 2, averaging=True, held=digest(new if pid == "A0" else old))
        b.announce(3, averaging=True, held=digest(new))
        [a] = b.others()
        assert (a.outer_step, a.averaging, a.held) == (3, True, digest(new)), order
        assert not b.outvoted(3, new, 0.0)
    assert b.outvoted(3, old, 0.0)  # a real difference is still seen (B is alone against A's ranks at round 3)
