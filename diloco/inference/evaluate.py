"""Held-out loss and perplexity of a trained model on any text, document by document.

Each document is cut into consecutive windows of the model's context; every byte after the first of
a window is predicted from the bytes before it in that window.  The loss is the mean over every
predicted byte (so long documents weigh more), in nats; bits per byte = loss / ln 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from diloco.config import DataConfig
from diloco.data.corpus import DataError, Document, documents, split_documents
from diloco.data.tokenizer import Tokenizer
from diloco.model.transformer import Transformer
from diloco.progress import Progress


@dataclass
class Evaluation:
    """The loss of a model on a set of documents."""

    loss_sum: float = 0.0
    tokens: int = 0
    bytes: int = 0
    """UTF-8 bytes of the text whose ``tokens`` were predicted."""
    per_document: list[tuple[str, float, int]] = field(default_factory=list)
    """(name, mean loss, predicted tokens) of every document, in reading order."""

    @property
    def loss(self) -> float:
        return self.loss_sum / self.tokens if self.tokens else float("nan")

    @property
    def bits_per_byte(self) -> float:
        """The summed loss in bits over the bytes of text: comparable across tokenizers."""
        return self.loss_sum / math.log(2) / self.bytes if self.bytes else float("nan")

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 50.0))


@torch.no_grad()
def document_loss(model: Transformer, data: bytes, batch_size: int,
                  tokenizer: Tokenizer | None = None) -> tuple[float, int]:
    """(summed loss in nats, predicted tokens) of one document (its UTF-8 ``data``, read by ``tokenizer``;
    None: bytes)."""
    seq, device = model.cfg.seq_len, next(model.parameters()).device
    tokens = torch.from_numpy((tokenizer or Tokenizer()).encode_documents([data]).astype(np.int64))
    total, count = 0.0, 0
    full = (len(tokens) - 1) // seq  # windows of seq + 1 tokens overlapping by one (the last target is the next input)
    starts = [i * seq for i in range(full)]
    for i in range(0, len(starts), batch_size):
        rows = torch.stack([tokens[s:s + seq + 1] for s in starts[i:i + batch_size]]).to(device)
        logits = model(rows[:, :-1])
        total += F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten(), reduction="sum").item()
        count += rows[:, 1:].numel()
    rest = tokens[full * seq:]
    if len(rest) > 1:
        logits = model(rest[None, :-1].to(device))
        total += F.cross_entropy(logits.float()[0], rest[1:].to(device), reduction="sum").item()
        count += len(rest) - 1
    return total, count


def heldout_documents(cfg: DataConfig, split: str) -> tuple[list[Document], str]:
    """The documents to evaluate on: the held-out ones of ``cfg`` (as training chose them) or ``all``."""
    docs, what = documents(cfg)
    if split == "all":
        return list(docs), what
    if split != "heldout":
        raise DataError(f"--split {split!r} is not a split; use heldout or all")
    return split_documents(docs, cfg.heldout_fraction, what)[1], what


def evaluate(model: Transformer, docs: list[Document], batch_size: int = 8, progress: bool = True,
             tokenizer: Tokenizer | None = None) -> Evaluation:
    """The loss of ``model`` on ``docs``, with a progress bar on stderr when it is a terminal (and ``progress``)."""
    model.eval()
    out = Evaluation()
    bar = Progress(sum(len(d) for _, d in docs), "eval", unit="B", unit_scale=True, enabled=None if progress else False)
    seen = 0
    for i, (name, data) in enumerate(docs):
        loss, count = document_loss(model, data, batch_size, tokenizer)
        out.loss_sum += loss
        out.tokens += count
        out.bytes += len(data) if count else 0
        seen += len(data)
        if count:
            out.per_document.append((name, loss / count, count))
        bar.set(seen, documents=f"{i + 1}/{len(docs)}", loss=f"{out.loss:.4f}")
    bar.close()
    return out
