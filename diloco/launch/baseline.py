"""The synchronous data-parallel baseline DiLoCo is compared against.

``k`` worker processes train the same model on the same data as a ``k``-island DiLoCo run, on the island's
trainer core (:class:`~diloco.engine.trainer.TrainerCore`: the same builders, inner step, evaluation, records and
summary): worker ``r`` reads shard ``r`` of ``k`` with the same per-worker batch (``inner.batch_size`` ×
``inner.grad_accum``), the same inner optimizer and schedule and the same number of steps
(``diloco.outer_steps × diloco.inner_steps``), but the gradients are averaged over all workers after **every**
step, as torch DDP does.

How gradients are averaged: with torch's own DDP (:class:`TimedDDP`, the composable ``replicate``), in
buckets of 25 MB all-reduced while the backward pass still runs (gloo on CPU, NCCL on GPU), as a user of
synchronous training would run it; with ``grad_accum`` micro-batches, only the last one's backward reduces.
``comm_seconds`` is what DDP could not hide: the time from the last bucket's gradients being ready to the
backward pass returning (plus one all-reduce of the loss, for the reported mean); ``compute_seconds`` the
rest of the forward/backward/optimizer steps and the evaluations.  Every worker builds the model from the
same seed, and a checksum all-reduce checks that they start equal before DDP's own broadcast.

``payload_bytes_sent`` is what a ring all-reduce makes each worker send per step: ``2·(k−1)/k`` × the
fp32 gradients' size (:func:`peers.wire.counters.ring_allreduce_bytes`); the summary's
``bytes_sent`` is what the kernel counted on the worker's own connections (see :mod:`peers.wire.counters`).

Rank 0 writes the island's records, made by the same functions (:mod:`diloco.engine.trainer`): the training
loss every ``logging.log_every`` steps (``tokens`` counted over all workers), an evaluation before training and
every ``inner_steps`` steps, so that the curves line up with DiLoCo rounds (``eval/loss``, its perplexity and
``eval/bits_per_byte``; ``outer_step`` = step // inner_steps), each with the sync's own figures
(``payload_bytes_sent``, ``allreduce_seconds``, ``num_peers``), to ``<run_dir>/metrics.jsonl`` and W&B; and
``<run_dir>/summary.json`` with the island summary's keys (:data:`~diloco.engine.trainer.SUMMARY_KEYS`) and the
baseline's own (``workers``, ``bytes_per_step``, the seconds per rank, ``losses``, ``comm_method``,
``hsdp_shard``).

Entry points: :func:`diloco.launch.baseline.run_baseline` launches the ``k`` workers as separate
processes (each one ``python -m diloco.launch.baseline --config FILE --rank R --workers K --master ADDR:PORT``,
so a launcher can wrap them, e.g. in ``ip netns exec``), and :func:`baseline_main` is the worker itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from diloco.command import run_command
from diloco.config import Config, to_dict
from diloco.engine.metrics import MetricsLogger, NullMetrics, RunStats
from diloco.engine.runtime import pick_device, use_device
from diloco.engine.trainer import TrainerCore, run_summary
from diloco.launch import tail, warm
from outer_optim import checksum
from peers import WireCounter, ring_allreduce_bytes
from pipeline.mesh import exit_worker, free_port, init_hsdp_mesh

log = logging.getLogger("diloco.launch.baseline")

DEFAULT_PORT = 29517
"""Port of the rendezvous store on worker 0 when it runs on its own (emulated) host."""


class BaselineError(RuntimeError):
    """A worker of the baseline failed; the message points at its log."""


def worker_threads(cfg: Config, workers: int) -> int:
    """Threads per worker: ``cfg.threads`` or the cores divided among the workers (as for islands)."""
    return cfg.threads or max(1, (os.cpu_count() or 1) // workers)


# ------------------------------------------------------------------------------------------ worker

DDP_BUCKET_MB = 25
"""torch DDP's default bucket size."""


