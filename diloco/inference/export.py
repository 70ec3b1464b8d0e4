"""A trained model out of a run: :func:`load_trained` takes whatever a user points at (a diloco checkpoint,
a checkpoint directory or run directory, a folder exported in the Hugging Face format) and returns the model
with its config (``diloco generate``, ``diloco eval``, ``diloco export``)."""

from __future__ import annotations

from pathlib import Path

import torch

from diloco.config import ModelConfig
from diloco.config.loader import from_dict
from diloco.data.tokenizer import Tokenizer
from diloco.model import checkpoint
from diloco.model.checkpoint import CheckpointError
from diloco.model.hf import is_hf_folder, read_hf
from diloco.model.transformer import Transformer, build_model


def load_trained(spec: str | Path) -> tuple[Transformer, ModelConfig, Path, Tokenizer]:
    """The model a run trained, from ``spec``: a diloco checkpoint file (its θ_global), a folder of them or a
    run directory (the newest valid one), or an exported Hugging Face folder.  Returns (model, config, file,
    the tokenizer it was trained with)."""
    path = Path(spec)
    if not path.exists():
        raise CheckpointError(f"{spec} does not exist; pass a checkpoint (ckpt-*.pt), a run or checkpoint "
                              f"directory, or a folder written by `diloco export`")
    if is_hf_folder(path):
        params, cfg = read_hf(path)
        source = path
        tokenizer = Tokenizer.load(str(path)) if (path / "tokenizer.json").is_file() else Tokenizer()
    else:
        if path.is_dir():
            found = checkpoint.find_resume("latest", path) or checkpoint.find_resume("latest", path / "checkpoints")
            if found is None:
                raise CheckpointError(f"{path} holds no checkpoint (ckpt-*.pt, also not under checkpoints/) and is "
                                      f"not an exported folder; pass a checkpoint file or a run directory")
            path = found
        state = checkpoint.load(path)
        if "outer_optimizer" not in state or "config" not in state:
            raise CheckpointError(f"{path} holds no θ_global (a tensor/pipeline-parallel rank's checkpoint); pass a "
                                  f"single-process island's checkpoint")
        cfg = from_dict(state["config"]).model
        params, source = dict(state["outer_optimizer"]["master"]), path
        tokenizer = Tokenizer.from_json(state.get("tokenizer"), f"the tokenizer of {path}")
    model = build_model(cfg)
    _install(model, params, source)
    return model, model.cfg, source, tokenizer


@torch.no_grad()
def _install(model: Transformer, params: dict[str, torch.Tensor], source: Path) -> None:
    own = dict(model.named_parameters())
    missing = sorted(set(own) - set(params))
    if missing:
        raise CheckpointError(f"{source} lacks {len(missing)} parameter(s) of its model (e.g. {missing[0]})")
    for name, p in own.items():
        if params[name].shape != p.shape:
            raise CheckpointError(f"{source} has {name} of shape {tuple(params[name].shape)} but its config says "
                                  f"{tuple(p.shape)}")
        p.copy_(params[name])
