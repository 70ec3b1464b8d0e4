"""The 3-D device mesh of one island: data-parallel (FSDP) replicas outside, then pipeline stages, tensor
parallelism inside.

An island is one ``torchrun`` job (its world is the island).  Ranks are laid out row-major over
``("dp", "pp", "tp")`` so the TP group of a rank is ``tp`` consecutive ranks (NVLinked GPUs), the PP group
strides across them, and the DP group strides across whole pipelines.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipeline.settings import shares_gpus


def backend_for(device_type: str, shared_gpu: bool = False) -> str:
    """Process-group backend for a device type: NCCL on CUDA, gloo otherwise, and gloo on GPUs that several
    ranks share (``shared_gpu``: NCCL refuses two ranks on one GPU)."""
    return "nccl" if device_type == "cuda" and not shared_gpu else "gloo"


def gpu_of(local_rank: int, gpus: int = 0) -> int:
    """The GPU index of the rank ``local_rank`` of an island whose ranks take ``gpus`` GPUs in turn (0: one each)."""
    return local_rank % gpus if gpus > 0 else local_rank


def island_coords(rank: int, tp: int, pp: int) -> tuple[int, int]:
    """``(pp_rank, tp_rank)`` of a global rank in a ``(pp, tp)`` island (TP innermost)."""
    if not 0 <= rank < tp * pp:
        raise ValueError(f"rank {rank} is outside an island of tp*pp = {tp * pp} processes")
    return rank // tp, rank % tp


def island_ranks(tp: int, pp: int) -> list[list[int]]:
    """Global ranks as a ``pp x tp`` grid: row ``i`` is the TP group of pipeline stage ``i``."""
    return [[p * tp + t for t in range(tp)] for p in range(pp)]


MESH_DIMS = ("dp", "pp", "tp")
"""The island mesh's dimensions, outermost first."""


def init_island_mesh(tp: int, pp: int, device_type: str = "cpu", timeout_s: float = 600.0,
                     dp: int = 1, gpus: int = 0) -> DeviceMesh:
    """Initialise the default process group if needed (from torchrun's env vars) and return the
    ``("dp", "pp", "tp")`` mesh of this island, every group of it with the timeout ``timeout_s``.

    Uses gloo on CPU and NCCL on CUDA (setting this process's GPU from ``LOCAL_RANK``; with ``gpus`` fewer than
    the ranks, GPU ``LOCAL_RANK mod gpus`` and gloo).  Raises ValueError when the world size is not
    ``dp * pp * tp``.
    """
    if tp < 1 or pp < 1 or dp < 1:
        raise ValueError(f"--parallel.dp, --parallel.tp and --parallel.pp must be at least 1, got dp={dp}, "
                         f"tp={tp}, pp={pp}")
    if device_type == "cuda":
        torch.cuda.set_device(gpu_of(int(os.environ.get("LOCAL_RANK", "0")), gpus))
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device_type, shares_gpus(gpus, dp * pp * tp)),
                                timeout=datetime.timedelta(seconds=timeout_s))
    world, size = dist.get_world_size(), dp * pp * tp
    if world != size:
        raise ValueError(f"the island has {world} processes but --parallel.dp * --parallel.pp * --parallel.tp = "
                         f"{size}; launch it with torchrun --nproc-per-node {size}")
    return timed_mesh(device_type, (dp, pp, tp), MESH_DIMS, timeout_s)


def timed_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...], timeout_s: float) -> DeviceMesh:
    """``init_device_mesh`` over the initialised world whose every group takes the timeout ``timeout_s``.

    torch gives a mesh's subgroups their backend's default timeout (10 minutes on NCCL), not the default group's:
    a rank that waits longer than the run allows for (a peer writing a checkpoint, a hivemind round) would be
    ended by NCCL's watchdog.  A dimension that spans the whole world is the default group itself (its timeout
    is the run's already; overriding it would make a second communicator of every rank)."""
    world, backend = dist.get_world_size(), dist.get_backend()
    # the options alone: each group keeps the default group's backend (NCCL on GPUs; a fake one in a dry run)
    override = {name: timeout_options(backend, timeout_s) for name, n in zip(names, shape) if n != world} \
        if backend in ("gloo", "nccl") else {}
    return init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override or None)


def timeout_options(backend: str, timeout_s: float) -> Any:
    """The options of a ``backend`` process group that carry a timeout (what ``init_device_mesh`` takes per
    dimension)."""
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return options


def group_timeout(group: dist.ProcessGroup | None = None) -> datetime.timedelta | None:
    """The timeout ``group`` (None: the default group, whose timeout is the run's) was made with, as its backend
    keeps it; None where torch does not say (a fake backend)."""
    group = dist.distributed_c10d._get_default_group() if group is None else group
    for device in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return None


def free_port() -> int:
    """A TCP port that is free on loopback right now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_hsdp_mesh(replicas: int, dp: int, device_type: str = "cpu") -> DeviceMesh:
    """The ``("replicate", "dp", "pp", "tp")`` mesh of an initialised world of ``replicas`` servers of ``dp``
    ranks each (consecutive ranks share a server), no TP or PP: HSDP, FSDP over ``dp`` inside each server and
    replicas across servers (the synchronous baseline's)."""
    return timed_mesh(device_type, (replicas, dp, 1, 1), ("replicate", *MESH_DIMS),
                      group_timeout().total_seconds())


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards over: ``dp``, or ``("replicate", "dp")`` (HSDP) where the mesh has replicas."""
    return mesh["replicate", "dp"] if "replicate" in (mesh.mesh_dim_names or ()) else mesh["dp"]


def mesh_size(mesh: DeviceMesh | None, dim: str) -> int:
    """Size of ``dim`` in an island mesh (1 without a mesh, or for a dimension the mesh lacks)."""
    if mesh is None or dim not in (mesh.mesh_dim_names or ()):
        return 1
    return mesh[dim].size()


def mesh_rank(mesh: DeviceMesh | None, dim: str) -> int:
    """This rank's coordinate along ``dim`` (0 without a mesh, or for a dimension the mesh lacks)."""
    if mesh is None or dim not in (mesh.mesh_dim_names or ()):
        return 0
    return mesh[dim].get_local_rank()


def destroy_island() -> None:
    """Destroy the default process group (and with it the mesh's subgroups) if one exists."""
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_worker(code: int) -> None:
    """End a torchrun worker process without interpreter finalization.

    With torch 2.13 on CPU a worker whose work is done (process group destroyed, files closed) aborts in
    about 1 of 8 runs during finalization ("terminate called without an active exception", SIGABRT, no
    Python frame left), which torchrun reports as a failed worker after a run that succeeded.  Nothing
    remains to be written by then, so the worker flushes its output and leaves at once.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
