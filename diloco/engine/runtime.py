"""Where this process sits: the island's process group and mesh (torchtitan's ``ParallelDims``).

An island is the training process group of one server: ``dp * pp * tp`` processes under ``torchrun``,
or one process (``mesh=None``, ``group=None``, every collective below a no-op).  Several islands
may share one torchrun world (``--averaging.backend torch``/``auto``): island ``k`` is the ``k``-th
block of ``dp * pp * tp`` consecutive ranks.  Every decision the ranks of an island must take together
goes through the small control collectives here.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from diloco.config import Config
from diloco.errors import TrainingError
from pipeline import init_island_mesh
from pipeline.mesh import backend_for, gpu_of

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""glibc's ``mallopt`` parameters (malloc.h)."""


def return_freed_memory(threshold: int = 1 << 20) -> bool:
    """Have glibc serve every allocation of ``threshold`` bytes or more (a round's parts and averages, a
    checkpoint's copies) straight from the kernel and give it back when freed.  By default glibc raises that
    threshold to the largest block freed so far (up to 32 MB) and keeps such blocks in per-thread arenas, so an
    island of several transport threads would keep every round's peak of buffers.  False where it cannot
    (not glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def pick_device(spec: str, local_rank: int | None = None, gpus: int = 0) -> torch.device:
    """`auto` → CUDA if available, else CPU; `auto` and `cuda` take GPU ``local_rank`` (None: torchrun's
    ``LOCAL_RANK``), or ``local_rank mod gpus`` when the island's ranks take ``gpus`` GPUs in turn, always with an
    index (``torch.cuda.set_device`` refuses a CUDA device without one)."""
    if spec == "auto" and not torch.cuda.is_available():
        return torch.device("cpu")
    if spec in ("auto", "cuda"):
        rank = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
        return torch.device("cuda", gpu_of(rank, gpus))
    return torch.device(spec)


def use_device(device: torch.device) -> None:
    """Make ``device`` this process's CUDA device and let fp32 matrix products use TF32 tensor cores there
    (what torchtitan and prime do; a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


@dataclass
class Runtime:
    """Where this process sits: its island (``dp * pp * tp`` consecutive ranks of the torchrun world), its
    rank in it, the island's mesh and process groups.  A single process has no process group."""

    tp: int
    pp: int
    device: torch.device
    dp: int = 1
    world: int = 1
    global_rank: int = 0
    island_index: int = 0
    n_islands: int = 1
    mesh: Any = None
    """The island's ``("dp", "pp", "tp")`` DeviceMesh (None for one process)."""
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
        return self.dp * self.tp * self.pp

    @property
    def shape(self) -> str:
        """The island's split as the flags name it, e.g. ``dp=2 x pp=1 x tp=2``."""
        return f"dp={self.dp} x pp={self.pp} x tp={self.tp}"

    @property
    def rank(self) -> int:
        """This process's rank inside its island."""
        return self.global_rank - self.island_index * self.size

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel replica in its island (its outermost mesh coordinate)."""
        return self.rank // (self.pp * self.tp)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def lockstep(self) -> bool:
        """Islands of one torch world average in lockstep: they stop, resume and skip catch-up together."""
        return self.n_islands > 1

    def island_ranks(self) -> list[list[int]]:
        """Global ranks of every island of the world."""
        return [list(range(k * self.size, (k + 1) * self.size)) for k in range(self.n_islands)]

    @classmethod
    def start(cls, cfg: Config, device: torch.device) -> Runtime:
        """Join (or, without torchrun, skip) the process group and build the island's mesh.  Collective
        over the torchrun world; raises TrainingError with the command to use when the launch does not
        match ``--parallel.dp/tp/pp``."""
        dp, tp, pp = cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp
        size = cfg.parallel.processes
        a = cfg.averaging
        rt = cls(tp, pp, device, dp=dp)
        split = "--parallel.dp * --parallel.pp * --parallel.tp"
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            shown = torch.cuda.device_count()
            raise TrainingError(f"rank {os.environ.get('LOCAL_RANK', 0)} of this island takes GPU {device.index}, but "
                                f"this machine shows {shown}: pass --parallel.gpus {shown} to put several ranks "
                                f"on a GPU (gloo: to try the island's shape, not for speed), or run the island's "
                                f"{size} ranks on a server with {size} GPUs")
        use_device(device)
        # ranks wait in collectives while their island's owners run a hivemind round or a download
        rt.timeout_s = max(600.0, 2 * (a.matchmaking_timeout + a.allreduce_timeout + a.vote_timeout
                                       + a.state_download_timeout) + 120.0)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1 and not dist.is_initialized():
            if size > 1:
                raise TrainingError(f"an island with --parallel.dp {dp} --parallel.tp {tp} --parallel.pp {pp} is {size} "
                                    f"processes: launch it with torchrun --nproc-per-node {size} -m diloco.cli train ...")
            if a.backend == "torch":
                raise TrainingError("--averaging.backend torch averages islands launched as one torchrun world: "
                                    "torchrun --nproc-per-node ISLANDS*TP*PP -m diloco.cli train ...")
            return rt
        if world % size:
            raise TrainingError(f"the torchrun world has {world} processes, not a multiple of {split} = {size}; "
                                f"launch an island with torchrun --nproc-per-node {size}")
        n = world // size
        if n == 1 and a.backend == "torch":
            raise TrainingError(f"--averaging.backend torch averages the islands of one torchrun world, but this world "
                                f"of {world} processes is a single island of {split} = {size}; "
                                f"launch ISLANDS*{size} processes, or use --averaging.backend hivemind or auto")
        if n > 1 and a.backend not in ("torch", "auto"):
            raise TrainingError(f"the torchrun world has {world} processes but an island is {split} = {size}: "
                                f"launch each island as its own torchrun job with "
                                f"--nproc-per-node {size}, or pass --averaging.backend torch (or auto) to run {n} "
                                f"islands in one world")
        if not dist.is_initialized():
            dist.init_process_group(backend_for(device.type, cfg.parallel.shares_gpus),
                                    timeout=datetime.timedelta(seconds=rt.timeout_s))
            rt.owns_process_group = True
        rt.world, rt.global_rank = dist.get_world_size(), dist.get_rank()
        rt.n_islands, rt.island_index = n, rt.global_rank // size
        if size > 1:
            if n == 1:
                rt.mesh = init_island_mesh(tp, pp, device.type, rt.timeout_s, dp=dp, gpus=cfg.parallel.gpus)
            else:
                from pipeline.mesh import MESH_DIMS, timed_mesh

                rt.mesh = timed_mesh(device.type, (n, dp, pp, tp), ("island", *MESH_DIMS), rt.timeout_s)[MESH_DIMS]
        # the control groups are gloo on every device, so that a CPU run lays out its groups as a GPU run does (the
        # collective audit of the tests checks a CPU run against NCCL's rules)
        if n == 1:
            rt.group = dist.group.WORLD if size > 1 else None
            rt.ctrl = rt.new_group(backend="gloo") if size > 1 else None
            rt.world_ctrl = rt.ctrl
        else:
            for k, ranks in enumerate(rt.island_ranks()):  # every rank creates every group, in the same order
                group = rt.new_group(ranks) if size > 1 else None
                ctrl = rt.new_group(ranks, backend="gloo") if size > 1 else None
                if k == rt.island_index:
                    rt.group, rt.ctrl = group, ctrl
            rt.world_ctrl = rt.new_group(backend="gloo")
        return rt

    def new_group(self, ranks: list[int] | None = None, backend: str | None = None) -> dist.ProcessGroup:
        """Collective over the world: a process group of ``ranks`` (None: all) with the run's timeout (torch would
        give it its backend's default, 10 minutes on NCCL, whatever the default group's)."""
        return dist.new_group(ranks, backend=backend, timeout=datetime.timedelta(seconds=self.timeout_s))

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

    def round_view(self) -> Runtime:
        """Collective: this runtime over process groups of its own (the same ranks; gloo: a round's tensors are on
        the host), for a round thread whose collectives must never interleave with the training thread's.
        A single process, or islands of one torch world (their rounds are world collectives on the training
        thread), share this runtime."""
        if self.size == 1 or self.lockstep:
            return self
        group = self.new_group(backend="gloo")
        return dataclasses.replace(self, group=group, ctrl=group, world_ctrl=group, owns_process_group=False)

    def close(self) -> None:
        """Destroy the process group if this runtime created it."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_process_group = False

    def island_config(self, cfg: Config) -> Config:
        """``cfg`` as this island sees it: with several islands in one world, island ``k`` reads data
        shard ``k`` and writes under ``<run_dir>/island<k>``; otherwise ``cfg`` itself."""
        if self.n_islands == 1:
            return cfg
        k = self.island_index
        a, ck = cfg.averaging, cfg.checkpoint
        return dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, shard_index=k, num_shards=self.n_islands),
            logging=dataclasses.replace(cfg.logging, run_dir=os.path.join(cfg.logging.run_dir, f"island{k}")),
            checkpoint=dataclasses.replace(ck, dir=os.path.join(ck.dir, f"island{k}") if ck.dir else ""),
            averaging=dataclasses.replace(a, maddr_file=f"{a.maddr_file}.island{k}" if a.maddr_file else ""))
