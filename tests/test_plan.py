"""`diloco probe` (real sockets, on loopback and over an emulated link behind NAT) and `diloco plan` (its model's
directions, its command lines against the real config loader, and its one-line refusals)."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from diloco import cli
from diloco.config.schema import Config, resolve_model
from experiments import plan as planner
from experiments.netns import EmulatedNetwork, available
from peers.wire import probe

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def listener():
    """A probe listener on a free loopback port, stopped afterwards."""
    stop, port = threading.Event(), []
    ready = threading.Event()
    thread = threading.Thread(target=probe.serve, args=("127.0.0.1", 0),
                              kwargs={"ready": lambda h, p: (port.append(p), ready.set()), "stop": stop}, daemon=True)
    thread.start()
    assert ready.wait(5)
    yield port[0]
    stop.set()
    thread.join(5)


def test_a_probe_on_loopback_measures_every_field_and_its_line_reads_back(listener):
    result = probe.probe("127.0.0.1", listener, seconds=0.3, streams=2, pings=5)
    assert 0 < result.rtt_ms < 1000
    assert result.rate_1_mbit > 0 and result.rate_n_mbit > 0 and result.streams == 2
    assert result.caller_accepts and result.listener_accepts
    assert result.loss is None or 0 <= result.loss < 1
    assert probe.read_probe(result.line()) == result
    link = planner.Link.from_probe(result, "test")
    assert link.rate(1) == pytest.approx(result.rate_1_mbit * 1e6)
    assert link.rate(2) == pytest.approx(result.rate_n_mbit * 1e6)


def test_addresses_and_lines_that_are_not_a_probe_are_refused():
    assert probe.parse_address("/ip4/10.0.0.2/tcp/29400/p2p/12D3KooW") == ("10.0.0.2", 29400)
    assert probe.parse_address("example.org:80") == ("example.org", 80)
    assert probe.parse_address("[::1]:29400") == ("::1", 29400)
    for bad in ("foo", "/ip4/1.2.3.4/udp/5", "host:"):
        with pytest.raises(ValueError, match="not an address to probe"):
            probe.parse_address(bad)
    for bad in ("{}", "not json", json.dumps({"probe": 1, "rtt_ms": 1})):
        with pytest.raises(ValueError, match="not a line printed by `diloco probe`"):
            probe.read_probe(bad)


def test_probe_command_line_errors_are_one_line(capsys, listener):
    assert cli.main(["probe"]) == 2
    assert cli.main(["probe", "--initial-peers", "foo"]) == 2
    assert cli.main(["probe", "--initial-peers", "127.0.0.1:1"]) == 1  # nothing listens on port 1
    assert cli.main(["probe", "--listen", "--host", "127.0.0.1", "--port", str(listener)]) == 1  # taken
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 4 and all(line.startswith("error: ") for line in lines) and "Traceback" not in err
    assert "either --listen" in lines[0] and "not an address" in lines[1]
    assert "could not be reached" in lines[2] and "cannot listen" in lines[3]


def test_probe_takes_a_config_and_keys_as_train_does_and_names_what_it_does_not_use(tmp_path, capsys):
    config = tmp_path / "island.toml"
    config.write_text('[model]\npreset = "1b"\n')
    assert cli.main(["probe", "--config", str(config), "--model.dim", "512", "--initial-peers", "127.0.0.1:1",
                     "--seconds", "0.1"]) == 1  # nothing listens on port 1: the keys did not stop it
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "note: diloco probe measures the link only; it does not use --model.dim, --model.preset"
    assert err[1].startswith("error: the probe listener at 127.0.0.1:1")
    assert cli.main(["probe", "--modl.preset", "1b", "--listen"]) == 2
    assert capsys.readouterr().err.strip() == "error: unknown config key --modl.preset; did you mean --model.preset?"


def test_plan_takes_the_model_as_train_does(tmp_path, capsys):
    """``--model.preset``, ``--model.*`` keys and ``--config FILE`` plan the same model as the plan's own
    ``--model`` and ``--dims``; a key the plan decides itself is named, not silently dropped."""
    def plan(*argv: str) -> str:
        assert planner.main(["--tokens", "3B", *argv]) == 0
        out = capsys.readouterr()
        return out.out.split("planned in")[0]

    assert plan("--model.preset", "150m") == plan("--model", "150m")
    config = tmp_path / "train.toml"
    config.write_text('[model]\npreset = "150m"\n\n[diloco]\ninner_steps = 30\n')
    assert planner.main(["--tokens", "3B", "--config", str(config)]) == 0
    out = capsys.readouterr()
    assert out.out.split("planned in")[0] == plan("--model", "150m")
    assert out.err.strip() == ("note: diloco plan picks the island shape, H, codec and overlap itself; it does not "
                               "use --diloco.inner_steps")
    dims = ("--model.dim", "1024", "--model.n_layers", "12", "--model.n_heads", "16", "--model.ffn_dim", "2816",
            "--model.seq_len", "1024")
    assert plan(*dims) == plan("--dims", "1024,12,16,2816,1024")
    assert plan("--model.preset", "150m", "--model.n_layers", "24") == plan("--dims", "1024,24,16,2816,1024")
    assert planner.main(["--model.preset", "1b", "--model", "150m"]) == 2
    assert "give the model once" in capsys.readouterr().err


def test_a_probe_over_a_capped_link_sees_the_cap_and_a_host_behind_nat():
    ok, why = available(delay=True)
    if not ok:
        pytest.skip(why)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with EmulatedNetwork(2, rate="20mbit", rtt_ms=20, nat=(0,), delay_line=True,
                         run_id=f"p{os.getpid()}{secrets.token_hex(2)}") as net:
        serve = net.popen([sys.executable, "-m", "diloco.cli", "probe", "--listen", "--port", "29400"], 1, env=env,
                          stdout=subprocess.PIPE, text=True)
        assert "probe listener" in serve.stdout.readline()
        done = subprocess.run(net.wrap([sys.executable, "-m", "diloco.cli", "probe", "--initial-peers",
                                        f"{net.host(1).address}:29400", "--seconds", "0.5", "--streams", "2"], 0),
                              capture_output=True, text=True, timeout=120, env=env)
        net.reap(serve)
    assert done.returncode == 0, done.stderr
    result = probe.read_probe(done.stdout.strip().splitlines()[-1])
    assert result.rtt_ms >= 19  # nothing comes back sooner than the emulated round trip
    assert 0 < result.rate_1_mbit < 25 and 0 < result.rate_n_mbit < 25  # the 20 Mbit/s cap, with slack
    assert not result.caller_accepts  # host 0 is behind NAT: the listener could not connect back
    assert "does NOT accept" in done.stderr


def _inputs(**link) -> planner.Inputs:
    model = planner.Model.of_preset("1b", 32000)
    return planner.Inputs(model, planner.Servers(), planner.Link(**{"rate_bits": 1e9, "rtt_s": 0.05, **link}),
                          tokens=20e9, batch_tokens=524288, max_loss_penalty=0.01)


def test_the_model_counts_the_parameters_our_transformer_builds():
    import torch

    from diloco.model.transformer import Transformer, count_parameters

    cfg = Config().model
    cfg.preset, cfg.vocab_size = "small", 256
    resolve_model(cfg)
    with torch.device("meta"):
        real = count_parameters(Transformer(cfg))
    assert planner.Model.of_preset("small", 256).params == real


def test_the_plan_keeps_its_budget_ranks_by_wall_clock_and_slower_links_cost_more():
    fast, slow = planner.make_plan(_inputs()), planner.make_plan(_inputs(rate_bits=50e6, rtt_s=0.2))
    for plan in (fast, slow):
        assert plan.within_budget and plan.best
        assert all(c.loss_penalty <= 0.01 for c in plan.best)
        assert [c.wall_s for c in plan.best] == pytest.approx(sorted(c.wall_s for c in plan.best), rel=0.011)
        assert plan.best[0].wall_s <= plan.default.wall_s  # the default is one of the candidates it weighed
        assert plan.sync.utilization < plan.best[0].utilization  # every-step all-reduce over the internet
        assert set(plan.sources) >= {"compute of one device", "round: fixed seconds and round trips"}
    assert slow.default.utilization < fast.default.utilization
    assert slow.default.round_s > fast.default.round_s
    assert slow.best[0].bytes_per_round <= fast.best[0].bytes_per_round  # a slower link picks fewer bytes
    ratios = planner.Sources().wire_ratios()  # entropy coding, as a compare run measured it
    assert set(ratios) == {"int8", "int4"} and all(0.5 < r < 1 for r in ratios.values())
    assert ratios["int4"] < ratios["int8"]


def test_a_gpu_plan_takes_the_rounds_host_costs_from_an_island_measured_in_its_loop(monkeypatch):
    """On GPUs the training thread's hold and the round's host work come from a 1b island's running loop
    (``benchmarks/gpu_run.py``), not from CPU islands; without that run the plan pieces them together."""
    sources = planner.Sources()
    device = planner.device_for(_inputs(), sources)
    measured = planner.round_model(sources, device)
    rows = {r["case"]: r for r in map(json.loads, (planner.RESULTS / planner.GPU_RUN).read_text().splitlines())}
    params = planner.Model.of_preset("1b", 256).params
    assert measured.handover_s_per_param * params == pytest.approx(rows["1b-delayed"]["islands"][0]["stall_median_s"])
    assert measured.host_s_per_param * params == pytest.approx(rows["1b-blocking"]["islands"][0]["stall_median_s"])
    assert any("gpu-run" in where for where in sources.used.values())
    # blocking rounds take the outer state onto the GPU when it fits there (its stall measured the same way)
    on_gpu = {r["case"]: r for r in map(json.loads,
                                        (planner.RESULTS / planner.GPU_RUN_OUTER_ON_GPU).read_text().splitlines())}
    assert measured.gpu_s_per_param * params == pytest.approx(
        on_gpu["1b-blocking-outer-on-gpu"]["islands"][0]["stall_median_s"])
    assert measured.gpu_s_per_param < measured.host_s_per_param and measured.gpu_bytes_per_param > 0
    inputs, shape, losses = _inputs(), planner.island_shapes(_inputs(), device)[0], planner.loss_model(sources)
    blocking = planner.diloco_candidate(inputs, shape, measured, losses, 100, "none", "blocking")
    on_host = planner.diloco_candidate(inputs, shape, measured, losses, 100, "none", "blocking", outer_on_gpu=False)
    assert blocking.outer_on_gpu and blocking.round_s < on_host.round_s
    assert "--diloco.master_device cuda" in planner.command_lines(inputs, blocking)[0]
    assert "master_device" not in planner.command_lines(inputs, on_host)[0]
    assert not planner.diloco_candidate(inputs, shape, measured, losses, 100, "none", "delayed").outer_on_gpu
    full = replace(measured, gpu_memory_gb=shape.memory_gb / planner.MEMORY_HEADROOM)  # no room left beside it
    assert not planner.diloco_candidate(inputs, shape, full, losses, 100, "none", "blocking").outer_on_gpu
    monkeypatch.setattr(planner, "GPU_RUN", "no-such-run/results.json")
    pieced = planner.round_model(planner.Sources(), device)
    assert pieced.handover_s_per_param != measured.handover_s_per_param and pieced.gpu_s_per_param is None


@pytest.mark.parametrize("behind_nat", [False, True])
def test_every_flag_of_the_printed_commands_is_a_real_config_key(behind_nat):
    plan = planner.make_plan(_inputs(joiners_accept=not behind_nat))
    lines = planner.command_lines(plan.inputs, plan.best[0])
    assert len(lines) == plan.inputs.servers.count
    assert ["client_mode" in line for line in lines] == [False] + [behind_nat] * (len(lines) - 1)
    for line in lines:
        words = shlex.split(line.splitlines()[-1].replace(
            "ADDR", "/ip4/10.0.0.1/tcp/31337/p2p/QmaYNG8T8Rmo4Nh8gYuL5aGRT9349GDoHyfo8SysEb8MRG"))
        ns, rest = cli._split_args(words[words.index("train"):])
        cfg = cli.load_config(ns, rest)  # raises ConfigError on an unknown key or a bad value
        assert cfg.diloco.inner_steps == plan.best[0].H
        assert cfg.averaging.compression == plan.best[0].codec
        assert cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp == plan.inputs.servers.gpus
        assert cfg.averaging.client_mode == (behind_nat and "--initial-peers" in line)


def test_a_plan_that_cannot_fit_says_which_memory_and_bad_input_is_one_line(capsys):
    assert planner.main(["--model", "1b", "--gpu-memory", "2", "--servers", "2"]) == 1
    out = capsys.readouterr().out
    assert "no configuration fits" in out and "GB per GPU, more than 90% of the 2 GB of a H100" in out
    for argv, expected in ((["--model", "3b"], "--model 3b is not a preset"),
                           (["--gpu", "tpu"], "--gpu tpu is not a kind"),
                           (["--probe", "nonsense"], "--probe must be a line printed by `diloco probe`"),
                           (["--tokens", "lots"], "--tokens must be a number"),
                           (["--link", "fast"], "--link:"),
                           (["--dims", "4096,32,30,14336"], "--dims must be DIM,LAYERS,HEADS,FFN,SEQ")):
        assert planner.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and expected in err and "Traceback" not in err, err


def test_a_model_too_large_for_one_server_fits_nowhere_and_a_smaller_one_needs_checkpointing():
    def shapes(dims: str) -> list[planner.Shape]:
        args = planner.parser().parse_args(["--dims", dims])
        args.servers_given = args.gpus_given = args.gpu_given = args.price_given = False
        inputs = planner.inputs_from_args(args)
        return planner.island_shapes(inputs, planner.device_for(inputs, planner.Sources()))

    assert all(s.why_not for s in shapes("8192,80,64,28672,8192"))  # 70B dims: 160 GB a GPU before activations
    fitting = [s for s in shapes("6656,60,52,17920,2048") if not s.why_not]  # 33B dims
    assert fitting and all(s.checkpointing or s.tp > 1 for s in fitting)


def test_the_plan_names_what_it_assumed_and_every_source(capsys):
    assert planner.main(["--model", "150m", "--tokens", "3B"]) == 0
    out = capsys.readouterr().out
    assert "assumed (not given): link 1 Gbit/s; RTT 50 ms" in out
    assert "experiments/results/gpu-island-h100/results.json" in out
    assert "experiments/results/published/loss-gaps.json" in out
    assert "torchrun --nproc-per-node 8 -m diloco.cli train" in out and "--initial-peers ADDR" in out
