"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, causal scaled-dot-product attention.

Blocks live in a ``ModuleDict`` keyed by their index as a string, so parameter names
(``layers.3.attention.wq.weight``) stay the same when the model is split into pipeline stages
(a stage deletes the blocks it does not own) or sharded for tensor parallelism.  Every module
tolerates being absent (``tok_embeddings``/``norm``/``output`` set to ``None``) so a pipeline stage
is just this model with parts removed.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from diloco.config import ModelConfig, resolve_model
from diloco.model.weights import warm_start_parameters
from pipeline import cross_entropy_loss


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (seq_len, head_dim // 2), real (on the CPU) even while a skeleton is built on
    the meta device: computed, not trained, they survive materialisation (:func:`pipeline.materialize.materialize`)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device="cpu"), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (batch, heads, seq, head_dim) by position-dependent angles."""
    seq = x.shape[-2]
    cos, sin = cos[:seq].to(x.dtype), sin[:seq].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class Attention(nn.Module):
    """Multi-head causal self-attention.  Head count is derived from the local weight shape, so
    the same code runs on a tensor-parallel shard holding a subset of the heads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # -1 heads: under tensor parallelism q holds only this rank's heads.
        q, k, v = (t.view(bsz, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Decoder-only language model.  ``forward(tokens)`` returns logits; on a pipeline stage without
    embeddings it takes hidden states instead, and without ``output`` it returns hidden states."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        resolve_model(cfg)
        if cfg.vocab_size == 0:  # the tokenizer's size, when nobody fitted it: bytes
            cfg.vocab_size = 256
        self.cfg = cfg
        # no default draw (init_weights draws every parameter): on the meta device a normal_ costs 2 s of
        # imports (torch's compiler stack), for values a skeleton never holds
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim,
                                                                _weight=torch.empty(cfg.vocab_size, cfg.dim))
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.dim // cfg.n_heads, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.activation_checkpointing = False
        if not self.output.weight.is_meta:  # a skeleton (model_skeleton) holds no values to draw
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter with :func:`init_parameter` (from the global random state without ``seed``)."""
        for name, p in self.named_parameters():
            p.copy_(init_parameter(name, tuple(p.shape), self.cfg.n_layers, seed))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers.values():
            if self.activation_checkpointing and self.training:
                h = torch.utils.checkpoint.checkpoint(layer, h, self.rope_cos, self.rope_sin, use_reentrant=False)
            else:
                h = layer(h, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def init_parameter(name: str, shape: tuple[int, ...], n_layers: int, seed: int | None) -> torch.Tensor:
    """The initial value of parameter ``name``: ones for norm weights (1-D), else normal(0, 0.02), residual
    projections scaled by 1/sqrt(2·n_layers).  Each parameter draws from a generator of its own, seeded by
    ``(seed, name)``, so any rank can materialise any parameter alone, in any order, and get the same values."""
    if len(shape) == 1:
        return torch.ones(shape)
    std = 0.02 / math.sqrt(2 * max(n_layers, 1)) if name.endswith(("wo.weight", "w2.weight")) else 0.02
    gen = None if seed is None else torch.Generator().manual_seed((seed << 32) + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen) * std


def model_skeleton(cfg: ModelConfig) -> Transformer:
    """The model's structure on the meta device: parameter names and shapes, no memory (the rotary tables are real:
    :func:`rotary_tables`)."""
    with torch.device("meta"):
        return Transformer(cfg)


class InitialValues(Mapping[str, torch.Tensor]):
    """The initial value of every parameter by name, computed when asked for (one parameter in memory at a
    time): the seeded draw of :func:`init_parameter`, or the tensors of a warm start."""

    def __init__(self, cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], seed: int, init_from: str = ""):
        self.shapes, self.seed, self.n_layers = shapes, seed, cfg.n_layers
        self.tensors = warm_start_parameters(shapes, init_from)[0] if init_from else None

    def __getitem__(self, name: str) -> torch.Tensor:
        if self.tensors is not None:
            return self.tensors[name]
        return init_parameter(name, self.shapes[name], self.n_layers, self.seed)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def initial_model(cfg: ModelConfig, seed: int, init_from: str = "") -> tuple[Transformer, InitialValues]:
    """What every island and every baseline worker starts from: the model as a skeleton and where its parameters'
    initial values come from (the seeded draw, or ``init_from``, a warm start: :func:`diloco.model.weights.load_parameters`).
    Each rank materialises only its own pieces (``ModelParts(skeleton, ..., init=values)``)."""
    skeleton = model_skeleton(cfg)
    return skeleton, InitialValues(cfg, {n: tuple(p.shape) for n, p in skeleton.named_parameters()}, seed, init_from)


def build_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """Build the model with weights drawn from ``seed``: every island gets the same θ_0."""
    model = Transformer(cfg)
    model.init_weights(seed)
    return model


def count_parameters(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Number of parameters (optionally without the token embedding table)."""
    total = 0
    for name, p in model.named_parameters():
        if exclude_embeddings and name.startswith("tok_embeddings"):
            continue
        total += p.numel()
    return total


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token: 6·N (non-embedding) + 6·L·d·seq, as torchtitan counts them."""
    resolve_model(cfg)
    n = cfg.n_layers * (4 * cfg.dim * cfg.dim + 3 * cfg.dim * cfg.ffn_dim + 2 * cfg.dim) + cfg.dim
    n += cfg.dim * (cfg.vocab_size or 256)  # output projection (the embedding lookup costs no FLOPs)
    return 6.0 * n + 6.0 * cfg.n_layers * cfg.dim * cfg.seq_len


lm_loss = cross_entropy_loss
"""Mean next-token cross-entropy (in fp32): the one loss of islands, baseline and tests."""
