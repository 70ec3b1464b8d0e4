"""Text generation with a trained model: a KV cache, greedy or sampled decoding, streamed output.

Generation runs over the unmodified :class:`diloco.model.transformer.Transformer` (as torchtitan applies
parallelism: functions over the model, not a second model class): :func:`forward_cached` calls the
model's own modules, keeping each block's keys and values of the positions seen so far, so a new
token costs one position's work instead of the whole prefix's.  Tokens are UTF-8 bytes, as in training.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from diloco.model.transformer import Attention, Transformer, apply_rotary


class GenerationError(ValueError):
    """A generation request that cannot be served (one sentence saying what to change)."""


@dataclass
class Sampling:
    """How the next token is chosen."""

    temperature: float = 0.0
    """0: greedy (the most likely token); above 0: sample from the softmax of logits / temperature."""
    top_k: int = 0
    """Sample only among the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Sample only among the most likely tokens whose probabilities add up to p (1: all)."""
    seed: int = 0
    """Seed of the sampler, so that a sampled generation can be repeated."""

    def check(self) -> None:
        """Raise :class:`GenerationError` for settings that cannot work."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise GenerationError(f"--temperature {self.temperature} must be a finite number >= 0 (0 is greedy)")
        if self.top_k < 0:
            raise GenerationError(f"--top-k {self.top_k} must be >= 0 (0 keeps every token)")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise GenerationError(f"--top-p {self.top_p} must be in (0, 1] (1 keeps every token)")


@dataclass
class KVCache:
    """Keys and values of one attention layer for the positions seen so far: (batch, heads, len, head_dim)."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


@dataclass
class Generated:
    """What :func:`generate` produced."""

    tokens: list[int] = field(default_factory=list)
    """The new tokens (the prompt not included)."""
    seconds: float = 0.0
    """Wall-clock of the generation, prompt processing included."""
    stopped_at_context: bool = False
    """True when the model's context (``seq_len``) ended the generation before ``max_new_tokens``."""

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("nan")


def _attend(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
            start: int) -> torch.Tensor:
    """``attn``'s forward for positions ``start..start+len(x)``, attending to the cached positions too."""
    bsz, seq, _ = x.shape
    q, k, v = (t.view(bsz, seq, -1, attn.head_dim).transpose(1, 2) for t in (attn.wq(x), attn.wk(x), attn.wv(x)))
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    k, v = cache.extend(k, v)
    if seq == 1:  # one new position sees every cached one
        out = F.scaled_dot_product_attention(q, k, v)
    else:  # query i sits at position start + i and sees keys 0..start + i
        mask = torch.ones(seq, start + seq, dtype=torch.bool, device=x.device).tril(diagonal=start)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return attn.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


@torch.no_grad()
def forward_cached(model: Transformer, h: torch.Tensor, caches: list[KVCache], start: int) -> torch.Tensor:
    """The model's forward for positions ``start..start+seq``, reading and extending ``caches`` (one per
    block, empty before the first call).  ``h`` is token ids (batch, seq), or hidden states on a pipeline
    stage without the embedding; a stage without the output returns hidden states (as ``model.forward``)."""
    cos = model.rope_cos[start:start + h.shape[1]]
    sin = model.rope_sin[start:start + h.shape[1]]
    if model.tok_embeddings is not None:
        h = model.tok_embeddings(h)
    for block, cache in zip(model.layers.values(), caches, strict=True):
        h = h + _attend(block.attention, block.attention_norm(h), cos, sin, cache, start)
        h = h + block.feed_forward(block.ffn_norm(h))
    if model.norm is not None:
        h = model.norm(h)
    return model.output(h) if model.output is not None else h


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The token chosen from one position's ``logits`` (vocab,)."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / sampling.temperature
    if 0 < sampling.top_k < logits.numel():
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = torch.sort(logits, descending=True)
        probs = ordered.softmax(-1)
        drop = probs.cumsum(-1) - probs >= sampling.top_p  # keep the smallest prefix reaching p
        logits = logits.scatter(0, order, ordered.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


Forward = Callable[[torch.Tensor, int, bool], "torch.Tensor | None"]
"""``(new tokens (1, seq), their first position, whether to start from empty caches)`` → logits, or None on
the ranks of a parallel island that do not hold the output."""


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], max_new_tokens: int, sampling: Sampling | None = None,
             use_cache: bool = True, on_token: Callable[[int], None] | None = None) -> Generated:
    """Continue ``prompt`` (token ids) by up to ``max_new_tokens`` tokens; ``on_token`` sees each one as it
    comes.  Without the cache every step runs the model over the whole sequence (same tokens, slower)."""
    model.eval()
    forward = cached_forward(model) if use_cache else (lambda tokens, start, fresh: model(tokens))
    device = next(model.parameters()).device
    return decode_loop(forward, lambda token: token, prompt, max_new_tokens, model.cfg.seq_len, device,
                       sampling, use_cache, on_token)


def cached_forward(model: Transformer) -> Forward:
    """A :data:`Forward` over ``model`` (whole, or a TP shard of it) keeping one KV cache per block."""
    caches: list[KVCache] = []

    def forward(tokens: torch.Tensor, start: int, fresh: bool) -> torch.Tensor:
        if fresh:
            caches[:] = [KVCache() for _ in model.layers]
        return forward_cached(model, tokens, caches, start)

    return forward


def decode_loop(forward: Forward, share: Callable[[int | None], int], prompt: list[int], max_new_tokens: int,
                context: int, device: torch.device, sampling: Sampling | None = None, use_cache: bool = True,
                on_token: Callable[[int], None] | None = None) -> Generated:
    """The generation loop over any ``forward`` (one process, or the stages of a parallel island, whose
    ``share`` hands the token chosen where the logits are to every rank)."""
    sampling = sampling or Sampling()
    sampling.check()
    if not prompt:
        raise GenerationError("the prompt is empty; pass at least one character")
    if len(prompt) >= context:
        raise GenerationError(f"the prompt is {len(prompt)} tokens (bytes) long but the model's context is {context}; "
                              f"shorten it to at most {context - 1}")
    generator = torch.Generator().manual_seed(sampling.seed)
    out = Generated()
    t0 = time.perf_counter()
    seq = torch.tensor([prompt], dtype=torch.long, device=device)
    logits = forward(seq, 0, True)
    while len(out.tokens) < max_new_tokens:
        token = share(next_token(logits[0, -1], sampling, generator) if logits is not None else None)
        out.tokens.append(token)
        if on_token is not None:
            on_token(token)
        position = len(prompt) + len(out.tokens)
        if position >= context:
            out.stopped_at_context = len(out.tokens) < max_new_tokens
            break
        step = torch.tensor([[token]], dtype=torch.long, device=device)
        seq = torch.cat([seq, step], dim=1)
        logits = forward(step, position - 1, False) if use_cache else forward(seq, 0, True)
    out.seconds = time.perf_counter() - t0
    return out
