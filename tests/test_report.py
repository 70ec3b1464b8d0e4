"""The comparison report writer (experiments/report.py) on synthetic runs."""

from __future__ import annotations

import json
import math
import struct

import pytest

from experiments.report import (
    RunResult,
    format_bytes,
    format_ratio,
    markdown_table,
    perplexity,
    write_report,
)

PNG_SIG = b"\x89PNG\r\n\x1a\n"


def _curve(n, tokens_per_step, bytes_per_step, sec_per_step, offset=0.0):
    return [
        dict(tokens=i * tokens_per_step, bytes=i * bytes_per_step, seconds=i * sec_per_step,
             eval_loss=4.0 * math.exp(-i / 10) + 3.0 + offset)
        for i in range(n + 1)
    ]


def _runs():
    return [
        RunResult("single", "single", 1, _curve(20, 8192, 0, 1.0, 0.1), 3.2, 0.0, 40.0, 38.0),
        RunResult("ddp-4", "ddp", 4, _curve(20, 32768, 4.8e8, 6.0), 3.0, 9.6e9, 120.0, 40.0),
        RunResult("diloco-4", "diloco", 4, _curve(20, 32768, 9.6e6, 2.2, 0.03), 3.03, 1.92e8, 44.0, 39.6,
                  extra={"H": 50}),
    ]


def _table(md: str) -> tuple[list[str], dict[str, dict[str, str]]]:
    lines = [l for l in md.splitlines() if l.startswith("|")]
    split = lambda l: [c.strip() for c in l.strip().strip("|").split("|")]
    headers = split(lines[0])
    assert set(lines[1].replace("|", "").replace(" ", "")) <= set(":-")
    rows = [dict(zip(headers, split(l))) for l in lines[2:]]
    return headers, {r["run"].replace(" (ref)", ""): r for r in rows}


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIG, f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_write_report(tmp_path):
    runs = _runs()
    md_path = write_report(runs, tmp_path / "out", reference="ddp-4",
                           notes=["link rate measured: 19.1 Mbit/s (cap 20mbit)", "synthetic"])
    out = tmp_path / "out"
    assert md_path == out / "results.md"

    for name in ("loss_vs_tokens.png", "loss_vs_bytes.png", "loss_vs_time.png"):
        p = out / name
        assert p.stat().st_size > 10_000, f"{name} suspiciously small"
        w, h = _png_size(p)
        assert w >= 600 and h >= 400

    md = md_path.read_text()
    headers, rows = _table(md)
    assert set(rows) == {"single", "ddp-4", "diloco-4"}
    assert "bytes ÷ ddp-4" in headers and "wall ÷ ddp-4" in headers and "loss vs ddp-4" in headers
    assert "ddp-4 (ref)" in md

    d = rows["diloco-4"]
    assert d["workers"] == "4"
    assert d["final held-out loss"] == "3.0300"
    assert d["perplexity"] == f"{math.exp(3.03):.2f}" == "20.70"
    assert d["bytes / worker"] == "192 MB"
    assert d["wall-clock (s)"] == "44.0"
    assert d["compute util."] == "90.0%"
    assert d["bytes ÷ ddp-4"] == "0.02× (1/50)"
    assert d["wall ÷ ddp-4"] == "0.367×"
    assert d["loss vs ddp-4"] == "+1.00%"

    r = rows["ddp-4"]
    assert r["bytes / worker"] == "9.60 GB"
    assert r["bytes ÷ ddp-4"] == "1×" and r["wall ÷ ddp-4"] == "1×" and r["loss vs ddp-4"] == "+0.00%"
    assert r["compute util."] == "33.3%"

    s = rows["single"]
    assert s["bytes / worker"] == "0 B" and s["bytes ÷ ddp-4"] == "0×"
    assert s["perplexity"] == f"{math.exp(3.2):.2f}"
    assert s["loss vs ddp-4"] == "+6.67%"
    assert s["compute util."] == "95.0%"

    assert "## Notes" in md and "- link rate measured: 19.1 Mbit/s (cap 20mbit)" in md
    assert "![" in md and "(loss_vs_bytes.png)" in md

    data = json.loads((out / "results.json").read_text())
    assert data["reference"] == "ddp-4"
    assert [x["name"] for x in data["runs"]] == ["single", "ddp-4", "diloco-4"]
    dj = data["runs"][2]
    assert dj["extra"] == {"H": 50} and len(dj["curve"]) == 21
    assert dj["derived"]["bytes_ratio"] == pytest.approx(0.02)
    assert dj["derived"]["wall_ratio"] == pytest.approx(44 / 120)
    assert dj["derived"]["perplexity"] == pytest.approx(math.exp(3.03))
    assert dj["derived"]["compute_utilization"] == pytest.approx(0.9)
    assert data["runs"][0]["derived"]["loss_change_pct"] == pytest.approx(20 / 3)