class GradientSync:
    """Gradients that torch's data parallelism on ``module`` averages itself: under HSDP (the model's parts over
    :func:`pipeline.mesh.init_hsdp_mesh`), FSDP2 inside each server (parameters, gradients and AdamW's state
    sharded; all-gathers and reduce-scatters over the server's fast links) and replicas across servers (each
    shard's gradients all-reduced over the slow link), as a user of synchronous training across GPU servers
    would run it instead of flat DDP.

    FSDP overlaps its collectives inside the forward and backward passes with no hook that tells when the
    last gradient was ready, so :meth:`waited` is 0: the step's time is all counted as compute (an upper
    bound of the compute utilization), and the summary's ``comm_method`` says so."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def require_sync(self, last_micro_batch: bool) -> None:
        """Reduce gradients in the step's last micro-batch only (DDP's ``no_sync`` for the others)."""
        self.module.set_requires_gradient_sync(last_micro_batch)

    def waited(self) -> float:
        """Seconds the step waited for the gradients' collectives after the backward pass: not timed here."""
        return 0.0


class TimedDDP(GradientSync):
    """torch's own DDP on ``module`` (the composable ``replicate``: the module and its parameter names stay as
    they are), with a communication hook that notes when each bucket's gradients were ready, so that a step
    can tell how long it waited for the all-reduces after its last gradient: the part DDP could not hide
    under the backward pass."""

    def __init__(self, module: torch.nn.Module, device: torch.device, workers: int):
        from torch.distributed._composable import replicate

        super().__init__(module)
        self.workers = workers
        self.last_ready = 0.0
        replicate(module, bucket_cap_mb=DDP_BUCKET_MB, **({"device_id": device} if device.type == "cuda" else {}))
        module.register_comm_hook(None, self._all_reduce)

    def _all_reduce(self, state, bucket):  # no annotations: DDP checks them as objects, not as strings
        """DDP's default hook (the mean over workers), noting when the bucket (a ``dist.GradBucket``) was ready."""
        self.last_ready = time.perf_counter()
        tensor = bucket.buffer().div_(self.workers)
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])

    def waited(self) -> float:
        """Seconds since the last bucket was ready: called right after the backward pass returns, how long it
        waited for the all-reduces still running."""
        return max(0.0, time.perf_counter() - self.last_ready)


def device_for(cfg: Config, rank: int) -> torch.device:
    """The device of worker ``rank``: with ``auto`` or ``cuda``, GPU ``rank`` modulo the GPUs this machine has
    (consecutive workers share a server)."""
    return pick_device(cfg.device, rank % max(torch.cuda.device_count(), 1))


