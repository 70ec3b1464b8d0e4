"""Text to token ids and back: UTF-8 bytes (``bytes``, vocabulary 256) or a byte-level BPE of Hugging Face
``tokenizers`` read from a ``tokenizer.json`` (trained by ``diloco tokenizer train``, or saved by
``transformers``).  A run's tokenizer travels in its checkpoints and into exported folders, so a model is always
read with the tokenizer it was trained with.

    diloco tokenizer train --data.path PATH --tokenizer.vocab_size 4096 --out tokenizer.json
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from diloco.config import DataConfig, ModelConfig
from diloco.data.corpus import (
    SEPARATOR,
    DataError,
    Document,
    is_prepared,
    join_bytes,
    prepared_manifest,
)

END_OF_TEXT = "<|endoftext|>"
"""The special token a trained BPE puts between documents."""


def byte_tokenizer() -> dict[str, Any]:
    """A ``tokenizers`` JSON whose ids are UTF-8 bytes: byte-level pre-tokenization (GPT-2's byte↔character
    map) with a BPE of the 256 single bytes and no merges, so every byte is one token of id = its value."""
    chars = _bytes_to_unicode()
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {chars[b]: b for b in range(256)}, "merges": []},
    }


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of bytes to printable characters (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class Tokenizer:
    """UTF-8 bytes (``json_text`` None) or the ``tokenizers`` BPE serialized in ``json_text``."""

    def __init__(self, json_text: str | None = None, name: str = "bytes"):
        self.json_text = json_text
        self.name = name
        """What the user passed (`bytes`, or the tokenizer's file)."""
        self._bpe: Any = None
        self.eos_id: int | None = None
        """The id put between documents (None for bytes: a blank line separates them)."""
        if json_text is not None:
            from tokenizers import Tokenizer as HFTokenizer

            try:
                self._bpe = HFTokenizer.from_str(json_text)
            except Exception as e:  # tokenizers raises its own Exception types with the parser's message
                raise DataError(f"{name} is not a tokenizers JSON ({str(e).splitlines()[0]}); pass a tokenizer.json "
                                f"written by `diloco tokenizer train` or by transformers") from None
            self.eos_id = self._bpe.token_to_id(END_OF_TEXT)

    @property
    def is_bytes(self) -> bool:
        return self._bpe is None

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to this (exclusive)."""
        return 256 if self._bpe is None else self._bpe.get_vocab_size(with_added_tokens=True)

    @property
    def dtype(self) -> np.dtype:
        """The narrowest unsigned integer that holds every id: uint8 for bytes, uint16 up to 65,536, else uint32."""
        return np.dtype(np.uint8 if self._bpe is None else np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)

    @property
    def separator(self) -> np.ndarray:
        """The ids between two documents of a stream: a blank line for bytes, the end-of-text id for a BPE (none
        if it has no such token)."""
        if self._bpe is None:
            return np.frombuffer(SEPARATOR, dtype=np.uint8)
        return np.asarray([] if self.eos_id is None else [self.eos_id], dtype=self.dtype)

    @functools.cached_property
    def sha256(self) -> str:
        """Fingerprint of the tokenizer (of ``bytes`` for bytes), whatever the layout of its JSON."""
        text = "bytes" if self.json_text is None else json.dumps(json.loads(self.json_text), sort_keys=True)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        if self._bpe is None:
            return list(text.encode("utf-8"))
        return self._bpe.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (an incomplete UTF-8 sequence shows as U+FFFD)."""
        ids = [int(i) for i in ids]
        if self._bpe is None:
            return bytes(t for t in ids if 0 <= t < 256).decode("utf-8", errors="replace")
        return self._bpe.decode(ids, skip_special_tokens=False)

    def encode_documents(self, docs: list[bytes]) -> np.ndarray:
        """One token stream of ``docs``: for bytes, the documents joined by a blank line (uint8); for a BPE, each
        document's ids followed by the end-of-text id, encoded on every core (uint16, or uint32 past 65,536)."""
        if self._bpe is None:
            return join_bytes(docs)
        encoded = self._bpe.encode_batch([d.decode("utf-8", errors="replace") for d in docs], add_special_tokens=False)
        parts = []
        for i, e in enumerate(encoded):
            if i:
                parts.append(self.separator)
            parts.append(np.asarray(e.ids, dtype=self.dtype))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)

    def stream(self) -> "TextStream":
        """A decoder that turns ids into text as they come."""
        return TextStream(self)

    def save(self, path: Path) -> None:
        """Write the tokenizer as a ``tokenizer.json`` (bytes too: a BPE of the 256 bytes without merges)."""
        text = self.json_text if self.json_text is not None else json.dumps(byte_tokenizer(), ensure_ascii=False)
        path.write_text(text + ("" if text.endswith("\n") else "\n"), encoding="utf-8")

    @classmethod
    def load(cls, spec: str) -> "Tokenizer":
        """``bytes``, a ``tokenizer.json`` or a folder holding one (as ``transformers`` saves it)."""
        if spec in ("", "bytes"):
            return cls()
        path = Path(spec).expanduser()
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"--data.tokenizer {spec}: no such tokenizer file; pass bytes, a tokenizer.json (train "
                            f"one with `diloco tokenizer train`) or a folder holding one")
        try:
            return cls.from_json(path.read_text(encoding="utf-8"), str(spec))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"--data.tokenizer {spec} cannot be read as a tokenizer.json ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}); pass a tokenizer.json written by "
                            f"`diloco tokenizer train` or by transformers") from None

    @classmethod
    def for_data(cls, cfg: DataConfig) -> "Tokenizer":
        """The tokenizer of ``--data.tokenizer``, or of a prepared ``--data.path`` (whose tokens were written by
        one: ``--data.tokenizer`` must then be left at ``bytes`` or name the same one)."""
        if not is_prepared(cfg.path):
            return cls.load(cfg.tokenizer)
        folder = Path(cfg.path).expanduser()
        tokenizer = cls.load(str(folder / prepared_manifest(folder)["tokenizer"]))
        if cfg.tokenizer not in ("", "bytes") and cls.load(cfg.tokenizer).sha256 != tokenizer.sha256:
            raise DataError(f"--data.path {cfg.path} was prepared with another tokenizer than --data.tokenizer "
                            f"{cfg.tokenizer}; leave --data.tokenizer unset to use the folder's, or prepare it again")
        return tokenizer

    @classmethod
    def from_json(cls, json_text: str | None, name: str = "") -> "Tokenizer":
        """The tokenizer of ``json_text`` (None, or the JSON of the byte tokenizer: bytes)."""
        if json_text is None or json.loads(json_text) == byte_tokenizer():
            return cls()
        return cls(json_text, name or "tokenizer.json")


