"""Byte-level training data: corpus loading, a document-level held-out split and disjoint shards.

Every token is one UTF-8 byte (vocabulary 256), so no tokenizer is needed.  A corpus is read from
``DataConfig.path``:

* ``stdlib`` - the source of the running Python's standard library (on every machine);
* a file, a directory, a glob, or several of those separated by commas;
* ``hf:NAME[:CONFIG]`` - a Hugging Face dataset, streamed; ``hf:json:FILES`` / ``hf:text:FILES``
  (any packaged builder) read local files through the same code path.

Each document (a file or a dataset row) goes wholly to the training or the held-out stream,
chosen by a SHA-1 of its name, so the split is the same on every machine.  The training stream is
cut into windows of ``seq_len + 1`` tokens that :class:`diloco.data.batches.ShardedBatches` divides into
disjoint contiguous shards, one per island.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diloco.config import DataConfig

SEPARATOR = b"\n\n"
FORMAT = "diloco-tokens/1"
"""The format of a prepared folder (``diloco data prepare``), in its manifest."""
MANIFEST = "manifest.json"
"""Bytes placed between two documents of one stream."""
RECORD_FORMATS = {".jsonl": "json", ".ndjson": "json", ".parquet": "parquet", ".csv": "csv"}
"""Files of records rather than text, by extension: one document per record, its ``--data.hf_text_field``."""
"""How much of a streamed Hugging Face dataset is read when ``max_bytes`` is 0."""
HF_PACKAGED_BUILDERS = ("json", "csv", "text", "parquet", "arrow")
"""``hf:BUILDER:FILES`` reads local (or remote) files with one of these generic builders."""
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests"})

Document = tuple[str, bytes]
"""A document: its name (relative path or row index), which decides its split, and its bytes."""


class DataError(ValueError):
    """The training data cannot be read or is unusable; the message says how to fix it."""


@dataclass
class Corpus:
    """Training and held-out token streams of one data source (``uint8`` bytes, or the ids of a tokenizer)."""

    train: np.ndarray
    heldout: np.ndarray
    description: str
    num_documents: int
    heldout_bytes: int = 0
    """UTF-8 bytes of the held-out text (0: as many as its tokens, for bytes)."""

    @property
    def heldout_bytes_per_token(self) -> float:
        """What turns a loss per token into a loss per byte (bits per byte compare tokenizers)."""
        return (self.heldout_bytes or self.heldout.size) / max(self.heldout.size, 1)



def stdlib_root() -> Path:
    """Directory of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents() -> Iterator[Document]:
    """Yield every ``*.py`` of the standard library (no tests, no site-packages), sorted by path."""
    root = stdlib_root()
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS]
        paths += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    for rel in sorted(p.relative_to(root).as_posix() for p in paths):
        yield rel, (root / rel).read_bytes()


def _has_glob_magic(spec: str) -> bool:
    return any(c in spec for c in "*?[")


def _directory_files(root: Path) -> list[tuple[str, Path]]:
    """Files under ``root`` (hidden ones excluded) as (path relative to root, path), sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found += [Path(dirpath, f) for f in filenames if not f.startswith(".")]
    return sorted((p.relative_to(root).as_posix(), p) for p in found)


def _spec_files(spec: str) -> list[tuple[str, Path]]:
    """The files one path spec (file, directory or glob) names, as (document name, path)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return [(path.name, path)]
    if path.is_dir():
        return _directory_files(path)
    if not _has_glob_magic(spec):
        return []
    files: list[tuple[str, Path]] = []
    for match in sorted(glob.glob(os.path.expanduser(spec), recursive=True)):
        m = Path(match)
        if m.is_file():
            files.append((m.as_posix(), m))
        elif m.is_dir():
            files += [(f"{m.as_posix()}/{rel}", p) for rel, p in _directory_files(m)]
    return files


def split_path_specs(path: str) -> list[str]:
    """Split ``--data.path`` on commas, unless the whole string names an existing path."""
    if os.path.exists(os.path.expanduser(path)):
        return [path]
    return [s for s in (p.strip() for p in path.split(",")) if s]


def _read_text(path: Path) -> bytes | None:
    """The file's bytes if it is UTF-8 text without NUL bytes, else None."""
    data = path.read_bytes()
    if b"\x00" in data:
        return None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return data


