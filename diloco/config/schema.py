"""One typed configuration tree for every command.

Each section is a dataclass whose fields carry a docstring (the string literal right after the
field).  A TOML file fills the tree (``--config FILE``) and any key can be overridden on the
command line as ``--section.key VALUE`` (:mod:`diloco.config.loader`); :mod:`diloco.config.checks` reports
every problem as one line.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import textwrap
from dataclasses import dataclass, field
from typing import Any

from outer_optim.compression import COMPRESSIONS
from peers import AGGREGATES, WEIGHTINGS, PeerSettings, is_secret
from pipeline.settings import ParallelSettings


class ConfigError(ValueError):
    """A configuration problem; ``problems`` holds one human sentence per issue."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass
class ModelConfig:
    preset: str = "small"
    """Model size: `tiny` (tests), `small` (~1M params, trains in minutes on 2 CPU cores), `150m`, `1b`.
    Fields below left at 0 take the preset's value."""
    dim: int = 0
    """Width of the residual stream (0: from preset)."""
    n_layers: int = 0
    """Number of transformer blocks (0: from preset)."""
    n_heads: int = 0
    """Attention heads; must divide `dim` (0: from preset)."""
    ffn_dim: int = 0
    """Hidden width of the SwiGLU MLP (0: from preset)."""
    seq_len: int = 0
    """Tokens per training sequence (0: from preset)."""
    vocab_size: int = 0
    """Vocabulary size (0: the tokenizer's, 256 for bytes; larger pads the embedding)."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""


@dataclass
class DataConfig:
    path: str = "stdlib"
    """Training text: `stdlib` (the running Python's standard library source, on every machine),
    a file, a directory, a glob (`.jsonl`, `.parquet` and `.csv` files are read as records, the rest as text),
    `hf:NAME[:CONFIG]` for a Hugging Face dataset (streaming), or `hf:json|csv|parquet|text:FILES`."""
    hf_text_field: str = "text"
    """Field holding the text in the records of a Hugging Face dataset and of `.jsonl`, `.parquet` and `.csv`
    files."""
    heldout_fraction: float = 0.02
    """Fraction of the documents (chosen by a hash of their name) kept out of training for evaluation."""
    shard_index: int = 0
    """Which disjoint shard of the training data this island reads (0-based)."""
    num_shards: int = 1
    """How many disjoint shards the training data is split into (usually the number of islands)."""
    tokenizer: str = "bytes"
    """How text becomes tokens: `bytes` (UTF-8, vocabulary 256) or a `tokenizer.json` (or a folder holding one):
    a byte-level BPE trained by `diloco tokenizer train`, or one saved by `transformers`."""
    max_bytes: int = 0
    """Read at most this many bytes of text (0: no limit: a Hugging Face dataset is read to its end, into
    memory, so set a limit for large ones)."""


@dataclass
class InnerOptimConfig:
    optimizer: str = "adamw"
    """`adamw`, or `muon`: Muon (orthogonalised Nesterov momentum, Jordan et al. 2024) on the blocks' 2-D weights,
    AdamW on the embeddings, the output head and the norms, one learning rate for both (Muon's update is
    scaled to AdamW's RMS, as Moonlight does); with DiLoCo's outer step this is MuLoCo (Thérien et al. 2025)."""
    lr: float = 3e-3
    """Peak learning rate of the inner optimizer."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = 50
    """Linear warm-up steps of the inner learning rate."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    muon_momentum: float = 0.95
    """Muon's Nesterov momentum (with `--inner.optimizer muon`)."""
    muon_split: bool = True
    """With `--inner.optimizer muon` on an island of several ranks (TP, FSDP): each rank orthogonalises its
    share of the hidden matrices (one in turn) and sends the result to the others, instead of every rank
    orthogonalising every matrix (Moonlight's distributed Muon); the same update either way."""
    muon_dtype: str = "auto"
    """Precision of Muon's Newton–Schulz products: `bf16` (as the Muon paper and `torch.optim.Muon` do), `fp32`,
    or `auto`: bf16 where the device multiplies bf16 natively (CUDA, or a CPU with AMX or AVX-512 BF16, where
    it is 3-4x faster than fp32), fp32 elsewhere (where bf16 is slower).  The momentum, the update's scale and
    the parameters stay fp32 either way."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    batch_size: int = 16
    """Sequences per micro-batch on this island."""
    grad_accum: int = 1
    """Micro-batches accumulated per inner step (effective batch = batch_size * grad_accum)."""


@dataclass
class DilocoConfig:
    inner_steps: int = 50
    """H: inner steps between two outer rounds."""
    outer_steps: int = 10
    """Number of outer rounds to run."""
    outer_optimizer: str = "nesterov"
    """`nesterov` (SGD with Nesterov momentum, the DiLoCo default), `avg` (FedAvg: lr 1, no momentum) or `sparseloco` (SparseLoCo, Sarfi et al. 2025: plain averaged descent with `outer_lr`, no momentum: the error-feedback buffer of a lossy `averaging.compression` stands in for it; it wants a larger `outer_lr` than Nesterov's: over 30 rounds of 2 islands at H = 20, +7.8% against blocking DiLoCo at lr 1, +1.5% at lr 4, experiments/results/sparseloco-30/; at H = 50 also a larger `averaging.topk_density`: 18 rounds at lr 4 ended +2.9% against DDP at 2%, +0.25% at 5% (2,138× fewer bytes), experiments/results/sparseloco-H50/)."""
    outer_lr: float = 0.7
    """Outer learning rate (ignored by `avg`, which uses 1)."""
    outer_momentum: float = 0.9
    """Outer momentum (ignored by `avg`, which uses 0)."""
    master_device: str = "cpu"
    """Where the fp32 master copy of the global parameters and the outer state live: `cpu` (host memory, pinned on a GPU host) or `cuda` (this rank's GPU: 12 more bytes of GPU memory per parameter of the rank's shard; blocking rounds of 1b on an H100 then hold the GPUs 0.12 s instead of 3.1 s, docs/gpu-servers.md; rounds in flight hide the host's work either way)."""
    overlap: str = "none"
    """How the island trains while a round is in flight: `none` (the result is applied exactly `overlap_steps` inner steps after sending, waiting for it if needed; 0 blocks as plain DiLoCo), `delayed` (keep training; apply the average when it arrives, moving the progress made since onto the new θ_global) or `eager` (as `delayed`, but train meanwhile from θ_global stepped with this island's fresh Δ as a proxy for the average, after Kale et al. 2025)."""
    fragments: int = 1
    """Streaming DiLoCo: split the model into this many groups of whole layers, each averaged every H inner steps at its own offset (one sync every H/fragments steps, rounded to whole steps; ~1/fragments of the bytes)."""
    overlap_steps: int = 0
    """τ: inner steps trained after a round is sent before its result may be applied (at most H/fragments; `none` waits for the result then, `delayed`/`eager` apply it at the first step from then on at which it has arrived)."""
    sync_every: str = ""
    """How much each island trains before it joins the next round: steps (empty: `inner_steps`), seconds of compute (`90s`: a fast island does more steps instead of waiting for a slow one), tokens (`2M`, `500K`) or `auto` (seconds chosen after every round so that communication stays under `max_comm_fraction`). Not part of the run's fingerprint: islands with different budgets average together."""
    max_comm_fraction: float = 0.05
    """With `sync_every auto` or `averaging.compression auto`: the largest fraction of a round its communication may take (beyond what overlap hides)."""
    merge_alpha: float = 0.0
    """α: with `overlap none`, a fragment's parameters become α·θ_local + (1−α)·θ_global when its round is applied (0: θ_global, as plain DiLoCo; Streaming DiLoCo uses 0.5 with τ=1)."""
    round_thread: bool = True
    """Run each outer round on a thread of its own: at sending, the training thread only copies the parameters it trains on (when it trains on meanwhile) and hands the round over; catching up, fingerprints, Δ, the codec, the exchange, the vote, the registry's reads and the outer step happen off it; at applying, it only brings the parameters onto the result. `false` runs the round on the training thread (islands of one torch world always do)."""


AveragingConfig = PeerSettings
"""The ``averaging`` section: the peer node's settings (:class:`peers.settings.PeerSettings`: where it listens,
how its rounds form, how its pseudo-gradients travel, and the run it belongs to)."""


ParallelConfig = ParallelSettings
"""The ``parallel`` section: how an island splits its model (:class:`pipeline.settings.ParallelSettings`)."""


@dataclass
class CheckpointConfig:
    dir: str = ""
    """Directory for checkpoints (empty: `<run_dir>/checkpoints`)."""
    every: int = 5
    """Write a checkpoint every this many outer rounds (0 disables periodic checkpoints)."""
    keep: int = 3
    """Keep at most this many checkpoints; older ones are deleted after a new one is written."""
    background: bool = True
    """Write checkpoints from another thread: training stops only to copy its state in memory (about 5x the
    parameters' bytes, held until the file is written), not for the disk; false writes in the foreground,
    without that copy."""
    resume: str = ""
    """`latest` to continue from the newest valid checkpoint in `dir`, or a checkpoint file path."""
    init_from: str = ""
    """Start from these parameters instead of the seeded random initialisation (a warm start, as in the
    DiLoCo paper): a diloco checkpoint (its θ_global; a directory: its newest checkpoint) or a
    `torch.save(model.state_dict())` file.  Only the parameters are taken: steps, optimizer states and
    data positions start afresh.  Every island of a run must start from the same parameters."""


@dataclass
class WandbConfig:
    mode: str = "online"
    """`online`, `offline` or `disabled`; `online` becomes `offline` when no W&B API key is set."""
    project: str = "diloco"
    """W&B project name."""
    group: str = ""
    """W&B group (empty: the run id), so every island of one run lands in one group."""
    entity: str = ""
    """W&B entity (team or user); empty uses your default."""


@dataclass
class LoggingConfig:
    run_dir: str = "runs/default"
    """Where this island writes logs, metrics (metrics.jsonl), checkpoints and W&B files."""
    log_every: int = 10
    """Log training loss every this many inner steps."""
    eval_every: int = 1
    """Evaluate held-out loss every this many outer rounds."""
    eval_batches: int = 8
    """Held-out batches per evaluation."""
    samples: int = 2
    """Continue this many fixed held-out prompts with θ_global every `sample_every` rounds (and after the last)
    and log them to `samples.jsonl` and a W&B table (0: none)."""
    sample_every: int = 10
    """Log samples every this many outer rounds, at an evaluation (generating costs: 2 samples of 48 tokens took
    3.85 s of a 150m model on an H100, a quarter of a 1b round of 100 steps)."""
    sample_tokens: int = 48
    """Tokens generated per sample (capped by the model's context)."""


@dataclass
class Config:
    """The whole configuration of one island (or of a simulation of several)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerOptimConfig = field(default_factory=InnerOptimConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    seed: int = 0
    """Seed of model initialisation (shared by all islands) and of data order."""
    device: str = "auto"
    """`auto` (CUDA if available, else CPU), `cpu`, `cuda` or `cuda:N`."""
    threads: int = 0
    """CPU threads for torch in this process (0: torch's default)."""


MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(dim=32, n_layers=2, n_heads=2, ffn_dim=64, seq_len=32),
    "small": dict(dim=128, n_layers=4, n_heads=4, ffn_dim=384, seq_len=128),
    "150m": dict(dim=1024, n_layers=12, n_heads=16, ffn_dim=2816, seq_len=1024),
    "1b": dict(dim=2048, n_layers=24, n_heads=16, ffn_dim=5632, seq_len=2048),
}

CHOICES: dict[str, tuple[str, ...]] = {
    "model.preset": tuple(MODEL_PRESETS),
    "inner.optimizer": ("adamw", "muon"),
    "inner.muon_dtype": ("auto", "fp32", "bf16"),
    "diloco.outer_optimizer": ("nesterov", "avg", "sparseloco"),
    "diloco.overlap": ("none", "delayed", "eager"),
    "diloco.master_device": ("cpu", "cuda"),
    "averaging.backend": ("hivemind", "local", "torch", "auto"),
    "averaging.compression": COMPRESSIONS,
    "averaging.aggregate": AGGREGATES,
    "averaging.weighting": ("auto", *WEIGHTINGS),
    "wandb.mode": ("online", "offline", "disabled"),
    "parallel.schedule": ("gpipe", "1f1b", "interleaved-1f1b"),
    "parallel.balance": ("params", "layers", "profile"),
    "parallel.param_dtype": ("auto", "fp32", "bf16"),
}


def is_section(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def field_docs(cls: type) -> dict[str, str]:
    """Return {field name: docstring} read from the string literal following each field, of ``cls`` and of
    the dataclasses it extends (a section may *be* another package's settings, see :class:`AveragingConfig`)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """Map every leaf of the tree to its dotted key, e.g. ``{"model.preset": "small", ...}``."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        key = f"{prefix}{f.name}"
        if is_section(value):
            out.update(flatten(value, key + "."))
        else:
            out[key] = value
    return out


def to_dict(cfg: Any) -> dict[str, Any]:
    """The tree as nested plain dicts, for everything that leaves the process (TOML files, checkpoints, W&B,
    result files, ``diloco config show``): its secrets (the run key) left at their defaults, so that none is
    ever written or logged; an island given its key another way reads it from its file (or environment)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if is_section(value):
            out[f.name] = to_dict(value)
        else:
            out[f.name] = f.default if is_secret(f) else copy.deepcopy(value)
    return out


def secret_keys() -> list[str]:
    """The dotted keys of the settings that never leave the process (declared with
    :data:`peers.settings.SECRET`), e.g. ``averaging.run_key``."""
    out = []

    def walk(section: Any, prefix: str) -> None:
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if is_section(value):
                walk(value, f"{prefix}{f.name}.")
            elif is_secret(f):
                out.append(prefix + f.name)

    walk(Config(), "")
    return out


def redact_argv(argv: list[str]) -> list[str]:
    """``argv`` with the value of every secret setting given on it (``--averaging.run_key KEY`` or
    ``--averaging.run_key=KEY``) replaced by ``***``: the command line as W&B and error reports may record it."""
    secret = {f"--{k}" for k in secret_keys()}
    out = list(argv)
    for i, arg in enumerate(argv):
        name, eq, _ = arg.partition("=")
        name = "--" + name[2:].replace("-", "_") if name.startswith("--") else name
        if name in secret:
            if eq:
                out[i] = f"{arg.split('=', 1)[0]}=***"
            elif i + 1 < len(argv):
                out[i + 1] = "***"
    return out


def resolve_model(model: ModelConfig) -> None:
    """Fill the model fields left at 0 from the preset (in place)."""
    preset = MODEL_PRESETS.get(model.preset)
    if preset is None:
        return
    for name, value in preset.items():
        if getattr(model, name) == 0:
            setattr(model, name, value)


# Keys that must be equal on every island of a run for their pseudo-gradients to be averaged.
FINGERPRINT_PREFIXES = ("model.", "seed", "diloco.outer_optimizer", "diloco.outer_lr", "diloco.outer_momentum",
                        "diloco.fragments",
                        "averaging.compression", "averaging.topk_density", "averaging.topk_bits", "averaging.auto_codecs",
                        "averaging.run_id", "averaging.aggregate", "averaging.weighting", "averaging.member_check",
                        "averaging.strikes", "averaging.outlier_ratio")
ROBUSTNESS_DEFAULTS = {"averaging.aggregate": "mean", "averaging.weighting": "auto", "averaging.member_check": 10.0,
                       "averaging.strikes": 2, "averaging.outlier_ratio": 3.0}
"""Keys islands must share that joined the fingerprint later: at these values they stay out of it, so that the
fingerprints of runs from before them stay as they were."""


def config_fingerprint(cfg: Config, tokenizer: str = "") -> str:
    """Hash of the settings islands must share (model shape, outer optimizer, wire format, run id) and of
    ``tokenizer`` (a fingerprint of it; empty for bytes, whose fingerprints are as before tokenizers)."""
    import hashlib
    import json

    shared = {k: v for k, v in flatten(cfg).items() if k.startswith(FINGERPRINT_PREFIXES)}
    if shared["averaging.compression"] != "auto":  # (fingerprints of runs from before auto stay as they were)
        del shared["averaging.auto_codecs"]
    for key, default in ROBUSTNESS_DEFAULTS.items():
        if shared[key] == default:
            del shared[key]
    if tokenizer:
        shared["tokenizer"] = tokenizer
    return hashlib.sha1(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:12]


__all__ = [
    "Config", "ConfigError", "ModelConfig", "DataConfig", "InnerOptimConfig", "DilocoConfig",
    "AveragingConfig", "ParallelConfig", "CheckpointConfig", "WandbConfig", "LoggingConfig", "MODEL_PRESETS",
    "CHOICES", "flatten", "to_dict", "secret_keys", "redact_argv", "field_docs", "resolve_model", "config_fingerprint",
]
