"""An island rank's checkpoints: saving (at once or in the background), finding, verifying, loading and
resharding, given the parts it saves.

Checkpoints are per rank: each rank writes the state of its parts (its shards of the model, the inner optimizer,
θ_global and outer momentum, the data position, RNG states, counters, ...) to ``<checkpoint dir>/ckpt-NNNNNN.pt``
(one process) or ``<checkpoint dir>/rank<r>/ckpt-NNNNNN.pt``.  On resume the ranks agree on the newest outer step
every rank has, refuse a checkpoint of another config, and reshard one written by an island of another (dp, pp,
tp) shape: each rank reads the old ranks' files one after the other and copies the parts of its own pieces they
hold (:class:`Resharding`).  The files themselves (atomic, sha256-checked) are :mod:`diloco.model.checkpoint`.

As torchtitan's ``CheckpointManager``, :class:`CheckpointManager` never sees the island: it is handed
``{name: part}``, every part :class:`Stateful` (``state_dict``/``load_state_dict``), and keeps each part's state
under its name; a new stateful part is one more entry.  Parts that are not the project's own get a small adapter
here (:class:`ModelShards`, :class:`InnerOptimizer`, :class:`RngState`, :class:`CodecResiduals`).  Checkpoints
written before the parts had names of their own are read too (:func:`upgrade`).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from diloco.config import config_fingerprint
from diloco.config.loader import from_dict
from diloco.data.tokenizer import Tokenizer
from diloco.engine.metrics import RunStats
from diloco.engine.runtime import Runtime
from diloco.errors import TrainingError
from diloco.model import checkpoint
from diloco.model.checkpoint import CheckpointError
from outer_optim import OuterOptimizer
from peers import CanonicalLayout, FeedbackBuffers, spec_tuple
from pipeline import ShardSpec, copy_overlap, local_state, restore_dtensor_state

log = logging.getLogger("diloco")


class Stateful(Protocol):
    """A part of an island rank that a checkpoint holds (torchtitan's ``Stateful``).  A part whose class sets
    ``per_rank = True`` holds state that only the rank that wrote it can use: it starts empty when a checkpoint is
    resharded."""

    def state_dict(self) -> dict[str, Any]:
        """The part's state (copies: a checkpoint written in the background must not see later changes)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""


class ModelShards:
    """This rank's local shards of the model's parameters (sharing storage with the model)."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self.params = params

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().cpu().clone() for n, t in self.params.items()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for n, t in state.items():
            self.params[n].copy_(t)


class InnerOptimizer:
    """The inner optimizer's state: this rank's local pieces of it (DTensors' local shards)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return _copies(local_state(self.optimizer.state_dict()))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
        restore_dtensor_state(self.optimizer)


class RngState:
    """Python's, numpy's and torch's random number generators of this process."""

    def state_dict(self) -> dict[str, Any]:
        return checkpoint.rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        checkpoint.set_rng_state(state)


class CodecResiduals:
    """What a lossy codec left unsent of this rank's buckets (:class:`peers.FeedbackBuffers`: its own
    pseudo-gradient's error feedback and, as an owner of buckets, the re-encoding's), by canonical bucket.  Kept per
    rank: an island of another shape owns other buckets, so a resharded checkpoint starts without it."""

    per_rank: ClassVar[bool] = True

    def __init__(self, unsent: FeedbackBuffers):
        self.unsent = unsent

    def state_dict(self) -> dict[str, dict[int, torch.Tensor]]:
        return {"feedback": {b: t.clone() for b, t in self.unsent.feedback.items()},
                "carry": {b: t.clone() for b, t in self.unsent.carry.items()}}

    def load_state_dict(self, state: dict[str, dict[int, torch.Tensor]]) -> None:
        for kept, key in ((self.unsent.feedback, "feedback"), (self.unsent.carry, "carry")):
            kept.clear()
            kept.update({int(b): t.clone() for b, t in state.get(key, {}).items()})


def upgrade(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint written before the parts had names of their own (diloco up to 9ecef41: ``norm_history``,
    ``overlap`` and the codec's ``error_feedback``/``owner_feedback`` at its top level), or before the peer node
    kept state, as the parts read it now; later checkpoints as they are.  The other parts kept their names and their
    states."""
    up = dict(state)
    # before rounds formed from the registry a checkpoint kept no committed roster: the run's next round tells it
    up.setdefault("peers", {"committed": [], "strikes": {}})
    if "norm_guard" in state:
        return up
    up["norm_guard"] = {"history": list(state.get("norm_history", []))}
    # before fragments the schedule kept one counter, outside ``overlap``
    up["schedule"] = state.get("overlap") or \
        {"tokens_at_sync": int(state.get("tokens_at_sync", state.get("stats", {}).get("tokens", 0)))}
    up["codec_residuals"] = {"feedback": state.get("error_feedback", {}), "carry": state.get("owner_feedback", {})}
    return up


class Resharding:
    """How this rank's pieces sit in the whole model (its island's shape, the specs of its shards), and reading them
    from the files of an island of another shape: the parts named in :attr:`PARTS` are sharded over the island's
    ranks and filled from every old rank's file; ``grad_accum``: this island's, to warn when a resharded island's
    batch changes."""

    PARTS: ClassVar[tuple[str, ...]] = ("model", "inner_optimizer", "outer_optimizer")
    """The names of the sharded parts, which :meth:`load` fills."""

    def __init__(self, rt: Runtime, params: dict[str, torch.Tensor], specs: dict[str, ShardSpec],
                 layout: CanonicalLayout, named_parameters: list[tuple[str, torch.nn.Parameter]],
                 inner_opt: torch.optim.Optimizer, outer: OuterOptimizer, grad_accum: int):
        self.rt, self.params, self.specs, self.layout = rt, params, specs, layout
        self.named_parameters, self.inner_opt, self.outer, self.grad_accum = named_parameters, inner_opt, outer, grad_accum

    def shape(self) -> dict[str, Any]:
        """The island shape and this rank's place in it, as a checkpoint records it."""
        rt = self.rt
        return {"dp": rt.dp, "tp": rt.tp, "pp": rt.pp, "rank": rt.rank,
                "specs": {n: list(spec_tuple(s)) for n, s in self.specs.items()}}

    def header(self) -> dict[str, Any]:
        """What every checkpoint carries for resharding: the shape, and the inner optimizer's parameter names."""
        return {"island": self.shape(), "inner_param_names": self._inner_param_names()}

    def _inner_param_names(self) -> list[str]:
        """The parameter names in the inner optimizer's order (its state is keyed by position)."""
        names = {id(p): n for n, p in self.named_parameters}
        return [names[id(p)] for group in self.inner_opt.param_groups for p in group["params"]]

    def written_by_me(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` was written by this rank of an island of this shape (else it is resharded)."""
        saved, mine = _island_record(state), self.shape()
        return all(saved.get(k, 1) == mine[k] for k in ("dp", "tp", "pp", "rank")) and \
            saved.get("specs") in (None, mine["specs"])

    @torch.no_grad()
    def load(self, first: dict[str, Any], path: Path) -> None:
        """Fill this rank's pieces of the model, the inner optimizer's state (AdamW's moments, Muon's momentum),
        θ_global and the outer momentum from the files every rank of an island of another shape wrote at the step
        of ``path`` (read one after the other: at most one old rank's state in memory beside this rank's own)."""
        saved = _island_record(first)
        size = saved["dp"] * saved["tp"] * saved["pp"]
        if "inner_param_names" not in first:
            raise TrainingError(f"checkpoint {path} was written by a {saved['shape']} island before checkpoints could "
                                f"be resharded; resume it with the same --parallel.* settings")
        base = path.parent.parent if size > 1 else path.parent
        paths = [base / f"rank{r}" / path.name for r in range(size)] if size > 1 else [path]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise CheckpointError(f"resharding the checkpoint of a {saved['shape']} island needs every rank's file, "
                                  f"but {', '.join(missing)} is missing; restore it or resume with the same shape")
        moments: dict[str, dict[str, torch.Tensor]] = {n: {} for n in self.params}  # AdamW's or Muon's, per key
        momentum = dict(zip(self.outer.names, self.outer.momentum_buffers())) if self.outer.mu else {}
        copied: dict[str, int] = {n: 0 for n in self.params}
        seen: set[tuple[str, tuple[int, ...]]] = set()
        step = None
        for p in paths:
            state = first if p == path else checkpoint.load(p)
            specs = _island_record(state)["specs"] or {n: self.layout.full_spec(n) for n in state["model"]}
            inner = state["inner_optimizer"]["state"]
            inner_index = {n: i for i, n in enumerate(state["inner_param_names"])}
            old_momentum = dict(zip(state["outer_optimizer"]["master"], state["outer_optimizer"]["momentum"]))
            for n, piece in state["model"].items():
                if n not in self.params or (n, tuple(specs[n])) in seen:
                    continue  # another rank's copy of a replicated piece was read already
                seen.add((n, tuple(specs[n])))
                old, new = ShardSpec(self.layout.entry(n).shape, *specs[n], False), self.specs[n]
                pairs = [(self.params[n], piece), (self.outer.theta_global[n], state["outer_optimizer"]["master"][n])]
                if n in momentum:
                    pairs.append((momentum[n], old_momentum[n]))
                kept = inner.get(inner_index[n], {})
                for k, t in kept.items():
                    if k != "step" and torch.is_tensor(t) and t.numel() == math.prod(old.local_shape):
                        pairs.append((moments[n].setdefault(k, torch.zeros(self.params[n].shape)), t))
                step = kept.get("step", step)
                got = [copy_overlap(dst, new, src.reshape(old.local_shape), old) for dst, src in pairs]
                copied[n] += got[0]
        short = [n for n, c in copied.items() if c != self.params[n].numel()]
        if short:
            raise CheckpointError(f"the checkpoint of a {saved['shape']} island in {base} does not cover {short[0]}; "
                                  f"its rank files come from different runs")
        names = self._inner_param_names()
        own = self.inner_opt.state_dict()
        # the learning rate the schedule reached lives in the groups (LambdaLR sets it again only at its next step)
        own["param_groups"] = [{**old, "params": mine["params"]} for old, mine in
                               zip(first["inner_optimizer"]["param_groups"], own["param_groups"], strict=True)]
        if step is not None:
            own["state"] = {i: {"step": step.clone(), **moments[n]} for i, n in enumerate(names) if moments[n]}
        self.inner_opt.load_state_dict(own)
        restore_dtensor_state(self.inner_opt)
        self.outer.step_count = int(first["outer_optimizer"]["step_count"])
        was = saved["dp"] * int(first.get("config", {}).get("inner", {}).get("grad_accum", 1))
        now = self.rt.dp * self.grad_accum
        if was != now:
            log.warning("the island's batch changes from %d x --inner.batch_size to %d x on resume (dp x grad_accum): "
                        "pass --inner.grad_accum %s to keep the trajectory", was, now,
                        f"{was // self.rt.dp}" if was % self.rt.dp == 0 else "(none fits this dp)")
        log.info("resharded the checkpoint of a %s island onto a %s one", saved["shape"], self.rt.shape)


class CheckpointManager:
    """One island rank's checkpoints under ``base`` (its ranks' folders ``rank<r>/`` below it, or one process's
    files) of ``parts``, each :class:`Stateful` part's state kept under its name.  ``clock``: where the run stands
    (its outer step names each checkpoint); ``resharding``: how this rank's pieces sit in the island (a checkpoint
    of another shape fills the parts it names, see :class:`Resharding`); ``record``: what every checkpoint carries
    besides the state (the config as a dict, the tokenizer's JSON); ``fingerprint``: the config fingerprint a
    checkpoint must have to be resumed.  ``background``: write from a snapshot in a thread (the previous write is
    waited for first and its error raised at the next save)."""

    def __init__(self, base: Path, rt: Runtime, parts: dict[str, Stateful], *, clock: RunStats,
                 resharding: Resharding, record: dict[str, Any], fingerprint: str, keep: int, background: bool):
        self.base, self.rt, self.parts, self.clock, self.resharding = base, rt, parts, clock, resharding
        self.directory = base / f"rank{rt.rank}" if rt.size > 1 else base
        """This rank's folder."""
        self.record, self.fingerprint, self.keep = record, fingerprint, keep
        self.writer = checkpoint.BackgroundWriter() if background else None

    # ------------------------------------------------------------------------------------------ save
    def save(self) -> Path:
        """Write this rank's checkpoint of the current outer step (keeping ``keep``)."""
        path = checkpoint.checkpoint_path(self.directory, self.clock.outer_step)
        if self.writer is None:
            checkpoint.save(self.state_dict(), path, keep=self.keep)
            log.info("checkpoint written: %s", path)
        else:
            self.writer.submit(self.state_dict(), path, self.keep, lambda p: log.info("checkpoint written: %s", p))
        return path

    def wait(self) -> None:
        """Wait until the checkpoint being written in the background is on disk (raises its error)."""
        if self.writer is not None:
            self.writer.wait()

    def state_dict(self) -> dict[str, Any]:
        """Everything this rank needs to resume exactly, with the island shape it belongs to."""
        return {**self.record, "outer_step": self.clock.outer_step, "inner_step": self.clock.inner_step,
                **self.resharding.header(), **{name: part.state_dict() for name, part in self.parts.items()}}

    # ------------------------------------------------------------------------------------------ load
    def load_state_dict(self, state: dict[str, Any], path: Path | None = None) -> None:
        """Restore :meth:`state_dict`: written by this rank of an island of the same shape, or else (with the
        ``path`` it was read from, beside the other old ranks' files) resharded from all of them."""
        state = upgrade(state)
        mine = self.resharding.written_by_me(state)
        if not mine:
            if path is None:
                raise TrainingError("a checkpoint of another island shape needs the path it was read from")
            self.resharding.load(state, path)
        for name, part in self.parts.items():
            if mine:
                part.load_state_dict(state[name])
            elif name in Resharding.PARTS:
                continue  # filled from every old rank's file above
            elif getattr(part, "per_rank", False):
                part.load_state_dict({})
                if any(state.get(name, {}).values()):
                    log.warning("the checkpoint's %s start empty: they were kept per rank of a %s island",
                                name.replace("_", " "), _island_record(state)["shape"])
            else:
                part.load_state_dict(state[name])

    # ---------------------------------------------------------------------------------------- resume
    def _find(self, spec: str) -> Path | None:
        """This rank's checkpoint for ``--checkpoint.resume spec``: its own file, or else one an island of another
        shape wrote in the same checkpoint directory (rank 0's, or the single process's), to be resharded."""
        if spec != "latest":
            own = self.directory / Path(spec).name
            return checkpoint.find_resume(str(own) if self.rt.rank and own.is_file() else spec, self.directory)
        for directory in dict.fromkeys((self.directory, self.base / "rank0", self.base)):
            path = checkpoint.find_resume(spec, directory)
            if path is not None:
                return path
        return None

    def set_aside_earlier_run(self) -> None:
        """A fresh run: move every rank folder's checkpoints aside, whatever shape the earlier run had (a later
        ``--resume`` would reshard from them).  Rank 0 moves them all; the other ranks write nothing before
        rank 0 joins their first round."""
        if self.rt.rank != 0:
            return
        for directory in dict.fromkeys((self.base, *sorted(self.base.glob("rank*")))):
            aside = checkpoint.set_aside(directory)
            if aside is not None:
                log.warning("%s held an earlier run's checkpoints: moved them to %s (pass --resume to continue "
                            "that run instead)", directory, aside)

    def resume(self, spec: str) -> None:
        """Collective (over the world when islands average in lockstep): every rank loads its own checkpoint of
        ``--checkpoint.resume spec`` at the same outer step (the newest all ranks have), resharded when an island
        of another shape wrote it; any rank's problem stops every rank with the same message."""
        rt = self.rt
        world = rt.lockstep
        path, error = None, ""
        try:
            path = self._find(spec)
        except CheckpointError as e:
            error = str(e)
        rt.raise_if_any(error, CheckpointError, world=world)
        steps = rt.gather_all(_step_of(path) if path is not None else None, world=world)
        if all(s is None for s in steps):
            log.warning("--resume: no checkpoint in %s; starting fresh", self.directory)
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
                path = checkpoint.checkpoint_path(path.parent, step)
            state = checkpoint.load(path)
            saved = state.get("config", {})
            tokenizer = Tokenizer.from_json(state.get("tokenizer"))
            if saved and config_fingerprint(from_dict(saved), "" if tokenizer.is_bytes else tokenizer.sha256) \
                    != self.fingerprint:
                error = (f"checkpoint {path} was written with a different model, tokenizer or outer-optimizer config; "
                         f"resume with the same --model.*, --data.tokenizer and --diloco.outer_* settings")
        except CheckpointError as e:
            error = str(e)
        rt.raise_if_any(error, CheckpointError, world=world)
        try:
            self.load_state_dict(state, path)
        except (TrainingError, CheckpointError) as e:
            error = str(e)
        rt.raise_if_any(error, TrainingError, world=world)
        log.info("resumed from %s at outer step %d", path, self.clock.outer_step)


def _island_record(state: dict[str, Any]) -> dict[str, Any]:
    """The island shape a checkpoint was written by (older checkpoints: one process, or no ``dp``), with
    ``shape`` as the flags name it."""
    saved = {"dp": 1, "tp": 1, "pp": 1, "rank": 0, "specs": None, **(state.get("island") or {})}
    saved["shape"] = f"dp={saved['dp']} x pp={saved['pp']} x tp={saved['tp']}"
    return saved


def _copies(obj: Any) -> Any:
    """``obj`` with every tensor copied (a snapshot the training thread may go on changing the original of)."""
    if torch.is_tensor(obj):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _copies(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copies(v) for v in obj]
    return obj


def _step_of(path: Path | None) -> int | None:
    if path is None:
        return None
    m = checkpoint.NAME_RE.match(Path(path).name)
    return int(m[1]) if m else -1
