"""The `diloco` command: train, simulate, config show.

Every command takes ``--config FILE`` and any config key as ``--section.key VALUE``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Callable

from diloco.command import ArgumentParser, config_for, run_command
from diloco.config import ConfigError
from diloco.config import loader as config_load
from diloco.config.checks import device_problems
from diloco.config import schema as config_mod

USAGE = """diloco COMMAND [--config FILE] [--section.key VALUE ...]

commands:
  train                 run one island (prints the multiaddrs other islands join with)
  train --dry-run       the memory each of the island's GPUs needs and the largest batch that fits, on this
                        machine, without GPUs (--memory-gb N per GPU, default 80)
  simulate --islands N  run N islands on this machine over loopback, then print a summary table
                        (--share-gpus: several islands' processes on one GPU when there are too few)
  baseline --workers K  synchronous data parallelism (DDP, gradients all-reduced every step) on K workers
  generate MODEL        continue a prompt with a trained model (checkpoint, run dir or exported folder; --help)
  plan                  the fastest run within a loss budget for your servers and link, with each server's command
  probe --listen        answer link probes on this server (prints the address to give the other side)
  probe --initial-peers ADDR   round trip, rate of 1 and N TCP streams, loss and reachability to a listener
  eval MODEL            held-out loss and perplexity of a trained model on any --data.path (--per-document)
  export --format hf MODEL OUT   write θ_global as a Hugging Face Llama folder (transformers loads it)
  experiment compare    single worker vs synchronous baseline vs DiLoCo: plots and tables (--help)
  experiment sweeps     H / islands / outer-optimizer sweeps next to the paper's numbers (--help)
  experiment overlap    compute utilization and wall-clock against link rate, blocking vs rounds in flight
  experiment hetero     islands of unequal speed: fixed H vs time-budgeted and adaptive rounds vs DDP
  experiment horizon    the gap of overlapped rounds and codecs to blocking DiLoCo over a longer run
  experiment frontier   held-out loss against bytes per inner optimizer and codec, over seeds, vs DDP
  experiment scale-sim  simulated rounds at 100-1,000+ islands: roster rounds vs flat all-reduce vs gossip
  experiment islands    8 to 64 islands on this machine: rounds committed, distinct θ_global, bytes, round time
  experiment hostile    an attacking island, per attack and aggregation rule: honest loss against a clean run
  tokenizer train --data.path P --tokenizer.vocab_size N --out FILE   learn a byte-level BPE (--data.tokenizer FILE)
  data prepare --data.path P [--data.tokenizer FILE] --out DIR   tokenize once; train with --data.path DIR
  config show           print the effective configuration (TOML, with a comment per key)
  config reference      print every key with its default and meaning (markdown)

shortcuts: --initial-peers ADDR[,ADDR] = --averaging.initial_peers, --resume = --checkpoint.resume latest
examples:
  diloco simulate --islands 2
  diloco train --averaging.host_maddrs /ip4/0.0.0.0/tcp/31337    # takes TCP ports 31337 and 31338
  diloco train --initial-peers /ip4/203.0.113.5/tcp/31337/p2p/12D3Koo...
"""


def _split_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = ArgumentParser(prog="diloco", usage=USAGE, add_help=False)
    parser.add_argument("command", nargs="*")
    parser.add_argument("--config")
    parser.add_argument("--islands", type=int)
    parser.add_argument("--share-gpus", "--share_gpus", dest="share_gpus", action="store_true")
    parser.add_argument("--workers", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--initial-peers", "--initial_peers", dest="initial_peers")
    parser.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true")
    parser.add_argument("--memory-gb", "--memory_gb", dest="memory_gb", type=float, default=80.0)
    parser.add_argument("-h", "--help", action="store_true")
    return parser.parse_known_args(argv)


def load_config(ns: argparse.Namespace, rest: list[str]) -> config_mod.Config:
    """Config from --config, shortcuts and --section.key overrides (raises ConfigError)."""
    overrides = list(rest)
    if ns.initial_peers:
        overrides += ["--averaging.initial_peers", ns.initial_peers]
    if ns.resume:
        overrides += ["--checkpoint.resume", "latest"]
    return config_load.load(ns.config, overrides)


def setup_logging(prefix: str = "") -> None:
    """Our INFO logs to stdout; hivemind's chatter only when it matters."""
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for name in ("hivemind", "wandb"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if os.environ.get("DILOCO_HIVEMIND_LOGS"):
        logging.getLogger("hivemind").setLevel(logging.INFO)
        return
    # failed rounds are reported by us in one line; hivemind would print a traceback for each
    logging.getLogger("hivemind.averaging.averager").setLevel(logging.CRITICAL)
    logging.getLogger("hivemind.averaging.allreduce").setLevel(logging.CRITICAL)


def cmd_train(cfg: config_mod.Config) -> int:
    from diloco.engine.island import train

    setup_logging(f"[{cfg.averaging.run_id}-island{cfg.data.shard_index}] ")
    summary = train(cfg)
    if summary is not None:
        print(json.dumps({k: v for k, v in summary.items() if k != "failures"}, indent=None), flush=True)
        if summary.get("out_of_sync"):
            print(f"error: {summary['out_of_sync']}", file=sys.stderr)
            return 3
    return 0


def cmd_dry_run(cfg: config_mod.Config, memory_gb: float) -> int:
    """``diloco train --dry-run``: the island's memory per rank on its GPUs, measured on this machine with a fake
    process group and fake tensors (:mod:`diloco.launch.dry_run`)."""
    from diloco.launch.dry_run import dry_run

    result = dry_run(cfg, memory_gb)
    print("\n".join(result.lines()))
    print(json.dumps(result.record()), flush=True)
    return 0


def cmd_simulate(cfg: config_mod.Config, islands: int | None, share_gpus: bool = False) -> int:
    from diloco.launch.simulate import format_summary, simulate

    n = islands or 2
    if cfg.averaging.backend == "local" and n > 1:
        raise ConfigError(["--averaging.backend local cannot connect several islands; use hivemind"])
    if n == 1:
        cfg.averaging.backend = "local"
        cfg.averaging.min_group_size = 1
    print(f"simulating {n} island(s): model {cfg.model.preset}, H={cfg.diloco.inner_steps}, "
          f"{cfg.diloco.outer_steps} rounds, data {cfg.data.path}, run dir {cfg.logging.run_dir}", flush=True)
    result = simulate(cfg, n, share_gpus=share_gpus)
    text = format_summary(result)
    print(text)
    Path(cfg.logging.run_dir, "simulate_summary.json").write_text(json.dumps(result, indent=2))
    Path(cfg.logging.run_dir, "simulate_summary.txt").write_text(text + "\n")
    return 0


def cmd_baseline(cfg: config_mod.Config, workers: int | None) -> int:
    from diloco.launch.baseline import run_baseline

    setup_logging("[baseline] ")
    summary = run_baseline(cfg, workers or 2)
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, (list, dict))}), flush=True)
    return 0


