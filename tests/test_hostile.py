"""An island of the run that attacks it, with real island processes over hivemind on loopback (issue #63).

Three islands of the tiny model average with ``--averaging.aggregate centered-clip`` and ``--averaging.strikes 2``;
island 2 holds the run key and sends a pseudo-gradient scaled by 1e6 in rounds 2 to 4 (``DILOCO_FAULTS``).  The
member check rejects its Δ in every round it takes part in, every member alike (a robust rule checks every member's
whole Δ), so the strikes the run holds are the same on every island; after two committed rounds that rejected it, it
is left out of the run's rounds.  The two honest islands commit every round and end with one θ_global."""

from __future__ import annotations

import math

from diloco.engine.metrics import read_metrics
from diloco.launch.simulate import Cluster
from tests.conftest import tiny_config

ROUNDS = 6
ATTACKER = 2
BANNED = "this island is left out of the run's rounds: the run rejected its pseudo-gradient in 2 committed rounds"


def test_an_attacker_is_rejected_struck_and_left_out_while_the_honest_islands_commit_every_round(
        tmp_path, no_leaked_daemons):
    cfg = tiny_config(tmp_path, **{
        "averaging.backend": "hivemind", "averaging.min_group_size": 2, "averaging.matchmaking_time": 2.0,
        "averaging.request_timeout": 0.5, "averaging.matchmaking_timeout": 12.0, "averaging.vote_timeout": 4.0,
        "averaging.allreduce_timeout": 10.0, "averaging.next_chunk_timeout": 3.0, "averaging.member_ttl": 20.0,
        "averaging.aggregate": "centered-clip", "averaging.strikes": 2, "diloco.outer_steps": ROUNDS,
        "diloco.inner_steps": 20})
    cluster = Cluster(cfg, 3, env={ATTACKER: {"DILOCO_FAULTS": "scale@send:2-4"}})
    try:
        cluster.start_all()
        cluster.wait(timeout=180, allow_failures=True)  # the struck attacker may exit 3: asserted below
    finally:
        cluster.stop_all()
    codes = [cluster.procs[i].returncode for i in range(3)]
    summaries = cluster.summaries()
    honest = [summaries[i] for i in range(3) if i != ATTACKER]
    for s in honest:
        assert s["outer_step"] == ROUNDS and s["rounds_ok"] == ROUNDS, s["failures"]
        assert math.isfinite(s["eval_loss_end"]) and s["eval_loss_end"] < s["eval_loss_start"], s
    assert honest[0]["theta_checksum"] == honest[1]["theta_checksum"]
    rounds = {i: {r["outer_step"]: r for r in read_metrics(cluster.run_dirs[i]) if "round_ok" in r} for i in range(3)}
    attacker_id = None
    for i in (0, 1):
        # the attacker's Δ counted for nothing in every committed round it took part in after it started (2, 3), and
        # never again once struck twice: rounds 4 to 6 average the two honest islands alone
        rejected = {n: r["rejected"] for n, r in rounds[i].items() if r["rejected"]}
        assert sorted(rejected) == [2, 3], rejected
        ids = {p for ps in rejected.values() for p in ps.split(",")}
        assert len(ids) == 1, rejected
        attacker_id = attacker_id or ids.pop()
        assert all(rounds[i][n]["num_peers"] == 2 for n in range(4, ROUNDS + 1)), rounds[i]
        log = cluster.logs[i].read_text()
        assert "gets a strike (1 of 2)" in log and "gets a strike (2 of 2)" in log, log[-3000:]
    # the attacker: its rounds from 4 on fail with the one line that says why.  It trains on, alone; whether it ends
    # holding the run's θ_global depends on timing: a round it fails while the others move past it ends in taking
    # their state (it then ends in sync, exit 0); a last round refused as struck out leaves it with its own θ_global,
    # which it says in one line, exit 3 (as any island that ends out of sync)
    assert codes[:2] == [0, 0], codes
    # from round 4 on it commits nothing: each round it reaches in time is refused as struck out, and, since the
    # honest islands no longer count or wait for a struck island, it may instead reach a round after their roster
    # left (it then takes their θ_global)
    failures = summaries[ATTACKER]["failures"]
    assert summaries[ATTACKER]["rounds_ok"] <= 3, failures
    why = (BANNED, "the other islands moved past this round without this island", "behind the run, caught up")
    assert all(any(w in f for w in why) and int(f.split(":")[0].split()[1]) >= 4 for f in failures), failures
    assert codes[ATTACKER] in (0, 3), codes
    out_of_sync = summaries[ATTACKER].get("out_of_sync", "")
    assert (codes[ATTACKER] == 3) == bool(out_of_sync), (codes, out_of_sync)
    if codes[ATTACKER] == 3:
        assert out_of_sync.startswith("the run ended out of sync: θ_global of 2 of the "), out_of_sync
        assert f"error: {out_of_sync}" in cluster.logs[ATTACKER].read_text()
    else:
        assert summaries[ATTACKER]["theta_checksum"] == honest[0]["theta_checksum"]


