"""Where a run's starting parameters come from (``--checkpoint.init_from``): a diloco checkpoint's θ_global,
a folder exported in the Hugging Face format, or a plain ``{name: tensor}`` state dict."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from diloco.model.checkpoint import MAGIC, CheckpointError, find_resume, load
from diloco.model.hf import is_hf_folder, read_hf

log = logging.getLogger(__name__)


def load_parameters(spec: str | Path) -> tuple[dict[str, torch.Tensor], Path]:
    """The parameters to start a run from, by name, and the file they came from.

    ``spec`` is a diloco checkpoint (its θ_global is taken; a directory means its newest valid
    checkpoint), a folder written by ``diloco export --format hf``, or a file holding a plain
    ``{name: tensor}`` state dict (``torch.save(model.state_dict())``).
    """
    path = Path(spec)
    if is_hf_folder(path):
        return read_hf(path)[0], path
    if path.is_dir():
        found = find_resume("latest", path)
        if found is None:
            raise CheckpointError(f"--checkpoint.init_from {spec} is a directory without checkpoints (ckpt-*.pt); "
                                  f"pass a checkpoint file or a directory holding one")
        path = found
    try:
        with open(path, "rb") as f:
            is_ours = f.read(len(MAGIC)) == MAGIC
    except OSError as e:
        raise CheckpointError(f"cannot read --checkpoint.init_from {spec} ({e.strerror or e}); "
                              f"pass an existing checkpoint or state-dict file") from None
    if is_ours:
        state = load(path)
        if "outer_optimizer" not in state:
            raise CheckpointError(f"{path} holds no θ_global (it is a checkpoint of a tensor/pipeline-parallel rank); "
                                  f"start from a single-process island's checkpoint or a full state dict")
        return dict(state["outer_optimizer"]["master"]), path
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"--checkpoint.init_from {path} is neither a diloco checkpoint nor a torch state dict "
                              f"({type(e).__name__}); pass a ckpt-*.pt file or torch.save(model.state_dict())") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"--checkpoint.init_from {path} does not hold a {{name: tensor}} state dict; pass a "
                              f"ckpt-*.pt file or torch.save(model.state_dict())")
    return state, path


@torch.no_grad()
def warm_start_parameters(shapes: dict[str, tuple[int, ...]], spec: str | Path) -> tuple[dict[str, torch.Tensor], Path]:
    """The tensors of ``spec`` (:func:`load_parameters`) for a model whose parameters have ``shapes``; raise
    CheckpointError when a name is missing or a shape differs."""
    tensors, path = load_parameters(spec)
    missing = [n for n in shapes if n not in tensors]
    if missing:
        raise CheckpointError(f"--checkpoint.init_from {path} lacks {len(missing)} parameter(s) of this model "
                              f"(e.g. {missing[0]}); it was written for a different --model.* config")
    wrong = [(n, tuple(tensors[n].shape), tuple(s)) for n, s in shapes.items() if tuple(tensors[n].shape) != tuple(s)]
    if wrong:
        n, got, want = wrong[0]
        raise CheckpointError(f"--checkpoint.init_from {path} has {n} of shape {got} but this model needs {want}; "
                              f"use the --model.* config the file was written with")
    log.info("parameters initialised from %s", path)
    return tensors, path

