"""torchft's side of ``benchmarks/vs_torchft.py``: 2 replicas of ``torchft.local_sgd.DiLoCo`` with its Manager and
lighthouse, training our model on our data with our inner step.  Not a test, and not part of the product.

It runs in torchft's own virtual environment (torchft is never a dependency of diloco), with this repository on
``PYTHONPATH`` for the trainer core only (:class:`diloco.engine.trainer.TrainerCore`: the tokenizer, the corpus and
this replica's data shard, the model from the seed, the inner optimizer and its schedule, the inner step), built
from the same config items as our islands, so that the two sides differ in their sync alone.  Nothing of the peer
network (hivemind, our transports) is imported here.

    PYTHONPATH=. /work/venvs/torchft/bin/python benchmarks/torchft_worker.py run --replicas 2 --out DIR -- \\
        --model.dim 384 --diloco.inner_steps 20 ...

``run`` starts the lighthouse in this process and one ``worker`` process per replica (each its own replica group of
one process, its own TCPStore), waits for them, and leaves ``DIR/replica{i}.json`` per replica: per round when it
arrived, how long the round held its training thread and that time's parts (the quorum, the pseudo-gradient, the
all-reduce, the commit vote), every inner step's seconds, the loop's wall seconds and θ_global's checksum.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch


def run(replicas: int, out: Path, items: list[str]) -> int:
    """The lighthouse here, ``replicas`` worker processes of this script; the first non-zero exit status, or 0."""
    from torchft._torchft import LighthouseServer

    out.mkdir(parents=True, exist_ok=True)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=replicas)
    procs = []
    try:
        for i in range(replicas):
            cmd = [sys.executable, __file__, "worker", "--replica", str(i), "--replicas", str(replicas),
                   "--lighthouse", lighthouse.address(), "--out", str(out / f"replica{i}.json"), "--", *items]
            with open(out / f"replica{i}.log", "w") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        lighthouse.shutdown()
    bad = [(i, c) for i, c in enumerate(codes) if c]
    for i, c in bad:
        print(f"torchft replica {i} exited with status {c}; see {out / f'replica{i}.log'}", file=sys.stderr)
    return bad[0][1] if bad else 0


class RoundClock:
    """Times the parts of torchft's sync from outside it, through public methods: ``start_quorum`` (membership),
    the first ``allreduce`` of the round (the pseudo-gradient is computed before it), the fragment's ``wait``
    (called once every all-reduce of the round has finished), ``should_commit`` (the commit vote).  The sync runs in
    the inner optimizer's step post-hook of ``DiLoCo``; :meth:`before` and :meth:`after`, hooks registered around
    it, bracket the whole time the round holds the training thread."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.rounds: list[dict[str, Any]] = []
        self.arrived = 0.0
        self.returned: dict[str, Any] = {}

    def wrap(self, obj: Any, name: str, start: str | None, end: str | None, first_only: bool = False) -> None:
        """Replace ``obj.name`` by a call that notes the time it started at (``start``; with ``first_only``, the
        first such call of the step) and ended at (``end``), and keeps what it returned (:attr:`returned`)."""
        inner: Callable[..., Any] = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if start and not (first_only and start in self.marks):
                self.marks[start] = time.perf_counter()
            try:
                self.returned[name] = inner(*args, **kwargs)
                return self.returned[name]
            finally:
                if end:
                    self.marks[end] = time.perf_counter()

        setattr(obj, name, timed)

    def before(self, *_: Any) -> None:
        self.marks = {"held": time.perf_counter()}
        self.arrived = time.time()

    def after(self, *_: Any) -> None:
        m, now = self.marks, time.perf_counter()
        if "quorum" not in m:  # an inner step without a sync
            return
        held = now - m["held"]
        parts = {"membership": m["quorum_end"] - m["quorum"], "pseudo_grad": m["exchange"] - m["quorum_end"],
                 "exchange": m["exchange_end"] - m["exchange"], "vote": m["vote_end"] - m["vote"]}
        self.rounds.append({"round": len(self.rounds) + 1, "arrived": self.arrived, "held": held, **parts,
                            "rest": held - sum(parts.values()), "committed": bool(self.returned["should_commit"])})
        self.marks = {}


