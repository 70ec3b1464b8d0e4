"""One DiLoCo island: H inner AdamW steps, then a verified outer round with the other islands.

An island is the training process group of one server: ``tp * pp`` processes under ``torchrun``
(tensor parallelism inside, pipeline stages outside, see :mod:`pipeline`), or one process, which is
simply the ``tp = pp = 1`` case (:class:`diloco.engine.runtime.Runtime` with no process group).  Every rank
builds the same :class:`Island` and takes every decision together with the others.

- the model is this rank's :class:`pipeline.ModelParts`; the outer optimizer holds θ_global of this
  rank's local shards (they share storage with the parameters, DTensor or not);
- the pseudo-gradient is averaged over the canonical layout (:mod:`peers.layout`): buckets of
  ``--averaging.bucket_numel`` elements of the whole model, each averaged by the rank that owns it
  (:mod:`peers.sharded`), so islands of any shape average together;
- the outer round is a transaction (:mod:`diloco.engine.outer_round`); catching up with the run, serving
  θ_global to joiners and resynchronizing live in :mod:`diloco.engine.state_transfer`; checkpoints (one per
  rank) in :mod:`diloco.engine.island_state`; the peer network in :mod:`diloco.engine.peer_node`;
- rank 0 alone writes metrics, ``summary.json``, the multiaddrs and ``theta_global.pt`` and prints.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diloco.engine import island_state
from diloco.engine import peer_node as peer_setup
from diloco.engine import training_loop
from diloco.config import Config, config_fingerprint, to_dict
from diloco.data.batches import ShardedBatches, heldout_batches
from diloco.data.corpus import load_corpus
from diloco.errors import TrainingError
from diloco.engine.faults import FaultPlan
from diloco.model.inner import build_inner_optimizer, inner_step
from diloco.engine.metrics import MetricsLogger, NullMetrics, RunStats
from diloco.model.transformer import build_initial_model, lm_loss
from diloco.engine.outer_round import FaultHook, MembershipHook, RoundMetrics, begin_round, end_round
from diloco.engine.overlap import Overlap
from diloco.engine.runtime import Runtime, pick_device
from diloco.inference.samples import Sampler
from diloco.engine.state_transfer import StateTransfer
from outer_optim import OuterOptimizer
from outer_optim.codecs import LOSSY_CODECS
from outer_optim.fragments import split_into_fragments
from outer_optim.guard import NormGuard
from peers.dht import mute_shutdown_noise
from peers.layout import CanonicalLayout, spec_tuple
from peers.exchange import BucketExchange
from pipeline import ModelParts, SplitSettings

log = logging.getLogger("diloco")

CHUNKS_PER_BUCKET = 4
"""Fingerprint chunks per bucket of the canonical θ_global fingerprint (12 floats per bucket)."""


class Island:
    """Everything one island rank owns: model parts, data shard, inner and outer optimizers, peers, logs."""

    def __init__(self, cfg: Config):
        self.rt = Runtime.start(cfg, pick_device(cfg.device))
        try:
            self._build(self.rt.island_config(cfg))
        except BaseException:
            self.rt.close()
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
        ckpt_dir = Path(cfg.checkpoint.dir or self.run_dir / "checkpoints")
        self.ckpt_dir = ckpt_dir / f"rank{rt.rank}" if rt.size > 1 else ckpt_dir
        self.name = f"{cfg.averaging.run_id}-island{cfg.data.shard_index}"
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = rt.device
        torch.manual_seed(cfg.seed)
        corpus = load_corpus(cfg.data)
        log.info("data: %s", corpus.description)
        m = cfg.model
        self.batches = ShardedBatches(corpus.train, m.seq_len, cfg.inner.batch_size, cfg.data.shard_index,
                                      cfg.data.num_shards, cfg.seed)
        self.eval_batches = heldout_batches(corpus.heldout, m.seq_len, cfg.inner.batch_size,
                                            cfg.logging.eval_batches)
        lg = cfg.logging
        self.sampler = Sampler(m, corpus.heldout, lg.samples, lg.sample_tokens) if lg.samples and rt.is_main else None
        full = build_initial_model(cfg.model, cfg.seed, cfg.checkpoint.init_from)
        self.full_shapes = [(n, tuple(p.shape)) for n, p in full.named_parameters()]
        # the layout comes from the whole model on every rank, before the island splits it
        self.layout = CanonicalLayout.build(self.full_shapes, cfg.averaging.bucket_numel,
                                            split_into_fragments([n for n, _ in self.full_shapes], cfg.diloco.fragments)
                                            if cfg.diloco.fragments > 1 else ())
        micro = max(1, cfg.inner.batch_size // (cfg.parallel.microbatches if cfg.parallel.pp > 1 else 1))
        self.model = ModelParts(full, rt.mesh, SplitSettings.from_config(cfg.parallel), loss_fn=lm_loss,
                                device=self.device, profile_shape=(micro, m.seq_len))
        del full
        self.specs = self.model.shard_specs()
        self.params = self.model.local_named_parameters()  # local shards, sharing storage with the parameters
        d = cfg.diloco
        self.outer = OuterOptimizer.from_config(self.params, d.outer_optimizer, d.outer_lr, d.outer_momentum,
                                                device=d.master_device)
        self.exchange = BucketExchange(self.layout, self.params, self.specs, rt.group)
        self._contributes = self._contributed_names()
        self.outer_step = 0
        self.inner_step = 0
        self.stats = RunStats()
        self.overlap = Overlap(self)
        total_inner = cfg.diloco.outer_steps * cfg.diloco.inner_steps
        # without a fixed H the cosine follows the run's progress
        self.inner_opt, self.inner_sched = build_inner_optimizer(
            list(self.model.named_parameters()), cfg.inner, total_inner,
            None if self.overlap.budget.by_steps else self.overlap.progress)
        self.fingerprint = config_fingerprint(cfg)
        self.state_lock = threading.Lock()
        """Held while θ_global, the outer momentum or the outer step change (joiners read them meanwhile)."""
        self._stop = threading.Event()
        self.stopping = False
        self.dht: Any = None
        self.averager: Any = None
        self.feedback: dict[int, torch.Tensor] = {}
        """Error feedback of the buckets this rank averages (a lossy codec's dropped part, see
        :class:`peers.sharded.ShardedAverager`); checkpointed, kept across reconnects."""
        self.carry: dict[int, torch.Tensor] = {}
        """With a dense lossy codec and ``averaging.owner_feedback``: what re-encoding the averaged parts this
        rank owned left out, added to them next round (:attr:`peers.sharded.ShardedAverager.carry`);
        checkpointed like :attr:`feedback`."""
        self.keeps_unsent = cfg.averaging.compression in LOSSY_CODECS and cfg.averaging.error_feedback
        """Whether a codec's unsent part is carried into later rounds (:attr:`feedback` fills)."""
        self.membership: Any = None
        self.fallback: Any = None
        self.wire: Any = None  # peers.wire.WireCounter of this rank's DHT daemon
        self.alone = peer_setup.AloneWatch(cfg.averaging.rejoin_after)
        self.metrics: MetricsLogger | NullMetrics | None = None
        self.guard = NormGuard(cfg.averaging.max_norm_ratio)
        self.faults = FaultPlan.from_env()
        self.hooks = [FaultHook(self.faults)]
        self.transfer = StateTransfer(self)
        self.t_start = 0.0
        """``time.perf_counter()`` when the training loop started (for compute utilization)."""
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                         else nullcontext())

    @property
    def is_main(self) -> bool:
        """Whether this process writes the island's metrics, summary and files and prints (rank 0)."""
        return self.rt.is_main

    def _contributed_names(self) -> set[str]:
        """Parameters whose local shard this rank counts in island-wide norms: a shard held alike by
        several ranks (replicated under TP) counts on the lowest of them only."""
        mine = {n: ("full" if self.layout.is_full(n, s) else spec_tuple(s)) for n, s in self.specs.items()}
        seen: set[tuple] = set()
        out: set[str] = set()
        for r, held in enumerate(self.rt.gather_all(mine)):
            for name, key in held.items():
                if (name, key) not in seen:
                    seen.add((name, key))
                    if r == self.rt.rank:
                        out.add(name)
        return out

    # ------------------------------------------------------------------------------ peers
    def connect(self, rejoin: list[str] | None = None) -> None:
        """Start every rank's DHT and averager (collective); rank 0 prints how others join.
        ``rejoin``: peer addresses to reach by restarting the peer node (an island alone in the run)."""
        peer_setup.reconnect(self, rejoin) if rejoin else peer_setup.connect(self)
        self.hooks = [h for h in self.hooks if not isinstance(h, MembershipHook)]
        if self.membership is not None:
            self.hooks.append(MembershipHook(self.membership))

    def rejoin_if_alone(self) -> None:
        """Collective: an island alone in the run although it knew live islands restarts its peer node
        through their addresses, from time to time (see :class:`diloco.engine.peer_node.AloneWatch`)."""
        known = self.transfer.main_decides(lambda: self.alone.due(self))
        if known:
            self.connect(rejoin=known)

    def state_fingerprint(self) -> list[float]:
        """Collective: fingerprint of the whole θ_global in canonical bucket order, the same on every
        rank and on every island holding the same θ_global, whatever its shape."""
        return self.exchange.canonical_fingerprint(self.outer.master, CHUNKS_PER_BUCKET)

    def global_norm(self, tensors: dict[str, torch.Tensor]) -> float:
        """Collective: L2 norm of the island's whole ``{name: tensor}`` (replicated shards counted once)."""
        sq = sum(float(t.double().pow(2).sum()) for n, t in tensors.items() if n in self._contributes)
        return math.sqrt(self.rt.reduce([sq])[0])

    # ---------------------------------------------------------------------------- training
    def train_step(self) -> float:
        """One inner AdamW step over the island (with gradient accumulation); returns the mean loss."""
        loss = inner_step(self.model, self.batches, self.inner_opt, self.inner_sched, self.cfg.inner,
                          self.autocast)
        self.inner_step += 1
        self.stats.tokens += self.batches.tokens_per_batch * self.cfg.inner.grad_accum
        return loss

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean held-out loss of θ_global over the fixed evaluation batches (the same on every rank); the
        island's own parameters are put back afterwards."""
        own = {n: p.detach().clone() for n, p in self.params.items()}
        self.outer.copy_to(self.params)
        losses = []
        for x, y in self.eval_batches:
            with self.autocast:
                losses.append(self.model.eval_loss(x, y))
        for n, p in self.params.items():
            p.copy_(own[n])
        return float(np.mean(losses))

    def send_round(self) -> RoundMetrics | None:
        """Collective: catch up if the run moved on without us (the round's metrics), else send the
        round's pseudo-gradient (None: it is in flight, see :mod:`diloco.engine.overlap`)."""
        self.rejoin_if_alone()
        rnd = self.outer_step + 1
        if self.transfer.catch_up(counted=1):
            # the others moved on without us: our inner steps are dropped, never sent as a stale Δ
            self.stats.rounds_failed += 1
            self.stats.failures.append(f"round {rnd}: behind the run, caught up from a peer")
            return RoundMetrics.skipped(self, "behind the run; caught up from a peer")
        flight = begin_round(self)
        if isinstance(flight, RoundMetrics):
            return flight
        self.overlap.flight = flight
        return None

    def outer_round(self) -> RoundMetrics:
        """Collective: one whole round, blocking (catch up, or send and apply)."""
        return self.send_round() or self.apply_round()

    def apply_round(self) -> RoundMetrics:
        """Collective: wait for the round in flight and commit it or roll it back."""
        flight, self.overlap.flight = self.overlap.flight, None
        return end_round(self, flight)

    # ------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything this rank needs to resume exactly."""
        return island_state.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (written by the same rank of an island of the same shape)."""
        island_state.load_state_dict(self, state)

    def save_checkpoint(self) -> Path:
        """Write this rank's checkpoint of the current outer step."""
        return island_state.save_checkpoint(self)

    # -------------------------------------------------------------------------------- loop
    def request_stop(self, *_: Any) -> None:
        """Finish the current inner step, checkpoint and leave (SIGINT/SIGTERM)."""
        if not self._stop.is_set() and self.is_main:
            print(f"[{self.name}] stopping: finishing the current step and writing a checkpoint", flush=True)
        self._stop.set()

    def stop_requested(self) -> bool:
        """Whether a stop was asked of this process (it is not yet agreed across the island's ranks)."""
        return self._stop.is_set()

    def stop_agreed(self) -> bool:
        """Whether to stop now; every rank of the island (of the world, when islands average in
        lockstep) gets the same answer."""
        self.stopping = self.rt.reduce([float(self._stop.is_set())], op="max", world=self.rt.lockstep)[0] > 0
        return self.stopping

    def run(self) -> dict[str, Any]:
        """Train until ``diloco.outer_steps`` rounds are done (or a stop is requested)."""
        cfg = self.cfg
        island_state.maybe_resume(self)
        main_thread = threading.current_thread() is threading.main_thread()
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
        self.connect()
        # hivemind's averager makes this process ignore SIGINT: install ours after it started,
        # and give the previous handlers back when the island is done
        for sig in previous:
            signal.signal(sig, self.request_stop)
        w = cfg.wandb
        self.metrics = MetricsLogger(self.run_dir, wandb_mode=w.mode, project=w.project,
                                     group=w.group or cfg.averaging.run_id, name=self.name, entity=w.entity,
                                     config=to_dict(cfg), resume=bool(cfg.checkpoint.resume)) \
            if self.is_main else NullMetrics()
        try:
            self.transfer.join_from_peers()
            return training_loop.run(self)
        finally:
            self.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def theta_global(self) -> tuple[dict[str, torch.Tensor] | None, str]:
        """Collective: the whole θ_global on rank 0 (None elsewhere) and its checksum on every rank."""
        return island_state.theta_global(self)

    def close(self) -> None:
        """Announce leaving, stop the averagers, the DHT, the W&B run and the process group (idempotent)."""
        if self._stop.is_set():  # Ctrl-C or SIGTERM: the process is leaving, maybe with its p2p daemons gone
            mute_shutdown_noise()
        try:
            peer_setup.disconnect(self)
            if self.metrics is not None:
                self.metrics.close()
                self.metrics = None
        finally:
            self.rt.close()


def train(cfg: Config) -> dict[str, Any] | None:
    """Run one island to completion; return its summary on the island's main rank (None on the other
    ranks of a tp/pp island, which would only repeat it)."""
    island = Island(cfg)
    summary = island.run()
    return summary if island.is_main else None


__all__ = ["Island", "RunStats", "train", "TrainingError", "CHUNKS_PER_BUCKET"]
