"""The report's plots: held-out loss against tokens, bytes per worker and wall-clock, one line per run,
drawn with matplotlib's object API on an Agg canvas (importing this never changes pyplot's backend)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from experiments.report import RunResult


def finite(x: Any) -> bool:
    """Whether ``x`` is a finite number."""
    try:
        return x is not None and math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


PLOTS = {
    "loss_vs_tokens.png": dict(key="tokens", xlabel="training tokens processed (all workers)",
                               title="Held-out loss vs tokens", x_unit=""),
    "loss_vs_bytes.png": dict(key="bytes", xlabel="bytes communicated per worker (log scale)",
                              title="Held-out loss vs communication", logx=True, x_unit="B"),
    "loss_vs_time.png": dict(key="seconds", xlabel="wall-clock time (s)",
                             title="Held-out loss vs wall-clock time", x_unit="s"),
}


_LINESTYLE = {"single": ":", "ddp": "--", "diloco": "-"}
_MARKER = {"single": "s", "ddp": "o", "diloco": "^"}


def _points(r: RunResult, key: str) -> tuple[list[float], list[float]]:
    pts = []
    for p in r.curve:
        x, y = p.get(key), p.get("eval_loss")
        if finite(x) and finite(y):
            pts.append((float(x), float(y)))
    pts.sort(key=lambda t: t[0])
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_curves(results: Sequence[RunResult], key: str, path: Path, *, xlabel: str, title: str,
                logx: bool = False, x_unit: str = "") -> Path:
    """One held-out-loss line per run against ``curve[key]``; saved as a PNG at ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter

    fig = Figure(figsize=(8, 5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = [f"C{i % 10}" for i in range(len(results))]
    flat = []  # runs with nothing to draw on a log axis (e.g. a single worker sends 0 bytes)
    for r, c in zip(results, colors):
        xs, ys = _points(r, key)
        if logx:
            keep = [(x, y) for x, y in zip(xs, ys) if x > 0]
            xs, ys = [k[0] for k in keep], [k[1] for k in keep]
        label = f"{r.name} ({r.workers} worker{'s' if r.workers != 1 else ''})"
        if xs:
            ax.plot(xs, ys, color=c, linestyle=_LINESTYLE.get(r.kind, "-"), marker=_MARKER.get(r.kind, "."),
                    markersize=3.5, linewidth=1.8, label=label)
        elif finite(r.final_eval_loss):
            flat.append((r, c, label))
    for r, c, label in flat:
        ax.axhline(r.final_eval_loss, color=c, linestyle=":", linewidth=1.5,
                   label=f"{label}: final loss, {'no communication' if logx else 'no curve'}")
    if logx:
        ax.set_xscale("log")
        if x_unit:
            ax.xaxis.set_major_formatter(EngFormatter(unit=x_unit, sep=" "))
    else:
        ax.xaxis.set_major_formatter(EngFormatter(unit=x_unit, sep=" "))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.35)
    if logx:
        ax.grid(True, which="minor", alpha=0.12)
        lo, hi = ax.get_xlim()
        if x_unit and lo > 0 and hi / lo < 20:  # too few decades for labelled major ticks
            ax.xaxis.set_minor_formatter(EngFormatter(unit=x_unit, sep=" "))
            ax.tick_params(axis="x", which="minor", labelsize=7.5)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8.5, loc="best", framealpha=0.85)
    else:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="gray")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path
