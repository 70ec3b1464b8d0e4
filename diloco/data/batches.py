"""Batches of a token stream (bytes or a tokenizer's ids): disjoint shards of the training windows, one per island, and
the fixed held-out batches every island evaluates on (the corpus itself: :mod:`diloco.data.corpus`)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from diloco.data.corpus import DataError


def _windows_to_batch(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather windows of ``seq_len + 1`` tokens at ``starts`` into (inputs, targets) LongTensors."""
    rows = tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64)
    windows = torch.from_numpy(rows)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class ShardedBatches:
    """Batches from one of ``num_shards`` disjoint contiguous shards of the training stream.

    The stream is cut into non-overlapping windows of ``seq_len + 1`` tokens; this shard owns a
    contiguous range of them and visits them in a fresh permutation every epoch, seeded by
    ``(seed, shard_index, epoch)``.  A batch may span the end of one epoch and the start of the next.

    The ``replicas`` data-parallel replicas of an island read the shard together: each draw takes
    ``replicas * batch_size`` windows and replica ``replica`` keeps its own consecutive ``batch_size`` of them,
    so ``dp`` replicas see what one process would see over ``dp`` accumulated batches, and every replica's
    position (its :meth:`state_dict`) is the same.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, shard_index: int,
                 num_shards: int, seed: int, replica: int = 0, replicas: int = 1):
        if seq_len < 1 or batch_size < 1:
            raise DataError(f"seq_len and batch_size must be at least 1, got {seq_len} and {batch_size}")
        if not 0 <= shard_index < num_shards:
            raise DataError(f"shard index {shard_index} must be in [0, {num_shards - 1}] for {num_shards} shards")
        self.tokens = np.asarray(tokens)
        if self.tokens.dtype.kind not in "ui":
            raise DataError(f"token ids must be integers, got an array of {self.tokens.dtype}")
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.seed = seed
        if not 0 <= replica < replicas:
            raise DataError(f"replica {replica} must be in [0, {replicas - 1}] for {replicas} replicas")
        self.replica, self.replicas = replica, replicas
        total = self.tokens.size // (seq_len + 1)
        self.window_range = range(total * shard_index // num_shards, total * (shard_index + 1) // num_shards)
        if len(self.window_range) < batch_size * replicas:
            raise DataError(f"shard {shard_index} of {num_shards} holds only {len(self.window_range)} sequences "
                            f"of {seq_len + 1} tokens but a batch needs {batch_size * replicas}; use fewer shards, a "
                            f"shorter --model.seq_len, a smaller --inner.batch_size or --parallel.dp, or more data")
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    @property
    def num_windows(self) -> int:
        """Sequences (windows) in this shard: one epoch."""
        return len(self.window_range)

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens in one batch of every replica together (replicas * batch_size * seq_len)."""
        return self.replicas * self.batch_size * self.seq_len

    def _permutation(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.shard_index, epoch])
        return self.window_range.start + rng.permutation(self.num_windows)

    def _next_windows(self) -> np.ndarray:
        picked = []
        needed = self.batch_size * self.replicas
        while needed:
            take = self._order[self.position:self.position + needed]
            picked.append(take)
            needed -= take.size
            self.position += take.size
            if self.position == self.num_windows:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
        mine = self.replica * self.batch_size
        return np.concatenate(picked)[mine:mine + self.batch_size]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This replica's next (inputs, targets) pair, each a (batch_size, seq_len) LongTensor."""
        return _windows_to_batch(self.tokens, self._next_windows() * (self.seq_len + 1), self.seq_len)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """Where the stream stands: ``{"epoch": ..., "position": ...}``."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a :meth:`state_dict` taken on a stream with the same data and sharding."""
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.num_windows:
            raise DataError(f"data position (epoch {epoch}, sequence {position}) does not fit shard "
                            f"{self.shard_index} of {self.num_shards} with {self.num_windows} sequences; "
                            f"the data or its sharding changed since the checkpoint was written")
        self.epoch, self.position = epoch, position
        self._order = self._permutation(epoch)


def heldout_batches(tokens: np.ndarray, seq_len: int, batch_size: int,
                    n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n_batches`` fixed (inputs, targets) batches of windows evenly spaced over ``tokens``.

    The same on every island, so their held-out losses are comparable.  Windows overlap when the
    stream is shorter than ``n_batches * batch_size`` windows.
    """
    tokens = np.asarray(tokens)
    if tokens.size < seq_len + 1:
        raise DataError(f"the held-out text holds only {tokens.size} tokens but one sequence needs {seq_len + 1}; "
                        f"raise --data.heldout_fraction, use more data or a shorter --model.seq_len")
    count = n_batches * batch_size
    starts = np.linspace(0, tokens.size - (seq_len + 1), count).round().astype(np.int64)
    return [_windows_to_batch(tokens, starts[i:i + batch_size], seq_len)
            for i in range(0, count, batch_size)]


__all__ = ["ShardedBatches", "heldout_batches"]
