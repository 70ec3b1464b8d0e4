"""No secret leaves the process: the run key, given as a user would (a file, the environment, the command line),
reaches no file a run writes (logs, metrics, checkpoints, W&B, configs, summaries, exports) but the key file that
holds it (mode 600), and no join line; a key a person chose is stretched alike on every island."""

from __future__ import annotations

import gzip
import io
import json
import os
import stat
import zipfile
from pathlib import Path

import pytest

from diloco import cli
from diloco.config import redact_argv, to_dict
from diloco.config.loader import describe, from_dict
from diloco.launch.simulate import Cluster
from diloco.model import checkpoint
from peers import RunKeyError
from peers.discovery.run_key import KEY_BITS, key_bits, new_run_key, obtain_run_key, stretch, write_private
from tests.conftest import tiny_config

RUN_ID = "diloco"  # the default run id: the salt of every stretched key below


def test_generated_keys_are_strong_and_chosen_ones_are_scored_low():
    assert key_bits(new_run_key()) >= KEY_BITS
    assert key_bits(stretch("anything", RUN_ID)) >= KEY_BITS  # a stretched key handed on is not stretched again
    for chosen in ("SECRETKEY123", "our-key", "correct horse battery staple", "Tr0ub4dor&3-but-much-longer-2026"):
        assert key_bits(chosen) < KEY_BITS, chosen
    # a key that repeats itself counts once, however long
    assert key_bits("deadbeef" * 8) == key_bits("deadbeef") < KEY_BITS
    assert key_bits("a" * 200) == 0


def test_a_chosen_key_is_stretched_to_the_same_key_whichever_way_it_is_given(tmp_path, monkeypatch, caplog):
    caplog.set_level("INFO", logger="diloco")
    monkeypatch.delenv("DILOCO_RUN_KEY", raising=False)
    chosen = "our-team-key"
    by_hand = tmp_path / "chosen.key"
    by_hand.write_text(chosen + "\n")
    by_hand.chmod(0o600)

    def obtain(given: str = "", key_file: str = "", where: str = "island", run_id: str = RUN_ID):
        return obtain_run_key(given, key_file, tmp_path / where / "run.key", run_id, read_default=False, first=False)

    on_command_line = obtain(given=chosen, where="a")
    assert "lists this server's processes (ps)" in caplog.text and "--averaging.run_key_file" in caplog.text
    assert "DILOCO_RUN_KEY" in caplog.text
    assert "stretched with scrypt" in caplog.text
    from_file = obtain(key_file=str(by_hand), where="b")
    monkeypatch.setenv("DILOCO_RUN_KEY", chosen)
    from_env = obtain(where="c")
    monkeypatch.delenv("DILOCO_RUN_KEY")
    assert on_command_line.key == from_file.key == from_env.key == stretch(chosen, RUN_ID) != chosen
    # the file a user gave is the key's home; one given otherwise is kept, stretched, in the island's run dir
    assert from_file.file == by_hand and by_hand.read_text() == chosen + "\n"
    for way in (on_command_line, from_env):
        assert way.file.read_text().strip() == way.key and stat.S_IMODE(way.file.stat().st_mode) == 0o600
    # a copy of that kept file lets another island join: it is used as it is
    assert obtain(key_file=str(from_env.file), where="d").key == from_env.key
    # another run (its id is the salt) derives another key from the same words
    assert obtain(given=chosen, where="e", run_id="other-run").key != on_command_line.key


def test_the_first_island_writes_a_fresh_key_file_and_a_joiner_is_told_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.delenv("DILOCO_RUN_KEY", raising=False)
    named = tmp_path / "keys" / "run.key"
    first = obtain_run_key("", str(named), tmp_path / "a" / "run.key", RUN_ID, read_default=False, first=True)
    assert first.file == named and named.read_text().strip() == first.key
    assert stat.S_IMODE(named.stat().st_mode) == 0o600 and key_bits(first.key) >= KEY_BITS
    assert [p.name for p in named.parent.iterdir()] == ["run.key"]  # no temporary file left behind
    # a named file that exists is read, not replaced (two first islands at once: one key)
    again = obtain_run_key("", str(named), tmp_path / "b" / "run.key", RUN_ID, read_default=False, first=True)
    assert again.key == first.key
    assert not write_private(named, "another\n", replace=False) and named.read_text().strip() == first.key
    with pytest.raises(RunKeyError, match="--averaging.run_key_file FILE"):
        obtain_run_key("", "", tmp_path / "c" / "run.key", RUN_ID, read_default=False, first=False)
    with pytest.raises(RunKeyError, match="does not exist"):
        obtain_run_key("", str(tmp_path / "missing.key"), tmp_path / "c" / "run.key", RUN_ID, read_default=False,
                       first=False)
    (tmp_path / "empty.key").write_text("\n")
    with pytest.raises(RunKeyError, match="is empty"):
        obtain_run_key("", str(tmp_path / "empty.key"), tmp_path / "c" / "run.key", RUN_ID, read_default=False,
                       first=False)