class TextStream:
    """Ids in, text out as soon as it is complete: ids whose text ends in an unfinished character (up to 4 of
    them, a UTF-8 character's length) wait for the next."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._pending: list[int] = []

    def push(self, token: int) -> str:
        self._pending.append(int(token))
        text = self.tokenizer.decode(self._pending)
        if text.endswith("\ufffd") and len(self._pending) < 4:
            return ""
        self._pending = []
        return text

    def flush(self) -> str:
        text, self._pending = self.tokenizer.decode(self._pending), []
        return text


def fit_vocabulary(model: ModelConfig, tokenizer: Tokenizer) -> None:
    """Give ``model`` the tokenizer's vocabulary when its ``vocab_size`` is 0, or refuse one too small for it
    (a larger one pads the embedding, which some GPUs run faster)."""
    if model.vocab_size == 0:
        model.vocab_size = tokenizer.vocab_size
    elif model.vocab_size < tokenizer.vocab_size:
        raise DataError(f"--model.vocab_size {model.vocab_size} is smaller than the {tokenizer.vocab_size} tokens of "
                        f"--data.tokenizer {tokenizer.name}; leave it at 0 to follow the tokenizer")


def train_bpe(docs: Iterable[Document], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` ids (the 256 bytes, the merges learnt from ``docs``, the end-of-text
    token), as GPT-2's: every text encodes, nothing is unknown."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise DataError(f"--tokenizer.vocab_size {vocab_size} must be at least 257 (the 256 bytes and the "
                        f"end-of-text token)")
    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator((data.decode("utf-8", errors="replace") for _, data in docs), trainer=trainer)
    return Tokenizer(bpe.to_str(), "trained")


def main(argv: list[str]) -> int:
    """``diloco tokenizer train``: learn a byte-level BPE on ``--data.path`` and write its tokenizer.json."""
    from diloco.command import ArgumentParser, run_command
    from diloco.config import DataConfig
    from diloco.data.corpus import documents, split_documents
    from diloco.files import output_file

    parser = ArgumentParser(prog="diloco tokenizer train", description=main.__doc__)
    parser.add_argument("action", choices=["train"])
    defaults = DataConfig()
    parser.add_argument("--data.path", dest="path", default=defaults.path)
    parser.add_argument("--data.max_bytes", dest="max_bytes", type=int, default=0)
    parser.add_argument("--data.hf_text_field", dest="hf_text_field", default=defaults.hf_text_field)
    parser.add_argument("--data.heldout_fraction", dest="heldout_fraction", type=float,
                        default=defaults.heldout_fraction)
    parser.add_argument("--tokenizer.vocab_size", dest="vocab_size", type=int, default=4096)
    parser.add_argument("--out", required=True, help="the tokenizer.json to write")
    args = parser.parse_args(argv)

    def body() -> int:
        cfg = DataConfig(path=args.path, max_bytes=args.max_bytes, hf_text_field=args.hf_text_field,
                         heldout_fraction=args.heldout_fraction)
        docs, what = documents(cfg)
        train, _ = split_documents(docs, cfg.heldout_fraction, what)  # never learn from the held-out text
        t0 = time.perf_counter()
        tokenizer = train_bpe(train, args.vocab_size)
        seconds = time.perf_counter() - t0
        out = Path(args.out)
        with output_file(out) as tmp:
            tokenizer.save(tmp)
        text = b"".join(d for _, d in train)
        tokens = tokenizer.encode_documents([d for _, d in train]).size
        print(f"wrote {out}: {tokenizer.vocab_size} tokens learnt from {len(text) / 1e6:.2f} MB of {what} in "
              f"{seconds:.1f} s, {len(text) / max(tokens, 1):.2f} bytes per token")
        return 0

    return run_command(body, (DataError,))
