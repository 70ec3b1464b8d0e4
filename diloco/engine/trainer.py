"""The trainer core: what every trainer of this project builds from the config, how it takes an inner step and
evaluates, and the records it writes, whatever its sync.  An island rank (:mod:`diloco.engine.island`, whose sync
is the outer rounds of :mod:`diloco.engine.round`) and a worker of the synchronous baseline
(:mod:`diloco.launch.baseline`, whose sync is DDP's all-reduce of every gradient) stand on it alike, so that their
curves and summaries show the same quantities, computed the same way.

- :class:`TrainerCore`, built in order: tokenizer → corpus → this worker's training batches and the held-out ones →
  the model's skeleton (no memory) and this process's parts of it; then :meth:`TrainerCore.start_inner`: the
  inner optimizer and its schedule (an island's schedule may follow its rounds' progress, known only once they
  exist);
- :meth:`TrainerCore.step` (one inner step, with gradient accumulation and the sync's hooks) and
  :meth:`TrainerCore.evaluate` (the held-out loss of the parameters the model holds);
- the records: :meth:`TrainerCore.loss_record` (training loss and throughput), :meth:`TrainerCore.evaluation_record`
  (held-out loss per token, its perplexity and bits per byte), :meth:`TrainerCore.round_record` (where the run
  stands after a round), and :func:`run_summary` (``summary.json``), each trainer adding its sync's own figures.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh

from diloco.config import Config, InnerOptimConfig
from diloco.data.batches import ShardedBatches, heldout_batches
from diloco.data.corpus import Corpus, load_corpus
from diloco.data.tokenizer import Tokenizer, fit_vocabulary
from diloco.engine.metrics import RunStats
from diloco.engine.throughput import Throughput, peak_flops, peak_host_memory_gb, peak_memory_gb
from diloco.model.inner import build_inner_optimizer, take_inner_step
from diloco.model.transformer import flops_per_token, initial_model, lm_loss
from pipeline import ModelParts, ParallelSettings

SUMMARY_KEYS = ("island", "outer_step", "inner_step", "tokens", "eval_loss_start", "eval_loss_end", "rounds_ok",
                "rounds_failed", "rounds_caught_up", "bytes_sent", "bytes_received", "payload_bytes_sent",
                "payload_bytes_received", "compute_seconds", "comm_seconds", "stall_seconds", "wall_seconds",
                "theta_checksum", "peak_memory_gb", "peak_host_memory_gb", "failures", "stopped_early")
"""What every trainer's ``summary.json`` holds (:func:`run_summary`), besides its sync's own figures."""
EVALUATION_KEYS = ("eval/loss", "eval/perplexity", "eval/bits_per_byte", "tokens", "outer_step")
"""What every evaluation record holds (:meth:`TrainerCore.evaluation_record`)."""


def perplexity(loss: float) -> float:
    """``exp(loss)``, capped where it would overflow (a diverged run's loss)."""
    return math.exp(min(loss, 50))


class TrainerCore:
    """One worker's text, model and inner optimizer, and what it writes about them (see the module's docstring).

    Built from the config in order: the tokenizer (``cfg.model``'s vocabulary is fitted to it, in place), the
    corpus, the training batches of data shard ``shard`` of ``shards`` read by replica ``replica`` of ``replicas``
    (FSDP replicas of an island), the held-out batches (none unless ``evaluates``), and the model of ``cfg.model``
    as a skeleton, split and sharded by ``parallel`` over ``mesh``, each piece of this process materialised on
    ``device`` from the seed (or ``--checkpoint.init_from``).  ``devices``: the devices that train together (for
    the throughput per device); ``profile_shape``: a micro-batch's shape, when the pipeline balances its stages by
    profiling them."""

    def __init__(self, cfg: Config, *, mesh: DeviceMesh | None, parallel: ParallelSettings, device: torch.device,
                 shard: int, shards: int, replica: int = 0, replicas: int = 1, devices: int = 1,
                 evaluates: bool = True, profile_shape: tuple[int, int] | None = None):
        m = cfg.model
        self.tokenizer = Tokenizer.for_data(cfg.data)
        fit_vocabulary(m, self.tokenizer)
        self.corpus: Corpus = load_corpus(cfg.data, self.tokenizer)
        self.batches = ShardedBatches(self.corpus.train, m.seq_len, cfg.inner.batch_size, shard, shards, cfg.seed,
                                      replica=replica, replicas=replicas)
        """This worker's training batches (its data shard, its replica's part of it)."""
        self.eval_batches: list[tuple[torch.Tensor, torch.Tensor]] = heldout_batches(
            self.corpus.heldout, m.seq_len, cfg.inner.batch_size, cfg.logging.eval_batches) if evaluates else []
        """The fixed held-out batches every evaluation averages over (none on a worker that does not evaluate)."""
        skeleton, initial = initial_model(m, cfg.seed, cfg.checkpoint.init_from)
        flops = flops_per_token(m)
        self.full_shapes = [(n, tuple(p.shape)) for n, p in skeleton.named_parameters()]
        """The whole model's parameter names and shapes (from its skeleton)."""
        self.model = ModelParts(skeleton, mesh, parallel, loss_fn=lm_loss, device=device, profile_shape=profile_shape,
                                init=initial)
        """This process's parts of the model."""
        self.throughput = Throughput(flops, devices, device,
                                     peak_flops(device, self.model.compute_dtype, parallel.peak_tflops))
        self.inner: InnerOptimConfig = cfg.inner
        """The inner loop's settings (batch accumulation, clipping, learning rate)."""
        self.inner_opt: torch.optim.Optimizer | None = None
        """The inner optimizer (:meth:`start_inner`)."""
        self.inner_sched: torch.optim.lr_scheduler.LRScheduler | None = None

    def start_inner(self, total_steps: int, progress: Callable[[], float] | None = None) -> None:
        """Build the inner optimizer of the model's parameters and its schedule over ``total_steps`` (or over
        ``progress()``, the fraction of the run done, when the steps are not known in advance)."""
        self.inner_opt, self.inner_sched = build_inner_optimizer(list(self.model.named_parameters()), self.inner,
                                                                 total_steps, progress)

    @property
    def heldout_bytes_per_token(self) -> float:
        """What turns a held-out loss per token into one per byte of text."""
        return self.corpus.heldout_bytes_per_token

    # ---------------------------------------------------------------------------------------- train
    def step(self, sync_grads: Callable[[float], float] | None = None,
             gradient_sync: Callable[[bool], None] | None = None) -> float:
        """One inner step (see :func:`~diloco.model.inner.take_inner_step`, whose ``sync_grads`` and
        ``gradient_sync`` are the sync's hooks); returns its mean loss."""
        return take_inner_step(self.model, self.batches, self.inner_opt, self.inner_sched, self.inner,
                               sync_grads=sync_grads, gradient_sync=gradient_sync)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean held-out loss of the parameters the model holds now, over the fixed evaluation batches."""
        return float(np.mean([self.model.eval_loss(x, y) for x, y in self.eval_batches]))

    # -------------------------------------------------------------------------------------- records
    def loss_record(self, loss: float, stats: RunStats, tokens_per_second: float,
                    outer_step: int | None = None) -> dict[str, Any]:
        """The training loss as logged, with the learning rate, the throughput since the last such record and
        where the run stands (``outer_step``: the one to report, when the training thread sees another than
        ``stats``: an island's round in flight counts as at the step it was sent at until it is applied)."""
        return {"loss": loss, "perplexity": perplexity(loss), "lr": self.inner_sched.get_last_lr()[0],
                "tokens": stats.tokens, "tokens_per_second": tokens_per_second,
                **self.throughput.record(tokens_per_second),
                "outer_step": stats.outer_step if outer_step is None else outer_step, "inner_step": stats.inner_step}

    def evaluation_record(self, loss: float, stats: RunStats) -> dict[str, Any]:
        """A held-out loss as logged: per token, its perplexity, and in bits per byte of text (which compares runs
        of different tokenizers), with where the run stands (:data:`EVALUATION_KEYS`)."""
        return {"eval/loss": loss, "eval/perplexity": perplexity(loss),
                "eval/bits_per_byte": loss / math.log(2) / self.heldout_bytes_per_token,
                "tokens": stats.tokens, "outer_step": stats.outer_step}

    def round_record(self, loss: float, stats: RunStats, wall: float, evaluation: float | None) -> dict[str, Any]:
        """Where the run stands after a round (H inner steps, for a sync without rounds): the last training loss,
        the evaluation when one was made (:meth:`evaluation_record`), and the share of ``wall`` seconds so far
        spent computing."""
        record = {"loss": loss, "tokens": stats.tokens, "outer_step": stats.outer_step}
        if evaluation is not None:
            record.update(self.evaluation_record(evaluation, stats))
        record["compute_utilization"] = stats.compute_seconds / max(wall, 1e-9)
        return record


def run_summary(name: str, stats: RunStats, *, wall: float, theta_checksum: str, device: torch.device,
                stopped_early: bool, sync: dict[str, Any]) -> dict[str, Any]:
    """What ``summary.json`` says of a trainer's run (:data:`SUMMARY_KEYS`, from its totals ``stats``), followed by
    its sync's own figures (``sync``)."""
    s = stats
    return {
        "island": name, "outer_step": s.outer_step, "inner_step": s.inner_step, "tokens": s.tokens,
        "eval_loss_start": s.eval_loss_start, "eval_loss_end": s.eval_loss_end,
        "rounds_ok": s.rounds_ok, "rounds_failed": s.rounds_failed, "rounds_caught_up": s.rounds_caught_up,
        "bytes_sent": s.bytes_sent, "bytes_received": s.bytes_received, "payload_bytes_sent": s.payload_bytes_sent,
        "payload_bytes_received": s.payload_bytes_received, "compute_seconds": s.compute_seconds,
        "comm_seconds": s.comm_seconds, "stall_seconds": s.stall_seconds, "wall_seconds": wall,
        "theta_checksum": theta_checksum, "peak_memory_gb": peak_memory_gb(device),
        "peak_host_memory_gb": peak_host_memory_gb(), "failures": s.failures[-20:], "stopped_early": stopped_early,
        **sync,
    }
