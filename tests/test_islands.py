"""Islands end to end: separate processes averaging over real hivemind on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from diloco.launch.simulate import Cluster, simulate
from tests.conftest import tiny_config, wait_until


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
        # the kernel's count of the DHT daemon's connections holds the all-reduce payload and more
        assert 0 < s["payload_bytes_sent"] < s["bytes_sent"]
        assert 0 < s["payload_bytes_received"] < s["bytes_received"]
    assert result["theta_global_max_abs_diff"] < 1e-5
    # all islands evaluate the same θ_global on the same held-out batches
    assert len({round(s["eval_loss_end"], 6) for s in islands}) == 1  # evaluated on the same θ_global


def test_an_island_forked_warm_is_the_island_started_cold(tmp_path, monkeypatch):
    """The suite forks its islands from a warm interpreter (DILOCO_WARM_ISLANDS=1): such an island trains to
    the same θ_global as one started cold, in a session of its own, with the environment it was given (a
    scripted kill is obeyed and reported as a SIGKILL), and its output in its log."""
    runs = {}
    for how in ("cold", "warm", "killed"):
        monkeypatch.setenv("DILOCO_WARM_ISLANDS", "0" if how == "cold" else "1")
        cluster = Cluster(tiny_config(tmp_path / how, **{"diloco.outer_steps": 2}), 1,
                          env={0: {"DILOCO_FAULTS": "kill@inner:2" if how == "killed" else ""}})
        proc = cluster.start(0)
        if how != "cold":
            assert wait_until(lambda: os.getsid(proc.pid) == proc.pid == os.getpgid(proc.pid), 10)
        cluster.wait(timeout=120, allow_failures=how == "killed")
        runs[how] = cluster
    assert runs["killed"].procs[0].returncode == -signal.SIGKILL
    cold, warm = (runs[h].summaries()[0] for h in ("cold", "warm"))
    assert warm["rounds_ok"] == cold["rounds_ok"] == 2
    assert warm["theta_checksum"] == cold["theta_checksum"]
    assert "round 2/2 ok" in runs["warm"].logs[0].read_text()


def test_islands_meet_through_a_standalone_bootstrap_node(tmp_path, no_leaked_daemons):
    """The README's multi-server recipe with a `hivemind-dht` bootstrap node: both islands of a private
    run join through it (neither through the other) and average every round together."""
    boot = subprocess.Popen([str(Path(sys.executable).with_name("hivemind-dht")), "--host_maddrs",
                             "/ip4/127.0.0.1/tcp/0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        address = ""
        deadline = time.time() + 60
        while not address:
            line = boot.stdout.readline()
            assert line and time.time() < deadline, "the bootstrap node printed no address"
            address = next((w for w in line.split() if w.startswith("/ip4/127.0.0.1/") and "/p2p/" in w), "")
        cfg = tiny_config(tmp_path, **{
            "averaging.backend": "hivemind", "averaging.min_group_size": 2, "averaging.run_key": "our-key",
            "averaging.initial_peers": [address], "diloco.outer_steps": 2})
        cluster = Cluster(cfg, 2)
        try:
            for i in range(2):
                assert cluster.configs[i]["averaging"]["initial_peers"] == [address]
                cluster.start(i)
            cluster.wait(timeout=180)
            summaries = cluster.summaries()
        finally:
            cluster.stop_all()
        # an island that arrives after both finished learns from the bootstrap's records that the run ended
        late = subprocess.run([sys.executable, "-m", "diloco.cli", "train", "--config", str(cluster.run_dirs[0] /
                               "config.toml"), "--logging.run_dir", str(tmp_path / "late"),
                               "--averaging.maddr_file", str(tmp_path / "late.maddrs")],
                              capture_output=True, text=True, timeout=120)
    finally:
        os.killpg(boot.pid, signal.SIGTERM)
        boot.wait(30)
    assert [s["rounds_ok"] for s in summaries] == [2, 2], [s["failures"] for s in summaries]
    assert cluster.theta_spread() < 1e-6
    # neither waited for the other to register before asking to be dialed back: one of them registered
    # first, unasked, and the other asked it and was reached
    logs = [log.read_text() for log in cluster.logs]
    assert sorted("reachable: an island of the run connected back" in log for log in logs) == [False, True], logs
    assert sum("no reachable island registered to ask" in log for log in logs) == 1
    assert not any(s["behind_nat"] for s in summaries)
    assert late.returncode == 1, late.stdout + late.stderr
    assert f"run {cfg.averaging.run_id} ended at outer step 2" in late.stderr, late.stdout + late.stderr


def test_an_island_alone_waits_on_the_registry_instead_of_looking_for_a_group(tmp_path, no_leaked_daemons):
    """With nobody else live and groups of two needed, a round waits (looking at the registry once a second)
    and fails saying so, without starting hivemind's matchmaking, which would ask the DHT for averagers
    without pause: an island alone with a bootstrap node sent 9.7 MB in 3 rounds that way, 0.12 MB now."""
    from diloco.engine.island import Island

    cfg = tiny_config(tmp_path, **{"averaging.backend": "hivemind", "averaging.min_group_size": 2,
                                   "averaging.target_group_size": 2, "averaging.matchmaking_time": 1.0, "averaging.request_timeout": 0.5,
                                   "averaging.matchmaking_timeout": 3.0,
                                   "diloco.outer_steps": 1, "diloco.inner_steps": 2})
    summary = Island(cfg).run()
    assert summary["rounds_ok"] == 0 and summary["rounds_failed"] == 1
    assert summary["failures"][0].endswith("no other island is live in the run: waited 3 s for one (without "
                                           "looking for a group)"), summary["failures"]
