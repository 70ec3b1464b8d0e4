"""Generation on a tp×pp island: the training layout mirrored for inference.

The island is built exactly as for training (:class:`pipeline.ModelParts` over the full model, the same
``--parallel.*`` settings): tensor parallelism shards the attention heads and the MLP of every block (each
TP rank keeps the KV cache of its own heads), pipeline stages hold their blocks and their part of the
cache.  One generation step walks the stages in order: the owner of a stage runs
:func:`diloco.inference.generate.forward_cached` on its module and sends the hidden states to the owner of the
next stage (same TP rank); the last stage's ranks hold the full logits (the output layer all-gathers
them) and choose the token, which is broadcast to every rank.  No pipeline schedule: one sequence
fills one stage at a time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from diloco.config import ModelConfig
from diloco.inference.generate import (
    Generated,
    KVCache,
    Sampling,
    decode_loop,
    forward_cached,
)
from diloco.model.transformer import Transformer
from pipeline import ModelParts, ParallelSettings, check_split, init_island_mesh


def check_island(model: Transformer, settings: ParallelSettings) -> list[str]:
    """Why ``model`` cannot be split over this island shape (one sentence each, as for training)."""
    c = model.cfg
    return check_split(settings, c.n_layers, c.n_heads, c.dim, c.ffn_dim, c.vocab_size)


def start_island(model: Transformer, settings: ParallelSettings, device: torch.device) -> ModelParts:
    """Join torchrun's process group and split ``model`` (the full model, on every rank) over the island."""
    mesh = init_island_mesh(settings.tp, settings.pp, device.type)
    return ModelParts(model, mesh, settings, device=device)


class IslandGenerator:
    """Runs :func:`decode_loop` over the stages of a :class:`ModelParts` (collective over the island)."""

    def __init__(self, parts: ModelParts, cfg: ModelConfig):
        self.parts, self.context, self.width = parts, cfg.seq_len, cfg.dim
        self.tp, self.pp = parts.mesh["tp"].size(), parts.mesh["pp"].size()
        self.caches: dict[int, list[KVCache]] = {}

    def _global(self, pp_rank: int, tp_rank: int | None = None) -> int:
        return pp_rank * self.tp + (self.parts.tp_rank if tp_rank is None else tp_rank)

    def forward(self, tokens: torch.Tensor, start: int, fresh: bool) -> torch.Tensor | None:
        parts, n = self.parts, self.parts.n_stages
        if fresh:
            self.caches = {s: [KVCache() for _ in m.layers] for s, m in zip(parts.stage_ids, parts.modules)}
        h: torch.Tensor | None = tokens
        for stage in range(n):
            owner = stage % self.pp
            if owner == parts.pp_rank:
                module = parts.modules[parts.stage_ids.index(stage)]
                h = forward_cached(module, h, self.caches[stage], start)
            if stage == n - 1:
                break
            nxt = (stage + 1) % self.pp
            if owner == nxt:
                continue
            if owner == parts.pp_rank:
                dist.send(h.contiguous(), self._global(nxt))
            elif nxt == parts.pp_rank:
                h = torch.empty(tokens.shape[0], tokens.shape[1], self.width, dtype=torch.float32, device=parts.device)
                dist.recv(h, self._global(owner))
        return h if (n - 1) % self.pp == parts.pp_rank else None

    def share(self, token: int | None) -> int:
        """The token chosen on the last stage (its TP ranks agree: same logits, same seed), to every rank."""
        t = torch.tensor([-1 if token is None else token], dtype=torch.long, device=self.parts.device)
        dist.broadcast(t, self._global((self.parts.n_stages - 1) % self.pp, 0))
        return int(t.item())

    def generate(self, prompt: list[int], max_new_tokens: int, sampling: Sampling | None = None,
                 use_cache: bool = True, on_token=None) -> Generated:
        for m in self.parts.modules:
            m.eval()
        return decode_loop(self.forward, self.share, prompt, max_new_tokens, self.context, self.parts.device,
                           sampling, use_cache, on_token)

