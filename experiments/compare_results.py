"""What the compare's runs came to: held-out-loss curves from their metrics, one :class:`RunResult` per
run, the wall-clock model, the acceptance verdicts, and bytes from the emulated links' counters."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

from diloco.engine.metrics import read_metrics
from experiments.report import RunResult, format_bytes

ACCEPT_LOSS_PCT = 2.0
ACCEPT_BYTES_FACTOR = 0.8  # × H
ACCEPT_WALL_RATIO = 3.0


def curve_from_metrics(run_dir: Path, token_scale: int = 1) -> list[dict[str, float]]:
    """Held-out-loss points {tokens (all workers), bytes (per worker), seconds, eval_loss} of one run.

    ``seconds`` counts from the first record (the evaluation before training).  ``token_scale``
    multiplies the logged tokens (an island logs its own tokens; the run's total is k times that).
    """
    records = read_metrics(run_dir)
    if not records:
        return []
    t0 = records[0]["time"]
    bytes_so_far = 0.0
    points = []
    for r in records:
        if "payload_bytes_sent" in r:
            bytes_so_far = float(r["payload_bytes_sent"])
        if "eval/loss" in r:
            points.append({"tokens": float(r.get("tokens", 0)) * token_scale, "bytes": bytes_so_far,
                           "seconds": float(r["time"] - t0), "eval_loss": float(r["eval/loss"]),
                           "outer_step": r.get("outer_step")})
    return points


def diloco_result(name: str, kind: str, out: dict[str, Any]) -> RunResult:
    """The result of a DiLoCo run from its islands' summaries (bytes: the largest payload of one island)."""
    summaries = out["islands"]
    n = len(summaries)
    first = summaries[0]
    wall = max(s["wall_seconds"] for s in summaries)
    compute = sum(s["compute_seconds"] for s in summaries) / n
    return RunResult(
        name=name, kind=kind, workers=n, curve=curve_from_metrics(Path(out["run_dirs"][0]), token_scale=n),
        final_eval_loss=float(first["eval_loss_end"]), bytes_per_worker=float(max(s["payload_bytes_sent"] for s in summaries)),
        wall_seconds=float(wall), compute_seconds=float(compute),
        extra={"comm_seconds": sum(s["comm_seconds"] for s in summaries) / n,
               "stall_seconds": sum(s.get("stall_seconds", s["comm_seconds"]) for s in summaries) / n,
               "peak_sync_bytes": max(peak_sync_bytes(Path(d)) for d in out["run_dirs"]),
               "counted_bytes_sent": [s["bytes_sent"] for s in summaries],
               "rounds_ok": [s["rounds_ok"] for s in summaries], "rounds_failed": [s["rounds_failed"] for s in summaries],
               "tokens": sum(s["tokens"] for s in summaries), "inner_steps_per_worker": first["inner_step"],
               "theta_global_max_abs_diff": out["theta_global_max_abs_diff"],
               "launcher_wall_seconds": out["launcher_wall_seconds"],
               "failures": [f for s in summaries for f in s.get("failures", [])][:20]})


def peak_sync_bytes(run_dir: Path) -> int:
    """The most all-reduce payload one island sent in a single round (one fragment's sync, with fragments)."""
    sent = [int(r["payload_bytes_sent"]) for r in read_metrics(run_dir) if "round_ok" in r]
    return max((b - a for a, b in zip([0] + sent, sent)), default=0)


def overlap_lines(blocking: RunResult, base: RunResult, arms: list[RunResult]) -> list[str]:
    """For each overlapped arm: compute utilization, wall-clock against the baseline, held-out loss against
    blocking DiLoCo and the baseline (at equal tokens, except for timed arms: the tokens they trained are
    said), and the bytes of its largest single sync."""
    def util(r: RunResult) -> float:
        return 100 * r.compute_seconds / r.wall_seconds if r.wall_seconds else float("nan")

    def pct(a: float, b: float) -> float:
        return (a - b) / abs(b) * 100

    lines = [f"overlap: blocking DiLoCo {blocking.name}: compute utilization {util(blocking):.1f}%, wall "
             f"{base.wall_seconds / blocking.wall_seconds:.1f}× shorter than the baseline, stalled "
             f"{blocking.extra.get('stall_seconds', 0):.0f} s, largest sync {format_bytes(blocking.extra.get('peak_sync_bytes', 0))}"]
    for r in arms:
        lines.append(
            f"overlap: {r.name}: compute utilization {util(r):.1f}% (blocking {util(blocking):.1f}%), wall "
            f"{base.wall_seconds / r.wall_seconds:.1f}× shorter than the baseline (blocking "
            f"{base.wall_seconds / blocking.wall_seconds:.1f}×), stalled {r.extra.get('stall_seconds', 0):.0f} s; held-out "
            f"loss {r.final_eval_loss:.4f}: {pct(r.final_eval_loss, blocking.final_eval_loss):+.2f}% vs blocking DiLoCo, "
            f"{pct(r.final_eval_loss, base.final_eval_loss):+.2f}% vs the baseline, with "
            f"{pct(r.extra.get('tokens', 0), blocking.extra.get('tokens', 0) or 1):+.1f}% tokens against blocking; largest sync "
            f"{format_bytes(r.extra.get('peak_sync_bytes', 0))}, θ_global spread {r.extra.get('theta_global_max_abs_diff')}")
    return lines


def codec_lines(fp32: RunResult, base: RunResult, arms: list[RunResult]) -> list[str]:
    """For each low-bit arm: held-out loss against fp32 DiLoCo and the baseline at equal tokens, bytes per
    worker (the codec's own count and, over emulated links, the busiest host's link counter) against the
    baseline's, and the θ_global spread across islands at the end."""
    def pct(a: float, b: float) -> float:
        return (a - b) / abs(b) * 100

    def ratio(key: str, r: RunResult) -> str:
        a, b = base.extra.get(key), r.extra.get(key)
        return f"{a / b:,.0f}×" if a and b else "n/a"

    lines = []
    for r in [fp32, *arms]:
        lines.append(
            f"codec: {r.name}: held-out loss {r.final_eval_loss:.4f} ({pct(r.final_eval_loss, fp32.final_eval_loss):+.2f}% "
            f"vs fp32 DiLoCo, {pct(r.final_eval_loss, base.final_eval_loss):+.2f}% vs the baseline); bytes per worker "
            f"{format_bytes(r.bytes_per_worker)}, {base.bytes_per_worker / max(r.bytes_per_worker, 1):,.0f}× fewer than "
            f"the baseline (link counters: {ratio('wire_bytes_sent_max_host', r)}); θ_global spread "
            f"{r.extra.get('theta_global_max_abs_diff')}")
    return lines


def counted_vs_link(r: RunResult, link_tx: list[int]) -> str:
    """How far the bytes a run's workers counted on their own connections (``bytes_sent``, from the
    kernel's per-socket counts) are from their hosts' link counters."""
    counted = r.extra["counted_bytes_sent"]
    gaps = [c / t - 1 for c, t in zip(counted, link_tx) if t]
    r.extra["counted_vs_link_max_gap"] = max(gaps, key=abs) if gaps else None
    pairs = ", ".join(f"{format_bytes(c)} vs {format_bytes(t)}" for c, t in zip(counted, link_tx))
    worst = f"{100 * r.extra['counted_vs_link_max_gap']:+.2f}%" if gaps else "n/a"
    return (f"{r.name}: bytes_sent the workers counted vs their hosts' link counters: {pairs} "
            f"(largest gap {worst})")


def baseline_result(name: str, summary: dict[str, Any], run_dir: Path) -> RunResult:
    """The result of a DDP baseline run from rank 0's summary."""
    return RunResult(
        name=name, kind="ddp", workers=int(summary["workers"]), curve=curve_from_metrics(run_dir),
        final_eval_loss=float(summary["eval_loss_end"]), bytes_per_worker=float(summary["payload_bytes_sent"]),
        wall_seconds=float(summary["wall_seconds"]), compute_seconds=float(summary["compute_seconds"]),
        extra={"comm_seconds": summary["comm_seconds"], "tokens": summary["tokens"],
               "counted_bytes_sent": [summary["bytes_sent"]],
               "inner_steps_per_worker": summary["inner_step"], "bytes_per_step": summary["bytes_per_step"],
               "comm_seconds_per_rank": summary.get("comm_seconds_per_rank"),
               "compute_seconds_per_rank": summary.get("compute_seconds_per_rank"),
               "launcher_wall_seconds": summary.get("launcher_wall_seconds"),
               "comm_method": summary.get("comm_method")})


def wall_model_line(r: RunResult, rate_bits: float | None) -> str:
    """``wall ≈ compute + bytes / link rate`` for one run, against what was measured."""
    comm = r.extra.get("comm_seconds", 0.0) or 0.0
    if rate_bits:
        link = r.bytes_per_worker * 8 / rate_bits
        predicted = r.compute_seconds + link
        return (f"{r.name}: wall ≈ compute {r.compute_seconds:.0f} s + bytes/link {format_bytes(r.bytes_per_worker)}"
                f" ÷ {rate_bits / 1e6:.1f} Mbit/s = {link:.0f} s → {predicted:.0f} s predicted, "
                f"{r.wall_seconds:.0f} s measured (time blocked communicating {comm:.0f} s)")
    return (f"{r.name}: wall ≈ compute {r.compute_seconds:.0f} s + communication {comm:.0f} s "
            f"= {r.compute_seconds + comm:.0f} s predicted, {r.wall_seconds:.0f} s measured (loopback, no link cap)")


def acceptance_lines(single: RunResult | None, base: RunResult, dl: RunResult, H: int,
                     capped: bool) -> tuple[list[str], dict[str, Any]]:
    """The three acceptance checks (loss within 2 %, bytes ≥ 0.8·H lower, wall ≥ 3× shorter)."""
    loss_pct = (dl.final_eval_loss - base.final_eval_loss) / abs(base.final_eval_loss) * 100
    bytes_factor = base.bytes_per_worker / dl.bytes_per_worker if dl.bytes_per_worker else math.inf
    wall_factor = base.wall_seconds / dl.wall_seconds if dl.wall_seconds else math.inf
    checks = {
        "loss_change_pct": loss_pct, "loss_ok": abs(loss_pct) <= ACCEPT_LOSS_PCT or loss_pct < 0,
        "bytes_reduction": bytes_factor, "bytes_ok": bytes_factor >= ACCEPT_BYTES_FACTOR * H,
        "wall_speedup": wall_factor, "wall_ok": wall_factor >= ACCEPT_WALL_RATIO, "link_capped": capped,
    }
    ok = lambda b: "PASS" if b else "FAIL"  # noqa: E731
    lines = [
        f"acceptance: DiLoCo final held-out loss {dl.final_eval_loss:.4f} vs baseline {base.final_eval_loss:.4f} "
        f"({loss_pct:+.2f}%, target within {ACCEPT_LOSS_PCT:g}%) {ok(checks['loss_ok'])}",
        f"acceptance: bytes per worker {bytes_factor:.1f}× lower than the baseline (target ≥ {ACCEPT_BYTES_FACTOR:g}·H "
        f"= {ACCEPT_BYTES_FACTOR * H:g}×) {ok(checks['bytes_ok'])}",
        f"acceptance: wall-clock {wall_factor:.2f}× shorter than the baseline (target ≥ {ACCEPT_WALL_RATIO:g}× "
        f"{'under the capped link' if capped else 'ON LOOPBACK, the target is about a capped link'}) "
        f"{ok(checks['wall_ok'])}",
    ]
    failed = dl.extra.get("rounds_failed") or []
    checks["diloco_rounds_failed"] = failed
    if any(failed):
        lines.append(f"warning: DiLoCo rounds failed (per island {failed}): "
                     + "; ".join(dl.extra.get("failures", [])[:3]))
    if single is not None:
        lines.append(f"single worker (1/{dl.workers} of the tokens): final held-out loss {single.final_eval_loss:.4f}")
    return lines, checks


def link_tx_bytes(network: Any) -> list[int]:
    """Bytes each emulated host has sent on its link so far (kernel counters, headers included)."""
    out = []
    for h in network.hosts:
        res = subprocess.run(["ip", "-n", h.namespace, "-j", "-s", "link", "show", h.interface],
                             capture_output=True, text=True, timeout=10)
        try:
            out.append(int(json.loads(res.stdout)[0]["stats64"]["tx"]["bytes"]))
        except (ValueError, IndexError, KeyError):
            out.append(0)
    return out


# ------------------------------------------------------------------------------------ the experiment
