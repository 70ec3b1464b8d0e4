"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, causal scaled-dot-product attention.

Blocks live in a ``ModuleDict`` keyed by their index as a string, so parameter names
(``layers.3.attention.wq.weight``) stay the same when the model is split into pipeline stages
(a stage deletes the blocks it does not own) or sharded for tensor parallelism.  Every module
tolerates being absent (``tok_embeddings``/``norm``/``output`` set to ``None``) so a pipeline stage
is just this model with parts removed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from diloco.config import ModelConfig, resolve_model
from diloco.model.weights import init_parameters
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
    """cos and sin tables of shape (seq_len, head_dim // 2)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
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
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.dim // cfg.n_heads, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.activation_checkpointing = False
        self.init_weights()

    def init_weights(self, seed: int | None = None) -> None:
        """Initialise weights (normal 0.02, residual projections scaled by depth, norms to 1)."""
        gen = None
        if seed is not None:
            gen = torch.Generator().manual_seed(seed)
        depth_std = 0.02 / math.sqrt(2 * max(self.cfg.n_layers, 1))
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
                continue
            std = depth_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * std)

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


def build_initial_model(cfg: ModelConfig, seed: int, init_from: str = "") -> Transformer:
    """The model every island and every baseline worker starts from: the seeded initialisation, or
    the parameters of ``init_from`` (a warm start, see :func:`diloco.model.weights.init_parameters`)."""
    model = build_model(cfg, seed=seed)
    if init_from:
        init_parameters(model, init_from)
    return model


lm_loss = cross_entropy_loss
"""Mean next-token cross-entropy (in fp32): the one loss of islands, baseline and tests."""
