"""Averaging that does not grow with the model: a bounded number of processes, a part that fails is sent again
alone while the round stays exact, checkpoints that stream (real DHTs, averagers and transports on loopback)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from diloco.model import checkpoint
from diloco.model.checkpoint import BackgroundWriter, CheckpointError
from peers.averaging.sharded import ShardedAverager
from peers.discovery.dht import start_dht, visible_maddrs
from peers.proctable import descendants, socket_files
from peers.settings import AveragerSettings, NetworkSettings, Scope
from peers.island.layout import CanonicalLayout

FAST = dict(matchmaking_time=1.0, request_timeout=0.5, matchmaking_timeout=8.0, vote_timeout=4.0,
            allreduce_timeout=15.0, target_group_size=2)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def pair(no_leaked_daemons):
    """Two connected DHTs (islands of one process each, in this process) and what the test registers."""
    made: list = []
    first = start_dht(NetworkSettings())
    second = start_dht(NetworkSettings(initial_peers=visible_maddrs(first)))
    made += [first, second]
    yield (first, second), made
    for obj in reversed(made):
        obj.shutdown()


def _together(calls) -> list:
    out = [None] * len(calls)
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, calls[i]())) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _our_processes() -> int:
    return len(descendants(os.getpid()))


def test_an_island_runs_the_same_processes_whatever_its_number_of_buckets(pair):
    """hivemind once ran one averager process per bucket (22 at 85M parameters), then one on each island's rank 0
    for its matchmaking; a round's group now forms over the island's own transport, so an island's rank runs its
    DHT (a process and its p2p daemon) and no averager process at all, for 3 buckets as for 300, and leaves no
    socket file behind once shut down."""
    dhts, made = pair
    before = _our_processes()
    ours = socket_files(list(descendants(os.getpid())))
    held: set[str] = set()  # the averagers' files (not other tests', which may run beside this one)
    counts = []
    for buckets, prefix in ((3, "few"), (300, "many")):
        numel = 30_000
        layout = CanonicalLayout.build([("w", (numel,))], numel // buckets)
        assert len(layout.buckets) == buckets
        avg = ShardedAverager(layout, {"w": torch.zeros(numel)}, {"w": (0, 0, numel)}, None, dhts[0],
                              AveragerSettings(**FAST), Scope(prefix=prefix))
        made.append(avg)
        counts.append(_our_processes() - before)
        held |= socket_files(list(descendants(os.getpid()))) - ours
        avg.shutdown()
        made.remove(avg)
    assert counts == [0, 0], counts  # no process of its own, whatever the buckets
    assert {f for f in held if Path(f).exists()} == set()


def test_a_part_whose_connection_fails_is_sent_again_alone_and_the_round_stays_exact(pair):
    """The connection carrying one part of bucket 1 breaks half-way: that part alone is sent again, on a new
    connection, and both islands commit the exact weighted average (no other part moves twice)."""
    dhts, made = pair
    numel, per_bucket = 40_000, 10_000
    layout = CanonicalLayout.build([("w", (numel,))], per_bucket)
    avgs = [ShardedAverager(layout, {"w": torch.zeros(numel)}, {"w": (0, 0, numel)}, None, d,
                            AveragerSettings(**FAST, weighting="tokens"), Scope(prefix="retry")) for d in dhts]
    made.extend(avgs)
    broken = []

    def fault(key: str) -> bool:  # island 0's part of bucket 1: once
        if key.startswith("rs.b1.") and not broken:  # the reduce-scatter half of bucket 1
            broken.append(key)
            return True
        return False

    avgs[0].transport.fault = fault
    deltas = [{"w": torch.randn(numel, generator=torch.Generator().manual_seed(i))} for i in range(2)]
    weights = [1.0, 3.0]
    results = _together([lambda i=i: avgs[i].average(deltas[i], weights[i], {"config_fingerprint": "x"}, "0")
                         for i in range(2)])
    expected = (deltas[0]["w"] * 1.0 + deltas[1]["w"] * 3.0) / 4.0
    assert broken, "the fault was not injected"
    for result, averaged in results:
        assert result.ok, result.reason
        torch.testing.assert_close(averaged["w"], expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(results[0][1]["w"], results[1][1]["w"])  # bit for bit on both islands
    assert results[0][0].parts_resent == 1 and results[1][0].parts_resent == 0
    # fp32 between 2 islands reduce-scatters: the part that went twice is half a bucket
    assert avgs[0].transport.stats.resent_bytes == 4 * per_bucket // 2


LOAD_PEAK = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {repo!r})
    from diloco.model import checkpoint
    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    path = sys.argv[1]
    base = rss()
    open("/proc/self/clear_refs", "w").write("5")  # the peak starts again from here
    state = checkpoint.load(path)
    print(hwm() - base, os.path.getsize(path))
""")


def test_loading_a_checkpoint_holds_about_one_copy_of_it(tmp_path):
    """The file is hashed chunk by chunk and its tensors read in place: loading peaks near the file's size
    (it held the file's bytes, a copy of the payload and the tensors: 3x)."""
    path = checkpoint.save({"model": {f"w{i}": torch.randn(4_000_000) for i in range(4)}, "step": 3},
                           tmp_path / "ckpt-000003.pt")
    script = tmp_path / "peak.py"
    script.write_text(LOAD_PEAK.format(repo=str(REPO)))
    out = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    peak, size = (int(x) for x in out.stdout.split())
    assert peak <= 1.5 * size, f"loading peaked at {peak / size:.2f}x the file"


def test_a_checkpoint_written_in_the_background_is_whole_and_its_errors_come_back(tmp_path):
    writer = BackgroundWriter()
    state = {"w": torch.arange(10.0), "step": 1}
    writer.submit(state, tmp_path / "ckpt-000001.pt", keep=2)
    writer.wait()
    assert torch.equal(checkpoint.load(tmp_path / "ckpt-000001.pt")["w"], state["w"])
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    writer.submit(state, blocked / "ckpt-000002.pt", keep=2)
    time.sleep(0.1)
    with pytest.raises(CheckpointError, match="could not write checkpoint"):
        writer.wait()
    assert checkpoint.list_checkpoints(tmp_path) == [tmp_path / "ckpt-000001.pt"]


def test_the_pieces_of_theta_global_a_rank_sends_pickle_to_about_their_own_bytes(tmp_path):
    """θ_global is one flat buffer with a view per name: pickled as views, every name would carry the whole
    buffer (the end of every run of a multi-rank island then needed GBs)."""
    import pickle

    from diloco.engine.island import Island
    from tests.conftest import tiny_config

    island = Island(tiny_config(tmp_path))
    try:
        own = 4 * sum(t.numel() for t in island.outer.theta_global.values())
        assert len(pickle.dumps(island.theta_pieces())) < 1.5 * own + 100_000
    finally:
        island.close()
