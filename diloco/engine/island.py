"""One DiLoCo island rank: the wiring of its parts and the training loop.

An island is the training process group of one server: ``dp * pp * tp`` processes under ``torchrun`` (tensor
parallelism inside, pipeline stages around it, data-parallel FSDP replicas outside, see :mod:`pipeline`), or one
process, which is simply the ``dp = pp = tp = 1`` case (:class:`~diloco.engine.runtime.Runtime` with no process
group).  Every rank builds the same :class:`Island` and takes every decision together with the others.
:class:`Island` only builds, connects and runs; each part has one job and gets the narrow pieces it needs:

- the trainer core (:class:`~diloco.engine.trainer.TrainerCore`, the synchronous baseline's too) holds the data,
  this rank's :class:`pipeline.ModelParts` and the inner optimizer, takes the inner steps, evaluates and makes the
  records; the outer optimizer holds θ_global of this rank's local shards (they share storage with the
  parameters, DTensor or not);
- the pseudo-gradient is averaged over the canonical layout (:mod:`peers`' ``CanonicalLayout``): buckets of
  ``--averaging.bucket_numel`` elements of the whole model, each averaged by the rank that owns it, so islands of
  any shape average together;
- :class:`~diloco.engine.round.OuterRounds` runs the outer rounds (:mod:`diloco.engine.round`: schedule, round in
  flight, transaction) over one :class:`~diloco.engine.round.RoundContext`;
  :class:`~diloco.engine.state_transfer.StateTransfer` catches up with the run, serves θ_global to joiners and
  resynchronizes; :class:`peers.PeerNode` is the rank's place in the peer network;
- rank 0 alone writes metrics, ``summary.json``, the multiaddrs and ``theta_global.pt`` and prints.

Checkpoints (per rank, resharded across island shapes) are :class:`~diloco.engine.checkpoints.CheckpointManager`'s:
the island hands it ``{name: part}``, one line per stateful part.
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

import torch

from diloco.config import Config, config_fingerprint, to_dict
from diloco.engine.checkpoints import (
    CheckpointManager,
    CodecResiduals,
    InnerOptimizer,
    ModelShards,
    Resharding,
    RngState,
)
from diloco.engine.faults import FaultPlan
from diloco.engine.metrics import MetricsLogger, NullMetrics, RunStats
from diloco.engine.round import OuterRounds, RoundContext, RoundMetrics
from diloco.engine.runtime import Runtime, pick_device, return_freed_memory
from diloco.engine.trainer import TrainerCore, run_summary
from diloco.errors import TrainingError
from diloco.inference.generate import cached_forward
from diloco.inference.samples import Sampler
from diloco.progress import Progress
from outer_optim import OuterOptimizer, checksum
from outer_optim.fragments import split_into_fragments
from peers import (
    BucketExchange,
    CanonicalLayout,
    FeedbackBuffers,
    PeerNode,
    is_peer_file,
    mute_shutdown_noise,
    spec_tuple,
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
        self.rt = Runtime.start(cfg, pick_device(cfg.device, gpus=cfg.parallel.gpus))
        self.peers: PeerNode | None = None
        self.cfg = self.rt.island_config(cfg)
        run_dir = Path(self.cfg.logging.run_dir)
        self._run_dir_before = set(run_dir.iterdir()) if run_dir.is_dir() else None
        try:
            self._build()
        except BaseException:
            mute_shutdown_noise()
            if self.peers is not None:
                self.peers.disconnect()
            self.rt.close()
            _forget_failed_start(run_dir, self._run_dir_before)
            raise

    def _build(self) -> None:
        """Wire the island's parts.  The order matters where a part needs another: the peer node's processes are
        forked before the data and the model exist; the layout comes from the model; the rounds' schedule exists
        before the inner optimizer, whose learning rate may follow it."""
        cfg, rt = self.cfg, self.rt
        if not rt.is_main:
            logging.getLogger("diloco").setLevel(logging.ERROR)  # rank 0 speaks for the island
        self.run_dir = Path(cfg.logging.run_dir)
        try:  # before any peer hears of us
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TrainingError(f"cannot create --logging.run_dir {self.run_dir} ({e.strerror}); "
                                f"pass a directory you can write to") from None
        self.name = f"{cfg.averaging.run_id}-island{cfg.data.shard_index}"
        try:  # a mistyped DILOCO_FAULTS, before any peer hears of us
            self.faults = FaultPlan.from_env()
        except ValueError as e:
            raise TrainingError(str(e)) from None
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = rt.device
        m, d, a, lg, ck = cfg.model, cfg.diloco, cfg.averaging, cfg.logging, cfg.checkpoint
        self.stats = RunStats()
        self.unsent = FeedbackBuffers()
        # the rounds' collectives (the exchange, the peer node, state transfer) on groups of their own when a thread
        # of its own runs them
        self.round_rt = round_rt = rt.round_view() if d.round_thread else rt
        # the peer node's processes are forked from this one: before the data and the model exist
        self.peers = PeerNode(a, round_rt, self.run_dir, self.name, resuming=bool(ck.resume), unsent=self.unsent,
                              count=self.stats.add_traffic)
        self.peers.start()

        # the data and the model: the layout comes from the whole model's skeleton (no memory), the same on every
        # rank; each rank materialises only its own pieces of it
        torch.manual_seed(cfg.seed)
        micro = max(1, cfg.inner.batch_size // (cfg.parallel.microbatches if cfg.parallel.pp > 1 else 1))
        self.core = core = TrainerCore(
            cfg, mesh=rt.mesh, parallel=cfg.parallel, device=self.device, shard=cfg.data.shard_index,
            shards=cfg.data.num_shards, replica=rt.dp_rank, replicas=rt.dp, devices=rt.size,
            profile_shape=(micro, m.seq_len))
        log.info("data: %s", core.corpus.description)
        self.model, self.batches, self.tokenizer = core.model, core.batches, core.tokenizer
        # without pipeline stages every rank takes part in generating the samples; with them the main rank alone
        self.sampler = Sampler(m, core.corpus.heldout, lg.samples, lg.sample_tokens, core.tokenizer) \
            if lg.samples and (rt.is_main or cfg.parallel.pp == 1) else None
        self.full_shapes = core.full_shapes
        fragments = split_into_fragments([n for n, _ in self.full_shapes], d.fragments) if d.fragments > 1 else ()
        self.layout = CanonicalLayout.build(self.full_shapes, a.bucket_numel, fragments)
        self.specs = self.model.shard_specs()
        self.params = self.model.local_named_parameters()  # local shards, sharing storage with the parameters
        self.fingerprint = config_fingerprint(cfg, "" if core.tokenizer.is_bytes else core.tokenizer.sha256)
        record = {"config": to_dict(cfg), "tokenizer": core.tokenizer.json_text}

        # the outer state, the rounds and their peers
        self.outer = OuterOptimizer.from_config(self.params, d.outer_optimizer, d.outer_lr, d.outer_momentum,
                                                device=d.master_device)
        self.exchange = BucketExchange(self.layout, self.params, self.specs, round_rt.group)
        ctx = RoundContext(d, a, rt=rt, round_rt=round_rt, stats=self.stats, layout=self.layout, specs=self.specs,
                          outer=self.outer, params=self.params, exchange=self.exchange, peers=self.peers,
                          unsent=self.unsent, fingerprint=self.fingerprint, faults=self.faults)
        self.schedule, self.transfer = ctx.schedule, ctx.transfer
        # without a fixed H the cosine follows the run's progress
        core.start_inner(d.outer_steps * d.inner_steps, None if self.schedule.budget.by_steps else self.schedule.progress)
        self._stop = threading.Event()
        self.stopping = False
        self.peers.bind(self.layout, self.params, self.specs, self.exchange)
        self.peers.serve(self.transfer.provide, self.outer.lock, self.transfer.connected, self._stop.is_set)
        self.rounds = OuterRounds(ctx)

        # what a checkpoint holds: one line per stateful part
        self.checkpoints = CheckpointManager(Path(ck.dir or self.run_dir / "checkpoints"), rt, {
            "model": ModelShards(self.params),
            "inner_optimizer": InnerOptimizer(core.inner_opt),
            "inner_scheduler": core.inner_sched,
            "outer_optimizer": self.outer,
            "data": core.batches,
            "rng": RngState(),
            "stats": self.stats,
            "norm_guard": ctx.guard,
            "schedule": self.schedule,
            "codec_residuals": CodecResiduals(self.unsent),
            "peers": self.peers,
        }, clock=self.stats, resharding=Resharding(rt, self.params, self.specs, self.layout,
                                                   list(self.model.named_parameters()), core.inner_opt, self.outer,
                                                   cfg.inner.grad_accum),
            record=record, fingerprint=self.fingerprint, keep=ck.keep, background=ck.background)
        self.metrics: MetricsLogger | NullMetrics = NullMetrics()
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
        loss = self.core.step()
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

    def evaluate(self) -> float:
        """Mean held-out loss of θ_global over the fixed evaluation batches (the same on every rank)."""
        with self._holding_theta_global():
            return self.core.evaluate()

    def theta_pieces(self) -> dict[str, tuple[tuple[int, int, int], torch.Tensor]]:
        """This rank's pieces of θ_global with where each sits in its parameter, as sent to rank 0: copies, since
        each name is a view of one flat buffer that pickling would send whole, once per name (a dp=2 rank of a
        10M model grew to 8.5 GB at the end of every run)."""
        return {n: (spec_tuple(self.specs[n]), t.detach().cpu().clone()) for n, t in self.outer.theta_global.items()}

    def theta_global(self) -> tuple[dict[str, torch.Tensor] | None, str]:
        """Collective: the whole θ_global assembled on rank 0 from the ranks' shards (None on the other
        ranks) and its checksum (on every rank), comparable between islands of any shape."""
        rt = self.rt
        parts = rt.gather_to_main(self.theta_pieces())
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
            if cfg.checkpoint.resume:
                self.checkpoints.resume(cfg.checkpoint.resume)
            else:
                self.checkpoints.set_aside_earlier_run()
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
            self.metrics.log(self.core.evaluation_record(s.eval_loss_start, s))
        loss, window = float("nan"), (time.perf_counter(), s.tokens)
        self.progress = Progress(100, self.name, percent=True, enabled=self.is_main and sys.stderr.isatty())
        first = (time.perf_counter(), s.tokens)
        while sched.outer_step < sched.total_rounds and not self.stop_agreed():
            t_step = time.perf_counter()
            if s.inner_step % sched.interval == sched.interval // 2:
                self.faults.at("inner", sched.outer_step + 1)
            loss = self.train_step()
            s.compute_seconds += time.perf_counter() - t_step
            self.progress.set(100 * sched.progress(), round=f"{sched.outer_step + 1}/{sched.total_rounds}",
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
            self.checkpoints.save()
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

    def _log_loss(self, loss: float, window: tuple[float, int]) -> tuple[float, int]:
        """Log the training loss and throughput since ``window`` (time, tokens); returns the new window."""
        now, s = time.perf_counter(), self.stats
        tokens_per_second = (s.tokens - window[1]) / max(now - window[0], 1e-9)
        self.metrics.log(self.core.loss_record(loss, s, tokens_per_second, outer_step=self.schedule.outer_step))
        return now, s.tokens

    def _after_round(self, metrics: RoundMetrics, loss: float) -> None:
        """Record a round that ended: metrics, evaluation of θ_global when due, progress line, checkpoint."""
        cfg, s, n, total = self.cfg, self.stats, self.schedule.n, self.schedule.total_rounds
        evaluation = None
        if s.outer_step % (cfg.logging.eval_every * n) == 0 or s.outer_step == total:
            with self._as_compute():
                evaluation = s.eval_loss_end = self.evaluate()
                if s.outer_step % (cfg.logging.sample_every * n) == 0 or s.outer_step == total:
                    self._log_samples()
        self.metrics.log({**metrics.record(), **s.traffic(),
                          **self.core.round_record(loss, s, time.perf_counter() - self.t_start, evaluation)})
        if self.is_main:
            self.progress.write(f"[{self.name}] {metrics.progress_line(s.outer_step, total, loss)}"
                                + (f" eval={evaluation:.3f}" if evaluation is not None else ""))
        if cfg.checkpoint.every and s.outer_step % (cfg.checkpoint.every * n) == 0:
            self.checkpoints.save()

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
            # the other ranks wait for the main one's CPU model on the host, in the gloo control group: a stage's
            # next send or receive would wait on the GPU, where NCCL's watchdog ends the island if it waits too long
            self.rt.bcast(None)
        if self.is_main and rows is not None:
            self.metrics.log_samples(rows, self.stats.tokens)

    def _finish(self, wall: float) -> dict[str, Any]:
        """After the last round: take the run's θ_global if the run committed a round this island missed (its last round
        rolled back while the others committed theirs), check the islands ended in sync, write θ_global and the
        summary."""
        if not self.stopping:
            self.transfer.catch_up()
        out_of_sync = self.transfer.check_in_sync(self.rounds.theta_fingerprint(), self.stopping)
        if out_of_sync:
            log.error("%s", out_of_sync)
        self.peers.count_bytes(0, 0, through_torch=False)  # what moved since the last round
        theta, theta_checksum = self.theta_global()
        if self.is_main:
            torch.save(theta, self.run_dir / "theta_global.pt")
        transport = self.peers.transport
        summary = run_summary(self.name, self.stats, wall=wall, theta_checksum=theta_checksum, device=self.device,
                              stopped_early=self.stopping, sync={
            "behind_nat": self.peers.a.client_mode, "behind_nat_found_by_dial_back": self.peers.behind_nat,
            "transport_relayed": transport.stats.relayed if transport is not None else 0,
            "transport_forged": transport.stats.forged if transport is not None else 0, "out_of_sync": out_of_sync})
        self.metrics.summary(summary)
        return summary

    def close(self) -> None:
        """Finish writing a checkpoint, announce leaving, stop the averagers, the DHT, the W&B run and the
        process group (idempotent)."""
        if self._stop.is_set():  # Ctrl-C or SIGTERM: the process is leaving, maybe with its p2p daemons gone
            mute_shutdown_noise()
        try:
            self.checkpoints.wait()
        finally:
            self._close_peers()

    def _close_peers(self) -> None:
        try:
            self.peers.disconnect()
            self.metrics.close()
            self.metrics = NullMetrics()
        finally:
            self.rt.close()


def train(cfg: Config) -> dict[str, Any] | None:
    """Run one island to completion; return its summary on the island's main rank (None on the other
    ranks of a tp/pp island, which would only repeat it)."""
    island = Island(cfg)
    summary = island.run()
    return summary if island.is_main else None
