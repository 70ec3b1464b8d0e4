"""One DiLoCo island rank: the wiring of its parts, the training loop, its checkpoints.

An island is the training process group of one server: ``dp * pp * tp`` processes under ``torchrun`` (tensor
parallelism inside, pipeline stages around it, data-parallel FSDP replicas outside, see :mod:`pipeline`), or one
process, which is simply the ``dp = pp = tp = 1`` case (:class:`~diloco.engine.runtime.Runtime` with no process group).  Every rank builds the
same :class:`Island` and takes every decision together with the others.  :class:`Island` only builds,
connects and runs; each part has one job and gets the narrow pieces it needs:

- the model is this rank's :class:`pipeline.ModelParts`; the outer optimizer holds θ_global of this rank's
  local shards (they share storage with the parameters, DTensor or not);
- the pseudo-gradient is averaged over the canonical layout (:mod:`peers.wire.layout`): buckets of
  ``--averaging.bucket_numel`` elements of the whole model, each averaged by the rank that owns it
  (:mod:`peers.averaging.sharded`), so islands of any shape average together;
- :class:`~diloco.engine.rounds.OuterRounds` runs the outer rounds (schedule, round in flight, transaction);
  :class:`~diloco.engine.state_transfer.StateTransfer` catches up with the run, serves θ_global to joiners
  and resynchronizes; :class:`~diloco.engine.peer_node.PeerNode` is the rank's place in the peer network;
- rank 0 alone writes metrics, ``summary.json``, the multiaddrs and ``theta_global.pt`` and prints.

Checkpoints are per rank: each rank writes its own shards (model, inner optimizer, θ_global and outer
momentum) with the data position, RNG states and counters to ``<checkpoint dir>/ckpt-NNNNNN.pt`` (one
process) or ``<checkpoint dir>/rank<r>/ckpt-NNNNNN.pt``; on resume the ranks agree on the newest outer step
every rank has, refuse a checkpoint of another config, and reshard one written by an island of another
(dp, pp, tp) shape: each rank reads the old ranks' files one after the other and copies the parts of its own
pieces they hold.
"""

from __future__ import annotations

import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diloco.config import Config, config_fingerprint, to_dict
from diloco.config.loader import from_dict
from diloco.data.batches import ShardedBatches, heldout_batches
from diloco.data.corpus import load_corpus
from diloco.data.tokenizer import Tokenizer, fit_vocabulary
from diloco.engine.faults import FaultPlan
from diloco.engine.metrics import MetricsLogger, NullMetrics, RunStats
from diloco.engine.peer_node import PeerNode, is_peer_file
from diloco.engine.rounds import (
    FaultHook,
    IslandNorm,
    MembershipHook,
    OuterRounds,
    RoundMetrics,
    RoundSchedule,
)
from diloco.engine.runtime import Runtime, pick_device, return_freed_memory
from diloco.engine.state_transfer import StateTransfer
from diloco.engine.throughput import Throughput, peak_flops
from diloco.errors import TrainingError
from diloco.inference.generate import cached_forward
from diloco.inference.samples import Sampler
from diloco.model import checkpoint
from diloco.model.checkpoint import CheckpointError
from diloco.model.inner import build_inner_optimizer, take_inner_step
from diloco.model.transformer import flops_per_token, initial_model, lm_loss
from diloco.progress import Progress
from outer_optim import OuterOptimizer, checksum
from outer_optim.codecs import LOSSY_CODECS
from outer_optim.fragments import split_into_fragments
from peers.averaging.sharded import FeedbackBuffers
from peers.discovery.dht import mute_shutdown_noise
from peers.wire.exchange import BucketExchange
from peers.wire.layout import CanonicalLayout, spec_tuple
from pipeline import (
    ModelParts,
    ShardSpec,
    copy_overlap,
    local_state,
    restore_dtensor_state,
)

log = logging.getLogger("diloco")


def _forget_failed_start(run_dir: Path, before: set[Path] | None) -> None:
    """Remove what an island that could not start left in ``run_dir`` (``before``: its entries beforehand, None
    if it did not exist): the peer node's files it made, and the directory itself when it made it and it is
    empty.  Nothing that was there before is touched."""
    if not run_dir.is_dir():
        return
    for path in run_dir.iterdir():
        if path not in (before or set()) and path.is_file() and is_peer_file(path.name):
            path.unlink(missing_ok=True)
    if before is None:
        try:
            run_dir.rmdir()
        except OSError:
            pass  # not empty: something worth keeping, or another rank's file not yet removed