def test_default_reference_and_degenerate_runs(tmp_path):
    runs = [
        RunResult("solo", "single", 1, [], 3.5, 0.0, 10.0, 9.0),  # no curve at all
        RunResult("ddp", "ddp", 2, [{"tokens": 1, "bytes": 0, "seconds": 1, "eval_loss": float("nan")}],
                  float("nan"), 0.0, 0.0, 0.0),
    ]
    md = write_report(runs, tmp_path, notes="one note").read_text()
    headers, rows = _table(md)
    assert "bytes ÷ ddp" in headers  # the ddp run is the default reference
    assert rows["solo"]["bytes ÷ ddp"] == "—"  # 0 / 0
    assert rows["solo"]["wall ÷ ddp"] == "∞"
    assert rows["ddp"]["final held-out loss"] == "n/a" and rows["ddp"]["compute util."] == "n/a"
    assert "- one note" in md
    for name in ("loss_vs_tokens.png", "loss_vs_bytes.png", "loss_vs_time.png"):
        _png_size(tmp_path / name)
    json.loads((tmp_path / "results.json").read_text())  # NaN written as null, still valid JSON


def test_write_report_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError):
        write_report([], tmp_path)
    with pytest.raises(ValueError, match="reference"):
        write_report(_runs(), tmp_path, reference="nope")
    dup = _runs()
    dup[1].name = "single"
    with pytest.raises(ValueError, match="unique"):
        write_report(dup, tmp_path)


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (999, "999 B"),
        (1000, "1.00 kB"),
        (1234, "1.23 kB"),
        (12_345_678, "12.3 MB"),
        (123_400_000, "123 MB"),
        (999_999, "1.00 MB"),
        (9_996, "10.0 kB"),
        (1.05e9, "1.05 GB"),
        (2.5e12, "2.50 TB"),
        (-2048, "-2.05 kB"),
        (float("nan"), "n/a"),
        (None, "n/a"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_format_ratio_and_perplexity():
    assert format_ratio(1, 500) == "0.002× (1/500)"
    assert format_ratio(3, 2) == "1.5×"
    assert format_ratio(0, 0) == "—"
    assert format_ratio(1, 0) == "∞"
    assert format_ratio(float("nan"), 1) == "n/a"
    assert perplexity(0.0) == 1.0
    assert perplexity(math.log(20)) == pytest.approx(20)
    assert perplexity(1e6) == math.inf
    assert math.isnan(perplexity(None))


def test_markdown_table():
    t = markdown_table(["name", "H", "loss"], [["a|b", 10, 3.14159], ["c", 500, 2.5]])
    lines = t.splitlines()
    assert len(lines) == 4
    assert all(l.startswith("| ") and l.endswith(" |") for l in lines)
    assert lines[1].replace(" ", "") == "|:---|--:|----:|"
    assert "a\\|b" in lines[2] and "3.142" in lines[2]
    assert lines[3].split("|")[2].strip() == "500"
    t2 = markdown_table(["x", "y"], [["1", None]], align=["c", "r"])
    assert t2.splitlines()[1].replace(" ", "") == "|:-:|--:|"
    with pytest.raises(ValueError):
        markdown_table(["a", "b"], [[1]])
    with pytest.raises(ValueError):
        markdown_table(["a"], [[1]], align=["x"])


def test_auto_codec_utilization_is_the_share_of_compute_between_round_records():
    """``experiments auto-codec``: a round's wall-clock runs from the previous round's record; its stall is what it
    did not train.  The first record opens the count (its round includes the start-up)."""
    from experiments.auto_codec import utilization

    records = [{"time": 100.0, "stall_seconds": 9.0}, {"time": 110.0, "stall_seconds": 1.0},
               {"time": 130.0, "stall_seconds": 10.0}]
    assert utilization(records) == pytest.approx(1 - 11 / 30)
    assert math.isnan(utilization(records[:1]))


def test_auto_codec_stretches_of_a_link_that_slows_down_and_comes_back():
    """Rounds 1-4 on the fast link, 5-8 slow, 9-12 fast again: each stretch's records start one before its first
    round (whose wall-clock runs from the record before it), and a link that stays slow has two stretches."""
    from experiments.auto_codec import stretches

    assert stretches(4, 8, 12) == [("fast", slice(0, 4)), ("slow", slice(3, 8)), ("fast again", slice(7, 12))]
    assert stretches(2, 0, 6) == [("fast", slice(0, 2)), ("slow", slice(1, 6))]


@pytest.mark.parametrize("args, words", [
    (["--switch", "9"], "--switch must be between 1 and --diloco.outer_steps"),
    (["--switch", "3", "--back", "3"], "--back must be between --switch + 1"),
    (["--slow", "fast"], "--fast/--slow"),
    (["--codecs", "none,zip"], "--averaging.compression is 'zip' but must be one of"),
])
def test_auto_codec_refuses_bad_settings_in_one_line(tmp_path, capsys, args, words):
    from experiments.auto_codec import main

    assert main([*args, "--out", str(tmp_path)]) == 2
    assert not any(tmp_path.iterdir())  # refused before anything ran
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and "Traceback" not in err[0], err


def _compare_cell(out, optimizer: str, seed: int, losses: dict[str, float], k: int = 2, H: int = 20,
                  rounds: int = 18, codecs: tuple[str, ...] = (), start: float = 1.58) -> None:
    """A compare run's results.json as run_compare writes it, in the frontier's cell of (optimizer, k, H, seed),
    every run from a warm start whose held-out loss was ``start``."""
    from experiments.frontier import cell_dir

    names = {"single": "single", "DDP": f"baseline-ddp-{k}", "fp32": f"diloco-{k}x-H{H}"}
    sizes = {"single": 0.0, "DDP": 1e9, "fp32": 1e9 / H, "int4": 1e9 / H / 8, "sign": 1e9 / H / 30}
    runs = [{"name": names.get(arm, f"diloco-codec-{arm}"), "final_eval_loss": loss, "bytes_per_worker": sizes[arm],
             "curve": [{"tokens": 0.0, "eval_loss": start}]} for arm, loss in losses.items()]
    cell = cell_dir(out, optimizer, k, H, seed, codecs)
    cell.mkdir(parents=True)
    (cell / "results.json").write_text(json.dumps({
        "runs": runs, "islands": k,
        "config": {"seed": seed, "inner": {"optimizer": optimizer}, "diloco": {"inner_steps": H, "outer_steps": rounds}}}))


def test_the_frontier_gathers_seeds_per_arm_and_says_what_they_show(tmp_path):
    """``experiments frontier``: every cell found under OUT counts; an arm's gap is to the DDP of its own seed;
    Muon is below AdamW beyond the spread only if every Muon seed is below every AdamW seed; the frontier goal asks
    ≥ 1,000× fewer bytes than DDP within 1% on every seed."""
    from experiments.frontier import collect, report

    for seed, shift in ((0, 0.0), (1, 0.01), (2, -0.01)):
        _compare_cell(tmp_path, "adamw", seed, {"single": 1.6, "DDP": 1.50 + shift, "fp32": 1.52 + shift,
                                               "sign": 1.53 + shift})
        _compare_cell(tmp_path, "muon", seed, {"single": 1.6, "DDP": 1.48 + shift, "fp32": 1.48 + shift,
                                              "int4": 1.49 + shift})
        # a later slice of other codecs: a cell of its own, with its own DDP and fp32 DiLoCo
        _compare_cell(tmp_path, "muon", seed, {"DDP": 1.48 + shift, "fp32": 1.48 + shift, "sign": 1.50 + shift},
                      codecs=("sign",))
    arms = {(a.optimizer, a.name): a for a in collect(tmp_path)}
    assert set(arms) == {("adamw", "DDP"), ("adamw", "fp32"), ("adamw", "sign"), ("muon", "DDP"), ("muon", "fp32"),
                         ("muon", "int4"), ("muon", "sign")}  # the single worker is no arm
    sign = arms[("muon", "sign")]
    assert sorted(sign.losses) == [0, 1, 2] and sign.reduction[0] == pytest.approx(600)
    assert sign.gaps[1] == pytest.approx((1.51 - 1.49) / 1.49 * 100)
    report(tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert "Muon vs AdamW, fp32 DiLoCo, k=2, H=20, 3 seed(s)" in md
    assert "below AdamW beyond the spread of the seeds" in md  # 1.47..1.49 against 1.51..1.53
    assert "frontier goal (≥ 1,000× fewer bytes than DDP within 1% on every seed) not met" in md
    assert "the most bytes saved within 1%: muon k=2 H=20 int4, 160×" in md  # sign is +1.35%
    assert (tmp_path / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from experiments.frontier import (
        short_name,  # the plot names an arm's own settings by key alone
    )
    assert short_name("sparseloco@diloco.outer_lr=4@averaging.topk_density=0.05") == (
        "sparseloco outer_lr=4 topk_density=0.05")
    # overlapping seeds are no verdict either way
    _compare_cell(tmp_path / "close", "adamw", 0, {"DDP": 1.50, "fp32": 1.50})
    _compare_cell(tmp_path / "close", "adamw", 1, {"DDP": 1.47, "fp32": 1.47})
    _compare_cell(tmp_path / "close", "muon", 0, {"DDP": 1.49, "fp32": 1.49})
    _compare_cell(tmp_path / "close", "muon", 1, {"DDP": 1.48, "fp32": 1.48})
    report(tmp_path / "close")
    assert "level with AdamW within the spread" in (tmp_path / "close" / "results.md").read_text()
    # a later AdamW cell of seed 1 from a warm start trained again: its rows count, yet Muon is compared with
    # AdamW on the warm start both ran from; seed 0's AdamW only from another warm start is left out
    _compare_cell(tmp_path / "close", "adamw", 1, {"DDP": 1.40, "fp32": 1.40, "sign": 1.41}, codecs=("sign",),
                  start=1.59)
    arms = {(a.optimizer, a.name): a for a in collect(tmp_path / "close")}
    assert arms[("adamw", "fp32")].losses[1] == 1.40
    (tmp_path / "close" / "adamw-k2-H20" / "seed0" / "results.json").unlink()
    _compare_cell(tmp_path / "close", "adamw", 0, {"DDP": 1.50, "fp32": 1.50}, codecs=("x",), start=1.60)
    report(tmp_path / "close")
    md = (tmp_path / "close" / "results.md").read_text()
    assert "1 seed(s): Muon 1.4800 [1.4800, 1.4800], AdamW 1.4700" in md, md
    assert "seed(s) 0 left out: no warm start run under both" in md


def test_a_new_frontier_cell_takes_ddp_and_fp32_from_a_cell_of_the_same_settings_and_start(tmp_path):
    """A cell of other codecs reuses the DDP and fp32 DiLoCo of a finished cell only when everything but the codec
    arms is the same: the seed, the inner optimizer, H, k, the link's rate and the warm start."""
    from diloco.config import loader as config_load
    from diloco.config import schema as config_mod
    from experiments.frontier import DEFAULTS, cell_dir, reusable_cell
    from experiments.islands import variant

    cfg = variant(config_load.load(None, [], defaults=DEFAULTS),
                  **{"seed": 1, "checkpoint.init_from": str(tmp_path / "warm-start" / "seed1")})
    cell = cell_dir(tmp_path, "adamw", 2, 20, 1, ("sign",))
    cell.mkdir(parents=True)
    (cell / "results.json").write_text(json.dumps({"runs": [], "islands": 2, "rate": None,
                                                   "config": config_mod.to_dict(cfg)}, default=str))
    assert reusable_cell(tmp_path, 2, None, cfg) == cell / "results.json"
    assert reusable_cell(tmp_path, 4, None, cfg) is None
    assert reusable_cell(tmp_path, 2, "20mbit", cfg) is None
    for other in ({"seed": 2}, {"checkpoint.init_from": str(tmp_path / "elsewhere")}, {"inner.optimizer": "muon"},
                  {"diloco.inner_steps": 50}, {"inner.lr": 2e-3}):
        assert reusable_cell(tmp_path, 2, None, variant(cfg, **other)) is None, other


@pytest.mark.parametrize("args, words", [
    (["--seeds", "a,b"], "--seeds takes whole numbers"),
    (["--optimizers", "sgd"], "--optimizers sgd is not a list of adamw, muon"),
    (["--codecs", "zip"], "--codecs zip is not one of"),
    (["--codecs", "sparseloco@diloco.outer_lr"], "--codecs sparseloco@diloco.outer_lr is not one of"),
    (["--codecs", "sparseloco@diloco.outer_rate=4"], "outer_rate"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--report-only"], "--report-only found no finished cell under"),
])
def test_the_frontier_refuses_bad_settings_in_one_line(tmp_path, capsys, args, words):
    from experiments.frontier import main

    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()  # refused before anything ran
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and "Traceback" not in err[0], err
