"""The figures of ``benchmarks/vs_torchft.py`` from its replicas' records, and its refusal without torchft's
environment.  Needs no torchft: the records here are written by hand, in the shape both sides' readers produce."""

from __future__ import annotations

import pytest

from benchmarks.vs_torchft import VENV_COMMAND, main, same_theta, summarize, table


def _replica(arrived: list[float], held: list[float], tokens: list[tuple[int, float]], theta: str = "t") -> dict:
    return {"rounds": [{"round": k + 1, "arrived": a, "held": h, "membership": h / 4, "exchange": h / 2,
                        "vote": 0.01, "committed": True} for k, (a, h) in enumerate(zip(arrived, held))],
            "step_tokens_per_s": [list(t) for t in tokens], "theta_checksum": theta, "loop_seconds": 5.0}


def test_the_last_to_arrive_is_chosen_per_round_and_the_first_round_is_left_out():
    # replica 0 arrives last in round 2, replica 1 in rounds 3 and 4; round 1 (the meeting) holds 9 s
    a = _replica([0.0, 10.0, 20.0, 30.0], [9.0, 0.1, 0.5, 0.6], [(1, 1.0), (2, 100.0), (3, 120.0), (4, 110.0)])
    b = _replica([0.5, 9.0, 21.0, 31.0], [9.0, 0.4, 0.2, 0.3], [(1, 1.0), (2, 200.0), (3, 220.0), (4, 210.0)])
    s = summarize([a, b])
    assert s["rounds"] == 3 and s["committed"] == 6
    assert s["held"] == pytest.approx(0.35)  # median of 0.1, 0.5, 0.6, 0.4, 0.2, 0.3
    assert s["held_last"] == pytest.approx(0.2)  # median of 0.1 (round 2), 0.2 (round 3), 0.3 (round 4)
    assert s["last"]["exchange"] == pytest.approx(0.1)
    assert "committed" not in s["last"] and "arrived" not in s["last"]
    assert s["tokens_per_s"] == [110.0, 210.0]


def test_the_table_divides_ours_by_torchfts_and_compares_theta():
    ref = _replica([0.0, 1.0], [1.0, 0.2], [(2, 100.0)], theta="x")
    ours = _replica([0.0, 1.0], [1.0, 0.4], [(2, 50.0)], theta="x")
    other = _replica([0.0, 1.0], [1.0, 0.4], [(2, 50.0)], theta="y")
    cases = {name: {"summary": summarize([r, r]), "wall_seconds": wall, "cpu_seconds": 2 * wall,
                    "load": [1.0, 2.0]}
             for name, r, wall in (("torchft", ref, 10.0), ("ours", ours, 15.0), ("ours delayed", other, 20.0))}
    rows = "\n".join(table("9m", 9_000_000, cases))
    assert "| training held by the round | 0.200 s | 0.400 s | 0.400 s | 2.00× | 2.00× |" in rows
    assert "| whole run (launch to exit) | 10 s | 15 s | 20 s | 1.50× | 2.00× |" in rows
    assert "0.50× | 0.50× |" in rows  # tokens/s
    assert same_theta(cases["ours"], cases["torchft"]) == "yes"
    assert same_theta(cases["ours delayed"], cases["torchft"]) == "no"


def test_without_torchfts_environment_it_says_how_to_make_one(tmp_path, capsys):
    assert main(["--torchft-python", str(tmp_path / "no-such-python"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert VENV_COMMAND in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "results.md").exists()


def test_a_case_that_fails_is_reported_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    """The 40M ``delayed`` case once ended with an island's error, and the whole benchmark stopped there."""
    import benchmarks.vs_torchft as bench

    replicas = [_replica([0.0, 1.0, 2.0], [1.0, 0.2, 0.3], [(2, 100.0)], theta="x")] * 2
    ran = {"wall_seconds": 10.0, "cpu_seconds": 20.0, "load": [1.0, 1.0]}

    def ours(items, overlap, run_dir, timeout):
        if overlap == "delayed":
            raise bench.BenchError(f"ours ({overlap}) exited with status 3; see {run_dir}.log")
        return {"replicas": replicas, **ran}

    monkeypatch.setattr(bench, "torchft_ready", lambda python: True)
    monkeypatch.setattr(bench, "run_torchft", lambda python, items, out, timeout: {"replicas": replicas, **ran})
    monkeypatch.setattr(bench, "run_ours", ours)
    monkeypatch.setattr(bench, "params_of", lambda size: 9_000_000)
    assert main(["--sizes", "9m,40m", "--out", str(tmp_path)]) == 1
    report = (tmp_path / "results.md").read_text()
    assert report.count("ours delayed failed: ours (delayed) exited with status 3") == 2  # both sizes, each reported
    assert "| 40m (9.0M), per round" in report and "| training held by the round | 0.250 s | 0.250 s | 1.00× |" in report
    assert "Traceback" not in capsys.readouterr().err
