"""Which settings cannot work together: one sentence per problem, naming the key and how to fix it."""

from __future__ import annotations

import math
import os
import re

from diloco.config.budget import parse_budget
from diloco.config.schema import CHOICES, Config, DilocoConfig, flatten
from outer_optim.compression import AUTO, CODECS, decay_problem, may_drop, topk_problems
from peers import codec_backend_problem, port_problems

WANDB_ENV_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")
"""What W&B accepts in ``WANDB_MODE`` (an empty variable counts as unset)."""


def validate(cfg: Config) -> list[str]:
    """Return one sentence per inconsistent or out-of-range value (empty when all is well)."""
    flat = flatten(cfg)
    # NaN passes every range check below (all comparisons are false) and inf passes most of them
    p = [f"--{key} must be a finite number, got {value}" for key, value in flat.items()
         if isinstance(value, float) and not math.isfinite(value)]
    if p:
        return p
    for key, choices in CHOICES.items():
        if flat[key] not in choices:
            p.append(f"--{key} is {flat[key]!r} but must be one of {', '.join(choices)}")
    m = cfg.model
    for name in ("dim", "n_layers", "n_heads", "ffn_dim", "seq_len"):
        # an unknown preset (named above) fills none of them: only the ones the user set are worth a line
        if getattr(m, name) < 1 and (m.preset in CHOICES["model.preset"] or getattr(m, name) < 0):
            p.append(f"--model.{name} must be at least 1, got {getattr(m, name)}")
    if m.vocab_size < 0:
        p.append(f"--model.vocab_size must be 0 (the tokenizer's) or positive, got {m.vocab_size}")
    if m.dim > 0 and m.n_heads > 0 and m.dim % m.n_heads:
        p.append(f"--model.n_heads ({m.n_heads}) must divide --model.dim ({m.dim}); pick a divisor such as "
                 f"{max(d for d in range(1, m.n_heads + 1) if m.dim % d == 0)}")
    elif m.dim > 0 and m.n_heads > 0 and (m.dim // m.n_heads) % 2:
        p.append(f"the head width --model.dim / --model.n_heads = {m.dim // m.n_heads} must be even for rotary embeddings")
    if 0 < m.vocab_size < 256 and cfg.data.tokenizer in ("", "bytes"):
        p.append(f"--model.vocab_size is {m.vocab_size} but byte-level tokens need at least 256 (0 follows the "
                 f"tokenizer)")
    d = cfg.data
    if not 0 < d.heldout_fraction < 1:
        p.append(f"--data.heldout_fraction must be between 0 and 1 (exclusive), got {d.heldout_fraction}")
    if d.num_shards < 1:
        p.append(f"--data.num_shards must be at least 1, got {d.num_shards}")
    elif not 0 <= d.shard_index < d.num_shards:
        p.append(f"--data.shard_index must be in [0, {d.num_shards - 1}] for --data.num_shards {d.num_shards}, got {d.shard_index}")
    if d.max_bytes < 0:
        p.append(f"--data.max_bytes must be 0 (no limit) or positive, got {d.max_bytes}")
    i = cfg.inner
    if i.lr <= 0:
        p.append(f"--inner.lr must be positive, got {i.lr}")
    if not 0 <= i.min_lr_ratio <= 1:
        p.append(f"--inner.min_lr_ratio must be between 0 and 1, got {i.min_lr_ratio}")
    for name in ("batch_size", "grad_accum"):
        if getattr(i, name) < 1:
            p.append(f"--inner.{name} must be at least 1, got {getattr(i, name)}")
    for name in ("warmup_steps",):
        if getattr(i, name) < 0:
            p.append(f"--inner.{name} must be 0 or more, got {getattr(i, name)}")
    if not 0 <= i.muon_momentum < 1:
        p.append(f"--inner.muon_momentum must be in [0, 1), got {i.muon_momentum}")
    if i.grad_clip < 0:
        p.append(f"--inner.grad_clip must be 0 (off) or positive, got {i.grad_clip}")
    dl = cfg.diloco
    if dl.inner_steps < 1:
        p.append(f"--diloco.inner_steps (H) must be at least 1, got {dl.inner_steps}")
    if dl.outer_steps < 1:
        p.append(f"--diloco.outer_steps must be at least 1, got {dl.outer_steps}")
    if dl.outer_lr <= 0:
        p.append(f"--diloco.outer_lr must be positive, got {dl.outer_lr}")
    if not 0 <= dl.outer_momentum < 1:
        p.append(f"--diloco.outer_momentum must be in [0, 1), got {dl.outer_momentum}")
    if not 1 <= dl.fragments <= max(dl.inner_steps, 1):
        p.append(f"--diloco.fragments must be between 1 and --diloco.inner_steps ({dl.inner_steps}), "
                 f"got {dl.fragments}")
    elif m.n_layers >= 1 and dl.fragments > m.n_layers:
        p.append(f"--diloco.fragments ({dl.fragments}) cannot exceed the model's {m.n_layers} layers "
                 f"(a fragment is a group of whole layers)")
    elif dl.inner_steps >= 1 and not 0 <= dl.overlap_steps <= dl.inner_steps // dl.fragments:
        p.append(f"--diloco.overlap_steps must be between 0 and H / fragments = {dl.inner_steps // dl.fragments} "
                 f"(a round must be applied before the next one is sent), got {dl.overlap_steps}")
    p += budget_problems(dl)
    if not 0 <= dl.merge_alpha < 1:
        p.append(f"--diloco.merge_alpha must be in [0, 1), got {dl.merge_alpha}")
    elif dl.merge_alpha and dl.overlap != "none":
        p.append("--diloco.merge_alpha applies to --diloco.overlap none only (delayed and eager keep the "
                 "progress made meanwhile); drop it or use overlap none")
    a = cfg.averaging
    if a.min_group_size < 1:
        p.append(f"--averaging.min_group_size must be at least 1, got {a.min_group_size}")
    if a.target_group_size and a.target_group_size < a.min_group_size:
        p.append(f"--averaging.target_group_size ({a.target_group_size}) must be 0 or at least "
                 f"--averaging.min_group_size ({a.min_group_size})")
    if a.matchmaking_time <= 0:
        p.append(f"--averaging.matchmaking_time must be positive, got {a.matchmaking_time}")
    if a.matchmaking_timeout <= a.matchmaking_time:
        p.append(f"--averaging.matchmaking_timeout ({a.matchmaking_timeout}) must exceed "
                 f"--averaging.matchmaking_time ({a.matchmaking_time})")
    if not 0 < a.request_timeout < a.matchmaking_time:
        p.append(f"--averaging.request_timeout ({a.request_timeout}) must be positive and below "
                 f"--averaging.matchmaking_time ({a.matchmaking_time})")
    if not a.run_id or "." in a.run_id:
        p.append(f"--averaging.run_id must be a non-empty name without '.' (it prefixes the run's DHT keys, "
                 f"whose parts '.' separates), got {a.run_id!r}")
    if a.wait_for_islands < 0:
        p.append(f"--averaging.wait_for_islands must be 0 or more, got {a.wait_for_islands}")
    if a.max_norm_ratio < 0:
        p.append(f"--averaging.max_norm_ratio must be 0 (off) or positive, got {a.max_norm_ratio}")
    if a.member_check < 0:
        p.append(f"--averaging.member_check must be 0 (only the finiteness check) or positive, got {a.member_check}")
    if a.outlier_ratio < 0:
        p.append(f"--averaging.outlier_ratio must be 0 (strike no member for its distance) or positive, got "
                 f"{a.outlier_ratio}")
    if a.strikes < 0:
        p.append(f"--averaging.strikes must be 0 (never leave a member out) or more, got {a.strikes}")
    if a.max_group_size < 0 or a.max_group_size == 1:
        p.append(f"--averaging.max_group_size must be 0 (one flat group) or at least 2, got {a.max_group_size}")
    for name in ("allreduce_timeout", "next_chunk_timeout", "startup_timeout", "state_download_timeout",
                 "vote_timeout", "member_ttl", "rejoin_after"):
        if getattr(a, name) <= 0:
            p.append(f"--averaging.{name} must be positive, got {getattr(a, name)}")
    for addr in a.initial_peers:
        if not addr.startswith("/") or "/p2p/" not in addr:
            p.append(f"--averaging.initial_peers entry {addr!r} is not a multiaddr ending in /p2p/PEER_ID; "
                     f"copy one printed by the island you want to join")
    if a.client_mode and not a.initial_peers and a.backend != "local" and not cfg.checkpoint.resume:
        p.append("an island behind NAT (--averaging.client_mode true) cannot start a run, since no other island "
                 "could reach it: start the run on a reachable island and pass its address with "
                 "--averaging.initial_peers")
    for addr in a.host_maddrs + a.announce_maddrs:
        if not addr.startswith("/ip4/") and not addr.startswith("/ip6/") and not addr.startswith("/dns"):
            p.append(f"multiaddr {addr!r} must look like /ip4/ADDRESS/tcp/PORT")
    p += port_problems(a)
    if a.bucket_numel < 1:
        p.append(f"--averaging.bucket_numel must be at least 1, got {a.bucket_numel}")
    p += codec_problems(cfg)
    p += parallel_problems(cfg)
    if cfg.parallel.peak_tflops < 0:
        p.append(f"--parallel.peak_tflops must be 0 (from the GPU's name) or positive, got {cfg.parallel.peak_tflops}")
    c = cfg.checkpoint
    if c.every < 0:
        p.append(f"--checkpoint.every must be 0 (off) or positive, got {c.every}")
    if c.keep < 1:
        p.append(f"--checkpoint.keep must be at least 1, got {c.keep}")
    lg = cfg.logging
    for name in ("log_every", "eval_every", "eval_batches", "sample_every"):
        if getattr(lg, name) < 1:
            p.append(f"--logging.{name} must be at least 1, got {getattr(lg, name)}")
    if lg.samples < 0 or lg.sample_tokens < 1:
        p.append(f"--logging.samples must be 0 (none) or positive and --logging.sample_tokens at least 1, got "
                 f"{lg.samples} and {lg.sample_tokens}")
    env_mode = os.environ.get("WANDB_MODE", "")
    if cfg.wandb.mode != "disabled" and env_mode and env_mode not in WANDB_ENV_MODES:
        p.append(f"the environment's WANDB_MODE={env_mode!r} is not a W&B mode: unset it, or set it to online, "
                 f"offline or disabled")
    if cfg.threads < 0:
        p.append(f"--threads must be 0 (default) or positive, got {cfg.threads}")
    index = re.fullmatch(r"cuda:(\d+)", cfg.device)
    local_rank = os.environ.get("LOCAL_RANK", "")
    if cfg.device not in ("auto", "cpu", "cuda") and index is None:
        p.append(f"--device must be auto, cpu, cuda or cuda:N, got {cfg.device!r}")
    elif index is not None and local_rank.isdigit() and int(index[1]) != int(local_rank):
        # under torchrun every rank reads the same flag: a fixed GPU would put them all on one device
        p.append(f"--device {cfg.device} contradicts torchrun's LOCAL_RANK {local_rank} (every rank would use GPU "
                 f"{index[1]}): pass --device cuda or auto, and each rank takes the GPU of its local rank")
    return p


def parallel_problems(cfg: Config) -> list[str]:
    """Why the model cannot be split over ``--parallel.dp`` x ``--parallel.tp`` x ``--parallel.pp`` (one sentence
    each)."""
    par, m = cfg.parallel, cfg.model
    if par.dp < 1:
        return [f"--parallel.dp must be at least 1, got {par.dp}"]
    if par.gpus < 0 or par.gpus > max(par.processes, 1):
        return [f"--parallel.gpus must be between 0 (one GPU per rank) and the island's {par.processes} rank(s), "
                f"got {par.gpus}"]
    if par.gpus and cfg.device == "cpu":
        return [f"--parallel.gpus {par.gpus} places the island's ranks on GPUs, but --device is cpu: drop "
                f"--parallel.gpus or pass --device cuda"]
    if par.tp == 1 and par.pp == 1:
        return []
    if min(m.dim, m.n_layers, m.n_heads, m.ffn_dim, m.vocab_size or 256) < 1:
        return []  # reported above
    if par.schedule not in CHOICES["parallel.schedule"] or par.balance not in CHOICES["parallel.balance"]:
        return []  # named by the choice check above; the split is checked once that is fixed
    from pipeline.model_parts import (
        check_split,  # torch-heavy: only for parallel islands
    )

    problems = check_split(par, m.n_layers, m.n_heads, m.dim, m.ffn_dim, m.vocab_size or 256)
    if par.pp > 1 and par.microbatches >= 1 and cfg.inner.batch_size % par.microbatches:
        problems.append(f"--inner.batch_size ({cfg.inner.batch_size}) must be divisible by "
                        f"--parallel.microbatches ({par.microbatches}) when --parallel.pp is above 1")
    return problems


def budget_problems(dl: DilocoConfig) -> list[str]:
    """What is wrong with ``--diloco.sync_every`` and ``--diloco.max_comm_fraction``."""
    try:
        budget = parse_budget(dl.sync_every, max(dl.inner_steps, 1))
    except ValueError as e:
        return [str(e)]
    p = []
    if budget.by_steps and budget.amount != dl.inner_steps and dl.inner_steps >= 1:  # H < 1: named once, above
        p.append(f"--diloco.sync_every {dl.sync_every} (steps) contradicts --diloco.inner_steps {dl.inner_steps}; "
                 f"set only one of them")
    if not 0 < dl.max_comm_fraction < 1:
        p.append(f"--diloco.max_comm_fraction must be in (0, 1), got {dl.max_comm_fraction}")
    return p


def codec_problems(cfg: Config) -> list[str]:
    """What is wrong with the wire format settings (the low-bit codecs and SparseLoCo)."""
    a, p = cfg.averaging, []
    encoded = may_drop(a.compression)
    p += topk_problems(a.topk_density, a.topk_bits)  # the codecs' own bounds, which make_codec checks too
    if decay := decay_problem(a.error_feedback_decay):
        p.append(decay)
    if backend_problem := codec_backend_problem(a.compression, a.backend):
        p.append(backend_problem)
    if a.compression == AUTO:
        if not a.auto_codecs or any(c not in CODECS for c in a.auto_codecs):
            p.append(f"--averaging.auto_codecs must list codecs among {', '.join(CODECS)}, most faithful first; "
                     f"got {','.join(a.auto_codecs) or 'none'}")
        if a.owner_feedback:
            p.append("--averaging.owner_feedback takes a fixed codec, not --averaging.compression auto: "
                     "name the codec, or leave owner_feedback off")
    if a.error_feedback_in not in ("buffer", "params"):
        p.append(f"--averaging.error_feedback_in must be buffer or params, got {a.error_feedback_in!r}")
    if cfg.diloco.outer_optimizer == "sparseloco" and not (encoded and a.error_feedback):
        missing = ([] if encoded else ["--averaging.compression topk"]) + \
            ([] if a.error_feedback else ["--averaging.error_feedback true"])
        p.append(f"--diloco.outer_optimizer sparseloco needs error feedback on a lossy codec: add "
                 f"{' '.join(missing)} (SparseLoCo's whole recipe, docs/low-bit-codecs.md: {SPARSELOCO_RECIPE})")
    return p


SPARSELOCO_RECIPE = ("--averaging.compression topk --averaging.topk_density 0.05 --averaging.topk_bits 2 "
                     "--averaging.error_feedback_in buffer --averaging.error_feedback_decay 0.95 "
                     "--diloco.outer_optimizer sparseloco --diloco.outer_lr 4")
"""SparseLoCo as measured within 1% of DDP at 2,138× fewer bytes (2 islands, H = 50, shared inner lr 1e-3,
experiments/results/sparseloco-H50/): every flag it needs, as the README shows it."""


def device_problems(cfg: Config) -> list[str]:
    """What this machine lacks for ``cfg``: a CUDA device asked for where torch sees none.  Checked by the commands
    that run islands, before anything starts, and not by :func:`validate`: a config may be written on one
    machine (``diloco config show``, ``diloco plan``) for another."""
    import torch

    if torch.cuda.is_available():
        return []
    p = []
    if cfg.device.startswith("cuda"):
        p.append(f"--device {cfg.device}: this machine has no CUDA device that torch {torch.__version__} can use; "
                 f"use --device cpu (or auto)")
    if cfg.diloco.master_device == "cuda":
        p.append(f"--diloco.master_device cuda: this machine has no CUDA device that torch {torch.__version__} can "
                 f"use for the outer state; use --diloco.master_device cpu")
    return p


__all__ = ["validate", "parallel_problems", "budget_problems", "codec_problems", "device_problems",
           "SPARSELOCO_RECIPE"]
