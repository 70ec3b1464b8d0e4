"""The config tree: TOML + overrides, one clear line per problem, docs for every key."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from diloco.config import ConfigError
from diloco.config import loader as config_load
from diloco.config import schema as C
from diloco.config.loader import load


def test_defaults_are_valid_and_presets_fill_the_model():
    cfg = load()
    assert cfg.model.preset == "small" and cfg.model.dim == 128 and cfg.diloco.outer_lr == 0.7
    assert load(None, ["--model.preset", "1b"]).model.n_layers == 24


def test_toml_file_then_command_line_overrides(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('seed = 7\n[diloco]\ninner_steps = 20\n[averaging]\ninitial_peers = ["/ip4/1.2.3.4/tcp/5/p2p/Qm"]\n')
    cfg = load(str(f), ["--diloco.inner_steps", "30", "--wandb.mode=offline"])
    assert cfg.seed == 7 and cfg.diloco.inner_steps == 30 and cfg.wandb.mode == "offline"
    assert cfg.averaging.initial_peers == ["/ip4/1.2.3.4/tcp/5/p2p/Qm"]


@pytest.mark.parametrize("args, expected", [
    (["--diloco.inner_step", "5"], "unknown config key --diloco.inner_step; did you mean --diloco.inner_steps?"),
    (["--inner_steps", "5"], "did you mean --diloco.inner_steps?"),
    (["--diloco.inner_steps", "five"], "--diloco.inner_steps expects an integer, got 'five'"),
    (["--averaging.client_mode", "maybe"], "expects true or false"),
    (["--averaging.client_mode", "true"], "an island behind NAT (--averaging.client_mode true) cannot start a run"),
    (["--model.n_heads", "3"], "--model.n_heads (3) must divide --model.dim (128)"),
    (["--diloco.inner_steps", "0"], "--diloco.inner_steps (H) must be at least 1"),
    (["--model.preset", "huge"], "--model.preset is 'huge' but must be one of tiny, small, 150m, 1b"),
    (["--wandb.mode", "on"], "must be one of online, offline, disabled"),
    (["--averaging.initial_peers", "1.2.3.4:5"], "is not a multiaddr ending in /p2p/PEER_ID"),
    (["--data.shard_index", "3", "--data.num_shards", "2"], "--data.shard_index must be in [0, 1]"),
    (["--averaging.matchmaking_timeout", "1"], "must exceed --averaging.matchmaking_time"),
    (["--averaging.run_id", "sweep.lr2"], "--averaging.run_id must be a non-empty name without '.'"),
    (["--diloco.outer_lr", "nan"], "--diloco.outer_lr must be a finite number, got nan"),
    (["--inner.lr", "nan"], "--inner.lr must be a finite number, got nan"),
    (["--inner.lr", "inf"], "--inner.lr must be a finite number, got inf"),
    (["--averaging.vote_timeout", "-inf"], "--averaging.vote_timeout must be a finite number, got -inf"),
])
def test_each_problem_is_one_clear_line(args, expected):
    with pytest.raises(ConfigError) as e:
        load(None, args)
    assert any(expected in p for p in e.value.problems), e.value.problems
    assert all("\n" not in p for p in e.value.problems)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as e:
        load(None, ["--model.dimm", "3", "--diloco.outer_steps", "0", "--inner.lr", "-1"])
    assert len(e.value.problems) == 3


def test_bad_toml_names_the_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[model\npreset = 1")
    with pytest.raises(ConfigError, match="bad.toml is not valid TOML"):
        load(str(f))
    with pytest.raises(ConfigError, match="does not exist"):
        load(str(tmp_path / "missing.toml"))


def test_every_field_has_a_docstring():
    def walk(cls):
        docs = C.field_docs(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.type if isinstance(f.type, type) else None):
                continue
            sub = getattr(cls(), f.name)
            if dataclasses.is_dataclass(sub):
                walk(type(sub))
            else:
                assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
    walk(C.Config)


def test_describe_round_trips_through_toml(tmp_path):
    cfg = load(None, ["--diloco.inner_steps", "17", "--averaging.host_maddrs", "/ip4/0.0.0.0/tcp/1234"])
    f = tmp_path / "shown.toml"
    f.write_text(config_load.describe(cfg))
    again = load(str(f))
    assert C.flatten(again) == C.flatten(cfg)


def test_cli_exit_codes():
    ok = subprocess.run([sys.executable, "-m", "diloco.cli", "config", "show", "--seed", "3"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "seed = 3" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "diloco.cli", "train", "--model.dimm", "3"],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: unknown config key --model.dimm; did you mean --model.dim?"


def test_config_reference_in_the_docs_is_current():
    from pathlib import Path

    current = (Path(__file__).parent.parent / "docs" / "config.md").read_text()
    assert current == config_load.reference_markdown(), "docs/config.md is stale: regenerate it with " \
        "`diloco config reference > docs/config.md`"


def test_command_defaults_under_file_under_overrides(tmp_path):
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('[diloco]\ninner_steps = 7\n[model]\npreset = "tiny"\n')
    cfg = load(str(cfg_file), ["--diloco.outer_steps", "3"],
                      defaults={"diloco.inner_steps": 50, "diloco.outer_steps": 6, "inner.batch_size": 16})
    assert (cfg.diloco.inner_steps, cfg.diloco.outer_steps, cfg.inner.batch_size) == (7, 3, 16)
    assert cfg.model.dim == 32  # preset resolved after the file replaced the default preset




def test_inner_steps_zero_is_one_error_naming_only_what_the_user_set():
    with pytest.raises(ConfigError) as e:
        load(None, ["--diloco.inner_steps", "0"])
    assert e.value.problems == ["--diloco.inner_steps (H) must be at least 1, got 0"]


def test_a_wandb_mode_in_the_environment_that_wandb_refuses_is_one_line(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "bogus")
    with pytest.raises(ConfigError) as e:
        load(None, ["--wandb.mode", "offline"])
    assert e.value.problems == ["the environment's WANDB_MODE='bogus' is not a W&B mode: unset it, or set it to "
                                "online, offline or disabled"]
    load(None, ["--wandb.mode", "disabled"])  # no W&B run: the variable does not matter


def test_a_device_that_contradicts_torchruns_local_rank_is_refused(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError) as e:
        load(None, ["--device", "cuda:0"])
    assert e.value.problems == ["--device cuda:0 contradicts torchrun's LOCAL_RANK 1 (every rank would use GPU 0): "
                                "pass --device cuda or auto, and each rank takes the GPU of its local rank"]
    load(None, ["--device", "cuda:1"])  # the rank's own GPU, named
    load(None, ["--device", "cuda"])
    monkeypatch.delenv("LOCAL_RANK")
    load(None, ["--device", "cuda:0"])  # one process, no torchrun: any GPU
    with pytest.raises(ConfigError):
        load(None, ["--device", "cudax"])