class Island:
    """One island rank: built from the config, then :meth:`run` (or driven step by step in tests)."""

    def __init__(self, cfg: Config):
        return_freed_memory()
        self.rt = Runtime.start(cfg, pick_device(cfg.device))
        self.peers: PeerNode | None = None
        cfg = self.rt.island_config(cfg)
        run_dir = Path(cfg.logging.run_dir)
        self._run_dir_before = set(run_dir.iterdir()) if run_dir.is_dir() else None
        try:
            self._build(cfg)
        except BaseException:
            mute_shutdown_noise()
            if self.peers is not None:
                self.peers.disconnect()
            self.rt.close()
            _forget_failed_start(run_dir, self._run_dir_before)
            raise

    def _build(self, cfg: Config) -> None:
        rt = self.rt
        if not rt.is_main:
            logging.getLogger("diloco").setLevel(logging.ERROR)  # rank 0 speaks for the island
        self.cfg = cfg
        self.run_dir = Path(cfg.logging.run_dir)
        try:  # before any peer hears of us
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TrainingError(f"cannot create --logging.run_dir {self.run_dir} ({e.strerror}); "
                                f"pass a directory you can write to") from None
        self.ckpt_base = Path(cfg.checkpoint.dir or self.run_dir / "checkpoints")
        """The checkpoint folder of the island: its ranks' folders ``rank<r>/`` below it, or one process's files."""
        self.ckpt_dir = self.ckpt_base / f"rank{rt.rank}" if rt.size > 1 else self.ckpt_base
        self.name = f"{cfg.averaging.run_id}-island{cfg.data.shard_index}"
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = rt.device
        m, d, a, lg = cfg.model, cfg.diloco, cfg.averaging, cfg.logging
        self.stats = RunStats()
        self.unsent = FeedbackBuffers()
        # the peer node's processes are forked from this one: before the data and the model exist
        self.peers = PeerNode(a, rt, self.run_dir, self.name, resuming=bool(cfg.checkpoint.resume),
                              unsent=self.unsent, stats=self.stats)
        self.peers.start()
        torch.manual_seed(cfg.seed)
        self.tokenizer = Tokenizer.for_data(cfg.data)
        fit_vocabulary(m, self.tokenizer)
        corpus = load_corpus(cfg.data, self.tokenizer)
        self.heldout_bytes_per_token = corpus.heldout_bytes_per_token
        log.info("data: %s", corpus.description)
        self.batches = ShardedBatches(corpus.train, m.seq_len, cfg.inner.batch_size, cfg.data.shard_index,
                                      cfg.data.num_shards, cfg.seed, replica=rt.dp_rank, replicas=rt.dp)
        self.eval_batches = heldout_batches(corpus.heldout, m.seq_len, cfg.inner.batch_size, lg.eval_batches)
        # without pipeline stages every rank takes part in generating the samples; with them the main rank alone
        self.sampler = Sampler(m, corpus.heldout, lg.samples, lg.sample_tokens, self.tokenizer) \
            if lg.samples and (rt.is_main or cfg.parallel.pp == 1) else None

        # the model: the layout comes from the whole model's skeleton (no memory), the same on every rank; each
        # rank materialises only its own pieces of it
        skeleton, initial = initial_model(m, cfg.seed, cfg.checkpoint.init_from)
        self.full_shapes = [(n, tuple(p.shape)) for n, p in skeleton.named_parameters()]
        fragments = split_into_fragments([n for n, _ in self.full_shapes], d.fragments) if d.fragments > 1 else ()
        self.layout = CanonicalLayout.build(self.full_shapes, a.bucket_numel, fragments)
        micro = max(1, cfg.inner.batch_size // (cfg.parallel.microbatches if cfg.parallel.pp > 1 else 1))
        self.model = ModelParts(skeleton, rt.mesh, cfg.parallel, loss_fn=lm_loss, device=self.device,
                                profile_shape=(micro, m.seq_len), init=initial)
        del skeleton, initial
        self.specs = self.model.shard_specs()
        self.params = self.model.local_named_parameters()  # local shards, sharing storage with the parameters
        self.throughput = Throughput(flops_per_token(m), rt.size, self.device,
                                     peak_flops(self.device, self.model.compute_dtype, cfg.parallel.peak_tflops))

        # the outer state and the run's counters
        self.outer = OuterOptimizer.from_config(self.params, d.outer_optimizer, d.outer_lr, d.outer_momentum,
                                                device=d.master_device)
        self.fingerprint = config_fingerprint(cfg, "" if self.tokenizer.is_bytes else self.tokenizer.sha256)
        self.exchange = BucketExchange(self.layout, self.params, self.specs, rt.group)
        self.schedule = RoundSchedule(d, rt, self.stats, self.layout, list(self.params))
        # without a fixed H the cosine follows the run's progress
        self.inner_opt, self.inner_sched = build_inner_optimizer(
            list(self.model.named_parameters()), cfg.inner, d.outer_steps * d.inner_steps,
            None if self.schedule.budget.by_steps else self.schedule.progress)

        # peers, state transfer and rounds
        self._stop = threading.Event()
        self.stopping = False
        self.peers.bind(self.layout, self.params, self.specs, self.exchange)
        self.transfer = StateTransfer(a, rt=rt, stats=self.stats, outer=self.outer, params=self.params,
                                      exchange=self.exchange, peers=self.peers, schedule=self.schedule,
                                      forget_unsent=self.unsent.clear, fingerprint=self.fingerprint)
        self.peers.serve(self.transfer.provide, self.outer.lock, self.transfer.connected, self._stop.is_set)
        self.faults = FaultPlan.from_env()
        hooks = [FaultHook(self.faults, self.outer, a.matchmaking_time + 3.0), MembershipHook(self.peers)]
        self.rounds = OuterRounds(d, a, rt=rt, stats=self.stats, schedule=self.schedule, outer=self.outer,
                                  params=self.params, exchange=self.exchange,
                                  norm=IslandNorm(rt, self.layout, self.specs), peers=self.peers,
                                  transfer=self.transfer, unsent=self.unsent, fingerprint=self.fingerprint,
                                  keeps_unsent=a.compression in LOSSY_CODECS and a.error_feedback, hooks=hooks)
        self.metrics: MetricsLogger | NullMetrics = NullMetrics()
        self.writer = checkpoint.BackgroundWriter() if cfg.checkpoint.background else None
        self.progress = Progress(None, self.name, enabled=False)
        """The bar of :meth:`run` on a terminal (rank 0 only)."""
        self.t_start = 0.0
        """``time.perf_counter()`` when the training loop started (for compute utilization)."""

    @property
    def is_main(self) -> bool:
        """Whether this process writes the island's metrics, summary and files and prints (rank 0)."""
        return self.rt.is_main

    # ---------------------------------------------------------------------------------------- steps
    def connect(self) -> None:
        """Collective: join the peer network (see :meth:`PeerNode.connect`)."""
        self.peers.connect()

    def train_step(self) -> float:
        """One inner AdamW step over the island (with gradient accumulation); returns the mean loss."""
        loss = take_inner_step(self.model, self.batches, self.inner_opt, self.inner_sched, self.cfg.inner)
        self.stats.inner_step += 1
        self.stats.tokens += self.batches.tokens_per_batch * self.cfg.inner.grad_accum
        return loss

    @contextmanager
    def _holding_theta_global(self) -> Iterator[None]:
        """Inside the block the island's parameters hold θ_global; its own are put back afterwards."""
        own = {n: p.detach().clone() for n, p in self.params.items()}
        self.outer.copy_to(self.params)
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(own[n])

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean held-out loss of θ_global over the fixed evaluation batches (the same on every rank)."""
        with self._holding_theta_global():
            return float(np.mean([self.model.eval_loss(x, y) for x, y in self.eval_batches]))

    def theta_global(self) -> tuple[dict[str, torch.Tensor] | None, str]:
        """Collective: the whole θ_global assembled on rank 0 from the ranks' shards (None on the other
        ranks) and its checksum (on every rank), comparable between islands of any shape."""
        rt = self.rt
        mine = {n: (spec_tuple(self.specs[n]), t.detach().cpu()) for n, t in self.outer.theta_global.items()}
        parts = rt.gather_to_main(mine)
        if parts is None:
            return None, rt.bcast(None)
        full = {n: torch.full(shape, float("nan")) for n, shape in self.full_shapes}
        for part in parts:
            for n, ((dim, offset, length), t) in part.items():
                if full[n].dim() == 0:
                    full[n].copy_(t.reshape(()))
                else:
                    full[n].narrow(dim, offset, length).copy_(t)
        return full, rt.bcast(checksum(full))

    # ------------------------------------------------------------------------------------ stopping
    def request_stop(self, *_: Any) -> None:
        """Finish the current inner step, checkpoint and leave (SIGINT/SIGTERM)."""
        if not self._stop.is_set() and self.is_main:
            print(f"[{self.name}] stopping: finishing the current step and writing a checkpoint", flush=True)
        self._stop.set()

    def stop_agreed(self) -> bool:
        """Whether to stop now; every rank of the island (of the world, when islands average in lockstep)
        gets the same answer."""
        self.stopping = self.rt.reduce([float(self._stop.is_set())], op="max", world=self.rt.lockstep)[0] > 0
        return self.stopping

    # ---------------------------------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        """Train until ``diloco.outer_steps`` rounds are done (or a stop is requested)."""
        cfg = self.cfg
        try:
            self.maybe_resume()
            main_thread = threading.current_thread() is threading.main_thread()
            previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
            self.connect()
        except BaseException:  # never started: leave the run dir as it was, and no noise after the error
            mute_shutdown_noise()
            self.close()
            _forget_failed_start(self.run_dir, self._run_dir_before)
            raise
        # hivemind's averager makes this process ignore SIGINT: install ours after it started,
        # and give the previous handlers back when the island is done
        for sig in previous:
            signal.signal(sig, self.request_stop)
        w = cfg.wandb
        if self.is_main:
            self.metrics = MetricsLogger(self.run_dir, wandb_mode=w.mode, project=w.project,
                                         group=w.group or cfg.averaging.run_id, name=self.name, entity=w.entity,
                                         config=to_dict(cfg), resume=bool(cfg.checkpoint.resume))
        try:
            self.transfer.join_from_peers()
            return self._loop()
        finally:
            self.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _loop(self) -> dict[str, Any]:
        """Inner steps; rounds sent and applied on the schedule of :class:`OuterRounds`; evaluations of
        θ_global; checkpoints between rounds; the summary at the end."""
        cfg, s, sched, rounds = self.cfg, self.stats, self.schedule, self.rounds
        t_start = self.t_start = time.perf_counter()
        if s.outer_step == 0 and math.isnan(s.eval_loss_start):
            with self._as_compute():
                s.eval_loss_start = self.evaluate()
            self.metrics.log({**self._eval_record(s.eval_loss_start), "tokens": s.tokens, "outer_step": s.outer_step})
        loss, window = float("nan"), (time.perf_counter(), s.tokens)
        self.progress = Progress(100, self.name, percent=True, enabled=self.is_main and sys.stderr.isatty())
        first = (time.perf_counter(), s.tokens)
        while s.outer_step < sched.total_rounds and not self.stop_agreed():
            t_step = time.perf_counter()
            if s.inner_step % sched.interval == sched.interval // 2:
                self.faults.at("inner", s.outer_step + 1)
            loss = self.train_step()
            s.compute_seconds += time.perf_counter() - t_step
            self.progress.set(100 * sched.progress(), round=f"{s.outer_step + 1}/{sched.total_rounds}",
                              step=s.inner_step, loss=f"{loss:.3f}",
                              tokens_per_s=f"{(s.tokens - first[1]) / max(time.perf_counter() - first[0], 1e-9):,.0f}")
            if s.inner_step % cfg.logging.log_every == 0 or sched.sync_due():
                window = self._log_loss(loss, window)
            if rounds.apply_due():
                self._after_round(rounds.apply(), loss)
            if not sched.sync_due() or self.stop_agreed():
                continue
            if rounds.flight is not None:  # the next round is due: the one in flight must end first
                self._after_round(rounds.apply(), loss)
            if s.outer_step >= sched.total_rounds:
                break
            if sched.restarted_now():  # a round it was left behind in made it catch up: nothing trained to send
                continue
            last = s.outer_step == sched.total_rounds - 1
            done = rounds.send()
            if done is None and (rounds.blocking or last or rounds.apply_due()):
                done = rounds.apply()
            if done is not None:
                self._after_round(done, loss)
        if rounds.flight is not None:  # stopping with a round in flight: see it through, then checkpoint
            self._after_round(rounds.apply(), loss)
        if self.stopping or (cfg.checkpoint.every and s.outer_step % (cfg.checkpoint.every * sched.n)):
            self.save_checkpoint()
        self.progress.close()
        if math.isnan(s.eval_loss_end):
            with self._as_compute():
                s.eval_loss_end = self.evaluate()
        return self._finish(time.perf_counter() - t_start)

    @contextmanager
    def _as_compute(self) -> Iterator[None]:
        """Count the time of the block as the island's compute: evaluating θ_global (and writing samples of
        it) is compute, as in the baseline's accounting, whichever evaluation it is."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.stats.compute_seconds += time.perf_counter() - t

    def _eval_record(self, loss: float) -> dict[str, float]:
        """The held-out loss of θ_global as logged: per token, its perplexity, and in bits per byte of text (which
        compares runs of different tokenizers)."""
        return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50)),
                "eval/bits_per_byte": loss / math.log(2) / self.heldout_bytes_per_token}

    def _log_loss(self, loss: float, window: tuple[float, int]) -> tuple[float, int]:
        """Log the training loss and throughput since ``window`` (time, tokens); returns the new window."""
        now, s = time.perf_counter(), self.stats
        tokens_per_second = (s.tokens - window[1]) / max(now - window[0], 1e-9)
        self.metrics.log({"loss": loss, "perplexity": math.exp(min(loss, 50)),
                          "lr": self.inner_sched.get_last_lr()[0], "tokens": s.tokens,
                          "tokens_per_second": tokens_per_second, **self.throughput.record(tokens_per_second),
                          "outer_step": s.outer_step, "inner_step": s.inner_step})
        return now, s.tokens

    def _after_round(self, metrics: RoundMetrics, loss: float) -> None:
        """Record a round that ended: metrics, evaluation of θ_global when due, progress line, checkpoint."""
        cfg, s, n, total = self.cfg, self.stats, self.schedule.n, self.schedule.total_rounds
        record = dict(metrics.record(), tokens=s.tokens, outer_step=s.outer_step, loss=loss)
        if s.outer_step % (cfg.logging.eval_every * n) == 0 or s.outer_step == total:
            with self._as_compute():
                ev = self.evaluate()
                self._log_samples()
            s.eval_loss_end = ev
            record.update(self._eval_record(ev))
        record["compute_utilization"] = s.compute_seconds / max(time.perf_counter() - self.t_start, 1e-9)
        self.metrics.log(record)
        if self.is_main:
            self.progress.write(f"[{self.name}] {metrics.progress_line(s.outer_step, total, loss)}"
                                + (f" eval={record['eval/loss']:.3f}" if "eval/loss" in record else ""))
        if cfg.checkpoint.every and s.outer_step % (cfg.checkpoint.every * n) == 0:
            self.save_checkpoint()

    def _log_samples(self) -> None:
        """Collective over the island's ranks: log the samples of θ_global as it is now, when
        ``--logging.samples`` asks for them.  Without pipeline stages the island's own model generates them,
        every rank together (nothing is gathered); a pipelined island assembles θ_global on its main rank."""
        if not self.cfg.logging.samples:
            return
        step = self.stats.outer_step
        if self.model.schedule is None:
            # FSDP gathers a block's weights in the block's own forward, which the KV cache's path bypasses
            cached = self.rt.dp == 1
            module = self.model.modules[0]
            forward = cached_forward(module) if cached else (lambda tokens, start, fresh: self.model.logits(tokens))
            with self._holding_theta_global(), torch.no_grad(), self.model.autocast():
                module.eval()
                try:
                    rows = self.sampler.rows_from(forward, self.rt.bcast, self.device, step, use_cache=cached)
                finally:
                    module.train()
        else:
            theta, _ = self.theta_global()
            rows = self.sampler.rows(theta, step) if self.sampler is not None and theta is not None else None
        if self.is_main and rows is not None:
            self.metrics.log_samples(rows, self.stats.tokens)

    def _finish(self, wall: float) -> dict[str, Any]:
        """After the last round: check the islands ended in sync, write θ_global and the summary."""
        out_of_sync = self.transfer.check_in_sync(self.rounds.theta_fingerprint(), self.stopping)
        if out_of_sync:
            log.error("%s", out_of_sync)
        self.peers.count_bytes(0, 0, through_torch=False)  # what moved since the last round
        theta, theta_checksum = self.theta_global()
        if self.is_main:
            torch.save(theta, self.run_dir / "theta_global.pt")
        s = self.stats
        summary = {
            "island": self.name, "outer_step": s.outer_step, "inner_step": s.inner_step, "tokens": s.tokens,
            "eval_loss_start": s.eval_loss_start, "eval_loss_end": s.eval_loss_end,
            "rounds_ok": s.rounds_ok, "rounds_failed": s.rounds_failed,
            "rounds_caught_up": s.rounds_caught_up, "bytes_sent": s.bytes_sent,
            "bytes_received": s.bytes_received, "payload_bytes_sent": s.payload_bytes_sent,
            "payload_bytes_received": s.payload_bytes_received, "compute_seconds": s.compute_seconds,
            "comm_seconds": s.comm_seconds, "stall_seconds": s.stall_seconds, "wall_seconds": wall,
            "theta_checksum": theta_checksum,
            "failures": s.failures[-20:], "stopped_early": self.stopping, "out_of_sync": out_of_sync,
        }
        self.metrics.summary(summary)
        return summary

    def close(self) -> None:
        """Finish writing a checkpoint, announce leaving, stop the averagers, the DHT, the W&B run and the
        process group (idempotent)."""
        if self._stop.is_set():  # Ctrl-C or SIGTERM: the process is leaving, maybe with its p2p daemons gone
            mute_shutdown_noise()
        try:
            self.wait_for_checkpoint()
        finally:
            self._close_peers()

    def _close_peers(self) -> None:
        try:
            self.peers.disconnect()
            self.metrics.close()
            self.metrics = NullMetrics()
        finally:
            self.rt.close()

    # --------------------------------------------------------------------------------- checkpoints
    def _shape(self) -> dict[str, Any]:
        rt = self.rt
        return {"dp": rt.dp, "tp": rt.tp, "pp": rt.pp, "rank": rt.rank,
                "specs": {n: list(spec_tuple(s)) for n, s in self.specs.items()}}

    def _inner_param_names(self) -> list[str]:
        """The parameter names in the inner optimizer's order (its state is keyed by position)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return [names[id(p)] for group in self.inner_opt.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        """Everything this rank needs to resume exactly, with the island shape it belongs to."""
        s = self.stats
        return {
            "config": to_dict(self.cfg), "tokenizer": self.tokenizer.json_text,
            "outer_step": s.outer_step, "inner_step": s.inner_step,
            "model": {n: t.detach().cpu().clone() for n, t in self.params.items()},
            "inner_optimizer": _copies(local_state(self.inner_opt.state_dict())),
            "inner_param_names": self._inner_param_names(),
            "inner_scheduler": self.inner_sched.state_dict(),
            "outer_optimizer": self.outer.state_dict(), "data": self.batches.state_dict(),
            "rng": checkpoint.rng_state(), "stats": dict(s.__dict__),
            "norm_history": list(self.rounds.guard.history), "island": self._shape(),
            "overlap": self.schedule.state_dict(),
            "error_feedback": {b: t.clone() for b, t in self.unsent.feedback.items()},
            "owner_feedback": {b: t.clone() for b, t in self.unsent.carry.items()},
        }

    def written_by_me(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` was written by this rank of an island of this shape (else it is resharded)."""
        saved, mine = _island_record(state), self._shape()
        return all(saved.get(k, 1) == mine[k] for k in ("dp", "tp", "pp", "rank")) and \
            saved.get("specs") in (None, mine["specs"])

    def load_state_dict(self, state: dict[str, Any], path: Path | None = None) -> None:
        """Restore :meth:`state_dict`: written by this rank of an island of the same shape, or else (with the
        ``path`` it was read from, beside the other old ranks' files) resharded from all of them."""
        mine = self.written_by_me(state)
        if mine:
            with torch.no_grad():
                for n, t in state["model"].items():
                    self.params[n].copy_(t)
            self.inner_opt.load_state_dict(state["inner_optimizer"])
            self.outer.load_state_dict(state["outer_optimizer"])
        else:
            if path is None:
                raise TrainingError("a checkpoint of another island shape needs the path it was read from")
            self._load_resharded(state, path)
        restore_dtensor_state(self.inner_opt)
        self.inner_sched.load_state_dict(state["inner_scheduler"])
        self.batches.load_state_dict(state["data"])
        checkpoint.set_rng_state(state["rng"])
        for k, v in state["stats"].items():
            setattr(self.stats, k, v)
        self.stats.outer_step, self.stats.inner_step = int(state["outer_step"]), int(state["inner_step"])
        self.rounds.guard.history = [float(x) for x in state.get("norm_history", [])]
        self.schedule.load_state_dict(state.get("overlap"), int(state.get("tokens_at_sync", self.stats.tokens)))
        for kept, key in ((self.unsent.feedback, "error_feedback"), (self.unsent.carry, "owner_feedback")):
            kept.clear()
            if mine:
                kept.update({int(b): t.clone() for b, t in state.get(key, {}).items()})
            elif state.get(key):
                log.warning("the codec's error feedback is reset: it was kept per rank of a %s island",
                            _island_record(state)["shape"])

    @torch.no_grad()
    def _load_resharded(self, first: dict[str, Any], path: Path) -> None:
        """Fill this rank's pieces of the model, AdamW's moments, θ_global and the outer momentum from the files
        every rank of an island of another shape wrote at the step of ``path`` (read one after the other: at
        most one old rank's state in memory beside this rank's own)."""
        saved = _island_record(first)
        size = saved["dp"] * saved["tp"] * saved["pp"]
        if "inner_param_names" not in first:
            raise TrainingError(f"checkpoint {path} was written by a {saved['shape']} island before checkpoints could "
                                f"be resharded; resume it with the same --parallel.* settings")
        base = path.parent.parent if size > 1 else path.parent
        paths = [base / f"rank{r}" / path.name for r in range(size)] if size > 1 else [path]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise CheckpointError(f"resharding the checkpoint of a {saved['shape']} island needs every rank's file, "
                                  f"but {', '.join(missing)} is missing; restore it or resume with the same shape")
        shapes = dict(self.full_shapes)
        moments = {n: {k: torch.zeros(p.shape, dtype=torch.float32) for k in ("exp_avg", "exp_avg_sq")}
                   for n, p in self.params.items()}
        momentum = dict(zip(self.outer.names, self.outer.momentum_buffers())) if self.outer.mu else {}
        copied: dict[str, int] = {n: 0 for n in self.params}
        seen: set[tuple[str, tuple[int, ...]]] = set()
        step = None
        for p in paths:
            state = first if p == path else checkpoint.load(p)
            specs = _island_record(state)["specs"] or {n: self.layout.full_spec(n) for n in state["model"]}
            inner = state["inner_optimizer"]["state"]
            inner_index = {n: i for i, n in enumerate(state["inner_param_names"])}
            old_momentum = dict(zip(state["outer_optimizer"]["master"], state["outer_optimizer"]["momentum"]))
            for n, piece in state["model"].items():
                if n not in self.params or (n, tuple(specs[n])) in seen:
                    continue  # another rank's copy of a replicated piece was read already
                seen.add((n, tuple(specs[n])))
                old, new = ShardSpec(shapes[n], *specs[n], False), self.specs[n]
                pairs = [(self.params[n], piece), (self.outer.theta_global[n], state["outer_optimizer"]["master"][n])]
                if n in momentum:
                    pairs.append((momentum[n], old_momentum[n]))
                adam = inner.get(inner_index[n], {})
                pairs += [(moments[n][k], adam[k]) for k in moments[n] if k in adam]
                step = adam.get("step", step)
                got = [copy_overlap(dst, new, src.reshape(old.local_shape), old) for dst, src in pairs]
                copied[n] += got[0]
        short = [n for n, c in copied.items() if c != self.params[n].numel()]
        if short:
            raise CheckpointError(f"the checkpoint of a {saved['shape']} island in {base} does not cover {short[0]}; "
                                  f"its rank files come from different runs")
        names = self._inner_param_names()
        own = self.inner_opt.state_dict()
        # the learning rate the schedule reached lives in the groups (LambdaLR sets it again only at its next step)
        own["param_groups"] = [{**old, "params": mine["params"]} for old, mine in
                               zip(first["inner_optimizer"]["param_groups"], own["param_groups"], strict=True)]
        if step is not None:
            own["state"] = {i: {"step": step.clone(), **moments[n]} for i, n in enumerate(names)}
        self.inner_opt.load_state_dict(own)
        self.outer.step_count = int(first["outer_optimizer"]["step_count"])
        was = saved["dp"] * int(first.get("config", {}).get("inner", {}).get("grad_accum", 1))
        now = self.rt.dp * self.cfg.inner.grad_accum
        if was != now:
            log.warning("the island's batch changes from %d x --inner.batch_size to %d x on resume (dp x grad_accum): "
                        "pass --inner.grad_accum %s to keep the trajectory", was, now,
                        f"{was // self.rt.dp}" if was % self.rt.dp == 0 else "(none fits this dp)")
        log.info("resharded the checkpoint of a %s island onto a %s one", saved["shape"], self.rt.shape)

    def save_checkpoint(self) -> Path:
        """Write this rank's checkpoint of the current outer step (keeping ``checkpoint.keep``): from a
        snapshot in a background thread (``--checkpoint.background``; the previous write is waited for first
        and its error raised here), else at once."""
        path = checkpoint.checkpoint_path(self.ckpt_dir, self.stats.outer_step)
        keep = self.cfg.checkpoint.keep
        if self.writer is None:
            checkpoint.save(self.state_dict(), path, keep=keep)
            log.info("checkpoint written: %s", path)
        else:
            self.writer.submit(self.state_dict(), path, keep, lambda p: log.info("checkpoint written: %s", p))
        return path

    def wait_for_checkpoint(self) -> None:
        """Wait until the checkpoint being written in the background is on disk (raises its error)."""
        if self.writer is not None:
            self.writer.wait()

    def _find_checkpoint(self, spec: str) -> Path | None:
        """This rank's checkpoint for ``--checkpoint.resume spec``: its own file, or else one an island of another
        shape wrote in the same checkpoint directory (rank 0's, or the single process's), to be resharded."""
        base = self.ckpt_base
        if spec != "latest":
            own = self.ckpt_dir / Path(spec).name
            return checkpoint.find_resume(str(own) if self.rt.rank and own.is_file() else spec, self.ckpt_dir)
        for directory in dict.fromkeys((self.ckpt_dir, base / "rank0", base)):
            path = checkpoint.find_resume(spec, directory)
            if path is not None:
                return path
        return None

    def maybe_resume(self) -> None:
        """With ``--checkpoint.resume``: every rank loads its own checkpoint of the same outer step (the
        newest all ranks have), resharded when an island of another shape wrote it; any rank's problem stops
        every rank with the same message."""
        spec, rt = self.cfg.checkpoint.resume, self.rt
        if not spec:
            # every rank's folder, whatever shape the earlier run had: a later --resume would reshard from them
            # (rank 0 moves them all; the other ranks write nothing before rank 0 joins their first round)
            base = self.ckpt_base
            for directory in dict.fromkeys((base, *sorted(base.glob("rank*")))) if rt.rank == 0 else ():
                aside = checkpoint.set_aside(directory)
                if aside is not None:
                    log.warning("%s held an earlier run's checkpoints: moved them to %s (pass --resume to continue "
                                "that run instead)", directory, aside)
            return
        world = rt.lockstep
        path, error = None, ""
        try:
            path = self._find_checkpoint(spec)
        except CheckpointError as e:
            error = str(e)
        rt.raise_if_any(error, CheckpointError, world=world)
        steps = rt.gather_all(_step_of(path) if path is not None else None, world=world)
        if all(s is None for s in steps):
            log.warning("--resume: no checkpoint in %s; starting fresh", self.ckpt_dir)
            return
        if any(s is None for s in steps):
            missing = [r for r, s in enumerate(steps) if s is None]
            rt.raise_if_any(f"rank(s) {missing} have no checkpoint to resume from while others do; resume every "
                            f"rank from the same run (checkpoints live in <checkpoint dir>/rank<r>/)",
                            CheckpointError, world=world)
        step = min(s for s in steps if s is not None)
        state, error = None, ""
        try:
            if _step_of(path) != step:
                path = checkpoint.checkpoint_path(path.parent, step)
            state = checkpoint.load(path)
            saved = state.get("config", {})
            tokenizer = Tokenizer.from_json(state.get("tokenizer"))
            if saved and config_fingerprint(from_dict(saved), "" if tokenizer.is_bytes else tokenizer.sha256) \
                    != self.fingerprint:
                error = (f"checkpoint {path} was written with a different model, tokenizer or outer-optimizer config; "
                         f"resume with the same --model.*, --data.tokenizer and --diloco.outer_* settings")
        except CheckpointError as e:
            error = str(e)
        rt.raise_if_any(error, CheckpointError, world=world)
        try:
            self.load_state_dict(state, path)
        except (TrainingError, CheckpointError) as e:
            error = str(e)
        rt.raise_if_any(error, TrainingError, world=world)
        log.info("resumed from %s at outer step %d", path, self.stats.outer_step)


def _island_record(state: dict[str, Any]) -> dict[str, Any]:
    """The island shape a checkpoint was written by (older checkpoints: one process, or no ``dp``), with
    ``shape`` as the flags name it."""
    saved = {"dp": 1, "tp": 1, "pp": 1, "rank": 0, "specs": None, **(state.get("island") or {})}
    saved["shape"] = f"dp={saved['dp']} x pp={saved['pp']} x tp={saved['tp']}"
    return saved


def _copies(obj: Any) -> Any:
    """``obj`` with every tensor copied (a snapshot the training thread may go on changing the original of)."""
    if torch.is_tensor(obj):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _copies(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copies(v) for v in obj]
    return obj


def _step_of(path: Path | None) -> int | None:
    if path is None:
        return None
    m = checkpoint.NAME_RE.match(Path(path).name)
    return int(m[1]) if m else -1


def train(cfg: Config) -> dict[str, Any] | None:
    """Run one island to completion; return its summary on the island's main rank (None on the other
    ranks of a tp/pp island, which would only repeat it)."""
    island = Island(cfg)
    summary = island.run()
    return summary if island.is_main else None
