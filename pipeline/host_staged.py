"""Point to point through host memory: the pipeline's sends and receives between ranks that share GPUs.

Ranks that share a GPU talk over gloo (NCCL refuses two ranks on one GPU).  gloo stages GPU tensors through host
memory for its collectives, but not for point to point: on an H200, ``send``/``recv`` and ``batch_isend_irecv``
of CUDA tensors aborted the process, and a pp2 island died at its first send (``writev: Bad address``;
``benchmarks/gloo_cuda_probe.py``).  A pipeline's stages do nothing but point to point on their group, so they get
a process group of their own (:func:`host_staged_group`) whose ``send`` copies the tensor to the host before gloo
sends it and whose ``recv`` receives into a host buffer and copies it into the GPU tensor when the receive is
waited for.  torch's pipelining then runs unchanged: its stages, schedules, metadata exchange and warm-up all
post their sends and receives on the group they were given.  On CPU tensors the same copies are made, so the CPU
tests run the path a GPU takes.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

BACKEND = "host_staged"
"""The name the group's backend is registered under (``dist.new_group(backend=...)``)."""

_registered = threading.Lock()


class StagedWork(dist.Work):
    """A gloo send or receive of a host copy: waiting for it waits for gloo, then (a receive) copies the host
    buffer into the tensor the caller posted, and lets go of the host copy."""

    def __init__(self, inner: dist.Work, finish: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._inner, self._finish = inner, finish

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Wait for gloo's transfer, then complete the receive into the posted tensor (once)."""
        if timeout is None:
            self._inner.wait()
        else:
            self._inner.wait(timeout)
        if self._finish is not None:
            self._finish()
            self._finish = None
        return True

    def is_completed(self) -> bool:
        """Whether gloo's transfer has ended (a receive's copy is made by :meth:`wait`)."""
        return self._inner.is_completed()

    def is_success(self) -> bool:
        """Whether gloo's transfer ended without an error."""
        return self._inner.is_success()


class HostStagedGroup(dist.ProcessGroup):
    """A process group for point to point only, over gloo, every tensor staged through host memory."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._name = self._desc = ""
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("staged/", store), rank, size, timeout)

    # torch reads a group's name and description from its first backend, and this group registers none
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        """The name ``new_group`` gave the group."""
        return self._name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:
        """The description ``new_group`` gave the group."""
        return self._desc

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        """The backend's registered name."""
        return BACKEND

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        """Send a host copy of ``tensors`` (kept alive by the work until gloo has sent it)."""
        staged = [t.detach().to("cpu", copy=True) for t in tensors]
        return StagedWork(self._gloo.send(staged, dst, tag))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        """Receive into host buffers; :meth:`StagedWork.wait` copies them into ``tensors``."""
        staged = [torch.empty_like(t, device="cpu") for t in tensors]

        def finish() -> None:
            with torch.no_grad():
                for t, s in zip(tensors, staged):
                    t.copy_(s)

        return StagedWork(self._gloo.recv(staged, src, tag), finish)

    def barrier(self, opts: object = None) -> dist.Work:
        """gloo's barrier over the group."""
        return self._gloo.barrier()


def register() -> None:
    """Make the backend known to ``torch.distributed`` (once per process)."""
    with _registered:
        if BACKEND not in dist.Backend.backend_list:
            dist.Backend.register_backend(BACKEND, HostStagedGroup, devices=["cpu", "cuda"])


def host_staged_group(groups: list[list[int]], timeout: datetime.timedelta) -> dist.ProcessGroup | None:
    """This rank's host-staged group among ``groups`` (global ranks, one list per group, the same on every rank:
    each group is made by every rank of the world, in order, as ``new_group`` requires), or None when this rank is
    in none of them."""
    register()
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks, timeout=timeout, backend=BACKEND)
        if dist.get_rank() in ranks:
            mine = group
    return mine
