"""The comparison runner end to end: single worker, synchronous baseline and DiLoCo, then the report."""

from __future__ import annotations

import json

import pytest

from diloco.engine.metrics import read_metrics
from experiments import netns
from experiments.compare import (
    arm_settings,
    curve_from_metrics,
    matched_budget,
    run_compare,
    unknown_arms,
)
from experiments.islands import CompareError, variant
from tests.conftest import PART_LOST, tiny_config

COMMON = {
    "averaging.min_group_size": 2, "averaging.matchmaking_time": 2.0, "averaging.request_timeout": 1.0,
    "averaging.matchmaking_timeout": 60.0, "diloco.inner_steps": 4, "diloco.outer_steps": 2,
}


def _check_report(out, H: int) -> dict:
    for name in ("loss_vs_tokens.png", "loss_vs_bytes.png", "loss_vs_time.png", "results.md", "results.json"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "loss_vs_tokens.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "results.md").read_text()
    for run in ("single", "baseline-ddp-2 (ref)", f"diloco-2x-H{H}"):
        assert f"| {run}" in md, md
    assert "wall ≈ compute" in md and "acceptance:" in md
    data = json.loads((out / "results.json").read_text())
    runs = {r["name"]: r for r in data["runs"]}
    single, base, dl = runs["single"], runs["baseline-ddp-2"], runs[f"diloco-2x-H{H}"]
    # same steps per worker, same per-worker batch: the baseline and DiLoCo see k× the single worker's tokens
    assert base["curve"][-1]["tokens"] == dl["curve"][-1]["tokens"] == 2 * single["curve"][-1]["tokens"] > 0
    assert [p["tokens"] for p in base["curve"]] == [p["tokens"] for p in dl["curve"]]
    assert single["bytes_per_worker"] == 0
    # hivemind may lose an all-reduce part under load: the vote rejects that round on every island alike
    assert not [f for f in dl["extra"]["failures"] if PART_LOST not in f], dl["extra"]["failures"]
    ok, failed = dl["extra"]["rounds_ok"], dl["extra"]["rounds_failed"]
    assert len(set(ok)) == 1 and ok[0] >= 1 and [a + b for a, b in zip(ok, failed)] == [2, 2], (ok, failed)
    # a round that averaged again (a member that never learned of its group) sent its bytes twice; a rejected
    # round sent its bytes too
    retried = [r for i in range(2) for r in read_metrics(out / "runs" / "diloco" / f"island{i}") if r.get("retried")]
    if retried:
        assert H / 2 <= data["acceptance"]["bytes_reduction"] < H, retried
    else:
        assert data["acceptance"]["bytes_reduction"] == pytest.approx(H, rel=1e-3)
        assert data["acceptance"]["bytes_ok"]
    for r in (single, base, dl):
        assert r["final_eval_loss"] < r["curve"][0]["eval_loss"]
    return data


def test_compare_end_to_end(tmp_path, no_leaked_daemons):
    """One comparison (single worker, DDP baseline, DiLoCo fp32 and top-k) from one warm start: over links
    emulated at 50 Mbit/s in network namespaces where this machine allows them, else on loopback."""
    emulated, why_not = netns.available()
    before = set(netns.list_namespaces()) if emulated else set()
    cfg = tiny_config(tmp_path / "unused", **COMMON)
    rate = "50mbit" if emulated else None
    md = run_compare(cfg, 2, rate, tmp_path / "out", progress=False, codecs=["topk"],
                     warm_start_steps=6, warm_start_lr=2e-3)
    assert md == tmp_path / "out" / "results.md"
    data = _check_report(tmp_path / "out", H=4)
    # all runs start where the warm start ended, not from the seeded initialisation
    warm = curve_from_metrics(tmp_path / "out" / "runs" / "warm_start" / "island0")
    assert warm[-1]["eval_loss"] < warm[0]["eval_loss"]
    for run in data["runs"]:
        assert run["curve"][0]["eval_loss"] == pytest.approx(warm[-1]["eval_loss"], rel=1e-6), run["name"]
    assert any(n.startswith("start: every run starts from the same warm start, 6 AdamW steps of one worker (peak lr 0.002)") for n in data["notes"])
    # the metrics of every run are where the report says
    assert curve_from_metrics(tmp_path / "out" / "runs" / "baseline")[-1]["outer_step"] == 2
    runs = {r["name"]: r for r in data["runs"]}
    fp32, topk = runs["diloco-2x-H4"], runs["diloco-codec-topk"]
    assert 0 < topk["bytes_per_worker"] < fp32["bytes_per_worker"] / 10
    assert topk["extra"]["theta_global_max_abs_diff"] == 0.0
    assert any(n.startswith("codec: diloco-codec-topk: held-out loss") for n in data["notes"])
    # the same settings and start again with another codec: (a), (b) and (c) are the first run's, only int4 runs
    again = variant(cfg, **{"checkpoint.init_from": data["config"]["checkpoint"]["init_from"]})
    run_compare(again, 2, rate, tmp_path / "again", progress=False, codecs=["int4"],
                reuse=tmp_path / "out" / "results.json")
    second = json.loads((tmp_path / "again" / "results.json").read_text())
    runs2 = {r["name"]: r for r in second["runs"]}
    for name in ("single", "baseline-ddp-2", "diloco-2x-H4"):
        assert runs2[name]["final_eval_loss"] == runs[name]["final_eval_loss"], name
    assert sorted(p.name for p in (tmp_path / "again" / "runs").iterdir()) == ["diloco-codec-int4"]
    assert runs2["diloco-codec-int4"]["curve"][0]["eval_loss"] == pytest.approx(warm[-1]["eval_loss"], rel=1e-6)
    assert runs2["diloco-codec-int4"]["extra"]["theta_global_max_abs_diff"] == 0.0
    assert any(n.startswith("reused: the single worker, baseline and DiLoCo (fp32)") for n in second["notes"])
    for other, other_rate in ((variant(again, seed=cfg.seed + 1), rate), (again, "7mbit")):  # neither can stand in
        with pytest.raises(CompareError, match="other settings, another start or another link"):
            run_compare(other, 2, other_rate, tmp_path / "other", progress=False, codecs=["int4"],
                        reuse=tmp_path / "out" / "results.json")
    if not emulated:
        print(f"links not emulated: {why_not}")
        assert data["measured_link_bits_per_second"] is None
        assert any("loopback" in n for n in data["notes"])
        return
    # the link counters (DHT, votes and state downloads included, which outweigh a tiny model's payload)
    # see at least what the codec counted
    assert topk["extra"]["wire_bytes_sent_max_host"] >= topk["bytes_per_worker"]
    rate = data["measured_link_bits_per_second"]
    assert 30e6 < rate < 55e6  # tbf at 50 Mbit/s; TCP goodput a few % lower
    assert any("TCP goodput measured" in n for n in data["notes"])
    assert any("bytes on the wire" in n for n in data["notes"])
    assert set(netns.list_namespaces()) <= before  # every namespace and link is gone


def test_sweep_verdicts_and_report(tmp_path):
    from experiments.sweeps import SWEEPS, verdict, write_sweep_report

    def rows(pairs, **extra):
        return [dict({"value": v, "perplexity": p, "islands": 2, "H": 50, "outer_optimizer": "nesterov",
                      "rounds_ok": 1, "rounds_failed": 0, "final_eval_loss": 1.0, "bytes_per_worker": 1e6,
                      "wall_seconds": 1.0, "curve": [{"tokens": 0, "eval_loss": 5.0}, {"tokens": 10, "eval_loss": 1.0}]},
                     **extra) for v, p in pairs]

    assert verdict("islands", rows([(1, 16.2), (2, 15.6), (4, 15.2), (8, 15.0)])).startswith("agrees")
    assert verdict("islands", rows([(1, 15.0), (4, 15.2)])).startswith("differs")
    assert verdict("H", rows([(10, 9.0), (50, 7.0), (100, 7.1), (500, 8.0)])).startswith("agrees")
    assert verdict("H", rows([(50, 8.0), (500, 7.0)])).startswith("differs")
    assert verdict("outer", rows([("nesterov", 7.0), ("avg", 7.5)])).startswith("agrees")
    assert verdict("outer", rows([("nesterov", 7.5), ("avg", 7.0)])).startswith("differs")
    md = write_sweep_report(SWEEPS["islands"], rows([(1, 16.2), (4, 15.2)]), tmp_path, scale="scale: test",
                            elapsed=1.0, config={})
    text = md.read_text()
    assert "15.18 (−6.5%)" in text and "**agrees" in text and "-6.17%" in text
    assert (tmp_path / "islands.png").read_bytes()[:4] == b"\x89PNG"


def test_overlapped_arms_join_a_codec_by_plus():
    assert arm_settings("delayed+int8") == {"diloco.overlap": "delayed", "averaging.compression": "int8"}
    assert arm_settings("eager") == {"diloco.overlap": "eager"}
    assert unknown_arms(["delayed", "eager+int4", "delayed+", "fast", "int8", "eager+zip"]) == [
        "delayed+", "fast", "int8", "eager+zip"]


def test_timed_arms_train_as_long_per_round_as_the_blocking_run(tmp_path):
    """A timed arm's budget is the blocking islands' median compute seconds per round; without a blocking run
    it says so instead of running with a budget it cannot know."""
    items = arm_settings("delayed-timed+int8")
    with pytest.raises(CompareError, match="run the blocking arm first"):
        matched_budget(items, tmp_path)
    for i, (compute, rounds) in enumerate([(60.0, 6), (66.0, 6), (120.0, 6)]):
        (tmp_path / f"island{i}").mkdir()
        (tmp_path / f"island{i}" / "summary.json").write_text(json.dumps({"compute_seconds": compute,
                                                                          "outer_step": rounds}))
    assert matched_budget(items, tmp_path) == {"diloco.overlap": "delayed", "averaging.compression": "int8",
                                               "diloco.sync_every": "11.00s"}
    assert matched_budget(arm_settings("eager"), tmp_path) == {"diloco.overlap": "eager"}


def test_horizon_reads_a_round_of_fragments_as_its_last_sync(tmp_path):
    """With P fragments a round of H steps is P syncs: the curve takes θ_global after syncs P, 2P, …"""
    from experiments.horizon import losses_per_round, tokens_of

    island = tmp_path / "island0"
    island.mkdir()
    rows = [{"outer_step": 0, "eval/loss": 2.0}] + [
        {"outer_step": s, "round_ok": 1, **({"eval/loss": 2.0 - 0.1 * s} if s % 2 == 0 else {})} for s in range(1, 7)]
    (island / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (island / "summary.json").write_text(json.dumps({"tokens": 300}))
    assert losses_per_round(tmp_path, 2) == pytest.approx([2.0, 1.8, 1.6, 1.4])
    assert losses_per_round(tmp_path) == pytest.approx([2.0, float("nan"), 1.8, float("nan"), 1.6, float("nan"), 1.4],
                                                      nan_ok=True)
    assert tokens_of(tmp_path) == 300


def test_horizon_report_gaps_and_bad_arguments(tmp_path, capsys):
    from diloco.config import loader as config_load
    from experiments.compare import COMPARE_DEFAULTS
    from experiments.horizon import (
        REFERENCE,
        _plot,
        _write_report,
        gap,
        main,
        run_name,
        settings_of,
        unknown,
    )

    assert unknown(["blocking", "topk", "delayed+int8", "eager+", "slow"]) == ["eager+", "slow"]
    # an arm of a sweep: settings of its own after @
    assert unknown(["sparseloco@diloco.outer_lr=0.5", "topk@averaging.topk_density", "slow@a=1"]) == [
        "topk@averaging.topk_density", "slow@a=1"]
    assert settings_of("sparseloco@averaging.error_feedback_decay=0.9@diloco.outer_lr=2")[
        "averaging.error_feedback_decay"] == "0.9"
    assert settings_of("blocking@diloco.outer_lr=2") == {"diloco.outer_lr": "2"}
    assert run_name("delayed+int8@diloco.outer_lr=0.5") == "delayed-int8_diloco_outer_lr-0_5"
    # compare's and the frontier's codec arms read the same settings of their own
    from experiments.compare import codec_settings, unknown_codecs
    assert codec_settings("sparseloco@diloco.outer_lr=4") == {**settings_of("sparseloco"), "diloco.outer_lr": "4"}
    assert unknown_codecs(["int4", "sparseloco@diloco.outer_lr=4", "int4@x", "delayed"]) == ["int4@x", "delayed"]
    curves = {REFERENCE: [1.6, 1.5, 1.4, 1.3], "delayed": [1.6, 1.55, 1.43, 1.31]}
    assert abs(gap(curves, "delayed", 3) - (1.31 / 1.3 - 1)) < 1e-12 and gap(curves, "delayed", 9) != gap(curves, "delayed", 9)
    _plot(curves, tmp_path / "horizon.png")
    assert (tmp_path / "horizon.png").read_bytes()[:4] == b"\x89PNG"
    text = _write_report(curves, [1, 3], 4, config_load.load(None, [], defaults=COMPARE_DEFAULTS), tmp_path).read_text()
    assert "1.3100 (+0.77%)" in text and "+3.33% after round 1, +0.77% after round 3" in text
    text = _write_report(curves, [3], 4, config_load.load(None, [], defaults=COMPARE_DEFAULTS), tmp_path,
                         {REFERENCE: 1000, "delayed": 1100}).read_text()
    assert "+0.77% after round 3; +10.0% tokens against blocking" in text
    assert main(["--arms", "delayed,fast", "--at", "40", "--rounds", "12"]) == 2
    err = capsys.readouterr().err
    assert "--arms fast is not one of" in err and "--at must list rounds between 1 and --rounds 12" in err
    # an arm's own setting that cannot work is told before any arm runs
    assert main(["--arms", "sparseloco@averaging.topk_density=2", "--rounds", "2", "--out", str(tmp_path / "h")]) == 2
    assert "topk_density" in capsys.readouterr().err and not (tmp_path / "h" / "runs").exists()
    from experiments.compare import main as compare
    assert compare(["--compression", "sparseloco@diloco.outer_rate=4", "--out", str(tmp_path / "c")]) == 2
    assert "outer_rate" in capsys.readouterr().err and not (tmp_path / "c" / "runs").exists()


def test_unsent_says_what_is_missing_when_no_round_was_checkpointed_by_every_island(tmp_path):
    from experiments.unsent import last_common_states
    for i in (0, 1):
        (tmp_path / f"island{i}" / "checkpoints").mkdir(parents=True)
    (tmp_path / "island0" / "checkpoints" / "ckpt-000003.pt").write_bytes(b"")
    with pytest.raises(SystemExit, match="no outer step checkpointed by every island; run with --checkpoint.every 1"):
        last_common_states(tmp_path)


def test_the_warm_start_of_sharded_islands_is_one_process_whose_checkpoint_every_shape_starts_from(tmp_path):
    """A compare of dp = 2 islands (HSDP against DiLoCo) warms up one process, not a dp = 2 island whose ranks
    checkpoint only their shards, which ``--checkpoint.init_from`` cannot start from."""
    from diloco.model.weights import load_parameters
    from experiments.warm_start import warm_start

    cfg = tiny_config(tmp_path / "unused", **{"parallel.dp": 2})
    ckpt_dir, result = warm_start(cfg, 3, tmp_path / "warm", progress=False)
    params, path = load_parameters(ckpt_dir)
    assert path.parent == ckpt_dir and params and result.final_eval_loss < result.curve[0]["eval_loss"]


def test_lr_sweep_reports_each_optimizers_best_ddp_and_diloco(tmp_path, capsys):
    import json

    from experiments.lr_sweep import main

    def cell(name: str, opt: str, inner: float, outer: float, ddp: float, diloco: float, seed: int = 0) -> None:
        d = tmp_path / name / f"{opt}-k2-H20" / f"seed{seed}"
        d.mkdir(parents=True)
        d.joinpath("results.json").write_text(json.dumps({
            "islands": 2, "config": {"seed": seed, "inner": {"optimizer": opt, "lr": inner},
                                     "diloco": {"outer_lr": outer, "inner_steps": 20}},
            "runs": [{"kind": "ddp", "final_eval_loss": ddp}, {"kind": "diloco", "final_eval_loss": diloco}]}))

    cell("a", "muon", 1e-3, 1.0, 1.45, 1.46)
    cell("b", "muon", 4e-3, 1.0, 1.33, 1.50)
    cell("c", "muon", 4e-3, 0.5, 1.33, 1.43)
    cell("c", "adamw", 4e-3, 0.5, 1.40, 1.46)
    assert main([str(tmp_path)]) == 0
    text = (tmp_path / "results.md").read_text()
    assert ("best DDP: 1.3300 at inner lr 0.004; best DiLoCo: 1.4300 at inner lr 0.004, outer lr 0.5; best DiLoCo "
            "against best DDP: +7.52%") in text
    assert "| 0.001    | 1        | 0     | 1.4500 | 1.4600 | +0.69%" in text
    assert "seeds 0: muon 1.4300, adamw 1.4600; seed by seed -2.05%; one seed: no spread to tell" in text
    assert (tmp_path / "lr_sweep.png").read_bytes()[:4] == b"\x89PNG"
    # two more seeds of the best lrs: the seeds' spread is told
    for seed, (muon, adamw) in {1: (1.42, 1.47), 2: (1.44, 1.435)}.items():
        cell("c", "muon", 4e-3, 0.5, 1.33, muon, seed)
        cell("c", "adamw", 4e-3, 0.5, 1.40, adamw, seed)
    assert main([str(tmp_path)]) == 0
    text = (tmp_path / "results.md").read_text()
    assert "| 0.004    | 0.5      | 0,1,2 | 1.3300 [1.3300, 1.3300] | 1.4300 [1.4200, 1.4400] |" in text
    assert ("seed by seed -2.05%, -3.40%, +0.35%; level with adamw within the spread of the seeds (the ranges "
            "overlap)") in text
    with pytest.raises(SystemExit, match="no frontier cell"):
        main([str(tmp_path / "a" / "muon-k2-H20" / "seed0")])  # a cell's own folder: no cell under it
