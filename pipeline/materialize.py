"""Modules built on the meta device (their structure, no memory) made real on a device, after they were split
over the island, so that no rank ever holds more of the model than its own part (torchtitan's way)."""

from __future__ import annotations

import itertools

import torch
from torch import nn


def is_skeleton(module: nn.Module) -> bool:
    """Whether any of ``module``'s parameters lives on the meta device."""
    return any(p.is_meta for p in module.parameters())


def materialize(module: nn.Module, device: torch.device | str) -> nn.Module:
    """Move ``module`` to ``device``; a skeleton's meta parameters and buffers are allocated there uninitialised
    (``to_empty``, sharded as they already are), while the buffers that were real (computed tables such as the
    rotary embeddings) keep their values.  Returns ``module``."""
    if not any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
        return module.to(device)
    real = {name: b for name, b in module.named_buffers() if not b.is_meta}
    module.to_empty(device=device)
    for name, b in real.items():
        owner, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner), attr, b.to(device))
    return module