def test_configs_command_lines_and_reprs_hold_no_secret(tmp_path, capsys):
    marker = "marker-in-config-5Tq"
    cfg = tiny_config(tmp_path, **{"averaging.run_key": marker})
    assert cfg.averaging.run_key == marker
    assert to_dict(cfg)["averaging"]["run_key"] == ""
    assert from_dict(to_dict(cfg)).averaging.run_key == ""
    assert marker not in describe(cfg) and marker not in repr(cfg)
    assert cli.main(["config", "show", "--averaging.run_key", marker]) == 0
    assert marker not in capsys.readouterr().out
    argv = ["diloco", "train", "--averaging.run_key", marker, "--averaging.run-key=" + marker, "--x", "1"]
    assert marker not in " ".join(redact_argv(argv))
    assert redact_argv(argv)[-2:] == ["--x", "1"]


# ------------------------------------------------------------------------------------- runs, searched whole
WAYS = {"file": "marker-file-7Qz", "env": "marker-env-4Kp", "command line": "marker-cli-9Xw"}
"""A chosen key per way of giving it to one island (each its own, so that a leak names its way)."""
SIMULATED = "marker-simulate-2Jd"


def _contents(path: Path) -> bytes:
    """A file's bytes, and those of its members, unpacked, where it holds a zip (a torch file, after a diloco
    checkpoint's header) or is gzip."""
    data = path.read_bytes()
    start = data.find(b"PK\x03\x04")
    if start >= 0:
        try:
            with zipfile.ZipFile(io.BytesIO(data[start:])) as z:
                data += b"".join(z.read(name) for name in z.namelist())
        except zipfile.BadZipFile:
            pass
    if data[:2] == b"\x1f\x8b":
        data += gzip.decompress(data)
    return data


def _every_file(root: Path, skip: Path) -> list[Path]:
    out = []
    for folder, _, names in os.walk(root):
        out += [Path(folder, n) for n in names if not Path(folder, n).is_symlink() and Path(folder, n).is_file()
                and skip not in Path(folder, n).parents]
    return out


def _join_line(log: Path) -> str:
    lines = [line for line in log.read_text().splitlines() if "here and join with --initial-peers" in line]
    assert lines, log.read_text()[-3000:]
    return lines[0]


