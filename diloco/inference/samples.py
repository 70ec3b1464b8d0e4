"""Samples on the dashboards: at each evaluation, continuations of fixed held-out prompts by θ_global.

The prompts are cut from the held-out text at fixed places (the same on every island and every
evaluation, so a person sees one prompt's continuation improve); the sampler is seeded by the outer
step, so islands holding the same θ_global write the same samples.  Generation runs on the CPU of the
island's main rank, on a copy of θ_global, so training memory and state are untouched.
"""

from __future__ import annotations

import numpy as np
import torch

from diloco.config import ModelConfig
from diloco.data.tokenizer import Tokenizer
from diloco.inference.generate import Sampling, generate
from diloco.model.transformer import build_model

SAMPLING = dict(temperature=0.8, top_k=40)
"""How samples are drawn: a little randomness keeps a small model out of loops, top-k out of noise."""


def sample_prompts(heldout: np.ndarray, count: int, length: int, newline: int | None = ord("\n")) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens from evenly spaced places of the held-out token stream, each
    starting after a ``newline`` token when there is one nearby (None: anywhere)."""
    prompts = []
    for i in range(count):
        at = len(heldout) * i // max(count, 1)
        newline_at = np.flatnonzero(heldout[at:at + 4096] == newline) if newline is not None else []
        start = at + int(newline_at[0]) + 1 if len(newline_at) else at
        piece = heldout[start:start + length]
        if len(piece) == length:
            prompts.append([int(t) for t in piece])
    return prompts


class Sampler:
    """Writes continuations of fixed prompts with a given θ_global (main rank only)."""

    def __init__(self, model_cfg: ModelConfig, heldout: np.ndarray, count: int, new_tokens: int,
                 tokenizer: Tokenizer | None = None):
        self.tokenizer = tokenizer or Tokenizer()
        length = max(1, min(48, model_cfg.seq_len // 2))
        self.new_tokens = max(1, min(new_tokens, model_cfg.seq_len - length))
        newline = self.tokenizer.encode("\n")
        self.prompts = sample_prompts(heldout, count, length, newline[0] if len(newline) == 1 else None)
        self.model = build_model(model_cfg) if self.prompts else None

    @torch.no_grad()
    def rows(self, theta: dict[str, torch.Tensor], outer_step: int) -> list[dict]:
        """One record per prompt: ``{"outer_step", "prompt", "continuation"}`` (text)."""
        if self.model is None:
            return []
        params = dict(self.model.named_parameters())
        for name, t in theta.items():
            params[name].copy_(t)
        out = []
        for prompt in self.prompts:
            tokens = generate(self.model, prompt, self.new_tokens, Sampling(**SAMPLING, seed=outer_step)).tokens
            out.append({"outer_step": outer_step, "prompt": self.tokenizer.decode(prompt),
                        "continuation": self.tokenizer.decode(tokens)})
        return out