def cmd_probe(argv: list[str]) -> int:
    """``diloco probe --listen`` or ``diloco probe --initial-peers ADDR``: the link between two servers."""
    from peers import probe

    parser = ArgumentParser(prog="diloco probe", description=probe.__doc__.split("\n\n")[0])
    parser.add_argument("--listen", action="store_true", help="answer probes (run this on the other server first)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default every interface)")
    parser.add_argument("--port", type=int, default=probe.PROBE_PORT, help=f"port (default {probe.PROBE_PORT})")
    parser.add_argument("--initial-peers", "--initial_peers", dest="peer",
                        help="the listener: HOST:PORT or /ip4/HOST/tcp/PORT")
    parser.add_argument("--seconds", type=float, default=3.0, help="how long each rate is measured (default 3)")
    parser.add_argument("--streams", type=int, default=8, help="streams side by side for the N-stream rate (default 8)")
    parser.add_argument("--config", help="a config file, as train takes (checked alike; the probe uses none of it)")
    args, rest = parser.parse_known_args(argv)

    def body() -> int:
        config_for("diloco probe", "measures the link only", args.config, rest, used=())
        if args.listen == bool(args.peer):
            raise ConfigError(["give either --listen (on one server) or --initial-peers ADDR (on the other)"])
        if args.seconds <= 0 or args.streams < 1:
            raise ConfigError([f"--seconds must be positive and --streams at least 1, got {args.seconds} and "
                               f"{args.streams}"])
        if args.listen:
            def ready(host: str, port: int) -> None:
                print(f"probe listener on /ip4/{host}/tcp/{port}; on the other server run: "
                      f"diloco probe --initial-peers /ip4/<THIS SERVER'S ADDRESS>/tcp/{port}", flush=True)

            probe.serve(args.host, args.port, ready=ready)
            return 0
        try:
            host, port = probe.parse_address(args.peer)
        except ValueError as e:
            raise ConfigError([str(e)]) from None
        result = probe.probe(host, port, seconds=args.seconds, streams=args.streams)
        print(f"round trip {result.rtt_ms:.1f} ms, 1 stream {result.rate_1_mbit:,.1f} Mbit/s, {result.streams} "
              f"streams {result.rate_n_mbit:,.1f} Mbit/s, loss "
              f"{'unknown' if result.loss is None else f'{result.loss:.2%}'}, this side "
              f"{'accepts' if result.caller_accepts else 'does NOT accept (NAT or firewall)'} connections",
              file=sys.stderr, flush=True)
        print(result.line(), flush=True)
        return 0

    return run_command(body, (probe.ProbeError,), "interrupted: the probe stopped")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `diloco` console command."""
    argv = sys.argv[1:] if argv is None else argv
    sys.argv[:] = config_mod.redact_argv(sys.argv)  # what W&B and error reports record of the command line
    _stacks_on_sigusr1()
    if argv and argv[0] in ("generate", "eval", "export"):
        from diloco.inference.commands import COMMANDS

        return COMMANDS[argv[0]](argv[1:])
    if argv and argv[0] == "tokenizer":
        from diloco.data import tokenizer

        return tokenizer.main(argv[1:])
    if argv and argv[0] == "data":
        from diloco.data import prepared

        return prepared.main(argv[1:])
    if argv and argv[0] == "probe":
        return cmd_probe(argv[1:])
    plugin = _plugin_command(argv[0]) if argv else None
    if plugin is not None:
        return plugin(argv[1:])
    ns, rest = _split_args(argv)
    if ns.help or not ns.command:
        print(USAGE)
        return 0 if ns.help else 2
    from diloco.data.corpus import DataError
    from diloco.errors import TrainingError
    from diloco.launch.baseline import BaselineError
    from diloco.launch.simulate import SimulationError
    from diloco.model.checkpoint import CheckpointError
    from peers import PeerNetworkError

    def body() -> int:
        cfg = load_config(ns, rest)
        command = ns.command
        if command in (["train"], ["simulate"], ["baseline"]) and not ns.dry_run and (problems := device_problems(cfg)):
            raise ConfigError(problems)
        if command == ["train"] and ns.dry_run:
            return cmd_dry_run(cfg, ns.memory_gb)
        if command == ["train"]:
            return cmd_train(cfg)
        if command == ["simulate"]:
            return cmd_simulate(cfg, ns.islands, ns.share_gpus)
        if command == ["baseline"]:
            return cmd_baseline(cfg, ns.workers)
        if command == ["config", "show"]:
            print(config_load.describe(cfg), end="")
            return 0
        if command == ["config", "reference"]:
            print(config_load.reference_markdown(), end="")
            return 0
        print(f"error: unknown command {' '.join(command)!r}; run `diloco --help` for the list", file=sys.stderr)
        return 2

    return run_command(body, (CheckpointError, DataError, PeerNetworkError, TrainingError, SimulationError,
                              BaselineError))


def _stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` prints every thread's stack, under `diloco` and `python -m diloco.cli` alike."""
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    except (AttributeError, OSError, ValueError):  # no real stderr (embedded, captured): nowhere to print
        pass


def _plugin_command(name: str) -> Callable[[list[str]], int] | None:
    """A command another installed package adds under the ``diloco.commands`` entry-point group
    (``diloco experiment`` comes from the experiments package): experiments build on diloco, so
    diloco finds them by name instead of importing them."""
    if name.startswith("-"):
        return None
    for ep in entry_points(group="diloco.commands"):
        if ep.name == name:
            return ep.load()
    return None


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a torchrun worker (islands of tp × pp, generate)
        from pipeline.mesh import exit_worker

        exit_worker(code)
    sys.exit(code)
