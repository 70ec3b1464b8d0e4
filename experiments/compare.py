"""How much wall-clock and bandwidth does DiLoCo save against synchronous data parallelism, and at what
cost in model quality?

``run_compare(cfg, islands, rate, out_dir)`` trains three runs with the same per-worker batch and the
same number of inner steps per worker, one after the other:

(a) ``single``   one worker: an island with the ``local`` backend and the ``avg`` outer optimizer, which
                 is plain AdamW (θ_global ← θ_global − (θ_global − θ_local) = θ_local);
(b) ``baseline`` synchronous data parallelism over ``k`` workers (:func:`diloco.launch.baseline.run_baseline`),
                 gradients all-reduced every step: ``k`` × the tokens of (a);
(c) ``diloco``   ``k`` DiLoCo islands averaging every ``H`` steps: the same tokens as (b).

With ``rate`` (e.g. ``20mbit``) and :func:`experiments.netns.available`, every baseline worker and every
island runs in its own emulated host over links capped at ``rate`` (the real goodput is measured and
reported); otherwise the one-line reason is printed and everything runs on loopback.  Results land in
``out_dir``: ``loss_vs_tokens.png``, ``loss_vs_bytes.png``, ``loss_vs_time.png``, ``results.md``,
``results.json`` (:func:`experiments.report.write_report`), the runs' logs and metrics under
``out_dir/runs/`` and offline W&B runs grouped by experiment (``--wandb.group``).

Command line::

    python -m experiments.compare --islands 4 --rate 20mbit --out experiments/results/compare \\
        [--config FILE] [--section.key VALUE ...]
"""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from diloco.command import ArgumentParser, run_command
from diloco.files import writable_folder
from diloco.config import Config, ConfigError
from diloco.config import loader as config_load
from diloco.config import schema as config_mod
from experiments.compare_results import (
    acceptance_lines,
    baseline_result,
    codec_lines,
    counted_vs_link,
    curve_from_metrics,
    diloco_result,
    link_tx_bytes,
    overlap_lines,
    wall_model_line,
)
from experiments.islands import CompareError, island_summaries, launch_islands, variant
from experiments.report import RunResult, format_bytes, write_report
from experiments.warm_start import (
    WARM_START_LR,
    WARM_START_STEPS,
    single_worker,
    warm_start,
)
from outer_optim.compression import LOSSY_CODECS

COMPARE_DEFAULTS: dict[str, Any] = {
    "model.preset": "small",
    "inner.batch_size": 16,
    "inner.lr": 1e-3,
    "inner.warmup_steps": 30,
    "diloco.inner_steps": 50,
    "diloco.outer_steps": 6,
    "diloco.outer_lr": 1.0,
    "logging.eval_batches": 8,
    "logging.log_every": 10,
    "checkpoint.every": 0,
    # rounds start as soon as all k islands are in (target_group_size = k); the long window only keeps a
    # slow island (2 shared cores) from being left out of a round
    "averaging.matchmaking_time": 30.0,
    "averaging.request_timeout": 10.0,
    "averaging.matchmaking_timeout": 180.0,
    "averaging.vote_timeout": 60.0,
    "averaging.allreduce_timeout": 300.0,
    "averaging.next_chunk_timeout": 60.0,
    "averaging.startup_timeout": 60.0,
    "averaging.state_download_timeout": 120.0,
    "wandb.mode": "offline",
}