def test_the_honest_islands_average_alone_from_the_first_round_after_which_every_group_was_theirs_alone():
    from experiments.hostile import alone_from

    rounds = [(1, 4, 1), (2, 4, 1), (3, 3, 0), (4, 3, 1), (5, 3, 1), (6, 3, 1)]
    records = [{"outer_step": s, "num_peers": n, "round_ok": ok} for s, n, ok in rounds]
    assert alone_from(records, 3) == 4  # round 3 failed: it counts for neither
    assert alone_from(records + [{"outer_step": 7, "num_peers": 4, "round_ok": 1}], 3) is None
    assert alone_from(records, 4) == 1 and alone_from([], 3) is None


def test_every_arm_is_compared_with_the_clean_mean_arm_of_its_own_seed():
    """Several seeds: a robust rule's cost with nobody attacking is each seed's ratio to that seed's clean ``mean``
    arm (a seed that trains worse must not count against another's rule), summed up as mean and worst."""
    from experiments.hostile import over_seeds, parse_seeds, rows

    def arm(rule: str, seed: int, loss: float) -> dict:
        return {"attack": "clean", "aggregate": rule, "seed": seed, "eval_loss_end": loss, "rounds_committed": [6, 6],
                "rounds": 6, "theta_distinct": 1, "wall_seconds": 1.0}

    results = [arm("mean", 0, 2.0), arm("centered-clip", 0, 2.02), arm("mean", 1, 3.0), arm("centered-clip", 1, 2.97)]
    assert [r[4] for r in rows(results)] == ["1.000", "1.010", "1.000", "0.990"]
    assert over_seeds(results) == ["clean under centered-clip, over 2 seeds: 1.0000× the clean mean arm on average, "
                                   "1.0100× at worst"]
    assert parse_seeds("0, 1,2") == [0, 1, 2] and parse_seeds("") is None


def test_colluding_attackers_are_counted_apart_from_the_honest_islands(tmp_path):
    """``--attackers 2`` of 8: the last two islands are the attackers, whatever they write; the honest figures are the
    other six's, and the attackers count as left out only once both are."""
    import json

    from experiments.hostile import HEADERS, arm_result, row

    dirs = []
    for i in range(8):
        d = tmp_path / f"island{i}"
        d.mkdir()
        liar = i >= 6
        failures = [f"round {5 + i - 6}: {BANNED}"] if liar else []
        (d / "summary.json").write_text(json.dumps({"eval_loss_end": 9.0 if liar else 2.0, "rounds_ok": 4 if liar else 6,
                                                    "theta_checksum": f"own{i}" if liar else "run",
                                                    "failures": failures}))
        (d / "train.log").write_text("" if liar else "island x gets a strike (2 of 2)\n")
        (d / "metrics.jsonl").write_text(json.dumps({"round_ok": 1, "outer_step": 1, "eval/loss": 2.0}) + "\n")
        dirs.append(d)
    codes = {i: (3 if i == 7 else 0) for i in range(8)}
    r = arm_result("flip-mean", "flip", "mean", dirs, codes, 1.0, attackers=2)
    assert (r["honest_islands"], r["eval_loss_end"], r["theta_distinct"], r["rounds_committed"]) == (6, 2.0, 1, [6] * 6)
    assert (r["attackers"], r["attacker_exit"], r["attacker_rounds_ok"], r["left_out_from"]) == (2, [0, 3], [4, 4], 6)
    assert r["error"] == "" and r["strikes"] == 2  # an attacker's exit 3 is no honest island's error
    assert r["alone_from"] is None  # island 0's records name no group sizes
    assert row(dict(r, rounds=6), 2.0)[HEADERS.index("attacker exit")] == "0, 3"
    one = arm_result("flip-mean", "flip", "mean", dirs, codes, 1.0)  # one attacker: island 6 counted as honest
    assert one["honest_islands"] == 7 and one["attacker_exit"] == 3 and one["theta_distinct"] == 2