def local_files(path: str) -> list[tuple[str, Path]]:
    """Every file named by ``path`` (comma-separated files, directories, globs), deduplicated.

    Raises :class:`DataError` when one of the comma-separated parts matches nothing.
    """
    seen: set[Path] = set()
    files: list[tuple[str, Path]] = []
    for spec in split_path_specs(path):
        matched = _spec_files(spec)
        if not matched:
            raise DataError(f"--data.path {spec} matches no file; pass a file, directory, glob, "
                            f"'stdlib' or hf:NAME")
        for name, p in matched:
            key = p.resolve()
            if key not in seen:
                seen.add(key)
                files.append((name, p))
    return files


def local_documents(files: Iterable[tuple[str, Path]], skipped: list[str] | None = None,
                    text_field: str = "text") -> Iterator[Document]:
    """Yield the UTF-8 text files among ``files`` (binary ones are appended to ``skipped``), and the records of
    record files (:data:`RECORD_FORMATS`) one by one."""
    for name, p in files:
        if p.suffix.lower() in RECORD_FORMATS:
            yield from record_documents(name, p, text_field)
            continue
        data = _read_text(p)
        if data is None:
            if skipped is not None:
                skipped.append(name)
            continue
        if data:
            yield name, data


def record_documents(name: str, path: Path, text_field: str) -> Iterator[Document]:
    """The records of a ``.jsonl``, ``.parquet`` or ``.csv`` file as documents ``name:index`` holding their
    ``text_field`` (parquet and csv through Hugging Face ``datasets``)."""
    kind = RECORD_FORMATS[path.suffix.lower()]
    if kind == "json":
        rows: Iterable[Any] = _json_lines(name, path)
    else:
        rows = _import_datasets().load_dataset(kind, data_files=str(path), split="train", streaming=True)
    for index, data in hf_documents(rows, text_field, name):
        yield f"{name}:{index}", data


def _json_lines(name: str, path: Path) -> Iterator[Any]:
    with path.open(encoding="utf-8", errors="strict") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{name} line {number} is not JSON ({e.msg}); a .jsonl file holds one JSON "
                                    f"object per line (rename it to .txt to train on it as text)") from None


@dataclass(frozen=True)
class HFSource:
    """A parsed ``hf:`` path: a hub dataset (``name``, ``config``) or a builder with ``data_files``."""

    name: str
    config: str | None = None
    data_files: str | None = None

    @classmethod
    def parse(cls, path: str) -> HFSource:
        """Parse ``hf:NAME``, ``hf:NAME:CONFIG`` or ``hf:BUILDER:FILES`` (e.g. ``hf:json:/d/*.jsonl``)."""
        body = path.removeprefix("hf:")
        name, _, rest = body.partition(":")
        if not name:
            raise DataError(f"--data.path {path} names no dataset; write hf:NAME or hf:NAME:CONFIG")
        if name in HF_PACKAGED_BUILDERS:
            if not rest:
                raise DataError(f"--data.path {path} needs data files after the builder name, "
                                f"e.g. hf:{name}:/data/*.{name if name != 'text' else 'txt'}")
            return cls(name, data_files=rest)
        return cls(name, config=rest or None)

    def __str__(self) -> str:
        if self.data_files:
            return f"{self.data_files} (Hugging Face '{self.name}' builder)"
        return f"Hugging Face dataset {self.name}" + (f" ({self.config})" if self.config else "")


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError("Hugging Face datasets need the optional extra: pip install 'diloco[hf]'") from None
    return datasets


def open_hf_dataset(source: HFSource) -> Iterable[dict[str, Any]]:
    """Stream the ``train`` split of ``source`` with ``datasets.load_dataset(..., streaming=True)``.

    Local ``text`` files are read one document per file rather than one per line.
    """
    datasets = _import_datasets()
    try:
        if source.data_files:
            extra = {"sample_by": "document"} if source.name == "text" else {}
            return datasets.load_dataset(source.name, data_files=source.data_files, split="train",
                                         streaming=True, **extra)
        return datasets.load_dataset(source.name, source.config, split="train", streaming=True)
    except Exception as e:
        raise DataError(f"cannot open {source}: {e}; check the dataset name, config and data files "
                        f"(and the network for hub datasets)") from e


