"""``diloco experiment islands`` (experiments/many_islands.py) and what it stands on: the report read from what islands
write (rounds committed and by whom, distinct θ_global, bytes and seconds per round, problems named), the memory of
process trees sampled from /proc, and which islands ``simulate`` forks from the warm interpreter.  No island runs
here: the figures are fed from files written the way an island writes them."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from diloco.config import ConfigError
from diloco.launch.memory import MemorySampler
from diloco.launch.simulate import Cluster
from experiments.many_islands import count_result, main, markdown, parse_counts, row, timeouts_for, write_report
from tests.conftest import tiny_config


def _island(run_dir: Path, rounds: list[dict], summary: dict | None) -> Path:
    """An island's run dir as the island leaves it: a record per round in metrics.jsonl, the summary at the end."""
    run_dir.mkdir(parents=True)
    lines = [{"loss": 5.0, "tokens": 0, "time": 0.0}]  # not a round's record
    for i, r in enumerate(rounds):
        lines.append({"outer_step": i + 1, "round_ok": int(r.get("ok", True)), "num_peers": r.get("peers", 3),
                      "round_failure": r.get("failure", ""), "averaging_backend": r.get("backend", "hivemind"),
                      "time": r["time"], "stall_seconds": r.get("stall", 1.0), "group_seconds": r.get("group", 0.5),
                      "allreduce_seconds": 0.8, "bytes_sent": 1000 * (i + 1), "payload_bytes_sent": 100 * (i + 1)})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def _summary(checksum: str, sent: int, payload: int) -> dict:
    return {"theta_checksum": checksum, "bytes_sent": sent, "bytes_received": sent, "payload_bytes_sent": payload}


def test_a_count_reports_its_commits_its_distinct_theta_and_each_problem_by_name(tmp_path):
    """Three islands, three rounds: one island leaves round 2 out and catches up, one dies after round 2 without a
    summary.  Each round's committers are counted, θ_global is one among the islands that finished, the bytes are
    divided by the rounds recorded, round seconds run from one round's last end to the next, and both failures are
    named."""
    dirs = [
        _island(tmp_path / "island0", [{"time": 10.0}, {"time": 20.0}, {"time": 31.0}], _summary("aa", 3300, 330)),
        _island(tmp_path / "island1", [{"time": 11.0}, {"time": 21.0, "ok": False, "backend": "caught-up",
                                                        "failure": "the run committed without this island"},
                                       {"time": 30.0}], _summary("aa", 3000, 200)),
        _island(tmp_path / "island2", [{"time": 12.0}, {"time": 22.0}], None),
    ]
    r = count_result(3, 3, dirs, {0: 0, 1: 0, 2: 1}, wall_seconds=40.0)
    assert r["committed_by"] == [3, 2, 2]
    assert r["rounds_committed"] == r["rounds_committed_by_majority"] == 3
    assert r["island_rounds"] == 8 and r["island_rounds_failed"] == r["island_rounds_left_out"] == 1
    assert r["round_failures"] == {"the run committed without this island": 1}
    assert r["theta_distinct"] == 1 and r["islands_without_summary"] == 1
    # island2 counts with its last record's totals (2000 B, payload 200 B)
    assert r["wire_bytes_per_island_round"] == pytest.approx((3300 + 3000 + 2000) / 8)
    assert r["payload_bytes_per_island_round"] == pytest.approx((330 + 200 + 200) / 8)
    assert r["round_seconds"]["median"] == pytest.approx(9.5)  # ends 12, 22, 31
    assert r["group_seconds"]["median"] == pytest.approx(0.5)
    assert not r["ok"]
    assert any("island2 (1)" in p for p in r["problems"]) and any("no summary" in p for p in r["problems"])
    cells = dict(zip(["islands", "committed", "majority", "theta"], row(r)))
    assert cells["committed"] == "3/3 (2–3 islands)" and cells["theta"] == "1"


