"""The island's training loop: inner steps, rounds sent and applied on the schedule of
:mod:`diloco.engine.overlap`, evaluations of θ_global, checkpoints between rounds, and the summary at the end."""

from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import torch

from diloco.engine import peer_node as peer_setup
from diloco.engine.outer_round import RoundMetrics
from diloco.inference.samples import log_samples

if TYPE_CHECKING:
    from diloco.engine.island import Island

log = logging.getLogger("diloco")


def run(island: Island) -> dict[str, Any]:
    """Train until every round is done (or a stop is agreed); return the island's summary."""
    cfg, ov = island.cfg, island.overlap
    t_start = island.t_start = time.perf_counter()
    if island.outer_step == 0 and math.isnan(island.stats.eval_loss_start):
        with _as_compute(island):
            island.stats.eval_loss_start = island.evaluate()
        island.metrics.log({"eval/loss": island.stats.eval_loss_start,
                            "eval/perplexity": math.exp(island.stats.eval_loss_start),
                            "tokens": island.stats.tokens, "outer_step": island.outer_step})
    loss, window = float("nan"), (time.perf_counter(), island.stats.tokens)
    while island.outer_step < ov.total_rounds and not island.stop_agreed():
        t_step = time.perf_counter()
        if island.inner_step % ov.interval == ov.interval // 2:
            island.faults.at("inner", island.outer_step + 1)
        loss = island.train_step()
        island.stats.compute_seconds += time.perf_counter() - t_step
        if island.inner_step % cfg.logging.log_every == 0 or ov.sync_due():
            window = _log_loss(island, loss, window)
        if ov.apply_due():
            _after_round(island, island.apply_round(), loss)
        if not ov.sync_due() or island.stop_agreed():
            continue
        if ov.flight is not None:  # the next round is due: the one in flight must end first
            _after_round(island, island.apply_round(), loss)
        if island.outer_step >= ov.total_rounds:
            break
        if ov.restarted_now():  # a round it was left behind in made it catch up: nothing trained to send yet
            continue
        last = island.outer_step == ov.total_rounds - 1
        done = island.send_round()
        if done is None and (ov.blocking or last or ov.apply_due()):
            done = island.apply_round()
        if done is not None:
            _after_round(island, done, loss)
    if ov.flight is not None:  # stopping with a round in flight: see it through, then checkpoint
        _after_round(island, island.apply_round(), loss)
    if island.stop_agreed() or (cfg.checkpoint.every and island.outer_step % (cfg.checkpoint.every * ov.n)):
        island.save_checkpoint()
    if math.isnan(island.stats.eval_loss_end):
        with _as_compute(island):
            island.stats.eval_loss_end = island.evaluate()
    return _finish(island, time.perf_counter() - t_start)


@contextmanager
def _as_compute(island: Island) -> Iterator[None]:
    """Count the time of the block as the island's compute: evaluating θ_global (and writing samples of it)
    is compute, as in the baseline's accounting, whichever evaluation it is."""
    t = time.perf_counter()
    try:
        yield
    finally:
        island.stats.compute_seconds += time.perf_counter() - t


def _log_loss(island: Island, loss: float, window: tuple[float, int]) -> tuple[float, int]:
    """Log the training loss and throughput since ``window`` (time, tokens); returns the new window."""
    now = time.perf_counter()
    island.metrics.log({"loss": loss, "perplexity": math.exp(min(loss, 50)),
                        "lr": island.inner_sched.get_last_lr()[0], "tokens": island.stats.tokens,
                        "tokens_per_second": (island.stats.tokens - window[1]) / max(now - window[0], 1e-9),
                        "outer_step": island.outer_step, "inner_step": island.inner_step})
    return now, island.stats.tokens


def _after_round(island: Island, metrics: RoundMetrics, loss: float) -> None:
    """Record a round that ended: metrics, evaluation of θ_global when due, progress line, checkpoint."""
    cfg, n = island.cfg, island.overlap.n
    total = island.overlap.total_rounds
    record = dict(metrics.record(), tokens=island.stats.tokens, outer_step=island.outer_step, loss=loss)
    if island.outer_step % (cfg.logging.eval_every * n) == 0 or island.outer_step == total:
        with _as_compute(island):
            ev = island.evaluate()
            log_samples(island)
        island.stats.eval_loss_end = ev
        record.update({"eval/loss": ev, "eval/perplexity": math.exp(ev)})
    record["compute_utilization"] = island.stats.compute_seconds / max(time.perf_counter() - island.t_start, 1e-9)
    island.metrics.log(record)
    if island.is_main:
        print(f"[{island.name}] {metrics.progress_line(island.outer_step, total, loss)}"
              + (f" eval={record['eval/loss']:.3f}" if "eval/loss" in record else ""), flush=True)
    if cfg.checkpoint.every and island.outer_step % (cfg.checkpoint.every * n) == 0:
        island.save_checkpoint()


def _finish(island: Island, wall: float) -> dict[str, Any]:
    """After the last round: check the islands ended in sync, write θ_global and the summary."""
    out_of_sync = island.transfer.check_in_sync(island.state_fingerprint())
    if out_of_sync:
        log.error("%s", out_of_sync)
    peer_setup.count_bytes(island, 0, 0, through_torch=False)  # what moved since the last round
    theta, theta_checksum = island.theta_global()
    if island.is_main:
        torch.save(theta, island.run_dir / "theta_global.pt")
    s = island.stats
    summary = {
        "island": island.name, "outer_step": island.outer_step, "inner_step": island.inner_step, "tokens": s.tokens,
        "eval_loss_start": s.eval_loss_start, "eval_loss_end": s.eval_loss_end,
        "rounds_ok": s.rounds_ok, "rounds_failed": s.rounds_failed,
        "rounds_caught_up": s.rounds_caught_up, "bytes_sent": s.bytes_sent,
        "bytes_received": s.bytes_received, "payload_bytes_sent": s.payload_bytes_sent,
        "payload_bytes_received": s.payload_bytes_received, "compute_seconds": s.compute_seconds,
        "comm_seconds": s.comm_seconds, "stall_seconds": s.stall_seconds, "wall_seconds": wall,
        "theta_checksum": theta_checksum,
        "failures": s.failures[-20:], "stopped_early": island.stopping, "out_of_sync": out_of_sync,
    }
    island.metrics.summary(summary)
    return summary