def hf_documents(rows: Iterable[dict[str, Any]], text_field: str, source: str = "the dataset") -> Iterator[Document]:
    """Yield (row index, UTF-8 bytes of ``row[text_field]``) for every non-empty row."""
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"record {index} of {source} is a {type(row).__name__}, not an object with a "
                            f"{text_field!r} field")
        if text_field not in row:
            raise DataError(f"{source} has no column {text_field!r} (columns: {', '.join(map(str, row))}); "
                            f"set --data.hf_text_field to the column holding the text")
        text = row[text_field]
        if text:
            yield str(index), str(text).encode("utf-8")



def is_heldout(name: str, fraction: float) -> bool:
    """Whether the document called ``name`` belongs to the held-out set (stable across machines)."""
    digest = int(hashlib.sha1(name.encode("utf-8")).hexdigest(), 16)
    return digest % 10_000 < fraction * 10_000


def take_bytes(docs: Iterable[Document], max_bytes: int) -> Iterator[Document]:
    """Yield documents until ``max_bytes`` bytes of text are read (0: all); the last is truncated."""
    budget = max_bytes
    for name, data in docs:
        if max_bytes > 0:
            if budget <= 0:
                return
            data = data[:budget]
            budget -= len(data)
        yield name, data


def _split_single(data: bytes, fraction: float) -> tuple[bytes, bytes]:
    """Split one document into (train, held-out) at a line break near its last ``fraction``."""
    cut = len(data) - max(1, round(len(data) * fraction))
    line_start = data.rfind(b"\n", 0, cut) + 1
    if 0 < line_start and cut - line_start <= 4096:
        cut = line_start
    return data[:cut], data[cut:]


def joined_size(parts: list[bytes]) -> int:
    """Bytes of text in ``parts`` joined as a stream: theirs and a blank line between two."""
    return sum(len(p) for p in parts) + len(SEPARATOR) * max(len(parts) - 1, 0)


def join_bytes(parts: list[bytes]) -> np.ndarray:
    """The byte-level token stream of documents: their UTF-8 bytes joined by a blank line (uint8)."""
    return np.frombuffer(SEPARATOR.join(parts), dtype=np.uint8).copy()


def split_documents(docs: Iterable[Document], heldout_fraction: float, description: str
                    ) -> tuple[list[Document], list[Document]]:
    """(training, held-out) documents by :func:`is_heldout`.

    The held-out side is never empty (without a hashed pick it takes the last document) and the
    training side is never empty either; a lone document is split by bytes.
    """
    labelled = [(is_heldout(name, heldout_fraction), (name, data)) for name, data in docs]
    if not labelled:
        raise DataError(f"{description} contains no text; point --data.path at UTF-8 text")
    if len(labelled) == 1:
        name, data = labelled[0][1]
        train_part, heldout_part = _split_single(data, heldout_fraction)
        return [(name, train_part)], [(f"{name} (held-out end)", heldout_part)]
    if not any(h for h, _ in labelled):
        labelled[-1] = (True, labelled[-1][1])
    if all(h for h, _ in labelled):
        labelled[0] = (False, labelled[0][1])
    return [d for h, d in labelled if not h], [d for h, d in labelled if h]


def build_corpus(docs: Iterable[Document], heldout_fraction: float, description: str, tokenizer: Any = None) -> Corpus:
    """Split documents with :func:`split_documents` and turn each side into one token stream: bytes joined by
    blank lines, or ``tokenizer.encode_documents`` (a :class:`diloco.data.tokenizer.Tokenizer`)."""
    docs = list(docs)
    train, heldout = split_documents(docs, heldout_fraction, description)
    encode = tokenizer.encode_documents if tokenizer is not None else join_bytes
    corpus = Corpus(encode([d for _, d in train]), encode([d for _, d in heldout]), "", len(docs),
                    joined_size([d for _, d in heldout]))
    train_bytes = joined_size([d for _, d in train])
    tokens = "" if tokenizer is None or tokenizer.is_bytes else \
        f" ({corpus.train.size / 1e6:.2f}M + {corpus.heldout.size / 1e6:.2f}M tokens)"
    corpus.description = (f"{description}: {corpus.num_documents} document{'s' if corpus.num_documents != 1 else ''}, "
                          f"{_mb(train_bytes)} train + {_mb(corpus.heldout_bytes)} held-out{tokens}")
    return corpus


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"



