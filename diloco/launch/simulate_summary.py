"""The table ``diloco simulate`` ends with: every island's figures, the spread of θ_global, a sample."""

from __future__ import annotations

import math
from typing import Any


def format_summary(result: dict[str, Any]) -> str:
    """A readable table of every island's figures."""
    head = ["island", "eval loss start", "eval loss end", "rounds ok", "rounds failed", "caught up", "sent", "received",
            "compute s", "comm s", "stalled s", "utilization"]
    rows = []
    for s in result["islands"]:
        util = s["compute_seconds"] / max(s["wall_seconds"], 1e-9)
        rows.append([s["island"], f"{s['eval_loss_start']:.3f}", f"{s['eval_loss_end']:.3f}", str(s["rounds_ok"]),
                     str(s["rounds_failed"]), str(s.get("rounds_caught_up", 0)),
                     _mb(s["bytes_sent"]), _mb(s["bytes_received"]),
                     f"{s['compute_seconds']:.1f}", f"{s['comm_seconds']:.1f}",
                     f"{s.get('stall_seconds', s['comm_seconds']):.1f}", f"{100 * util:.0f}%"])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    ppl = [math.exp(s["eval_loss_end"]) for s in result["islands"]]
    lines.append("")
    lines.append(f"held-out perplexity at the end: {', '.join(f'{p:.2f}' for p in ppl)}")
    lines.append(f"θ_global max |difference| between islands: {result['theta_global_max_abs_diff']:.3g}")
    lines.append(f"wall-clock: {result['wall_seconds']:.0f} s")
    sample = result.get("sample")
    if sample:
        lines.append(f"sample of θ_global after round {sample['outer_step']} (prompt, then → what the model wrote):")
        lines.append(f"  {sample['prompt']!r} → {sample['continuation']!r}")
    return "\n".join(lines)


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"
