"""Real slowness for experiments and tests: a process (and the children it starts later) capped at a
fraction of one CPU core by a cgroup v1 ``cpu`` cgroup (CFS bandwidth: ``cpu.cfs_quota_us`` out of every
``cpu.cfs_period_us``), removed again at the end.

    with cpu_limit(0.4) as slow:            # a fresh cgroup at 0.4 of a core
        proc = subprocess.Popen(slow.command(["diloco", "train", ...]))
        ...
    print(slow.description)                 # what was done, or the fallback

Where ``/sys/fs/cgroup/cpu`` cannot be written (no root, cgroup v2 only, a read-only mount) the context
says so in one line and yields a :class:`Slowdown` without a cgroup whose description names the
fallback: run the slow island with ``--threads 1``.  From the shell:
``python -m experiments.slowdown 0.4 -- diloco train ...``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000
MIN_QUOTA_US = 1_000  # the kernel refuses a smaller quota
FALLBACK = "--threads 1"


@dataclass
class Slowdown:
    """A cgroup a process was put into, or (``cgroup is None``) why there is none."""

    fraction: float | None
    """Share of one core the cgroup may use; None: no cap (a control group on the same footing)."""
    cgroup: Path | None
    description: str

    @property
    def limited(self) -> bool:
        """Whether a cgroup exists (False: the caller should fall back to ``--threads 1``)."""
        return self.cgroup is not None

    def add(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the cgroup; its later children stay inside."""
        if self.cgroup is not None:
            (self.cgroup / "cgroup.procs").write_text(str(pid))

    def command(self, cmd: list[str]) -> list[str]:
        """``cmd`` wrapped so the process joins the cgroup before it starts (no uncapped start-up; no
        ``preexec_fn``, which is unsafe in a threaded parent)."""
        if self.cgroup is None:
            return list(cmd)
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.cgroup / "cgroup.procs"), *cmd]


def cgroup_problem(root: Path = CPU_ROOT) -> str | None:
    """Why no cpu cgroup can be created under ``root`` (None when one can)."""
    if not (root / "cpu.cfs_quota_us").exists():
        return f"{root} is not a cgroup v1 cpu hierarchy"
    if not os.access(root, os.W_OK):
        return f"{root} is not writable (run as root)"
    return None


def nice_shares(pid: int = 0) -> int:
    """``cpu.shares`` matching the nice level of ``pid`` (CFS weights: nice 0 is 1024, each step 1.25×),
    so moving a niced process into its own cgroup does not raise its priority against the rest."""
    nice = os.getpriority(os.PRIO_PROCESS, pid)
    return max(2, round(1024 / 1.25 ** nice))


def _own_cgroup(root: Path) -> Path:
    """The cpu cgroup this process sits in (where members are moved back to before removal)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return root / path.lstrip("/")
    return root


@contextmanager
def cpu_limit(fraction: float | None, pid: int | None = None, name: str | None = None,
              root: Path = CPU_ROOT, shares: int | None = None) -> Iterator[Slowdown]:
    """A fresh cpu cgroup capped at ``fraction`` of one core (None: uncapped), holding ``pid`` if given.

    ``shares`` is the cgroup's weight against the rest of the machine (default: :func:`nice_shares` of
    ``pid``, or of this process, whose nice level children inherit).
    Processes are added with :meth:`Slowdown.add` or started with :meth:`Slowdown.command`.  On exit
    (exceptions included) whatever is still inside goes back to this process's cgroup and the cgroup is
    removed.  When cgroups cannot be written, prints one line and yields a Slowdown with no cgroup.
    """
    if fraction is not None and not fraction * PERIOD_US >= MIN_QUOTA_US:
        raise ValueError(f"the CPU fraction must be at least {MIN_QUOTA_US / PERIOD_US} of a core, got {fraction}")
    cap = f"{fraction:g} of a core" if fraction is not None else "no cap"
    problem = cgroup_problem(root)
    path = root / (name or f"diloco-slow-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    if problem is None:
        try:
            path.mkdir()
        except OSError as e:
            problem = f"cannot create {path} ({e.strerror})"
    if problem is not None:
        slow = Slowdown(fraction, None, f"no cpu cgroup ({problem}); fall back to {FALLBACK}")
        print(f"slowdown: {slow.description}", file=sys.stderr, flush=True)
        yield slow
        return
    slow = Slowdown(fraction, path, f"cpu cgroup {path} at {cap}")
    try:
        (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text(str(round(fraction * PERIOD_US)) if fraction is not None else "-1")
        (path / "cpu.shares").write_text(str(shares or nice_shares(pid or 0)))
        if pid is not None:
            slow.add(pid)
        yield slow
    finally:
        _remove(path, _own_cgroup(root))


def _remove(path: Path, home: Path, attempts: int = 50) -> None:
    """Move every member of ``path`` to ``home`` and remove ``path`` (retrying while members fork or exit)."""
    for _ in range(attempts):
        if not path.exists():
            return
        for member in (path / "cgroup.procs").read_text().split():
            try:
                (home / "cgroup.procs").write_text(member)
            except OSError:
                pass  # it exited meanwhile (or cannot move: the rmdir below fails and we retry)
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.02)
    print(f"slowdown: could not remove {path}; remove it by hand once its processes have ended",
          file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments.slowdown FRACTION -- CMD...``: run CMD capped at FRACTION of a core."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("fraction", type=float, help="share of one CPU core, e.g. 0.4")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="the command (after --)")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("give the command to run after --")
    with cpu_limit(args.fraction) as slow:
        if slow.limited:  # the fallback has already said so
            print(f"slowdown: {slow.description}", file=sys.stderr, flush=True)
        return subprocess.call(slow.command(cmd))


if __name__ == "__main__":
    sys.exit(main())