def test_a_run_that_split_shows_its_factions_and_rounds_no_majority_committed(tmp_path):
    """Four islands that averaged in two pairs: every round 'committed' by someone, none by a majority, and two
    θ_global at the end (2+2) - what issue #62 saw at 24 islands."""
    dirs = [_island(tmp_path / f"island{i}", [{"time": 10.0 + i, "peers": 2}, {"time": 20.0 + i, "peers": 2}],
                    _summary("ab"[i // 2], 2000, 200)) for i in range(4)]
    r = count_result(4, 2, dirs, {i: 0 for i in range(4)})
    assert r["committed_by"] == [4, 4] and r["largest_group"] == [2, 2]
    assert r["rounds_committed"] == 2 and r["rounds_committed_by_majority"] == 0
    assert r["theta_distinct"] == 2 and r["theta_factions"] == [2, 2]
    assert "2 different θ_global at the end" in r["problems"]
    text = markdown([r], "diloco experiment islands --counts 4", ["a note"])
    assert "| 2/2 (4 each) " in text and "| 0/2 " in text and "| 2 (2+2) " in text and "- a note" in text


def test_the_report_is_written_after_each_count(tmp_path):
    dirs = [_island(tmp_path / "runs" / f"island{i}", [{"time": 1.0 + i}, {"time": 5.0 + i}], _summary("aa", 900, 90))
            for i in range(2)]
    results = [count_result(2, 2, dirs, {0: 0, 1: 0}, wall_seconds=7.0, cpu_busy=0.97)]
    write_report(results, tmp_path, "diloco experiment islands --counts 2", cores=2, started_warm=True)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["results"][0]["theta_distinct"] == 1 and saved["results"][0]["ok"]
    assert "| 2/2 (2 each) " in (tmp_path / "results.md").read_text()
    assert (tmp_path / "islands.png").stat().st_size > 0


def test_timeouts_grow_with_islands_per_core_and_bad_counts_are_refused(capsys):
    few, many = timeouts_for(4, cores=2), timeouts_for(64, cores=2)
    assert set(few) == set(many) and all(many[k] > few[k] for k in few)
    assert timeouts_for(2, cores=16) == timeouts_for(1, cores=16)  # islands with a core each: the defaults' floor
    assert parse_counts("8, 16,32") == [8, 16, 32]
    for bad in ("1", "8,x", ""):
        with pytest.raises(ConfigError):
            parse_counts(bad)
    assert main(["--counts", "8,one", "--out", "/nonexistent/never"]) == 2
    assert capsys.readouterr().err.startswith("error: --counts takes island counts")


def _tree(ready) -> None:
    """A process with a child, both holding 20 MB, in a process group of their own until killed."""
    os.setpgrp()
    block = bytearray(20 * 1024 * 1024)
    if os.fork() == 0:
        block2 = bytearray(20 * 1024 * 1024)  # noqa: F841
        time.sleep(60)
        os._exit(0)
    ready.set()
    time.sleep(60)
    del block


def test_the_memory_sampler_follows_each_tree_and_counts_shared_pages_once():
    """Two trees of two processes: each tree's peak is its own two processes' memory, and the sum over all of this
    process's children (PSS) is at least the trees' and less than their RSS (the libraries are shared)."""
    ctx = multiprocessing.get_context("fork")
    events = [ctx.Event() for _ in range(2)]
    procs = [ctx.Process(target=_tree, args=(e,), daemon=True) for e in events]
    for p in procs:
        p.start()
    try:
        assert all(e.wait(30) for e in events)
        time.sleep(0.3)
        sampler = MemorySampler(lambda: {i: p.pid for i, p in enumerate(procs)})
        sampler.sample()
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.join()
    trees = sampler.peak_island
    assert set(trees) == {0, 1}
    for t in trees.values():
        assert t.processes == 2 and "island" in t.pss_by_name_kb and len(t.pss_by_name_kb) == 2  # the root, its child
        assert t.pss_kb >= 2 * 20 * 1024  # each process wrote its 20 MB
        assert t.pss_kb < t.rss_kb
    total = sampler.peak_total
    assert total.processes >= 4
    assert sum(t.pss_kb for t in trees.values()) <= total.pss_kb < total.rss_kb


def test_simulate_forks_cpu_islands_warm_unless_told_not_to(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, **{"averaging.backend": "hivemind"})
    monkeypatch.delenv("DILOCO_WARM_ISLANDS", raising=False)
    asked, plain = Cluster(cfg, 2, fork_warm=True), Cluster(cfg, 2)
    assert asked.forks_warm(0) and not plain.forks_warm(0)
    wrapped = Cluster(cfg, 2, fork_warm=True, wrap=lambda cmd, i: ["nice", *cmd])
    assert not wrapped.forks_warm(0)
    asked.gpus = ["0", "1"]  # islands on GPUs start cold unless the environment says warm
    assert not asked.forks_warm(1)
    monkeypatch.setenv("DILOCO_WARM_ISLANDS", "0")
    assert not Cluster(cfg, 2, fork_warm=True).forks_warm(0)
    monkeypatch.setenv("DILOCO_WARM_ISLANDS", "1")
    assert plain.forks_warm(0) and asked.forks_warm(1)
