"""Pre-tokenized corpora: ``diloco data prepare`` tokenizes a source once, on every core, into a folder of
token ids that islands then read by memory map, so an island's memory does not grow with the corpus and nothing
is tokenized at start.

    diloco data prepare --data.path PATH [--data.tokenizer FILE] --out DIR
    diloco train --data.path DIR            # the folder's tokenizer is used

The folder holds ``train.bin`` and ``heldout.bin`` (the ids, uint16 or uint32, documents separated as the
tokenizer separates them), ``tokenizer.json`` and ``manifest.json`` (format, tokenizer hash, dtype, token,
byte and document counts, the source).  Documents are split between the two files as training splits them
(:func:`diloco.data.corpus.is_heldout`), so a prepared corpus and the raw one hold out the same documents; islands
take disjoint ranges of the training windows (:class:`diloco.data.batches.ShardedBatches`), and each touches
only the pages of its own range.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from diloco.config import DataConfig
from diloco.data.corpus import (
    FORMAT,
    MANIFEST,
    SEPARATOR,
    DataError,
    Document,
    documents,
    is_heldout,
    joined_size,
)
from diloco.data.tokenizer import Tokenizer
from diloco.files import output_folder

BATCH_DOCUMENTS = 512
"""Documents tokenized together (``encode_batch`` spreads them over the cores)."""


class _Split:
    """One output file of ids, appended to batch by batch."""

    def __init__(self, path: Path, tokenizer: Tokenizer):
        self.path, self.tokenizer = path, tokenizer
        self.file = path.open("wb")
        self.tokens = self.bytes = self.documents = 0

    def add(self, docs: list[bytes]) -> None:
        if not docs:
            return
        if self.documents:  # what separates this batch from the last document before it
            self._write(self.tokenizer.separator)
            self.bytes += len(SEPARATOR)
        self._write(self.tokenizer.encode_documents(docs))
        self.bytes += joined_size(docs)
        self.documents += len(docs)

    def _write(self, ids: np.ndarray) -> None:
        self.file.write(ids.tobytes())
        self.tokens += ids.size

    def close(self) -> dict:
        self.file.close()
        return {"file": self.path.name, "tokens": self.tokens, "bytes": self.bytes, "documents": self.documents}


def prepare(docs: Iterable[Document], tokenizer: Tokenizer, out: Path, heldout_fraction: float,
            source: str = "") -> dict:
    """Tokenize ``docs`` into the folder ``out`` (see the module doc), streaming: at most :data:`BATCH_DOCUMENTS`
    documents in memory.  The folder appears whole or not at all (:func:`diloco.files.output_folder`: an
    earlier prepared folder there is replaced once this one is complete).  Returns the manifest."""
    with output_folder(out, marker=MANIFEST) as folder:
        return _prepare(docs, tokenizer, folder, heldout_fraction, source)


def _prepare(docs: Iterable[Document], tokenizer: Tokenizer, out: Path, heldout_fraction: float,
             source: str) -> dict:
    splits = {"train": _Split(out / "train.bin", tokenizer), "heldout": _Split(out / "heldout.bin", tokenizer)}
    pending: dict[str, list[bytes]] = {"train": [], "heldout": []}
    try:
        for name, data in docs:
            side = "heldout" if is_heldout(name, heldout_fraction) else "train"
            pending[side].append(data)
            if len(pending[side]) >= BATCH_DOCUMENTS:
                splits[side].add(pending[side])
                pending[side] = []
        for side, rest in pending.items():
            splits[side].add(rest)
    finally:
        counts = {side: split.close() for side, split in splits.items()}
    for side, c in counts.items():
        if not c["tokens"]:
            raise DataError(f"{source or 'the source'} gave no {side} document (held-out fraction "
                            f"{heldout_fraction}); use more documents or another --data.heldout_fraction")
    tokenizer.save(out / "tokenizer.json")
    manifest = {"format": FORMAT, "tokenizer": "tokenizer.json", "tokenizer_sha256": tokenizer.sha256,
                "vocab_size": tokenizer.vocab_size, "dtype": tokenizer.dtype.name, "heldout_fraction": heldout_fraction,
                "source": source, **counts}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str]) -> int:
    """``diloco data prepare``: tokenize ``--data.path`` once into a folder that islands memory-map."""
    from diloco.command import ArgumentParser, run_command

    parser = ArgumentParser(prog="diloco data prepare", description=main.__doc__)
    parser.add_argument("action", choices=["prepare"])
    defaults = DataConfig()
    parser.add_argument("--data.path", dest="path", default=defaults.path)
    parser.add_argument("--data.tokenizer", dest="tokenizer", default=defaults.tokenizer)
    parser.add_argument("--data.max_bytes", dest="max_bytes", type=int, default=0)
    parser.add_argument("--data.hf_text_field", dest="hf_text_field", default=defaults.hf_text_field)
    parser.add_argument("--data.heldout_fraction", dest="heldout_fraction", type=float,
                        default=defaults.heldout_fraction)
    parser.add_argument("--out", required=True, help="the folder to write")
    args = parser.parse_args(argv)

    def body() -> int:
        cfg = DataConfig(path=args.path, max_bytes=args.max_bytes, hf_text_field=args.hf_text_field,
                         heldout_fraction=args.heldout_fraction, tokenizer=args.tokenizer)
        if not 0 < cfg.heldout_fraction < 1:
            raise DataError(f"--data.heldout_fraction must be between 0 and 1 (exclusive), got {cfg.heldout_fraction}")
        tokenizer = Tokenizer.load(cfg.tokenizer)
        docs, what = documents(cfg)
        t0 = time.perf_counter()
        m = prepare(docs, tokenizer, Path(args.out), cfg.heldout_fraction, what)
        seconds = time.perf_counter() - t0
        mb = (m["train"]["bytes"] + m["heldout"]["bytes"]) / 1e6
        print(f"wrote {args.out}: {m['train']['tokens'] / 1e6:.2f}M training and {m['heldout']['tokens'] / 1e6:.2f}M "
              f"held-out tokens ({m['dtype']}) from {mb:.1f} MB of {what} in {seconds:.1f} s ({mb / seconds:.1f} MB/s)")
        return 0

    return run_command(body, (DataError,))
