"""Islands of tp x pp processes: the rank-aware parts of the trainer.

An island may be one process (``--parallel.tp 1 --parallel.pp 1``) or a ``torchrun`` job of
``tp * pp`` processes that split the model with :mod:`pipeline` (DTensor tensor parallelism inside,
pipeline stages outside).  :class:`ParallelIsland` is the trainer's :class:`~diloco.trainer.Island`
with the parts that depend on the rank:

- :class:`IslandRuntime`: the process group and ``("pp", "tp")`` mesh from torchrun's environment,
  and the small control collectives the ranks use to take every decision together;
- the model is the pipeline :class:`pipeline.Island`; the outer optimizer holds θ_global of this
  rank's *local shards* only (they share storage with the parameters, DTensor or not);
- averaging is shard-wise (:class:`peers.sharded.ShardedAverager`): every rank owns some buckets of
  the canonical layout and averages them with the other islands' owners over its own hivemind DHT;
  ``--averaging.backend torch``/``auto`` add the torch.distributed all-reduce among islands launched
  as one torchrun world (:class:`peers.fallback.HierarchicalAllReduce`);
- every rank registers its peer id in the run's member registry under its island's id (rank 0's
  peer id), so private runs accept all of them and islands are counted once;
- joining islands download θ_global and the outer momentum bucket by bucket: each owner serves a
  snapshot of its buckets (refreshed after every committed round) and downloads them from a peer;
- checkpoints: each rank writes its own shards to ``<checkpoint dir>/rank<r>/ckpt-NNNNNN.pt``
  (model shards, inner optimizer, θ_global shards and momentum, data position, RNG); on resume the
  ranks agree on the newest step every rank has;
- rank 0 alone writes metrics, ``summary.json``, the island's multiaddrs and ``theta_global.pt``
  (the whole θ_global, gathered from the ranks) and prints.

Several islands in one torchrun world (``--averaging.backend torch`` or ``auto``) are islands of
``tp * pp`` consecutive ranks: island ``k`` reads data shard ``k`` of ``WORLD_SIZE / (tp * pp)`` and
logs to ``<run_dir>/island<k>``.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from diloco import checkpoint
from diloco.checkpoint import CheckpointError
from diloco.config import Config
from diloco.model import build_model
from diloco.trainer import Island, TrainingError, _config_from, announce_join, averager_settings, \
    check_same_averaging, config_fingerprint, pick_device, resolve_run_key
from peers.averager import fingerprint, fingerprints_agree
from peers.dht import NetworkSettings, PeerNetworkError, start_dht, visible_maddrs
from peers.layout import CanonicalLayout, spec_tuple
from peers.local import LocalAverager
from peers.membership import Membership, new_run_key, wait_until
from peers.sharded import IslandExchange, ShardedAverager
from pipeline import Island as ModelIsland
from pipeline import IslandSettings, cross_entropy_loss, init_island_mesh

log = logging.getLogger("diloco")

CHUNKS_PER_BUCKET = 4
"""Fingerprint chunks per bucket of the canonical θ_global fingerprint (12 floats per bucket)."""


# ------------------------------------------------------------------------------------------ runtime
@dataclass
class IslandRuntime:
    """Where this process sits: its island (``tp * pp`` consecutive ranks of the torchrun world), its
    rank in it, the island's mesh and process groups.  A single process has no process group."""

    tp: int
    pp: int
    device: torch.device
    world: int = 1
    global_rank: int = 0
    island_index: int = 0
    n_islands: int = 1
    mesh: Any = None
    """The island's ``("pp", "tp")`` DeviceMesh (None for one process)."""
    group: Any = None
    """The island's process group (``dist.group.WORLD`` when the world is the island; None for one process)."""
    ctrl: Any = None
    """Process group for the island's small control collectives (gloo, also on GPUs)."""
    world_ctrl: Any = None
    """Control group of the whole world, when it holds several islands."""
    owns_process_group: bool = False
    timeout_s: float = 600.0

    @property
    def size(self) -> int:
        return self.tp * self.pp

    @property
    def rank(self) -> int:
        """This process's rank inside its island."""
        return self.global_rank - self.island_index * self.size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def island_ranks(self) -> list[list[int]]:
        """Global ranks of every island of the world."""
        return [list(range(k * self.size, (k + 1) * self.size)) for k in range(self.n_islands)]

    @classmethod
    def start(cls, cfg: Config, device: torch.device) -> IslandRuntime:
        """Join (or, without torchrun, skip) the process group and build the island's mesh.  Collective
        over the torchrun world; raises TrainingError with the command to use when the launch does not
        match ``--parallel.tp/pp``."""
        tp, pp = cfg.parallel.tp, cfg.parallel.pp
        size = tp * pp
        a = cfg.averaging
        rt = cls(tp, pp, device)
        # ranks wait in collectives while their island's owners run a hivemind round or a download
        rt.timeout_s = max(600.0, 2 * (a.matchmaking_timeout + a.allreduce_timeout + a.vote_timeout
                                       + a.state_download_timeout) + 120.0)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1 and not dist.is_initialized():
            if size > 1:
                raise TrainingError(f"an island with --parallel.tp {tp} --parallel.pp {pp} is {size} processes: launch "
                                    f"it with torchrun --nproc-per-node {size} -m diloco.cli train ...")
            if a.backend == "torch":
                raise TrainingError("--averaging.backend torch averages islands launched as one torchrun world: "
                                    "torchrun --nproc-per-node ISLANDS*TP*PP -m diloco.cli train ...")
            return rt
        if world % size:
            raise TrainingError(f"the torchrun world has {world} processes, not a multiple of --parallel.tp * "
                                f"--parallel.pp = {size}; launch an island with torchrun --nproc-per-node {size}")
        n = world // size
        if n == 1 and a.backend == "torch":
            raise TrainingError(f"--averaging.backend torch averages the islands of one torchrun world, but this world "
                                f"of {world} processes is a single island of --parallel.tp * --parallel.pp = {size}; "
                                f"launch ISLANDS*{size} processes, or use --averaging.backend hivemind or auto")
        if n > 1 and a.backend not in ("torch", "auto"):
            raise TrainingError(f"the torchrun world has {world} processes but an island is --parallel.tp * "
                                f"--parallel.pp = {size}: launch each island as its own torchrun job with "
                                f"--nproc-per-node {size}, or pass --averaging.backend torch (or auto) to run {n} "
                                f"islands in one world")
        if not dist.is_initialized():
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                    timeout=datetime.timedelta(seconds=rt.timeout_s))
            rt.owns_process_group = True
        rt.world, rt.global_rank = dist.get_world_size(), dist.get_rank()
        rt.n_islands, rt.island_index = n, rt.global_rank // size
        if size > 1:
            if n == 1:
                rt.mesh = init_island_mesh(tp, pp, device.type, rt.timeout_s)
            else:
                from torch.distributed.device_mesh import init_device_mesh

                rt.mesh = init_device_mesh(device.type, (n, pp, tp), mesh_dim_names=("island", "pp", "tp"))["pp", "tp"]
        gloo_ctrl = device.type == "cuda"
        if n == 1:
            rt.group = dist.group.WORLD if size > 1 else None
            rt.ctrl = (dist.new_group(backend="gloo") if gloo_ctrl else rt.group) if size > 1 else None
            rt.world_ctrl = rt.ctrl
        else:
            for k, ranks in enumerate(rt.island_ranks()):  # every rank creates every group, in the same order
                group = dist.new_group(ranks) if size > 1 else None
                ctrl = dist.new_group(ranks, backend="gloo") if size > 1 and gloo_ctrl else group
                if k == rt.island_index:
                    rt.group, rt.ctrl = group, ctrl
            rt.world_ctrl = dist.new_group(backend="gloo") if gloo_ctrl else dist.group.WORLD
        return rt

    # ---------------------------------------------------------------------- control collectives
    def gather_all(self, obj: Any, world: bool = False) -> list[Any]:
        """``obj`` of every rank of the island (or of the world), in rank order."""
        group = self.world_ctrl if world else self.ctrl
        n = self.world if world else self.size
        if n == 1 or group is None:
            return [obj]
        out: list[Any] = [None] * n
        dist.all_gather_object(out, obj, group=group)
        return out

    def bcast(self, obj: Any, world: bool = False) -> Any:
        """Rank 0's ``obj`` (of the island, or of the world) on every rank."""
        group = self.world_ctrl if world else self.ctrl
        n = self.world if world else self.size
        if n == 1 or group is None:
            return obj
        src = 0 if world else self.island_index * self.size
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    def gather_to_main(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on the island's rank 0 (None elsewhere)."""
        if self.size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.is_main else None
        dist.gather_object(obj, out, dst=self.island_index * self.size, group=self.ctrl)
        return out

    def reduce(self, values: list[float], op: str = "sum", world: bool = False) -> list[float]:
        """Element-wise sum or max of a few floats over the island (or the world)."""
        group = self.world_ctrl if world else self.ctrl
        n = self.world if world else self.size
        t = torch.tensor(values, dtype=torch.float64)
        if n > 1 and group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
        return t.tolist()

    def raise_if_any(self, error: str, exc: type[Exception] = TrainingError, world: bool = False) -> None:
        """Raise ``exc`` on every rank when any rank reports an error (so none is left waiting)."""
        errors = [e for e in self.gather_all(error, world=world) if e]
        if errors:
            raise exc(errors[0])

    def close(self) -> None:
        """Destroy the process group if this runtime created it."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_process_group = False


# ------------------------------------------------------------------------------------ the island
class ParallelIsland(Island):
    """An island of ``tp * pp`` processes (or one process averaging shard-wise); every rank builds and
    runs one, taking every decision together with the others (see the module doc)."""

    def __init__(self, cfg: Config):
        self.rt = IslandRuntime.start(cfg, pick_device(cfg.device))
        rt = self.rt
        if rt.n_islands > 1:  # several islands in one world: island k reads shard k and logs apart
            from diloco.config import from_dict, to_dict

            cfg = from_dict(to_dict(cfg))
            cfg.data.shard_index, cfg.data.num_shards = rt.island_index, rt.n_islands
            cfg.logging.run_dir = str(Path(cfg.logging.run_dir) / f"island{rt.island_index}")
            if cfg.checkpoint.dir:
                cfg.checkpoint.dir = str(Path(cfg.checkpoint.dir) / f"island{rt.island_index}")
            if cfg.averaging.maddr_file:
                cfg.averaging.maddr_file = f"{cfg.averaging.maddr_file}.island{rt.island_index}"
        if not rt.is_main:
            logging.getLogger("diloco").setLevel(logging.ERROR)  # rank 0 speaks for the island
        self.exchange: IslandExchange | None = None
        self.fallback = None
        self._served: dict[int, tuple[dict, list[torch.Tensor]]] = {}
        self._served_step = 0
        self._island_id = ""
        try:
            super().__init__(cfg)
            if rt.size > 1:
                self.ckpt_dir = self.ckpt_dir / f"rank{rt.rank}"
            self._contributes = self._contributed_names()
        except BaseException:
            rt.close()
            raise

    @property
    def is_main(self) -> bool:  # type: ignore[override]
        return self.rt.is_main

    @property
    def _lockstep_world(self) -> bool:
        """Islands of one torch world average in lockstep: they stop, resume and skip catch-up together."""
        return self.rt.n_islands > 1

    # ----------------------------------------------------------------------------------- model
    def _build_model(self):
        cfg = self.cfg
        full = build_model(cfg.model, seed=cfg.seed)
        if cfg.checkpoint.init_from:
            checkpoint.init_parameters(full, cfg.checkpoint.init_from)
        self.full_shapes = [(n, tuple(p.shape)) for n, p in full.named_parameters()]
        # the layout is built from the whole model on every rank, before the island splits it
        self.layout = CanonicalLayout.build(self.full_shapes, cfg.averaging.bucket_numel)
        self._layout_fingerprint = self.layout.fingerprint()
        self.island = ModelIsland(full, self.rt.mesh, IslandSettings.from_config(cfg.parallel),
                                  loss_fn=cross_entropy_loss, device=self.device)
        del full
        self.specs = self.island.shard_specs()
        params = self.island.local_named_parameters()  # local shards, sharing storage with the parameters
        return self.island, params, list(self.island.named_parameters())

    def _contributed_names(self) -> set[str]:
        """Parameters whose local shard this rank counts in island-wide norms: a shard held alike by
        several ranks (replicated under TP) counts on the lowest of them only."""
        mine = {n: ("full" if self.layout.is_full(n, s) else spec_tuple(s)) for n, s in self.specs.items()}
        seen: set[tuple] = set()
        out: set[str] = set()
        for r, held in enumerate(self.rt.gather_all(mine)):
            for name, key in held.items():
                if (name, key) not in seen:
                    seen.add((name, key))
                    if r == self.rt.rank:
                        out.add(name)
        return out

    def train_step(self) -> float:
        """One inner AdamW step over the island (with gradient accumulation); returns the mean loss."""
        accum = self.cfg.inner.grad_accum
        total = 0.0
        for _ in range(accum):
            x, y = self.batches.next_batch()
            with self.autocast:
                total += self.island.train_step(x, y, loss_scale=1.0 / accum) / accum
        if self.cfg.inner.grad_clip > 0:
            self.island.clip_grad_norm_(self.cfg.inner.grad_clip)
        self._optimizer_step(accum)
        return total

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean held-out loss over the fixed evaluation batches (the same on every rank)."""
        losses = []
        for x, y in self.eval_batches:
            with self.autocast:
                losses.append(self.island.eval_loss(x, y))
        return float(np.mean(losses))

    # ------------------------------------------------------------------------------ peers
    def connect(self) -> None:
        """Start every rank's DHT and averager (collective); rank 0 prints how others join."""
        a, rt = self.cfg.averaging, self.rt
        if a.backend == "local":
            self.exchange = IslandExchange(self.layout, self.params, self.specs, rt.group)
            self.averager = LocalAverager()
            return
        run_key = resolve_run_key(a, lambda: rt.bcast(new_run_key() if rt.global_rank == 0 else None, world=True))
        if a.backend != "torch":
            self.dht = self._start_dht("" if a.public else run_key)
        group = rt.group
        if a.backend in ("torch", "auto") and rt.n_islands > 1:
            from peers.fallback import HierarchicalAllReduce

            self.fallback = HierarchicalAllReduce(self.layout, self.params, self.specs, rt.island_ranks(),
                                                  min_group_size=a.min_group_size)
            group = self.fallback.island_group
        ids = rt.gather_all(str(self.dht.peer_id) if self.dht is not None else f"{a.run_id}-island{rt.island_index}")
        self._island_id = ids[0]
        settings = averager_settings(a, members_key=f"{a.run_id}.members")
        backend = a.backend if self.fallback is not None or a.backend == "hivemind" else "hivemind"
        self.averager = ShardedAverager(self.layout, self.params, self.specs, group, self.dht, settings,
                                        backend=backend, fallback=self.fallback,
                                        state_provider_for=self._state_provider, island_id=self._island_id)
        self.exchange = self.averager.exchange
        if self.dht is None:
            return
        self.membership = Membership(self.dht, a.run_id, ttl=a.member_ttl, island=self._island_id, rank=rt.rank,
                                     sharded=True)
        self.membership.start_heartbeat()
        self._refresh_served_state()
        self.averager.set_state_priority(self.outer_step)
        if rt.is_main:
            announce_join(self.name, self.dht, a, run_key)

    def _start_dht(self, run_key: str):
        """One DHT per rank (collective over the world): rank 0 joins the run's initial peers, the other
        ranks bootstrap from it (and from the initial peers).  Rank ``r`` of a server listens on the
        configured port + local rank (port 0 stays 0) and keeps its identity in ``<identity_path>.rank<r>``."""
        a, rt = self.cfg.averaging, self.rt
        local_rank = int(os.environ.get("LOCAL_RANK", rt.global_rank))

        identity = f"{a.identity_path}.rank{local_rank}" if a.identity_path and local_rank else a.identity_path

        def network(initial: list[str]) -> NetworkSettings:
            return NetworkSettings(
                initial_peers=initial, host_maddrs=[_shift_port(m, local_rank) for m in a.host_maddrs],
                announce_maddrs=[_shift_port(m, local_rank) for m in a.announce_maddrs], identity_path=identity,
                client_mode=a.client_mode, startup_timeout=a.startup_timeout, run_key=run_key)

        dht, error, boot = None, "", []
        if rt.global_rank == 0:
            try:
                dht = start_dht(network(list(a.initial_peers)))
                boot = visible_maddrs(dht)
            except PeerNetworkError as e:
                error = str(e)
        boot, error = rt.bcast((boot, error), world=True)
        if error:
            raise PeerNetworkError(error)
        if rt.global_rank != 0:
            try:
                dht = start_dht(network(list(boot) + [p for p in a.initial_peers if p not in boot]))
            except PeerNetworkError as e:
                error = f"rank {rt.global_rank}: {e}"
        try:
            rt.raise_if_any(error, PeerNetworkError, world=True)
        except PeerNetworkError:
            if dht is not None:
                dht.shutdown()
            raise
        return dht

    # ------------------------------------------------------------------ state served to joiners
    def _state_provider(self, bucket: int) -> Callable[[], tuple[dict, list[torch.Tensor]]]:
        def provide() -> tuple[dict, list[torch.Tensor]]:
            with self._state_lock:
                meta, tensors = self._served.get(bucket, ({}, []))
                if meta:  # failed rounds move the round number on without changing θ_global
                    meta = dict(meta, outer_step=self._served_step)
                return meta, tensors
        return provide

    def _refresh_served_state(self) -> None:
        """Collective: snapshot θ_global and the outer momentum of the buckets this rank owns, served
        to islands that join or resynchronize (after every committed round and adopted state)."""
        names = self.outer.names
        theta = self.exchange.gather(self.outer.master)
        momentum = self.exchange.gather(dict(zip(names, self.outer.momentum_buffers())))
        served = {}
        for b, values in theta.items():
            meta = {"outer_step": self.outer_step, "config_fingerprint": self.fingerprint,
                    "layout_fingerprint": self._layout_fingerprint, "bucket": b}
            served[b] = (meta, [values, momentum[b]])
        with self._state_lock:
            self._served, self._served_step = served, self.outer_step

    def global_state(self) -> tuple[dict, list[torch.Tensor]]:
        """This rank's θ_global shards, their outer momentum and the outer step."""
        return self._outer_snapshot(lambda: {"island_rank": self.rt.rank})

    def state_fingerprint(self) -> list[float]:
        """Collective: fingerprint of the whole θ_global in canonical bucket order, the same on every
        rank and on every island holding the same θ_global, whatever its shape."""
        return self.exchange.canonical_fingerprint(self.outer.master, CHUNKS_PER_BUCKET)

    def _main_decides(self, decide: Callable[[], Any]) -> Any:
        """Rank 0 evaluates ``decide`` (membership lookups, clocks); every rank gets its answer."""
        return self.rt.bcast(decide() if self.rt.is_main else None)

    def _can_download(self) -> bool:
        return self.membership is not None and isinstance(self.averager, ShardedAverager) \
            and not self._lockstep_world

    def join_from_peers(self) -> bool:
        """Before training: wait for the expected islands, then catch up with the run if it moved on."""
        a = self.cfg.averaging
        if self.membership is None:
            return False

        def look() -> tuple[str, bool]:
            if a.wait_for_islands > 1:
                ok = wait_until(lambda: self.membership.live_count() >= a.wait_for_islands, a.matchmaking_timeout)
                log.info("%d of %d expected islands registered%s", self.membership.live_count(), a.wait_for_islands,
                         "" if ok else " (gave up waiting)")
            if not a.initial_peers:
                return "", False
            others = self.membership.others()
            try:
                check_same_averaging(others, sharded=True)
            except TrainingError as e:
                return str(e), False
            return "", not all(m.outer_step <= self.outer_step and not m.averaging for m in others)

        error, behind = self._main_decides(look)
        if error:
            raise TrainingError(error)
        if not behind or not self._can_download():
            return False
        return self.catch_up(force_download=True)

    def adopt_state(self, meta: dict, tensors: list[torch.Tensor]) -> None:
        """Install this rank's shards of a downloaded state (collective) and serve it from now on."""
        super().adopt_state(meta, tensors)
        self._refresh_served_state()

    def _download_global_state(self, target: list[float] | None = None) -> tuple[dict, list[torch.Tensor]] | None:
        """Collective: every owner downloads its buckets' θ_global and momentum; when every bucket came
        at the same outer step (and matches ``target``, a canonical fingerprint, if given) return
        ``(meta, this rank's θ shards + momentum shards)`` on every rank, else None on every rank."""
        got: dict[int, list[torch.Tensor]] = {}
        verdict: dict[int, int] = {}
        foreign = ""
        for b, avg in self.averager.averagers.items():
            state = avg.download_state()
            step, why = self._check_bucket_state(b, state, target)
            verdict[b] = step
            foreign = foreign or why
            if step >= 0:
                got[b] = state[1]
        parts = self.rt.gather_all((verdict, foreign))
        merged: dict[int, int] = {}
        for part, why in parts:
            merged.update(part)
            foreign = foreign or why
        if foreign:
            raise TrainingError(foreign)
        steps = set(merged.values())
        if len(merged) != len(self.layout.buckets) or len(steps) != 1 or min(steps) < 0:
            return None
        theta = self.exchange.scatter({b: t[0] for b, t in got.items()})
        momentum = self.exchange.scatter({b: t[1] for b, t in got.items()})
        names = self.outer.names
        meta = {"outer_step": steps.pop(), "config_fingerprint": self.fingerprint}
        return meta, [theta[n] for n in names] + [momentum[n] for n in names]

    def _check_bucket_state(self, b: int, state: Any, target: list[float] | None) -> tuple[int, str]:
        """(outer step of a downloaded bucket state, or -1 if unusable; a reason to stop, if any)."""
        if state is None:
            return -1, ""
        meta, tensors = state
        if not isinstance(meta, dict) or not meta:
            return -1, ""
        if meta.get("config_fingerprint") != self.fingerprint:
            return -1, (f"the run you joined uses a different model or outer-optimizer config (fingerprint "
                        f"{meta.get('config_fingerprint')} vs ours {self.fingerprint}); use the same --model.*, --seed "
                        f"and --diloco.outer_* settings as the other islands")
        if meta.get("layout_fingerprint") != self._layout_fingerprint:
            return -1, ("the run you joined cuts the model into other buckets; use the same --averaging.bucket_numel "
                        "as the other islands")
        numel = self.layout.buckets[b].numel
        if len(tensors) != 2 or any(t.numel() != numel or not bool(torch.isfinite(t).all()) for t in tensors):
            return -1, ""
        if target is not None:
            mine = fingerprint([tensors[0].reshape(-1)], CHUNKS_PER_BUCKET)
            want = target[3 * CHUNKS_PER_BUCKET * b:3 * CHUNKS_PER_BUCKET * (b + 1)]
            if not fingerprints_agree(mine, want, 1e-5):
                return -1, ""
        return int(meta.get("outer_step", -1)), ""

    # -------------------------------------------------------------------------- round hooks
    def _average(self, delta: list[torch.Tensor], weight: float, meta: dict, rnd: int) -> tuple[Any, Any]:
        if isinstance(self.averager, LocalAverager):
            return self.averager.average(delta, weight, meta, str(rnd))
        names = self.outer.names
        result, averaged = self.averager.average(dict(zip(names, delta)), weight, meta, round_id=str(rnd),
                                                 on_stage=lambda phase: self.faults.at(phase, rnd))
        sent, received = self.rt.reduce([float(result.bytes_sent), float(result.bytes_received)])
        result.bytes_sent, result.bytes_received = int(sent), int(received)  # the island's slow-link traffic
        return result, ([averaged[n] for n in names] if averaged is not None else None)

    def _global_norm(self, tensors: list[torch.Tensor]) -> float:
        sq = sum(float(t.double().pow(2).sum()) for n, t in zip(self.outer.names, tensors) if n in self._contributes)
        return math.sqrt(self.rt.reduce([sq])[0])

    def _after_commit(self) -> None:
        if self.membership is not None:
            self._refresh_served_state()
        self.averager.set_state_priority(self.outer_step)

    def _after_rollback(self) -> None:
        with self._state_lock:
            self._served_step = self.outer_step
        super()._after_rollback()

    def _backend_used(self, result: Any) -> str:
        if isinstance(self.averager, LocalAverager):
            return "local"
        return getattr(result, "backend", "") or "none"

    def _stop_agreed(self) -> bool:
        # every rank of the island (of the world, when islands average in lockstep) stops at the same step
        self._stopping = self.rt.reduce([float(self._stop.is_set())], op="max", world=self._lockstep_world)[0] > 0
        return self._stopping

    def _theta_global(self) -> tuple[dict[str, torch.Tensor] | None, str]:
        """Collective: rank 0 assembles the whole θ_global from the ranks' shards."""
        mine = {n: (spec_tuple(self.specs[n]), t.detach().cpu()) for n, t in self.outer.master.items()}
        parts = self.rt.gather_to_main(mine)
        if parts is None:
            return None, self.rt.bcast(None)
        full = {n: torch.full(shape, float("nan")) for n, shape in self.full_shapes}
        for part in parts:
            for n, ((dim, offset, length), t) in part.items():
                if full[n].dim() == 0:
                    full[n].copy_(t.reshape(()))
                else:
                    full[n].narrow(dim, offset, length).copy_(t)
        h = hashlib.sha1()  # as OuterOptimizer.checksum, so islands of any shape compare
        for n, _ in self.full_shapes:
            h.update(full[n].to(torch.bfloat16).view(torch.int16).numpy().tobytes())
        return full, self.rt.bcast(h.hexdigest()[:16])

    # ---------------------------------------------------------------------------- checkpoints
    def _model_state(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().cpu().clone() for n, t in self.params.items()}

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the island's state (its shards), with the island shape it belongs to."""
        state = super().state_dict()
        state["inner_optimizer"] = _to_local(state["inner_optimizer"])
        state["island"] = {"tp": self.rt.tp, "pp": self.rt.pp, "rank": self.rt.rank,
                           "specs": {n: list(spec_tuple(s)) for n, s in self.specs.items()}}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (written by the same rank of an island of the same shape)."""
        saved = state.get("island") or {"tp": 1, "pp": 1, "rank": 0, "specs": None}
        mine = {n: list(spec_tuple(s)) for n, s in self.specs.items()}
        if (saved["tp"], saved["pp"], saved["rank"]) != (self.rt.tp, self.rt.pp, self.rt.rank) or \
                (saved.get("specs") is not None and saved["specs"] != mine):
            raise TrainingError(f"the checkpoint was written by rank {saved['rank']} of a tp={saved['tp']} x "
                                f"pp={saved['pp']} island; resume with the same --parallel.* settings")
        with torch.no_grad():
            for n, t in state["model"].items():
                self.params[n].copy_(t)
        self.inner_opt.load_state_dict(state["inner_optimizer"])
        _to_dtensor_state(self.inner_opt)
        self._load_training_state(state)

    def maybe_resume(self) -> None:
        """Every rank loads its own checkpoint of the same outer step (the newest all ranks have)."""
        spec, rt = self.cfg.checkpoint.resume, self.rt
        if not spec:
            return
        world = self._lockstep_world
        path, error = None, ""
        try:
            mine = spec if spec == "latest" or rt.rank == 0 else str(self.ckpt_dir / Path(spec).name)
            path = checkpoint.find_resume(mine, self.ckpt_dir)
        except CheckpointError as e:
            error = str(e)
        rt.raise_if_any(error, CheckpointError, world=world)
        steps = rt.gather_all(_step_of(path) if path is not None else None, world=world)
        if all(s is None for s in steps):
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
                path = checkpoint.checkpoint_path(self.ckpt_dir, step)
            state = checkpoint.load(path)
            saved = state.get("config", {})
            if saved and config_fingerprint(_config_from(saved)) != self.fingerprint:
                error = (f"checkpoint {path} was written with a different model or outer-optimizer config; resume "
                         f"with the same --model.* and --diloco.outer_* settings")
        except CheckpointError as e:
            error = str(e)
        rt.raise_if_any(error, CheckpointError, world=world)
        try:
            self.load_state_dict(state)
        except TrainingError as e:
            error = str(e)
        rt.raise_if_any(error, TrainingError, world=world)
        log.info("resumed from %s at outer step %d", path, self.outer_step)

    # ------------------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Leave the run, stop the averagers and the DHT, then the process group (idempotent)."""
        try:
            super().close()
        finally:
            self.fallback = None
            self.rt.close()


# ------------------------------------------------------------------------------------- helpers
def _shift_port(maddr: str, by: int) -> str:
    """``maddr`` with its TCP/UDP port moved up by ``by`` (port 0, "any free port", stays 0)."""
    if not by:
        return maddr
    return re.sub(r"/(tcp|udp)/(\d+)", lambda m: f"/{m[1]}/{int(m[2]) + by if int(m[2]) else 0}", maddr)


def _step_of(path: Path | None) -> int | None:
    if path is None:
        return None
    m = checkpoint.NAME_RE.match(Path(path).name)
    return int(m[1]) if m else -1


def _to_local(obj: Any) -> Any:
    """A state dict with every DTensor replaced by its local tensor (checkpoints load weights-only)."""
    if isinstance(obj, DTensor):
        return obj.to_local().detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_local(v) for v in obj]
    return obj


def _to_dtensor_state(optimizer: torch.optim.Optimizer) -> None:
    """After loading a :func:`_to_local` optimizer state: give DTensor parameters DTensor states again."""
    for p, st in optimizer.state.items():
        if not isinstance(p, DTensor):
            continue
        local_shape = tuple(p.to_local().shape)
        for k, v in list(st.items()):
            if torch.is_tensor(v) and not isinstance(v, DTensor) and k != "step" and tuple(v.shape) == local_shape:
                st[k] = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, run_check=False)


__all__ = ["ParallelIsland", "IslandRuntime", "CHUNKS_PER_BUCKET"]