def prepared_manifest(folder: Path) -> dict:
    """The manifest of a folder written by ``diloco data prepare`` (:mod:`diloco.data.prepared`)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read {folder / MANIFEST} ({e}); prepare the folder again with `diloco data "
                        f"prepare`") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"{folder} holds tokens of format {manifest.get('format')!r}, not {FORMAT!r}; prepare it "
                        f"again with this version's `diloco data prepare`")
    return manifest


def load_prepared(folder: str) -> Corpus:
    """The corpus of a prepared folder, its two streams memory-mapped read-only (nothing is read until used)."""
    path = Path(folder).expanduser()
    manifest = prepared_manifest(path)
    dtype = np.dtype(manifest["dtype"])
    streams = {}
    for side in ("train", "heldout"):
        file = path / manifest[side]["file"]
        expected = manifest[side]["tokens"] * dtype.itemsize
        if not file.is_file() or file.stat().st_size != expected:
            raise DataError(f"{file} is missing or not the {expected} bytes its manifest says; prepare {folder} again")
        streams[side] = np.memmap(file, dtype=dtype, mode="r")
    docs = manifest["train"]["documents"] + manifest["heldout"]["documents"]
    description = (f"{manifest.get('source') or folder} (prepared in {folder}): {docs} documents, "
                   f"{manifest['train']['tokens'] / 1e6:.2f}M + {manifest['heldout']['tokens'] / 1e6:.2f}M tokens, "
                   f"memory-mapped")
    return Corpus(streams["train"], streams["heldout"], description, docs, manifest["heldout"]["bytes"])


def is_prepared(path: str) -> bool:
    """Whether ``path`` is a folder written by ``diloco data prepare``."""
    return not path.startswith("hf:") and (Path(path).expanduser() / MANIFEST).is_file()


def load_corpus(cfg: DataConfig, tokenizer: Any = None) -> Corpus:
    """Read the corpus named by ``cfg.path`` and split it into training and held-out streams of ``tokenizer``'s
    ids (None: bytes); a prepared folder is memory-mapped as it was tokenized (see
    :meth:`diloco.data.tokenizer.Tokenizer.for_data`)."""
    if is_prepared(cfg.path):
        return load_prepared(cfg.path)
    docs, what = documents(cfg)
    return build_corpus(docs, cfg.heldout_fraction, what, tokenizer)


def documents(cfg: DataConfig) -> tuple[Iterable[Document], str]:
    """The documents named by ``cfg.path`` (at most ``cfg.max_bytes`` of text) and a description of them."""
    if cfg.path == "stdlib":
        what = f"Python {sys.version_info.major}.{sys.version_info.minor} standard library ({stdlib_root()})"
        return take_bytes(stdlib_documents(), cfg.max_bytes), what
    if cfg.path.startswith("hf:"):
        source = HFSource.parse(cfg.path)
        rows = open_hf_dataset(source)
        return take_bytes(hf_documents(rows, cfg.hf_text_field, str(source)), cfg.max_bytes), str(source)
    skipped: list[str] = []
    files = local_files(cfg.path)
    docs = list(take_bytes(local_documents(files, skipped, cfg.hf_text_field), cfg.max_bytes))
    if not docs:
        raise DataError(f"--data.path {cfg.path} holds no UTF-8 text ({len(files)} files, "
                        f"{len(skipped)} skipped as binary or not UTF-8); point it at text files")
    return docs, cfg.path + (f" ({len(skipped)} binary files skipped)" if skipped else "")


__all__ = [
    "DataError", "Corpus", "Document", "HFSource", "load_corpus",
    "build_corpus", "split_documents", "documents", "is_heldout", "stdlib_documents", "local_files", "local_documents", "hf_documents",
    "open_hf_dataset", "take_bytes", "split_path_specs", "stdlib_root", "SEPARATOR", "join_bytes", "joined_size", "is_prepared",
    "load_prepared", "prepared_manifest", "FORMAT", "MANIFEST",
]