def run_compare(cfg: Config, islands: int, rate: str | None, out_dir: Path, *, progress: bool = True,
                latency_ms: float = 0.0, rtt_ms: float = 0.0, jitter_ms: float = 0.0, loss: float = 0.0,
                warm_start_steps: int = 0,
                warm_start_lr: float | None = None, arms: list[str] = (), codecs: list[str] = (),
                single: bool = True, reuse: Path | None = None) -> Path:
    """Run single worker, synchronous baseline and DiLoCo (and the overlapped DiLoCo ``arms``, names of
    :data:`ARMS`, and the low-bit ``codecs``, names of :data:`CODEC_ARMS`); write the report; return ``results.md``.

    With ``warm_start_steps`` (and no ``checkpoint.init_from`` of the user's), all three start from the
    parameters one worker reached after that many steps at peak lr ``warm_start_lr`` (default: the inner
    lr), as the DiLoCo paper starts every run from a pretrained model; the report names the shared
    starting point.  ``single=False`` leaves the single worker (a) out (the frontier compares with DDP only).
    ``reuse``: the ``results.json`` of an earlier compare with the same settings and start, whose (a), (b) and (c)
    this run takes instead of running them again (from one start they repeat to the last digit); only the arms
    and codecs run.
    """
    from diloco.launch.baseline import run_baseline
    from experiments import netns

    if islands < 2:
        raise ConfigError([f"--islands must be at least 2 to compare against data parallelism, got {islands}"])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = out_dir / "runs"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    group = cfg.wandb.group or f"compare-{out_dir.name}-{stamp}"
    H, T = cfg.diloco.inner_steps, cfg.diloco.outer_steps * cfg.diloco.inner_steps
    say = print if progress else (lambda *a, **k: None)
    notes: list[str] = []
    say(f"compare: {islands} workers, model {cfg.model.preset} ({cfg.model.dim}d × {cfg.model.n_layers} layers), "
        f"batch {cfg.inner.batch_size}×{cfg.model.seq_len} tokens per worker, {T} steps per worker, H={H}, "
        f"data {cfg.data.path}; results in {out_dir}", flush=True)

    network = None
    rate_bits = None
    capped = False
    extra: list[RunResult] = []
    try:
        if rate:
            ok, why = netns.available(delay=bool(latency_ms or rtt_ms or jitter_ms or loss))
            if ok:
                network = netns.EmulatedNetwork(islands, rate=rate, latency_ms=latency_ms, rtt_ms=rtt_ms,
                                                jitter_ms=jitter_ms, loss=loss)
                rate_bits = network.measure_rate(0, 1, seconds=2)
                capped = True
                msg = (f"link: every worker on its own emulated host, links capped at {rate} "
                       f"({network.rate_bits / 1e6:g} Mbit/s configured, {rate_bits / 1e6:.2f} Mbit/s TCP goodput "
                       f"measured host0→host1)" + (f", {network.impairments}" if network.impairments else ""))
            else:
                msg = f"link: {why}"
            say(msg, flush=True)
            notes.append(msg)
        else:
            notes.append("link: loopback, no bandwidth cap (pass --rate 20mbit to cap each worker's link)")

        def check_network() -> None:
            if network is not None and network.closed:
                raise KeyboardInterrupt  # a signal closed the emulated network: stop here

        # (0) the shared starting point
        if cfg.checkpoint.init_from:
            notes.append(f"start: every run starts from the parameters in {cfg.checkpoint.init_from}")
        elif warm_start_steps:
            say(f"\n== (0) warm start: one worker, {warm_start_steps} steps from the seeded initialisation ==",
                flush=True)
            init, warm = warm_start(variant(cfg, **{"wandb.group": group}), warm_start_steps, runs / "warm_start",
                                    progress=progress, lr=warm_start_lr)
            cfg = variant(cfg, **{"checkpoint.init_from": str(init)})
            notes.append(f"start: every run starts from the same warm start, {warm_start_steps} AdamW steps of one "
                         f"worker (peak lr {warm_start_lr or cfg.inner.lr:g}) from the seeded initialisation "
                         f"(held-out loss {warm.curve[0]['eval_loss']:.3f} → "
                         f"{warm.final_eval_loss:.4f}, {warm.wall_seconds:.0f} s, not counted in the runs below), as "
                         f"the DiLoCo paper starts every run from a pretrained model; --warm-start-steps 0 starts "
                         f"from scratch")
        else:
            notes.append("start: every run starts from the same seeded random initialisation (no warm start)")

        c_dl = variant(cfg, **{"logging.run_dir": str(runs / "diloco"), "averaging.backend": "hivemind",
                                "averaging.run_id": "diloco", "wandb.group": group})
        blocking_runs = runs / "diloco"
        tx0 = None
        if reuse is not None:
            one, base, dl = reused_runs(Path(reuse), cfg, islands, rate, single)
            base_comm = f"as in {reuse}"
            blocking_runs = Path(reuse).parent / "runs" / "diloco"
            say(f"\n== {'single worker, ' if one else ''}baseline and DiLoCo: those of {reuse} (the same settings and "
                f"start) ==", flush=True)
            notes.append(f"reused: the {'single worker, ' if one else ''}baseline and DiLoCo (fp32) are those of "
                         f"{reuse}, which ran with the same settings from the same start (from one start they repeat "
                         f"to the last digit), not run again")
        else:
            # (a) one worker, plain AdamW
            one = None
            if single:
                say("\n== (a) single worker ==", flush=True)
                c_single = single_worker(cfg, runs / "single", "single", **{"wandb.group": group})
                one = diloco_result("single", "single", launch_islands(c_single, 1, progress=progress))

            # (b) synchronous data parallelism over k workers
            # as many workers as the islands have ranks: HSDP inside each island's server when it has several
            workers = islands * cfg.parallel.dp
            say(f"\n== (b) synchronous data-parallel baseline, {workers} workers"
                f"{f' (HSDP, servers of {cfg.parallel.dp})' if cfg.parallel.dp > 1 else ''} ==", flush=True)
            c_base = variant(cfg, **{"logging.run_dir": str(runs / "baseline"), "averaging.run_id": "ddp",
                                      "wandb.group": group})
            check_network()
            tx0 = link_tx_bytes(network) if network else None
            s_base = run_baseline(c_base, workers, network=network, progress=progress)
            base_comm = str(s_base.get("comm_method", ""))
            tx1 = link_tx_bytes(network) if network else None
            base = baseline_result(f"baseline-ddp-{islands}", s_base, runs / "baseline")
            if cfg.parallel.dp > 1:  # like an island's, what crosses a server's link: its dp workers' shards together
                base.bytes_per_worker *= cfg.parallel.dp

            # (c) DiLoCo with k islands
            say(f"\n== (c) DiLoCo, {islands} islands, H={H}, outer {cfg.diloco.outer_optimizer} ==", flush=True)
            check_network()
            out_dl = launch_islands(c_dl, islands, network=network, progress=progress)
            check_network()
            tx2 = link_tx_bytes(network) if network else None
            dl = diloco_result(f"diloco-{islands}x-H{H}", "diloco", out_dl)
        if cfg.parallel.dp > 1:
            notes.append(f"bytes: per server for both, {cfg.parallel.dp} workers (the island's ranks, the baseline's "
                         f"HSDP shards) sharing each server's link")

        # (d) the same DiLoCo with rounds in flight, (e) with low-bit pseudo-gradients
        for arm, items in [(a, arm_settings(a)) for a in arms] + [(f"codec-{c}", codec_settings(c)) for c in codecs]:
            items = matched_budget(items, blocking_runs)
            say(f"\n== DiLoCo {arm}: {', '.join(f'{k}={v}' for k, v in items.items())} ==", flush=True)
            c_arm = variant(c_dl, **{"logging.run_dir": str(runs / f"diloco-{run_name(arm)}"),
                                      "averaging.run_id": f"diloco-{run_name(arm)}",
                                      **items})
            check_network()
            before = link_tx_bytes(network) if network else None
            r = diloco_result(f"diloco-{arm}", "diloco", launch_islands(c_arm, islands, network=network,
                                                                          progress=progress))
            if before is not None:
                sent = [b - a for a, b in zip(before, link_tx_bytes(network))]
                r.extra["wire_bytes_sent_max_host"] = max(sent)
                notes.append(counted_vs_link(r, sent))
            extra.append(r)
    finally:
        if network is not None:
            network.close()

    results = [r for r in (one, base, dl) if r is not None] + extra
    if tx0 is not None:
        wire_base = max(b - a for a, b in zip(tx0, tx1))
        wire_dl = max(b - a for a, b in zip(tx1, tx2))
        base.extra["wire_bytes_sent_max_host"] = wire_base
        dl.extra["wire_bytes_sent_max_host"] = wire_dl
        notes.append(f"bytes on the wire (kernel counters of each host's link, headers and DHT traffic included, "
                     f"busiest host): baseline {format_bytes(wire_base)}, DiLoCo {format_bytes(wire_dl)} "
                     f"(the DiLoCo figure includes the one-time download of θ_global and the outer momentum by "
                     f"each joining island); ratio {wire_base / max(wire_dl, 1):.1f}×")
        notes.append(counted_vs_link(base, [b - a for a, b in zip(tx0, tx1)]))
        notes.append(counted_vs_link(dl, [b - a for a, b in zip(tx1, tx2)]))
    acc, checks = acceptance_lines(one, base, dl, H, capped)
    model_lines = [wall_model_line(r, rate_bits) for r in results]
    overlapped = [r for r in extra if not r.name.startswith("diloco-codec-")]
    if overlapped:
        acc += overlap_lines(dl, base, overlapped)
    if codecs:
        acc += codec_lines(dl, base, [r for r in extra if r.name.startswith("diloco-codec-")])
    notes += model_lines + acc
    notes.append(f"scale: model `{cfg.model.preset}` ({_param_count(cfg):,} parameters, fp32 gradient "
                 f"{format_bytes(4 * _param_count(cfg))}), {T} steps per worker of {cfg.inner.batch_size}×"
                 f"{cfg.model.seq_len} byte tokens, {islands} workers, data `{cfg.data.path}`, {os.cpu_count()} CPU "
                 f"core(s) shared by all workers; DiLoCo outer {cfg.diloco.outer_optimizer} "
                 f"(lr {cfg.diloco.outer_lr}, momentum {cfg.diloco.outer_momentum}), "
                 f"inner {_inner_optimizer(cfg)} lr {cfg.inner.lr}")
    notes.append("wall-clock is each run's training loop (first evaluation to last), excluding process start, "
                 "data loading and (DiLoCo) DHT bootstrap; launch-to-exit: "
                 + ", ".join(f"{r.name} {r.extra.get('launcher_wall_seconds', float('nan')):.0f} s" for r in results))
    notes.append("baseline communication: " + base_comm +
                 "; DiLoCo bytes are the hivemind all-reduce's 2·(k−1)/k of the fp32 pseudo-gradient per round")
    md = write_report(results, out_dir, reference=base.name, notes=notes,
                      title=f"DiLoCo ({islands} islands, H={H}) vs synchronous data parallelism")
    summary = {"acceptance": checks, "measured_link_bits_per_second": rate_bits, "wandb_group": group,
               "config": config_mod.to_dict(cfg), "islands": islands, "rate": rate}
    payload = json.loads((out_dir / "results.json").read_text())
    payload.update(summary)
    (out_dir / "results.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    if progress:
        print("\n" + md.read_text(encoding="utf-8").split("\n## Plots")[0])
        for line in model_lines + acc:
            print(line)
        print(f"\nreport: {md}", flush=True)
    return md


def same_settings(data: dict[str, Any], cfg: Config, islands: int, rate: str | None) -> bool:
    """Whether the compare run whose ``results.json`` is ``data`` ran with ``cfg`` (its start,
    ``checkpoint.init_from``, included), ``islands`` and the link ``rate``."""
    return (data.get("islands") == islands and data.get("rate") == rate
            and data.get("config") == json.loads(json.dumps(config_mod.to_dict(cfg), default=str)))


def reused_runs(results_json: Path, cfg: Config, islands: int, rate: str | None,
                single: bool) -> tuple[RunResult | None, RunResult, RunResult]:
    """The single worker (when ``single``), baseline and fp32 DiLoCo of the compare run that wrote
    ``results_json``, which must have run with ``cfg``, ``islands`` and ``rate``."""
    data = json.loads(Path(results_json).read_text())
    if not same_settings(data, cfg, islands, rate):
        raise CompareError(f"{results_json} ran with other settings, another start or another link rate than this run: "
                           f"its baseline and DiLoCo cannot stand for this run's (run them again without reusing it)")
    runs = {r["name"]: RunResult.from_dict(r) for r in data["runs"]}
    names = ["single"] * single + [f"baseline-ddp-{islands}", f"diloco-{islands}x-H{cfg.diloco.inner_steps}"]
    missing = [n for n in names if n not in runs]
    if missing:
        raise CompareError(f"{results_json} has no run {', '.join(missing)} to reuse: run them again without reusing it")
    return runs.get("single") if single else None, runs[names[-2]], runs[names[-1]]


def _inner_optimizer(cfg: Config) -> str:
    """The inner optimizer as the notes name it; Muon's with the dtype its Newton–Schulz products ran in here."""
    if cfg.inner.optimizer != "muon":
        return "AdamW"
    from diloco.engine.runtime import pick_device
    from diloco.model.inner import newton_schulz_dtype

    dtype = newton_schulz_dtype(cfg.inner.muon_dtype, pick_device(cfg.device).type)
    return f"Muon (Newton–Schulz in {str(dtype).removeprefix('torch.')}) + AdamW"


def _param_count(cfg: Config) -> int:
    from diloco.model.transformer import build_model

    return sum(p.numel() for p in build_model(copy.deepcopy(cfg.model), seed=0).parameters())


# ------------------------------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments.compare --islands K [--rate 20mbit [--rtt MS] [--jitter MS] [--loss FRACTION]]
    [--out DIR] [--section.key VALUE ...]``."""
    from experiments import netns

    parser = ArgumentParser(
        prog="python -m experiments.compare",
        description="DiLoCo vs synchronous data parallelism vs a single worker: loss, bytes, wall-clock.",
        epilog="Any config key can follow as --section.key VALUE (defaults of this command: "
               + ", ".join(f"{k}={v}" for k, v in COMPARE_DEFAULTS.items()) + ").")
    parser.add_argument("--islands", type=int, default=4, help="workers k of the baseline and of DiLoCo (default 4)")
    parser.add_argument("--rate", default=None,
                        help="cap every worker's link at this rate, e.g. 20mbit (needs root and iproute2; "
                             "default: loopback, no cap)")
    parser.add_argument("--latency-ms", type=float, default=0.0,
                        help="deprecated: one-way latency between hosts, the same as --rtt of twice as much")
    netns.add_link_arguments(parser)
    parser.add_argument("--out", default="experiments/results/compare", help="output directory")
    parser.add_argument("--config", help="TOML config file (applied over this command's defaults)")
    parser.add_argument("--warm-start-steps", type=int, default=WARM_START_STEPS,
                        help=f"steps one worker trains from scratch before the three runs start from its parameters "
                             f"(default {WARM_START_STEPS}; 0: all start from scratch; ignored with "
                             f"--checkpoint.init_from)")
    parser.add_argument("--warm-start-lr", type=float, default=WARM_START_LR,
                        help=f"peak inner lr of the warm start (default {WARM_START_LR:g}, pretraining; the runs "
                             f"after it use --inner.lr)")
    parser.add_argument("--arms", default="",
                        help=f"also run DiLoCo with rounds in flight, comma-separated: {', '.join(ARMS)}, each "
                             f"optionally joined to a codec of --compression by + (e.g. delayed+int8; each as long "
                             f"as the DiLoCo run; default: none)")
    parser.add_argument("--compression", default="",
                        help=f"also run DiLoCo with low-bit pseudo-gradients, comma-separated: {', '.join(CODEC_ARMS)} "
                             f"(each as long as the DiLoCo run; then any @section.key=value of its own, e.g. "
                             f"sparseloco@diloco.outer_lr=4; default: none)")
    args, rest = parser.parse_known_args(argv)
    # Ctrl-C / kill -INT must stop the experiment even when started from a shell that ignores SIGINT in
    # background jobs (the emulated network closes itself on SIGINT and passes it on to this handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from diloco.data.corpus import DataError
    from diloco.launch.baseline import BaselineError
    from diloco.launch.simulate import SimulationError
    from experiments.netns import NetworkSetupError

    def body() -> int:
        cfg = config_load.load(args.config, rest, defaults=COMPARE_DEFAULTS)
        rate = args.rate if args.rate and args.rate.lower() not in ("none", "off", "0") else None
        if rate:
            try:
                netns.parse_rate(rate)
            except ValueError as e:
                raise ConfigError([f"--rate: {e}"]) from None
        try:
            link = netns.link_arguments(args, rate)
        except ValueError as e:
            raise ConfigError([str(e)]) from None
        if not args.latency_ms >= 0:
            raise ConfigError([f"--latency-ms must be a number of milliseconds >= 0, got {args.latency_ms:g}"])
        if args.latency_ms and link["rtt_ms"]:
            raise ConfigError(["--latency-ms is the deprecated one-way spelling of --rtt: give one of them"])
        if args.warm_start_steps < 0:
            raise ConfigError([f"--warm-start-steps must be 0 or more, got {args.warm_start_steps}"])
        if not args.warm_start_lr > 0:
            raise ConfigError([f"--warm-start-lr must be positive, got {args.warm_start_lr}"])
        arms = [a.strip() for a in args.arms.split(",") if a.strip()]
        unknown = unknown_arms(arms)
        if unknown:
            raise ConfigError([f"--arms {','.join(unknown)} is not one of {', '.join(ARMS)} (optionally +"
                               f"{'|'.join(CODEC_ARMS)})"])
        codecs = [c.strip() for c in args.compression.split(",") if c.strip()]
        unknown = unknown_codecs(codecs)
        if unknown:
            raise ConfigError([f"--compression {','.join(unknown)} is not one of {', '.join(CODEC_ARMS)} (then any "
                               f"@section.key=value)"])
        for codec in codecs:  # a wrong key of an arm's own says so now, not after the baseline has run
            variant(cfg, **codec_settings(codec))
        run_compare(cfg, args.islands, rate, writable_folder(args.out), latency_ms=args.latency_ms, **link,
                    warm_start_steps=args.warm_start_steps, warm_start_lr=args.warm_start_lr, arms=arms,
                    codecs=codecs)
        return 0

    return run_command(body, (CompareError, BaselineError, SimulationError, DataError, NetworkSetupError),
                       "interrupted: every worker and emulated link was removed")


__all__ = ["run_compare", "launch_islands", "curve_from_metrics", "COMPARE_DEFAULTS", "main",
           "wall_model_line", "acceptance_lines"]




MATCHED = "matched"
"""``diloco.sync_every`` of a timed arm, replaced before it runs by the seconds of compute per round the blocking
DiLoCo run of the same command took (:func:`matched_budget`)."""

# DiLoCo arms whose rounds do not stop the inner steps (``--arms``), each against blocking DiLoCo (c)
ARMS: dict[str, dict[str, Any]] = {
    "delayed": {"diloco.overlap": "delayed"},
    "eager": {"diloco.overlap": "eager"},
    # the same, every island sending when it has trained as long as a blocking round took rather than after
    # H steps: islands of different speed (4 sharing 2 cores) then send at once, and their rounds stay in
    # flight for the transfer alone instead of the time the slowest island takes to catch up
    "delayed-timed": {"diloco.overlap": "delayed", "diloco.sync_every": MATCHED},
    "eager-timed": {"diloco.overlap": "eager", "diloco.sync_every": MATCHED},
    # Streaming DiLoCo's setting: 4 fragments (the `small` model has 4 blocks), τ = 1, α = 0.5
    "streaming": {"diloco.fragments": 4, "diloco.overlap_steps": 1, "diloco.merge_alpha": 0.5},
    # the same 4 fragments in flight under the timed budget: each sync carries a quarter of the bytes, so it
    # is in flight (stale) a quarter as long, and the last one, which nothing hides, takes a quarter as long
    "streaming-timed": {"diloco.fragments": 4, "diloco.overlap": "delayed", "diloco.sync_every": MATCHED},
}

# DiLoCo arms with low-bit pseudo-gradients (``--compression``), each against fp32 DiLoCo (c): every lossy codec
# of the registry, and variants of their settings
CODEC_ARMS: dict[str, dict[str, Any]] = {
    **{name: {"averaging.compression": name} for name in LOSSY_CODECS},
    # the same with the owners' feedback: what re-encoding each averaged part drops goes into its next average
    "sign-owner": {"averaging.compression": "sign", "averaging.owner_feedback": True},
    # the same with the islands' error feedback in a buffer (EF21) instead of the parameters
    "sign-buffer": {"averaging.compression": "sign", "averaging.error_feedback_in": "buffer"},
    "topk": {"averaging.compression": "topk", "averaging.topk_density": 0.02, "averaging.topk_bits": 2},
    # the same top-k with the unsent part re-sent from a buffer (EF21) instead of kept in the parameters
    "topk-buffer": {"averaging.compression": "topk", "averaging.topk_density": 0.02, "averaging.topk_bits": 2,
                    "averaging.error_feedback_in": "buffer"},
    # the same top-k without error feedback
    "topk-noef": {"averaging.compression": "topk", "averaging.topk_density": 0.02, "averaging.topk_bits": 2,
                  "averaging.error_feedback": False},
    # SparseLoCo: the same top-k, its error-feedback buffer (β = 0.95) in place of the outer Nesterov momentum
    "sparseloco": {"averaging.compression": "topk", "averaging.topk_density": 0.02, "averaging.topk_bits": 2,
                   "diloco.outer_optimizer": "sparseloco", "averaging.error_feedback_decay": 0.95,
                   "averaging.error_feedback_in": "buffer"},
}



def arm_settings(name: str) -> dict[str, Any]:
    """The settings of an overlapped arm: a name of :data:`ARMS`, or one joined to a codec of
    :data:`CODEC_ARMS` by ``+`` (``delayed+int8``: rounds in flight carrying int8 pseudo-gradients)."""
    mode, _, codec = name.partition("+")
    return {**ARMS[mode], **(CODEC_ARMS[codec] if codec else {})}


def matched_budget(items: dict[str, Any], blocking_runs: Path) -> dict[str, Any]:
    """``items`` with a ``diloco.sync_every`` of :data:`MATCHED` replaced by the seconds of compute per round
    of the blocking run whose islands' logs are in ``blocking_runs`` (the median over its islands)."""
    if items.get("diloco.sync_every") != MATCHED:
        return items
    per_round = sorted(s["compute_seconds"] / s["outer_step"] for s in island_summaries(blocking_runs)
                       if s.get("outer_step"))
    if not per_round:
        raise CompareError(f"a timed arm needs the blocking run's compute per round, and {blocking_runs} has "
                           f"no island summary with a round in it: run the blocking arm first")
    return {**items, "diloco.sync_every": f"{per_round[len(per_round) // 2]:.2f}s"}


def own_settings(arm: str) -> tuple[str, dict[str, str]]:
    """``NAME@section.key=value@...``: the arm's name and the settings of its own that follow it
    (``sparseloco@diloco.outer_lr=4``: SparseLoCo at outer lr 4)."""
    name, *own = arm.split("@")
    return name, dict(item.split("=", 1) for item in own)


def malformed_own(arm: str) -> bool:
    """Whether an ``@`` item of ``arm`` lacks its ``=value``."""
    return any("=" not in item for item in arm.split("@")[1:])


def codec_settings(codec: str) -> dict[str, Any]:
    """The settings of a codec arm: a name of :data:`CODEC_ARMS`, then any ``@section.key=value`` of its own."""
    name, own = own_settings(codec)
    return {**CODEC_ARMS[name], **own}


def unknown_codecs(codecs: list[str]) -> list[str]:
    """The codec arms of ``codecs`` that :func:`codec_settings` cannot read."""
    return [c for c in codecs if c.split("@")[0] not in CODEC_ARMS or malformed_own(c)]


def run_name(arm: str) -> str:
    """The folder of ``arm``'s run under ``runs/`` (and its run id's suffix, where '.' may not appear)."""
    return arm.replace("+", "-").replace("@", "_").replace("=", "-").replace(".", "_")


def unknown_arms(names: list[str]) -> list[str]:
    """The names of ``names`` that :func:`arm_settings` cannot read."""
    def known(name: str) -> bool:
        mode, plus, codec = name.partition("+")
        return mode in ARMS and (not plus or codec in CODEC_ARMS)
    return [n for n in names if not known(n)]


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
