"""Atomic, self-verifying checkpoints.

A checkpoint file is ``MAGIC + sha256(payload) + payload`` where payload is a ``torch.save`` of a
plain dict.  It is written to a temporary file in the same directory, flushed to disk and renamed
over its final name, so a crash never leaves a half-written checkpoint under a valid name; the hash
catches truncation and bit rot on load.  Loading uses ``weights_only=True``: a checkpoint cannot run
code.  Both ways stream: ``torch.save`` writes into the file through the hash, and loading checks the
hash chunk by chunk and then reads the tensors straight from the file, so neither holds the file's bytes in
memory beside the tensors (loading an 85M-parameter checkpoint held 3x the file; now about 1x).
:class:`BackgroundWriter` writes them from another thread.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import os
import random
import re
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

MAGIC = b"DILOCO-CKPT-1\n"
NAME_RE = re.compile(r"^ckpt-(\d{6,})\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file and what to do."""


def checkpoint_path(directory: str | Path, outer_step: int) -> Path:
    """Where the checkpoint taken after ``outer_step`` rounds lives."""
    return Path(directory) / f"ckpt-{outer_step:06d}.pt"


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoint files in ``directory``, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted((p for p in d.iterdir() if NAME_RE.match(p.name)), key=lambda p: int(NAME_RE.match(p.name)[1]))


def set_aside(directory: str | Path) -> Path | None:
    """Move the checkpoints an earlier run left in ``directory`` into ``directory/earlier-<time>/`` (a fresh
    run must never resume from them later, nor have them count as its newest); returns that folder."""
    found = list_checkpoints(directory)
    if not found:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(found[-1].stat().st_mtime))
    aside = Path(directory) / f"earlier-{stamp}"
    aside.mkdir(exist_ok=True)
    for path in found:
        os.replace(path, aside / path.name)
    return aside


def save(state: dict[str, Any], path: str | Path, keep: int | None = None) -> Path:
    """Write ``state`` atomically to ``path``; then delete older checkpoints beyond ``keep``.

    Raises CheckpointError (leaving every existing checkpoint untouched) if the directory is not
    writable or the disk is full.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            f.write(bytes(32))  # the payload's hash, once it is known
            hashing = _HashingWriter(f)
            torch.save(state, hashing)
            f.seek(len(MAGIC))
            f.write(hashing.hash.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        previous = list_checkpoints(path.parent)
        kept = f"; the previous checkpoint {previous[-1]} is intact" if previous else ""
        raise CheckpointError(f"could not write checkpoint {path} ({e.strerror or e}): free disk space or point "
                              f"--checkpoint.dir at a writable directory{kept}") from None
    if keep is not None:
        for old in list_checkpoints(path.parent)[:-keep]:
            old.unlink(missing_ok=True)
    return path


def load(path: str | Path) -> dict[str, Any]:
    """Read and verify a checkpoint; raise CheckpointError naming the file if it is damaged."""
    path = Path(path)
    head = len(MAGIC) + 32
    try:
        with open(path, "rb") as f:
            start = f.read(head)
            if len(start) < head or not start.startswith(MAGIC):
                raise CheckpointError(f"checkpoint {path} is not a diloco checkpoint or is truncated; delete it or "
                                      f"resume from an older one with --checkpoint.resume PATH")
            digest = hashlib.sha256()
            while chunk := f.read(HASH_CHUNK):
                digest.update(chunk)
            if digest.digest() != start[len(MAGIC):]:
                raise CheckpointError(f"checkpoint {path} is corrupted or truncated (checksum mismatch); delete it "
                                      f"or resume from an older one with --checkpoint.resume PATH")
            try:
                return torch.load(_OffsetReader(f, head), map_location="cpu", weights_only=True)
            except Exception as e:
                raise CheckpointError(f"checkpoint {path} could not be decoded ({type(e).__name__}); it was written "
                                      f"by an incompatible version") from None
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path} ({e.strerror or e}); check the path") from None


HASH_CHUNK = 1 << 24


class _HashingWriter:
    """A file ``torch.save`` writes into that hashes what goes through."""

    def __init__(self, f: Any):
        self.f, self.hash = f, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


class _OffsetReader:
    """The file ``f`` seen from ``offset`` on (``torch.load`` reads the payload in place, behind our header)."""

    def __init__(self, f: Any, offset: int):
        self.f, self.offset = f, offset
        f.seek(offset)

    def read(self, n: int = -1) -> bytes:
        return self.f.read(n)

    def readinto(self, buf: Any) -> int:
        return self.f.readinto(buf)

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.f.seek(pos + self.offset if whence == 0 else pos, whence) - self.offset

    def tell(self) -> int:
        return self.f.tell() - self.offset

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True


class BackgroundWriter:
    """Writes checkpoints with :func:`save` in a background thread, one at a time: the caller hands over a
    snapshot (copies of what keeps changing) and goes on training.  A write that failed raises its
    :class:`CheckpointError` at the next :meth:`submit` or at :meth:`wait`."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: CheckpointError | None = None
        self.written: list[Path] = []

    def submit(self, state: dict[str, Any], path: Path, keep: int | None, done: Any = None) -> None:
        """Write ``state`` to ``path`` once the write before it finished; ``done(path)`` afterwards."""
        self.wait()

        def write() -> None:
            try:
                self.written.append(save(state, path, keep))
                if done is not None:
                    done(path)
            except CheckpointError as e:
                self._error = e

        self._thread = threading.Thread(target=write, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Wait for the write in flight; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


def find_resume(spec: str, directory: str | Path) -> Path | None:
    """Resolve ``--checkpoint.resume``: '' → None, 'latest' → newest valid file in ``directory``
    (damaged newer files are skipped with a warning), anything else → that path."""
    if not spec:
        return None
    if spec != "latest":
        if not Path(spec).is_file():
            raise CheckpointError(f"--checkpoint.resume {spec} does not exist; pass an existing checkpoint file "
                                  f"or 'latest'")
        return Path(spec)
    candidates = list_checkpoints(directory)
    for path in reversed(candidates):
        try:
            load(path)
            return path
        except CheckpointError as e:
            log.warning("skipping damaged checkpoint: %s", e)
    if candidates:
        raise CheckpointError(f"every checkpoint in {directory} is damaged ({', '.join(p.name for p in candidates)}); "
                              f"start without --checkpoint.resume or restore a backup")
    return None


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states as checkpoint-safe plain types and tensors."""
    np_state = np.random.get_state()
    state = {"python": repr(random.getstate()), "torch": torch.get_rng_state(),
             "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`."""
    random.setstate(_tuplify(ast.literal_eval(state["python"])))
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuplify(x: Any) -> Any:
    return tuple(_tuplify(i) for i in x) if isinstance(x, (list, tuple)) else x
