"""Atomic, self-verifying checkpoints.

A checkpoint file is ``MAGIC + sha256(payload) + payload`` where payload is a ``torch.save`` of a
plain dict.  It is written to a temporary file in the same directory, flushed to disk and renamed
over its final name, so a crash never leaves a half-written checkpoint under a valid name; the hash
catches truncation and bit rot on load.  Loading uses ``weights_only=True``: a checkpoint cannot run
code.
"""

from __future__ import annotations

import ast
import hashlib
import io
import logging
import os
import random
import re
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
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            f.write(hashlib.sha256(payload).digest())
            f.write(payload)
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
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path} ({e.strerror or e}); check the path") from None
    head = len(MAGIC) + 32
    if len(data) < head or not data.startswith(MAGIC):
        raise CheckpointError(f"checkpoint {path} is not a diloco checkpoint or is truncated; delete it or resume "
                              f"from an older one with --checkpoint.resume PATH")
    digest, payload = data[len(MAGIC):head], data[head:]
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"checkpoint {path} is corrupted or truncated (checksum mismatch); delete it or "
                              f"resume from an older one with --checkpoint.resume PATH")
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} could not be decoded ({type(e).__name__}); it was written by an "
                              f"incompatible version") from None


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