def test_a_run_key_reaches_no_file_a_run_writes(tmp_path, monkeypatch, capsys, no_leaked_daemons):
    """Three single islands over hivemind (a group of one commits its rounds, so the key signs the DHT and the
    transport), the key given each way a user would, then `diloco simulate --islands 2` with the key on its
    command line, W&B offline, a checkpoint every round and an export: every file under their run dirs and
    W&B's folders is searched, bytes and zip members, for each chosen key and for each key actually used."""
    monkeypatch.delenv("DILOCO_RUN_KEY", raising=False)
    wandb_env = {"WANDB_MODE": "offline", **{v: str(tmp_path / "wandb-home" / v.lower()) for v in (
        "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR")}}
    for name, value in wandb_env.items():
        monkeypatch.setenv(name, value)
    secret = tmp_path / "secret"  # the user's own key file, outside every run dir: the one place a key may be
    secret.mkdir()
    own_file = secret / "team.key"
    write_private(own_file, WAYS["file"] + "\n")
    common = {"averaging.backend": "hivemind", "averaging.min_group_size": 1, "wandb.mode": "offline",
              "checkpoint.every": 1, "diloco.outer_steps": 2, "diloco.inner_steps": 3,
              "averaging.matchmaking_time": 1.0, "averaging.request_timeout": 0.5}
    clusters = {
        way: Cluster(tiny_config(tmp_path / way.replace(" ", "-"), **common, **(
            {"averaging.run_key_file": str(own_file)} if way == "file" else {})), 1,
            env={0: {"DILOCO_RUN_KEY": WAYS["env"]}} if way == "env" else {})
        for way in WAYS}
    try:
        for way, cluster in clusters.items():
            cluster.start(0, ["--averaging.run_key", WAYS[way]] if way == "command line" else [])
        for cluster in clusters.values():
            cluster.wait(timeout=240)
    finally:
        for cluster in clusters.values():
            cluster.stop_all()
    sim = tmp_path / "simulate"
    assert cli.main(["simulate", "--islands", "2", "--averaging.run_key", SIMULATED, "--model.preset", "tiny",
                     "--diloco.inner_steps", "3", "--diloco.outer_steps", "2", "--inner.batch_size", "4",
                     "--inner.warmup_steps", "1", "--logging.eval_batches", "1", "--data.max_bytes", "2000000",
                     "--threads", "1", "--checkpoint.every", "1", "--wandb.mode", "offline",
                     "--averaging.matchmaking_time", "2.0", "--averaging.request_timeout", "0.5",
                     "--logging.run_dir", str(sim)]) == 0
    capsys.readouterr()
    export = tmp_path / "export"
    assert cli.main(["export", str(clusters["command line"].run_dirs[0]), str(export)]) == 0

    # the runs did what is searched: rounds committed under the key, W&B runs, checkpoints with their config
    for way, cluster in clusters.items():
        (summary,) = cluster.summaries()
        assert summary["rounds_ok"] == 2, (way, summary["failures"])
        log = cluster.logs[0].read_text()
        assert "stretched with scrypt" in log, log[-3000:]
        assert ("shows the run key to anyone who lists this server's processes" in log) == (way == "command line")
        assert list((cluster.run_dirs[0] / "wandb").glob("offline-run-*/*.wandb")), f"{way}: no W&B run written"
        ckpt = checkpoint.load(sorted((cluster.run_dirs[0] / "checkpoints").glob("ckpt-*.pt"))[-1])
        assert ckpt["config"]["averaging"]["backend"] == "hivemind" and ckpt["config"]["averaging"]["run_key"] == ""
    assert (sim / "island0" / "config.toml").is_file() and (export / "config.json").is_file()
    assert [json.loads((sim / f"island{i}" / "summary.json").read_text())["rounds_ok"] for i in range(2)] == [2, 2]

    # the keys used: a chosen key is stretched, and kept so (mode 600) where it was not given in a file
    used = {way: stretch(marker, RUN_ID) for way, marker in {**WAYS, "simulate": SIMULATED}.items()}
    assert (tmp_path / "env" / "island0" / "run.key").read_text().strip() == used["env"]
    assert (tmp_path / "command-line" / "island0" / "run.key").read_text().strip() == used["command line"]
    assert (sim / "run.key").read_text().strip() == used["simulate"]
    assert not (tmp_path / "file" / "island0" / "run.key").exists()  # its home is the user's file

    files = _every_file(tmp_path, skip=secret)
    key_files = [p for p in files if p.name == "run.key"]
    kept = {p.read_text().strip() for p in key_files}  # with the keys generated for the runs that were not given one
    assert set(used.values()) - {used["file"]} <= kept
    contents = {p: _contents(p) for p in files}
    for marker in [*WAYS.values(), SIMULATED]:
        assert not [p for p, data in contents.items() if marker.encode() in data], f"{marker} was written"
    for key in kept | {used["file"]}:
        holders = [p for p, data in contents.items() if key.encode() in data]
        assert all(p.name == "run.key" for p in holders), f"a run key was written to {holders}"
    for p in key_files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p

    # the join lines name the file to copy, never a key
    for log in [c.logs[0] for c in clusters.values()] + [sim / "island0" / "train.log"]:
        line = _join_line(log)
        assert "--averaging.run_key_file FILE" in line and ("run.key" in line or "team.key" in line), line
        assert not any(k in line for k in [*WAYS.values(), SIMULATED, *used.values(), *kept]), line
