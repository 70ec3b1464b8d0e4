"""Per-rank state of an island and its checkpoints.

Each rank writes its own shards (model, inner optimizer, θ_global and outer momentum) with the data
position, RNG states and counters to ``<checkpoint dir>/ckpt-NNNNNN.pt`` (one process) or
``<checkpoint dir>/rank<r>/ckpt-NNNNNN.pt``; on resume the ranks agree on the newest outer step every
rank has, and refuse a checkpoint of another island shape or config.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from diloco.model import checkpoint
from diloco.model.checkpoint import CheckpointError
from diloco.config import config_fingerprint, to_dict
from diloco.config.loader import from_dict
from diloco.errors import TrainingError
from outer_optim import checksum
from peers.layout import spec_tuple
from pipeline import local_state, restore_dtensor_state

if TYPE_CHECKING:
    from diloco.engine.island import Island

log = logging.getLogger("diloco")


def _shape_of(island: Island) -> dict[str, Any]:
    rt = island.rt
    return {"tp": rt.tp, "pp": rt.pp, "rank": rt.rank,
            "specs": {n: list(spec_tuple(s)) for n, s in island.specs.items()}}


def state_dict(island: Island) -> dict[str, Any]:
    """Everything this rank needs to resume exactly, with the island shape it belongs to."""
    return {
        "config": to_dict(island.cfg), "outer_step": island.outer_step, "inner_step": island.inner_step,
        "model": {n: t.detach().cpu().clone() for n, t in island.params.items()},
        "inner_optimizer": local_state(island.inner_opt.state_dict()),
        "inner_scheduler": island.inner_sched.state_dict(),
        "outer_optimizer": island.outer.state_dict(), "data": island.batches.state_dict(),
        "rng": checkpoint.rng_state(), "stats": dict(island.stats.__dict__),
        "norm_history": list(island.guard.history), "island": _shape_of(island),
        "overlap": island.overlap.state_dict(),
        "error_feedback": {b: t.clone() for b, t in island.feedback.items()},
        "owner_feedback": {b: t.clone() for b, t in island.carry.items()},
    }


def load_state_dict(island: Island, state: dict[str, Any]) -> None:
    """Restore :func:`state_dict` (written by the same rank of an island of the same shape)."""
    saved = state.get("island") or {"tp": 1, "pp": 1, "rank": 0, "specs": None}
    mine = _shape_of(island)
    if (saved["tp"], saved["pp"], saved["rank"]) != (mine["tp"], mine["pp"], mine["rank"]) or \
            (saved.get("specs") is not None and saved["specs"] != mine["specs"]):
        raise TrainingError(f"the checkpoint was written by rank {saved['rank']} of a tp={saved['tp']} x "
                            f"pp={saved['pp']} island; resume with the same --parallel.* settings")
    with torch.no_grad():
        for n, t in state["model"].items():
            island.params[n].copy_(t)
    island.inner_opt.load_state_dict(state["inner_optimizer"])
    restore_dtensor_state(island.inner_opt)
    island.inner_sched.load_state_dict(state["inner_scheduler"])
    island.outer.load_state_dict(state["outer_optimizer"])
    island.batches.load_state_dict(state["data"])
    checkpoint.set_rng_state(state["rng"])
    island.outer_step, island.inner_step = int(state["outer_step"]), int(state["inner_step"])
    for k, v in state["stats"].items():
        setattr(island.stats, k, v)
    island.guard.history = [float(x) for x in state.get("norm_history", [])]
    island.overlap.load_state_dict(state.get("overlap"), int(state.get("tokens_at_sync", island.stats.tokens)))
    for kept, key in ((island.feedback, "error_feedback"), (island.carry, "owner_feedback")):
        kept.clear()
        kept.update({int(b): t.clone() for b, t in state.get(key, {}).items()})


def save_checkpoint(island: Island) -> Path:
    """Write this rank's checkpoint of the current outer step (keeping ``checkpoint.keep``)."""
    path = checkpoint.save(state_dict(island), checkpoint.checkpoint_path(island.ckpt_dir, island.outer_step),
                           keep=island.cfg.checkpoint.keep)
    log.info("checkpoint written: %s", path)
    return path


def maybe_resume(island: Island) -> None:
    """With ``--checkpoint.resume``: every rank loads its own checkpoint of the same outer step (the
    newest all ranks have); any rank's problem stops every rank with the same message."""
    spec, rt = island.cfg.checkpoint.resume, island.rt
    if not spec:
        aside = checkpoint.set_aside(island.ckpt_dir)
        if aside is not None:
            log.warning("%s held an earlier run's checkpoints: moved them to %s (pass --resume to continue that run "
                        "instead)", island.ckpt_dir, aside)
        return
    world = rt.lockstep
    path, error = None, ""
    try:
        mine = spec if spec == "latest" or rt.rank == 0 else str(island.ckpt_dir / Path(spec).name)
        path = checkpoint.find_resume(mine, island.ckpt_dir)
    except CheckpointError as e:
        error = str(e)
    rt.raise_if_any(error, CheckpointError, world=world)
    steps = rt.gather_all(_step_of(path) if path is not None else None, world=world)
    if all(s is None for s in steps):
        log.warning("--resume: no checkpoint in %s; starting fresh", island.ckpt_dir)
        return
    if any(s is None for s in steps):
        missing = [r for r, s in enumerate(steps) if s is None]
        rt.raise_if_any(f"rank(s) {missing} have no checkpoint to resume from while others do; resume every "
                        f"rank from the same run (checkpoints live in <checkpoint dir>/rank<r>/)",
                        CheckpointError, world=world)
    step = min(s for s in steps if s is not None)
    state, error = None, ""
    try:
        if _step_of(path) != step:
            path = checkpoint.checkpoint_path(island.ckpt_dir, step)
        state = checkpoint.load(path)
        saved = state.get("config", {})
        if saved and config_fingerprint(from_dict(saved)) != island.fingerprint:
            error = (f"checkpoint {path} was written with a different model or outer-optimizer config; resume "
                     f"with the same --model.* and --diloco.outer_* settings")
    except CheckpointError as e:
        error = str(e)
    rt.raise_if_any(error, CheckpointError, world=world)
    try:
        load_state_dict(island, state)
    except TrainingError as e:
        error = str(e)
    rt.raise_if_any(error, TrainingError, world=world)
    log.info("resumed from %s at outer step %d", path, island.outer_step)


def theta_global(island: Island) -> tuple[dict[str, torch.Tensor] | None, str]:
    """Collective: the whole θ_global assembled on rank 0 from the ranks' shards (None on the other
    ranks) and its checksum (on every rank), comparable between islands of any shape."""
    rt = island.rt
    mine = {n: (spec_tuple(island.specs[n]), t.detach().cpu()) for n, t in island.outer.master.items()}
    parts = rt.gather_to_main(mine)
    if parts is None:
        return None, rt.bcast(None)
    full = {n: torch.full(shape, float("nan")) for n, shape in island.full_shapes}
    for part in parts:
        for n, ((dim, offset, length), t) in part.items():
            if full[n].dim() == 0:
                full[n].copy_(t.reshape(()))
            else:
                full[n].narrow(dim, offset, length).copy_(t)
    return full, rt.bcast(checksum(full))


def _step_of(path: Path | None) -> int | None:
    if path is None:
        return None
    m = checkpoint.NAME_RE.match(Path(path).name)
    return int(m[1]) if m else -1
