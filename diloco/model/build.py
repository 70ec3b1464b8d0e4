"""What a trainer builds from the config, in order: tokenizer → corpus → batches → the model's skeleton and
this process's parts of it → the inner optimizer.  The island, the synchronous baseline and the benchmarks
call these; ``diloco eval`` reads the same documents and held-out split (:func:`diloco.data.corpus.documents`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from diloco.config import Config
from diloco.data.batches import ShardedBatches, heldout_batches
from diloco.data.corpus import Corpus, load_corpus
from diloco.data.tokenizer import Tokenizer, fit_vocabulary
from diloco.model.inner import build_inner_optimizer
from diloco.model.transformer import initial_model, lm_loss
from pipeline import ModelParts, ParallelSettings


@dataclass
class TrainingData:
    """A worker's text: the tokenizer, the corpus, its own training batches and the held-out ones."""

    tokenizer: Tokenizer
    corpus: Corpus
    batches: ShardedBatches
    eval_batches: list[tuple[torch.Tensor, torch.Tensor]]


def build_data(cfg: Config, shard: int, shards: int, *, replica: int = 0, replicas: int = 1,
               evaluates: bool = True) -> TrainingData:
    """The tokenizer (``cfg.model``'s vocabulary is fitted to it, in place), the corpus, the training batches of
    data shard ``shard`` of ``shards`` read by replica ``replica`` of ``replicas`` (FSDP replicas of an island),
    and the held-out batches (none unless ``evaluates``)."""
    m = cfg.model
    tokenizer = Tokenizer.for_data(cfg.data)
    fit_vocabulary(m, tokenizer)
    corpus = load_corpus(cfg.data, tokenizer)
    batches = ShardedBatches(corpus.train, m.seq_len, cfg.inner.batch_size, shard, shards, cfg.seed,
                             replica=replica, replicas=replicas)
    evals = heldout_batches(corpus.heldout, m.seq_len, cfg.inner.batch_size, cfg.logging.eval_batches) \
        if evaluates else []
    return TrainingData(tokenizer, corpus, batches, evals)


@dataclass
class BuiltModel:
    """This process's parts of the model, and the whole model's parameter shapes (from its skeleton)."""

    parts: ModelParts
    full_shapes: list[tuple[str, tuple[int, ...]]]


def build_model(cfg: Config, mesh: DeviceMesh | None, parallel: ParallelSettings, device: torch.device | str,
                profile_shape: tuple[int, int] | None = None) -> BuiltModel:
    """The model of ``cfg.model`` as a skeleton (no memory), split and sharded by ``parallel`` over ``mesh``,
    each piece of this process materialised on ``device`` from the seed (or ``--checkpoint.init_from``)."""
    skeleton, initial = initial_model(cfg.model, cfg.seed, cfg.checkpoint.init_from)
    full_shapes = [(n, tuple(p.shape)) for n, p in skeleton.named_parameters()]
    parts = ModelParts(skeleton, mesh, parallel, loss_fn=lm_loss, device=device, profile_shape=profile_shape,
                       init=initial)
    return BuiltModel(parts, full_shapes)


def build_inner(model: ModelParts, cfg: Config, total_steps: int, progress=None
                ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The inner optimizer of ``model``'s parameters and its schedule over ``total_steps`` (or over
    ``progress()``, the fraction of the run done, when the steps are not known in advance)."""
    return build_inner_optimizer(list(model.named_parameters()), cfg.inner, total_steps, progress)
