"""``experiments.slowdown``: a cpu cgroup really slows a process down, and is gone afterwards."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from experiments.slowdown import cgroup_problem, cpu_limit

BUSY_S = 2.0
# burns CPU for BUSY_S of wall time, then prints the CPU time it got
BUSY = ("import time\nend = time.monotonic() + %r\nwhile time.monotonic() < end:\n    pass\n"
        "print(time.process_time())" % BUSY_S)
PROBLEM = cgroup_problem()
NICE_0 = 1024
CAP = 0.3


def _throttled_periods(cgroup: Path) -> int:
    stat = dict(line.split() for line in (cgroup / "cpu.stat").read_text().splitlines())
    return int(stat["nr_throttled"])


@pytest.mark.alone  # an uncapped child must get a whole core, which a second busy test worker takes
@pytest.mark.skipif(PROBLEM is not None, reason=f"no writable cpu cgroup: {PROBLEM}")
def test_a_child_capped_at_0_3_of_a_core_gets_clearly_less_cpu_than_an_uncapped_one():
    # Both children run at once, each in its own cgroup (the uncapped one too), so they share the
    # machine's load on the same footing and differ only by the cap.  They run at the weight of nice 0
    # for these 2 s: at a niced weight on a loaded machine neither would get 0.3 of a core, and a cap
    # that never binds shows nothing.
    with cpu_limit(CAP, shares=NICE_0) as capped, cpu_limit(None, shares=NICE_0) as free:
        assert capped.limited and free.limited
        procs = [subprocess.Popen(group.command([sys.executable, "-c", BUSY]), stdout=subprocess.PIPE, text=True)
                 for group in (capped, free)]
        outs = [p.communicate(timeout=60)[0] for p in procs]
        throttled_periods = [_throttled_periods(group.cgroup) for group in (capped, free)]
        paths = [capped.cgroup, free.cgroup]
    assert all(p.returncode == 0 for p in procs)
    assert not any(path.exists() for path in paths)
    assert throttled_periods[0] > 0 and throttled_periods[1] == 0  # the kernel enforced the cap, and only it
    throttled, unthrottled = (float(out) for out in outs)
    if unthrottled < CAP / 0.7 * BUSY_S:
        pytest.skip(f"the machine is so loaded that an uncapped child got only {unthrottled / BUSY_S:.2f} of a "
                    f"core, so a cap of {CAP} cannot show in CPU time (the kernel did throttle the capped one)")
    assert throttled < 0.7 * unthrottled, (throttled, unthrottled)


@pytest.mark.skipif(PROBLEM is not None, reason=f"no writable cpu cgroup: {PROBLEM}")
def test_the_cgroup_is_removed_after_an_exception_even_with_a_process_inside():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(RuntimeError, match="boom"), cpu_limit(0.5, pid=proc.pid) as slow:
            assert str(proc.pid) in (slow.cgroup / "cgroup.procs").read_text().split()
            raise RuntimeError("boom")
        assert not slow.cgroup.exists()
    finally:
        proc.kill()
        proc.wait()


def test_without_writable_cgroups_it_says_so_in_one_line_and_falls_back(tmp_path: Path, capsys):
    with cpu_limit(0.4, root=tmp_path) as slow:
        assert not slow.limited
        assert slow.command(["diloco", "train"]) == ["diloco", "train"]
        slow.add(12345)  # nothing to join: a no-op
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"slowdown: no cpu cgroup ({tmp_path} is not a cgroup v1 cpu hierarchy); fall back to --threads 1"]
    assert "--threads 1" in slow.description
    with pytest.raises(ValueError, match="at least 0.01 of a core"):
        with cpu_limit(0.001, root=tmp_path):
            pass