def worker(replica: int, replicas: int, lighthouse: str, out: Path, items: list[str]) -> int:
    """One replica: our trainer core under torchft's DiLoCo for ``diloco.outer_steps`` rounds of
    ``diloco.inner_steps`` inner steps; writes what :class:`RoundClock` measured to ``out``."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    from diloco.config.loader import load
    from diloco.engine.trainer import TrainerCore
    from outer_optim import checksum

    cfg = load(None, [*items, "--data.shard_index", str(replica), "--data.num_shards", str(replicas)])
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)  # as an island seeds before building its trainer core
    d = cfg.diloco
    core = TrainerCore(cfg, mesh=None, parallel=cfg.parallel, device=torch.device("cpu"), shard=replica,
                       shards=replicas)
    core.start_inner(d.outer_steps * d.inner_steps)
    module, inner = core.model.modules[0], core.inner_opt
    outer = torch.optim.SGD(module.parameters(), lr=d.outer_lr, momentum=d.outer_momentum, nesterov=True)

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=120)), min_replica_size=replicas, use_async_quorum=False,
        load_state_dict=lambda sd: (module.load_state_dict(sd["model"]), inner.load_state_dict(sd["inner"])),
        state_dict=lambda: {"model": module.state_dict(), "inner": inner.state_dict()},
        replica_id=f"replica{replica}", store_addr="localhost", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=lighthouse, timeout=timedelta(seconds=120), quorum_timeout=timedelta(seconds=600),
        connect_timeout=timedelta(seconds=60),
        init_sync=False)  # every replica builds the same initial parameters from the seed, as our islands do
    clock = RoundClock()
    clock.wrap(manager, "start_quorum", "quorum", "quorum_end")
    clock.wrap(manager, "allreduce", "exchange", None, first_only=True)
    clock.wrap(manager, "should_commit", "vote", "vote_end")
    steps: list[float] = []
    tokens_per_step = cfg.inner.batch_size * cfg.inner.grad_accum * cfg.model.seq_len
    try:
        t0 = time.perf_counter()
        eval_start = core.evaluate()
        inner.register_step_post_hook(clock.before)  # hooks run in the order registered: DiLoCo's sits between
        with DiLoCo(manager, [module], inner, outer, sync_every=d.inner_steps, backup_device=torch.device("cpu"),
                    pin_memory=False) as diloco:
            inner.register_step_post_hook(clock.after)
            for fragment in diloco._fragments:  # one fragment: the whole model, as our blocking DiLoCo
                clock.wrap(fragment, "wait", None, "exchange_end")
            for _ in range(d.outer_steps * d.inner_steps):
                t = time.perf_counter()
                rounds = len(clock.rounds)
                core.step()
                seconds = time.perf_counter() - t
                steps.append(seconds - (clock.rounds[-1]["held"] if len(clock.rounds) > rounds else 0.0))
        eval_end = core.evaluate()
        wall = time.perf_counter() - t0
        theta = core.model.full_parameters()
        out.write_text(json.dumps({
            "replica": replica, "rounds": clock.rounds, "step_seconds": steps, "tokens_per_step": tokens_per_step,
            "inner_steps": d.inner_steps, "wall_seconds": wall, "eval_loss_start": eval_start,
            "eval_loss_end": eval_end, "theta_checksum": checksum({n: theta[n] for n, _ in core.full_shapes}),
            "manager_step": manager.current_step(), "torch": torch.__version__}, indent=1))
    finally:
        manager.shutdown(wait=False)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("run", "worker"))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--replica", type=int, default=0)
    parser.add_argument("--lighthouse", default="")
    parser.add_argument("--out", type=Path, required=True)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    items = argv[cut + 1:]  # config items, as diloco takes them (--section.key VALUE)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.mode == "run":
        return run(args.replicas, args.out, items)
    return worker(args.replica, args.replicas, args.lighthouse, args.out, items)


if __name__ == "__main__":
    sys.exit(main())
