"""The memory that islands on one machine hold: each island's process tree, sampled from ``/proc``.

An island on this machine is several processes: the training process, the DHT process hivemind forks from it and
that DHT's ``p2pd`` daemon (an island of several ranks has one of each per rank).  Their resident sets (RSS) count
every page they map, so pages that islands share (the text of torch's libraries, and for islands forked from one
warm interpreter the interpreter's heap until someone writes it) are counted once per island: the sum of RSS
overstates what a machine needs.  The proportional set size (PSS, ``/proc/PID/smaps_rollup``) splits each shared
page between the processes that map it, so the PSS of every process summed is what the processes hold together.

:class:`MemorySampler` reads both, every few seconds, for every island's tree and for all the launcher's children
at once (which includes the warm fork server: the pages islands share with it are counted there), and keeps
the peaks.  Reading the PSS of a process costs about 2 ms of CPU, so at 64 islands a sample is about 0.4 s:
sample every few seconds, not faster.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from peers import process_table


def rss_pss_kb(pid: int) -> tuple[int, int]:
    """RSS and PSS of process ``pid`` in kB, from ``/proc/PID/smaps_rollup`` ((0, 0) once it is gone)."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    except (OSError, ValueError):  # exited meanwhile, or a kernel thread
        pass
    return rss, pss


@dataclass
class TreeMemory:
    """One process tree's memory at one instant."""

    rss_kb: int = 0
    pss_kb: int = 0
    processes: int = 0
    pss_by_name_kb: dict[str, int] = field(default_factory=dict)
    """PSS summed by process name, an island's root process as ``island`` and the others by their command name
    (``python3`` for the DHT processes and the fork server, ``p2pd``, ...): where the memory sits."""

    def add(self, name: str, rss: int, pss: int) -> None:
        self.rss_kb += rss
        self.pss_kb += pss
        self.processes += 1
        self.pss_by_name_kb[name] = self.pss_by_name_kb.get(name, 0) + pss


def tree_pids(root: int, children: dict[int, list[int]]) -> list[int]:
    """``root`` and every process below it, given each process's children."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


class MemorySampler:
    """Peak memory of island process trees, sampled in a thread every ``every`` seconds.

    ``roots`` returns the root pid of each island's tree (the process a launcher started: a cold ``diloco train``,
    a warm fork, a torchrun agent), asked again at every sample, so islands restarted meanwhile are followed.
    :attr:`peak_island` keeps, per island, the sample at which its tree's PSS peaked; :attr:`peak_total` the
    sample at which the PSS of every process below ``launcher`` (default: this process) peaked, summed: what
    the run held on this machine, shared pages counted once.
    """

    def __init__(self, roots: Callable[[], dict[int, int]], every: float = 5.0, launcher: int | None = None):
        self.roots = roots
        self.launcher = os.getpid() if launcher is None else launcher
        self.peak_island: dict[int, TreeMemory] = {}
        self.peak_total = TreeMemory()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), name="memory-sampler", daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """End the sampling (the peaks stay)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            self.sample()

    def sample(self) -> None:
        """Read every tree once and update the peaks."""
        table = process_table()
        children: dict[int, list[int]] = {}
        for pid, stat in table.items():
            children.setdefault(stat.parent, []).append(pid)
        roots = self.roots()
        name = {pid: table[pid].name for pid in table}
        name.update({root: "island" for root in roots.values()})
        memory = {pid: rss_pss_kb(pid) for pid in tree_pids(self.launcher, children) if pid != self.launcher}
        total = TreeMemory()
        for pid, (rss, pss) in memory.items():
            total.add(name[pid], rss, pss)
        if total.pss_kb > self.peak_total.pss_kb:
            self.peak_total = total
        for island, root in roots.items():
            tree = TreeMemory()
            for pid in tree_pids(root, children):
                if pid in table:
                    tree.add(name[pid], *memory.get(pid) or rss_pss_kb(pid))
            if tree.pss_kb > self.peak_island.get(island, TreeMemory()).pss_kb:
                self.peak_island[island] = tree
        self.samples += 1


__all__ = ["MemorySampler", "TreeMemory", "rss_pss_kb", "tree_pids"]
