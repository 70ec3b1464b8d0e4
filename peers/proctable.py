"""Read the Linux process table (``/proc``): who started whom, process groups, zombies.

Launchers use it to find every process an island started (torchrun workers, DHT children, p2pd
daemons) so that none outlives a run; the traffic counters, to find hivemind's p2p daemons and their sockets.
Plain data of the operating system: any floor of ``peers`` and above may import it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/PID/stat`` that launchers need."""

    pid: int
    name: str
    """Command name (``comm``), e.g. ``p2pd``."""
    state: str
    """One letter: ``R`` running, ``S`` sleeping, ``Z`` zombie, ..."""
    parent: int
    pgid: int
    start_time: str
    """Clock ticks after boot when the process started: with the pid, names one process for good."""
    cpu_seconds: float = 0.0
    """CPU time it used so far, user and system (its own threads, not its children's)."""


def read_stat(pid: int) -> ProcStat | None:
    """The process ``pid`` as ``/proc`` describes it, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # the name may hold spaces and parentheses: it ends at the last ')'
    fields = stat[stat.rindex(")") + 2:].split()
    return ProcStat(pid=pid, name=stat[stat.index("(") + 1:stat.rindex(")")], state=fields[0],
                    parent=int(fields[1]), pgid=int(fields[2]), start_time=fields[19],
                    cpu_seconds=(int(fields[11]) + int(fields[12])) / _TICKS)


def process_table() -> dict[int, ProcStat]:
    """Every process visible in ``/proc``."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := read_stat(int(entry))) is not None:
            table[stat.pid] = stat
    return table


def process_trees(roots: Iterable[int]) -> dict[int, ProcStat]:
    """The processes ``roots`` and every process they started, directly or not, from one reading of ``/proc``
    (a root that is gone is left out)."""
    table, wanted = process_table(), set(roots)
    out = {}
    for pid, stat in table.items():
        p = pid
        while p > 1 and p in table:
            if p in wanted:
                out[pid] = stat
                break
            p = table[p].parent
    return out


def descendants(root: int) -> dict[int, ProcStat]:
    """The processes started, directly or not, by ``root`` (``root`` itself excluded)."""
    return {pid: stat for pid, stat in process_trees([root]).items() if pid != root}


def is_running(pid: int) -> bool:
    """True while ``pid`` exists and has not exited (a zombie has exited, only its parent has not reaped it)."""
    stat = read_stat(pid)
    return stat is not None and stat.state != "Z"


def process_sockets(pids: list[int]) -> set[int]:
    """Inodes of the sockets the processes ``pids`` hold."""
    inodes: set[int] = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # the process exited meanwhile
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile (the listing's own descriptor is one)
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def socket_files(pids: list[int], under: str = "/tmp/") -> set[str]:
    """Paths under ``under`` of the Unix sockets that the processes ``pids`` hold (bound or connected), from
    ``/proc/net/unix``: what a process killed with SIGKILL leaves on disk (hivemind's daemon and clients)."""
    inodes = {str(i) for i in process_sockets(pids)}
    out = set()
    try:
        with open("/proc/net/unix") as f:
            next(f)
            for line in f:
                fields = line.split()
                if len(fields) >= 8 and fields[6] in inodes and fields[7].startswith(under):
                    out.add(fields[7])
    except OSError:
        pass
    return out


__all__ = ["ProcStat", "read_stat", "process_table", "descendants", "is_running", "process_sockets", "socket_files"]