def train_worker(cfg: Config, rank: int, workers: int, master: str, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run one data-parallel worker to the end; rank 0 returns the summary (the others a short one).  With
    ``cfg.parallel.dp > 1`` the workers are servers of ``dp`` ranks each, trained with HSDP
    (:class:`GradientSync`).  The worker stands on the island's trainer core (:mod:`diloco.engine.trainer`): the
    same builders, inner step, evaluation, records and summary; only the sync differs."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = device_for(cfg, rank)
    use_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{master}", rank=rank, world_size=workers,
                            timeout=datetime.timedelta(seconds=timeout_s))
    metrics: MetricsLogger | NullMetrics = NullMetrics()
    try:
        torch.manual_seed(cfg.seed)
        H = cfg.diloco.inner_steps
        total_steps = cfg.diloco.outer_steps * H
        shard = cfg.parallel.dp
        # under HSDP a forward pass gathers the server's shards: every worker evaluates, rank 0 reports
        evaluates = rank == 0 or shard > 1
        # a worker holds the whole model, or under HSDP its server's share: the island's precision and
        # compilation, no TP or PP
        mesh = init_hsdp_mesh(workers // shard, shard, device.type) if shard > 1 else None
        core = TrainerCore(cfg, mesh=mesh, parallel=dataclasses.replace(cfg.parallel, dp=shard, tp=1, pp=1),
                           device=device, shard=rank, shards=workers, devices=workers, evaluates=evaluates)
        model = core.model

        # every worker must start from the same parameters (DDP would broadcast rank 0's)
        whole = model.full_parameters().values()
        numel = sum(p.numel() for p in whole)
        check = torch.tensor([float(sum(p.double().sum() for p in whole))], dtype=torch.float64, device=device)
        lo, hi = check.clone(), check.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        if lo.item() != hi.item():
            raise BaselineError("workers built different initial parameters; use the same --model.* and --seed")

        # what crosses the servers' links: the whole gradient under DDP, this rank's shard of it under HSDP
        step_bytes = ring_allreduce_bytes(numel * 4 // shard, workers // shard)
        wire = WireCounter(own=True)  # gloo's connections are this process's own
        if shard > 1:
            grads: GradientSync | None = GradientSync(model.modules[0])
        else:
            grads = TimedDDP(model.modules[0], device, workers) if workers > 1 else None
        core.start_inner(total_steps)
        tokens_per_step = workers * core.batches.tokens_per_batch * cfg.inner.grad_accum

        name = f"{cfg.averaging.run_id}-baseline-rank{rank}"
        if rank == 0:
            w = cfg.wandb
            metrics = MetricsLogger(cfg.logging.run_dir, wandb_mode=w.mode, project=w.project,
                                    group=w.group or cfg.averaging.run_id, name=f"{cfg.averaging.run_id}-baseline",
                                    entity=w.entity, config=dict(to_dict(cfg), baseline_workers=workers))

        s = RunStats()  # the run's totals, as an island keeps them: each step is a sync that cannot fail
        loss_buffer = torch.zeros(1, dtype=torch.float64, device=device)
        comm_window = 0.0

        def after_backward(local_loss: float) -> float:
            """DDP has averaged the gradients: count how long the step waited for it, average the loss."""
            nonlocal comm_window
            t1 = time.perf_counter()
            loss_buffer[0] = local_loss
            dist.all_reduce(loss_buffer)
            waited = grads.waited() + time.perf_counter() - t1
            s.comm_seconds += waited
            comm_window += waited
            s.payload_bytes_sent += step_bytes
            return float(loss_buffer.item()) / workers

        def sync_record() -> dict[str, Any]:
            """The sync's own figures in a record: its bytes so far and the workers averaging every step."""
            return {"payload_bytes_sent": s.payload_bytes_sent, "num_peers": workers}

        step_losses: list[float] = []
        dist.barrier()
        t_start = time.perf_counter()
        if evaluates:
            s.eval_loss_start = core.evaluate()
        metrics.log(core.evaluation_record(s.eval_loss_start, s))
        s.compute_seconds += time.perf_counter() - t_start
        window_t, window_tokens = time.perf_counter(), 0
        for step in range(total_steps):
            t0, comm_before = time.perf_counter(), s.comm_seconds
            step_loss = core.step(sync_grads=after_backward if grads else None,
                                  gradient_sync=grads.require_sync if grads else None)
            s.compute_seconds += time.perf_counter() - t0 - (s.comm_seconds - comm_before)
            s.tokens += tokens_per_step
            s.inner_step = done = step + 1
            s.outer_step = done // H
            step_losses.append(step_loss)
            round_end = done % H == 0 or done == total_steps
            if rank != 0:
                if evaluates and round_end:
                    core.evaluate()
                continue
            if done % cfg.logging.log_every == 0 or round_end:
                now = time.perf_counter()
                tokens_per_second = (s.tokens - window_tokens) / max(now - window_t, 1e-9)
                metrics.log({**core.loss_record(step_loss, s, tokens_per_second), **sync_record()})
                window_t, window_tokens = now, s.tokens
            if round_end:
                t_eval = time.perf_counter()
                s.eval_loss_end = core.evaluate()
                s.compute_seconds += time.perf_counter() - t_eval
                metrics.log({**sync_record(), "allreduce_seconds": comm_window, "round_ok": 1,
                             **core.round_record(step_loss, s, time.perf_counter() - t_start, s.eval_loss_end)})
                comm_window = 0.0
                print(f"[baseline] step {done}/{total_steps} (outer step {done // H}) loss={step_loss:.3f} "
                      f"eval={s.eval_loss_end:.3f} comm={s.comm_seconds:.1f}s compute={s.compute_seconds:.1f}s",
                      flush=True)
        dist.barrier()
        wall = time.perf_counter() - t_start
        seen = wire.take()
        s.payload_bytes_received = s.payload_bytes_sent
        s.bytes_sent, s.bytes_received = (seen.sent, seen.received) if seen is not None else \
            (s.payload_bytes_sent, s.payload_bytes_sent)
        s.rounds_ok = total_steps if workers > 1 else 0
        s.stall_seconds = s.comm_seconds  # nothing hides a synchronous step's wait
        per_rank = torch.zeros(workers, 2, dtype=torch.float64, device=device)
        per_rank[rank, 0], per_rank[rank, 1] = s.compute_seconds, s.comm_seconds
        dist.all_reduce(per_rank)
        final = model.full_parameters()
        if shard > 1:
            method = (f"HSDP: FSDP2 inside servers of {shard} workers, {workers // shard} replicas all-reducing "
                      f"their shards' gradients across servers, backend {backend}; FSDP's collectives overlap "
                      f"the passes with no hook to time them, so comm_seconds is the loss's all-reduce alone and "
                      f"compute_seconds (and the utilization) an upper bound")
        else:
            method = (f"torch DDP (buckets of {DDP_BUCKET_MB} MB all-reduced during the backward pass), backend "
                      f"{backend}; comm_seconds = time the step waited for them after its last gradient was "
                      f"ready, plus the loss's all-reduce")
        summary = run_summary(name, s, wall=wall, theta_checksum=checksum(final), device=device, stopped_early=False,
                              sync={"workers": workers, "bytes_per_step": step_bytes,
                                    "compute_seconds_per_rank": per_rank[:, 0].tolist(),
                                    "comm_seconds_per_rank": per_rank[:, 1].tolist(), "losses": step_losses,
                                    "comm_method": method, "hsdp_shard": shard})
        if rank == 0:
            torch.save(final, Path(cfg.logging.run_dir) / "params.pt")
            metrics.summary(summary)
        return summary
    finally:
        metrics.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def baseline_main(argv: list[str] | None = None) -> int:
    """Worker entry point: ``python -m diloco.launch.baseline --config FILE --rank R --workers K --master ADDR:PORT``.

    Without ``--rank`` it launches all ``--workers`` workers on loopback (:func:`diloco.launch.baseline.run_baseline`), with
    any ``--section.key VALUE`` overrides.
    """
    from diloco.config import ConfigError
    from diloco.config import loader as config_load

    parser = argparse.ArgumentParser(prog="python -m diloco.launch.baseline", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="TOML config file (the launcher writes one)")
    parser.add_argument("--rank", type=int, help="this worker's rank (omit to launch all workers)")
    parser.add_argument("--workers", type=int, default=2, help="number of data-parallel workers k")
    parser.add_argument("--master", help="ADDR:PORT of rank 0's rendezvous store")
    parser.add_argument("--iface", default="", help="network interface gloo uses (sets GLOO_SOCKET_IFNAME)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a collective may block")
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s [baseline rank {args.rank}] %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("wandb").setLevel(logging.WARNING)

    def body() -> int:
        cfg = config_load.load(args.config, rest)
        if args.workers < 1:
            raise ConfigError([f"--workers must be at least 1, got {args.workers}"])
        if args.rank is None:
            from diloco.launch.baseline import run_baseline

            signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C stops every worker
            summary = run_baseline(cfg, args.workers)
            print(json.dumps({k: v for k, v in summary.items() if k != "losses"}), flush=True)
            return 0
        if not 0 <= args.rank < args.workers:
            raise ConfigError([f"--rank must be in [0, {args.workers - 1}], got {args.rank}"])
        if not args.master or ":" not in args.master:
            raise ConfigError(["--master ADDR:PORT is required for a worker (rank 0's address)"])
        if args.iface:
            os.environ["GLOO_SOCKET_IFNAME"] = args.iface
        summary = train_worker(cfg, args.rank, args.workers, args.master, args.timeout)
        if args.rank == 0:
            print(json.dumps({k: v for k, v in summary.items() if k != "losses"}), flush=True)
        return 0

    from diloco.model.checkpoint import CheckpointError

    return run_command(body, (BaselineError, CheckpointError))



def stop_processes(procs: Sequence[subprocess.Popen | warm.WarmProcess], grace: float = 10.0) -> None:
    """SIGTERM each process group, wait up to ``grace`` s, then SIGKILL what is left and reap."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.time() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:  # children left in the worker's session (e.g. a W&B service) go too
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def run_baseline(cfg: Config, workers: int, network: Any = None, *,
                 wrap: Callable[[list[str], int], list[str]] | None = None,
                 progress: bool = True, timeout_s: float = 600.0) -> dict[str, Any]:
    """Train the synchronous data-parallel baseline with ``workers`` processes; return rank 0's summary.

    Worker ``r`` runs ``python -m diloco.launch.baseline --config <run_dir>/config.toml --rank r ...`` with its
    log in ``<run_dir>/rank<r>.log``; rank 0 writes ``metrics.jsonl``, ``summary.json`` and the final
    parameters ``params.pt`` into ``cfg.logging.run_dir``.  With ``network`` (an
    :class:`experiments.netns.EmulatedNetwork` with at least ``workers`` hosts) worker ``r`` runs in
    host ``r``'s namespace and the workers talk over its capped links; otherwise they use loopback.
    ``wrap`` (``(cmd, rank) -> cmd``) overrides how a worker's command is wrapped.  Every worker is
    stopped when one fails, on Ctrl-C/SIGTERM and at the end.
    """
    import tomli_w

    if workers < 1:
        raise BaselineError(f"the baseline needs at least one worker, got {workers}")
    shard = cfg.parallel.dp
    if workers % shard:
        raise BaselineError(f"--parallel.dp {shard} makes the baseline HSDP over servers of {shard} workers, which "
                            f"{workers} workers do not fill: use a multiple of {shard} workers or --parallel.dp 1")
    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("summary.json", "metrics.jsonl", "params.pt"):
        (run_dir / stale).unlink(missing_ok=True)
    d = to_dict(cfg)
    d["threads"] = worker_threads(cfg, workers)
    cfg_path = run_dir / "config.toml"
    cfg_path.write_text(tomli_w.dumps(d))
    if network is not None:  # one host per server: its workers share it, as GPUs of one server do
        if len(network.hosts) < workers // shard:
            raise BaselineError(f"the emulated network has {len(network.hosts)} hosts but the baseline needs "
                                f"{workers // shard}")
        master = f"{network.hosts[0].address}:{DEFAULT_PORT}"
        iface = network.hosts[0].interface
        wrap = wrap or (lambda cmd, r: network.wrap(cmd, r // shard))
    else:
        master = f"127.0.0.1:{free_port()}"
        iface = "lo"
    env = dict(os.environ, OMP_NUM_THREADS=str(d["threads"]), PYTHONUNBUFFERED="1")
    procs: list[subprocess.Popen | warm.WarmProcess] = []
    logs: list[Path] = []
    previous = signal.getsignal(signal.SIGTERM)
    in_main = _in_main_thread()

    def _interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    if in_main:
        signal.signal(signal.SIGTERM, _interrupt)
    t0 = time.time()
    try:
        for r in range(workers):
            cmd = [sys.executable, "-m", "diloco.launch.baseline", "--config", str(cfg_path), "--rank", str(r),
                   "--workers", str(workers), "--master", master, "--iface", iface, "--timeout", str(timeout_s)]
            if wrap is not None:
                cmd = wrap(cmd, r)
            log_path = run_dir / f"rank{r}.log"
            if warm.enabled() and wrap is None:  # the test suite's workers fork from a warm interpreter
                procs.append(warm.start(cmd[3:], env, log_path, program="diloco.launch.baseline"))
            else:
                with open(log_path, "w") as out:
                    procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                                  start_new_session=True))
            logs.append(log_path)
        if progress:
            print(f"started {workers} baseline worker(s) (master {master}); logs in {run_dir}/rank*.log", flush=True)
        seen = 0
        while any(p.poll() is None for p in procs):
            for r, p in enumerate(procs):
                if p.poll() not in (None, 0):
                    raise BaselineError(f"baseline worker {r} exited with code {p.returncode}; its log {logs[r]} "
                                        f"ends with:\n{tail(logs[r])}")
            if progress:
                seen = _print_progress(logs[0], seen, t0)
            time.sleep(0.5)
        for r, p in enumerate(procs):
            if p.returncode != 0:
                raise BaselineError(f"baseline worker {r} exited with code {p.returncode}; its log {logs[r]} "
                                    f"ends with:\n{tail(logs[r])}")
        if progress:
            _print_progress(logs[0], seen, t0)
    except KeyboardInterrupt:
        print("interrupted: stopping every baseline worker", flush=True)
        stop_processes(procs)
        raise
    except BaseException:
        stop_processes(procs)
        raise
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    stop_processes(procs)
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise BaselineError(f"baseline rank 0 wrote no {summary_path}; see {logs[0]}")
    summary = json.loads(summary_path.read_text())
    summary["launcher_wall_seconds"] = time.time() - t0
    return summary


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _print_progress(log_path: Path, seen: int, t0: float) -> int:
    try:
        lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.startswith("[baseline] step")]
    except OSError:
        return seen
    for ln in lines[seen:]:
        print(f"[{time.time() - t0:6.0f}s] {ln}", flush=True)
    return len(lines)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    exit_worker(baseline_main())
