"""The collective audit catches each rule NCCL has and gloo has not, and nothing that obeys them.

Runs this file as a script in 2 gloo ranks under the audit with its GPU stand-in (tests/collective_audit.py): the
ranks break each rule once, on purpose, next to calls that obey it, and gloo runs all of them happily.
"""

from __future__ import annotations

import datetime
import re
import sys
import threading

import pytest
import torch

from pipeline.mesh import exit_worker
from tests.conftest import launch_ranks


def run_cases() -> None:
    import torch.distributed as dist

    from tests.collective_audit import lazy_device

    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", timeout=timeout)
    me, gpu = dist.get_rank(), lazy_device()
    # a tensor where NCCL wants it (the stand-in GPU), and one on the host: only the second breaks a rule
    on_gpu = torch.ones(2, device=gpu)
    dist.all_reduce(on_gpu)
    assert on_gpu.cpu().tolist() == [2.0, 2.0], "the audit carries the stand-in's tensors through gloo"
    dist.all_reduce(torch.ones(2))  # the host tensor on the default group
    # a gloo group asked for by name takes host tensors, and may change threads (one at a time)
    ctrl = dist.new_group(backend="gloo", timeout=timeout)
    dist.all_reduce(torch.ones(1), group=ctrl)
    handed_over = threading.Thread(target=lambda: dist.all_reduce(torch.ones(1), group=ctrl), name="a-ctrl-thread")
    handed_over.start()
    handed_over.join()
    # a group made without the run's timeout
    untimed = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1, device=gpu), group=untimed)
    # a group used by two threads, one after the other
    shared = dist.new_group([0, 1], timeout=timeout)
    dist.all_reduce(torch.ones(1, device=gpu), group=shared)
    thread = threading.Thread(target=lambda: dist.all_reduce(torch.ones(1, device=gpu), group=shared),
                              name="a-round-thread")
    thread.start()
    thread.join()
    # point-to-point: rank 0 posts (3 elements, tag 1), then (5, tag 2); rank 1 posts its receives the other way
    # round, which gloo matches by tag and NCCL by order; then a pair posted in the same order on both sides
    if me == 0:
        works = [dist.isend(torch.ones(3, device=gpu), 1, tag=1), dist.isend(torch.ones(5, device=gpu), 1, tag=2)]
    else:
        bufs = [torch.empty(5, device=gpu), torch.empty(3, device=gpu)]
        works = [dist.irecv(bufs[0], 0, tag=2), dist.irecv(bufs[1], 0, tag=1)]
    for w in works:
        w.wait()
    ops = [dist.P2POp(dist.isend if me == 0 else dist.irecv, torch.full((4,), 7.0, device=gpu), 1 - me, tag=k)
           for k in (3, 4)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    if me == 1:
        assert bufs[0].cpu().sum() == 5 and bufs[1].cpu().sum() == 3
        assert all(op.tensor.cpu().tolist() == [7.0] * 4 for op in ops)
    dist.destroy_process_group()


def test_the_audit_names_each_rule_broken_and_nothing_else(tmp_path):
    with pytest.raises(AssertionError, match="the collective audit found") as failed:
        launch_ranks(__file__, ["audit"], 2, tmp_path, 60, stand_in="lazy")
    found = str(failed.value).splitlines()[1:]
    found = [line.strip() for line in found if line.strip().startswith(("rank", "group"))]
    for rank in (0, 1):
        mine = [line for line in found if line.startswith(f"rank {rank}:")]
        assert sum("device: all_reduce: a cpu tensor on group 0 (ranks [0, 1])" in line for line in mine) == 1, mine
        assert sum("timeout: group 2 (ranks [0, 1], nccl in production) has a timeout of 1800 s, the run's is 60 s"
                   in line for line in mine) == 1, mine
        assert sum(re.search(r"threads: group 3 \(ranks \[0, 1\], nccl in production\) is used by 2 threads: "
                             r"MainThread \(first at tests/test_collective_audit.py:\d+ \(run_cases\)\); "
                             r"a-round-thread \(first at tests/test_collective_audit.py:\d+ \(<lambda>\)\)", line)
                   is not None for line in mine) == 1, mine
        assert len(mine) == 3, mine  # the gloo group's host tensor and second thread, the stand-in's tensors: fine
        assert all("tests/test_collective_audit.py" in line for line in mine), mine
    order = [line for line in found if line.startswith("group 0:")]
    assert len(order) == 1 and "rank 0's send #0 to rank 1 (numel, dtype, tag [3, 'torch.float32', 1]) meets " \
        "rank 1's receive #0 from it ([5, 'torch.float32', 2])" in order[0], order


if __name__ == "__main__":
    run_cases()
    exit_worker(0)
