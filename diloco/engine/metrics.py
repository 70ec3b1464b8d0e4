"""Metrics: one JSON line per record in ``metrics.jsonl`` and, if enabled, one W&B run per island."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peers import Traffic

if TYPE_CHECKING:
    from diloco.engine.round.record import RoundMetrics

log = logging.getLogger(__name__)

# Every metric name the trainer emits (W&B charts and the simulate summary rely on them).
METRIC_NAMES = ("loss", "perplexity", "lr", "outer_lr", "eval/loss", "eval/perplexity", "num_peers",
                "tokens_per_second", "pseudo_grad_norm", "allreduce_seconds", "bytes_sent", "bytes_received",
                "compute_utilization", "outer_step", "tokens", "round_ok", "round_failure",
                "averaged_pseudo_grad_norm", "averaging_backend", "used_fallback", "overlap_seconds",
                "stall_seconds", "send_seconds", "fragment", "unsent_norm", "exchange_seconds", "group_seconds",
                "vote_seconds", "round_payload_bytes", "parts_resent", "tokens_per_second_per_device", "mfu", "peak_memory_gb",
                "eval/bits_per_byte")


def resolve_wandb_mode(mode: str) -> str:
    """`online` without an API key (env or ~/.netrc) becomes `offline`."""
    if mode != "online":
        return mode
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path.home() / ".netrc"
    if netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return "online"
    return "offline"


class MetricsLogger:
    """Writes records to ``<run_dir>/metrics.jsonl`` and mirrors them to W&B.

    A resumed run appends to its records; a new run in a directory that holds an earlier run's
    records moves them aside to ``metrics.<time>.jsonl`` first (so curves never mix two runs).
    """

    def __init__(self, run_dir: str | Path, *, wandb_mode: str = "disabled", project: str = "diloco",
                 group: str = "", name: str = "", entity: str = "", config: dict | None = None,
                 resume: bool = False):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        if not resume and path.exists() and path.stat().st_size:
            earlier = self.run_dir / time.strftime("metrics.%Y%m%d-%H%M%S.jsonl", time.localtime(path.stat().st_mtime))
            os.replace(path, earlier)
            log.warning("%s held an earlier run's records: moved them to %s", path, earlier.name)
        self._file = open(path, "a", buffering=1)
        self._wandb = None
        self.wandb_mode = resolve_wandb_mode(wandb_mode)
        if self.wandb_mode != "disabled":
            self._wandb = _start_wandb(self.run_dir, self.wandb_mode, project, group, name, entity, config or {})

    def log(self, record: dict[str, Any]) -> None:
        """Write one record (it should carry `tokens` and/or `outer_step` for the x axis)."""
        record = {k: (float(v) if hasattr(v, "item") else v) for k, v in record.items()}
        self._file.write(json.dumps(dict(record, time=time.time())) + "\n")
        if self._wandb is not None:
            self._wandb.log(record)

    def log_samples(self, rows: list[dict[str, Any]], tokens: int) -> None:
        """Generated samples (``outer_step``, ``prompt``, ``continuation``): appended to ``samples.jsonl``
        and logged as a W&B table ``samples``."""
        with open(self.run_dir / "samples.jsonl", "a") as f:
            for row in rows:
                f.write(json.dumps(dict(row, tokens=tokens, time=time.time()), ensure_ascii=False) + "\n")
        if self._wandb is not None and rows:
            import wandb

            columns = ["outer_step", "prompt", "continuation"]
            table = wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])
            self._wandb.log({"samples": table, "tokens": tokens})

    def summary(self, values: dict[str, Any]) -> None:
        """Final figures: written to ``summary.json`` and the W&B run summary."""
        (self.run_dir / "summary.json").write_text(json.dumps(json_safe(values), indent=2, allow_nan=False))
        if self._wandb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float, str)):
                    self._wandb.summary[k] = v

    def close(self) -> None:
        """Flush and finish the W&B run."""
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities as null, so the file is JSON that any reader accepts."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _start_wandb(run_dir: Path, mode: str, project: str, group: str, name: str, entity: str, config: dict):
    os.environ.setdefault("WANDB_SILENT", "true")
    if os.environ.get("WANDB_MODE") == "":  # empty means unset, but W&B would refuse it with a traceback
        del os.environ["WANDB_MODE"]
    import wandb

    run = wandb.init(mode=mode, project=project, group=group or None, name=name or None, entity=entity or None,
                     config=config, dir=str(run_dir), reinit="finish_previous")
    # tokens and outer_step are both usable as the x axis of any chart
    run.define_metric("tokens")
    run.define_metric("outer_step")
    run.define_metric("*", step_metric="tokens")
    run.define_metric("eval/*", step_metric="tokens")
    return run


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of ``<run_dir>/metrics.jsonl`` (a partially written last line is ignored)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class NullMetrics:
    """Stands in for :class:`MetricsLogger` on the ranks of an island that do not write metrics."""

    def log(self, record: dict[str, Any]) -> None:
        pass

    def log_samples(self, rows: list[dict[str, Any]], tokens: int) -> None:
        pass

    def summary(self, values: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class RunStats:
    """Where one island process stands (its outer and inner step) and its running totals, reported at the
    end (checkpointed: a resumed island carries them on)."""

    outer_step: int = 0
    """Outer rounds this island went through (committed, rolled back or caught up): the round it sends next."""
    inner_step: int = 0
    """Inner steps this island trained."""
    rounds_ok: int = 0
    rounds_failed: int = 0
    rounds_caught_up: int = 0
    """Outer steps this island took from a peer's state (rounds it was not there to average) beyond those it
    counts in rounds_failed: rounds_ok + rounds_failed + rounds_caught_up is the rounds it went through (a
    round it failed twice, left out with no state to take yet and then dropped when it caught up, twice)."""
    bytes_sent: int = 0
    """Bytes on the wire to other islands (the kernel's counts; see :mod:`peers.wire.counters`)."""
    bytes_received: int = 0
    payload_bytes_sent: int = 0
    """Bytes of pseudo-gradient the all-reduce sent (what the exchange computed, no headers or DHT)."""
    payload_bytes_received: int = 0
    compute_seconds: float = 0.0
    comm_seconds: float = 0.0
    stall_seconds: float = 0.0
    """Seconds the island did not train because of its rounds (the part of comm_seconds not hidden)."""
    tokens: int = 0
    eval_loss_start: float = float("nan")
    eval_loss_end: float = float("nan")
    failures: list[str] = field(default_factory=list)
    failed_in_a_row: int = 0
    """Rounds failed since the last one this island committed (caught-up rounds leave it as it is)."""
    behind: bool = False
    """The other islands averaged this island's latest round without it (it was late for their group)
    and it has not taken their θ_global since: a run that ends so may end out of sync."""

    def add_round(self, m: RoundMetrics) -> None:
        """Count a round that ended, from its record: committed or failed (and why), the seconds its averaging
        took and those it kept the island from training."""
        if m.ok:
            self.rounds_ok += 1
            self.failed_in_a_row = 0
        else:
            self.rounds_failed += 1
            self.failed_in_a_row += 1
            self.failures.append(f"round {m.rnd + 1}: {m.failure}")
        self.comm_seconds += m.result.seconds
        self.stall_seconds += m.stall_seconds

    def traffic(self) -> dict[str, int]:
        """The island's bytes on the slow link so far, as its records carry them."""
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "payload_bytes_sent": self.payload_bytes_sent}

    def state_dict(self) -> dict[str, Any]:
        """Every counter (a resumed island carries them on)."""
        return {**self.__dict__, "failures": list(self.failures)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (counters a checkpoint lacks keep their values)."""
        for k, v in state.items():
            setattr(self, k, v)

    def add_traffic(self, t: Traffic) -> None:
        """Add the island's slow-link traffic since the last count (:meth:`peers.PeerNode.count_bytes`)."""
        self.bytes_sent += t.bytes_sent
        self.bytes_received += t.bytes_received
        self.payload_bytes_sent += t.payload_bytes_sent
        self.payload_bytes_received += t.payload_bytes_received
