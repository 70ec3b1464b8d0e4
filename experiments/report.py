"""Comparison report for training runs: plots, a markdown table and raw JSON.

``write_report(results, out_dir, reference=None, notes=())`` writes into ``out_dir``:

* ``loss_vs_tokens.png`` - held-out loss against training tokens processed (all workers);
* ``loss_vs_bytes.png``  - held-out loss against bytes communicated per worker (log x axis;
  runs that communicate nothing are drawn as a dashed horizontal line at their final loss);
* ``loss_vs_time.png``   - held-out loss against wall-clock seconds;
* ``results.md``         - a table (final loss, perplexity, bytes/worker, wall-clock, compute
  utilisation and ratios against a reference run), links to the plots and free-text notes;
* ``results.json``       - the raw ``RunResult`` fields plus the derived numbers.

Plots are drawn with matplotlib's object API on an Agg canvas, so importing this module
never changes the global pyplot backend.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = [
    "RunResult",
    "format_bytes",
    "format_ratio",
    "markdown_table",
    "perplexity",
    "plot_curves",
    "summary_rows",
    "write_report",
]

KINDS = ("single", "ddp", "diloco")


@dataclass
class RunResult:
    name: str
    kind: str  # "single" | "ddp" | "diloco"
    workers: int
    # points with keys: tokens (total trained so far, all workers), bytes (communicated per
    # worker so far), seconds (wall clock since start), eval_loss (held-out, nats/token)
    curve: list[dict] = field(default_factory=list)
    final_eval_loss: float = float("nan")
    bytes_per_worker: float = 0.0
    wall_seconds: float = 0.0
    compute_seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunResult":
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in names})


# --------------------------------------------------------------------------- formatting


def format_bytes(n: float) -> str:
    """Human-readable byte count with decimal (SI) units: ``512 B``, ``12.3 MB``, ``1.05 GB``.

    Three significant digits from kB up; ``n/a`` for None/NaN/inf.
    """
    if not finite(n):
        return "n/a"
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    if round(n) < 1000:
        return f"{sign}{n:.0f} B"
    for unit in ("kB", "MB", "GB", "TB", "PB"):
        n /= 1000.0
        if n < 999.5:
            return f"{sign}{f'{n:#.3g}'.rstrip('.')} {unit}"
    return f"{sign}{n / 1000.0:#.3g}".rstrip(".") + " EB"


def format_ratio(value: float, reference: float) -> str:
    """``value / reference`` as ``"0.25×"``; small ratios also as a fraction: ``"0.002× (1/500)"``."""
    if not (finite(value) and finite(reference)):
        return "n/a"
    if reference == 0:
        return "—" if value == 0 else "∞"
    r = float(value) / float(reference)
    if r == 0:
        return "0×"
    text = f"{r:.3g}×"
    if 0 < r < 0.1:
        text += f" (1/{1 / r:.3g})"
    return text


def _format_pct_change(value: float, reference: float) -> str:
    if not (finite(value) and finite(reference)) or reference == 0:
        return "n/a"
    return f"{(float(value) - float(reference)) / abs(float(reference)) * 100:+.2f}%"


def perplexity(loss: float) -> float:
    """``exp(loss)`` (loss in nats/token); inf on overflow, NaN for a missing loss."""
    if not finite(loss):
        return float("nan")
    try:
        return math.exp(float(loss))
    except OverflowError:
        return float("inf")


def _cell(v: Any, float_fmt: str) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return float_fmt.format(v) if math.isfinite(v) else ("n/a" if math.isnan(v) else str(v))
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown_table(
    headers: Sequence[Any],
    rows: Iterable[Sequence[Any]],
    align: Sequence[str] | None = None,
    float_fmt: str = "{:.4g}",
) -> str:
    """A GitHub-flavoured markdown table (no trailing newline).

    Cells are ``str()``-ed (``|`` escaped); floats use ``float_fmt``; None is empty.
    ``align`` is one of ``"l"``, ``"r"``, ``"c"`` per column; by default columns whose
    cells are all numbers (int/float) are right-aligned, the others left-aligned.
    """
    headers = list(headers)
    rows = [list(r) for r in rows]
    ncol = len(headers)
    if ncol == 0:
        raise ValueError("markdown_table needs at least one column")
    for i, r in enumerate(rows):
        if len(r) != ncol:
            raise ValueError(f"row {i} has {len(r)} cells, expected {ncol}: {r!r}")
    if align is None:
        align = [
            "r" if rows and all(isinstance(r[c], (int, float)) and not isinstance(r[c], bool) for r in rows) else "l"
            for c in range(ncol)
        ]
    align = list(align)
    if len(align) != ncol or any(a not in ("l", "r", "c") for a in align):
        raise ValueError(f"align must give one of 'l', 'r', 'c' for each of the {ncol} columns")
    cells = [[_cell(h, float_fmt) for h in headers]] + [[_cell(v, float_fmt) for v in r] for r in rows]
    widths = [max(3, *(len(row[c]) for row in cells)) for c in range(ncol)]

    def fmt(row: list[str]) -> str:
        out = []
        for c, text in enumerate(row):
            out.append(text.rjust(widths[c]) if align[c] == "r" else text.ljust(widths[c]))
        return "| " + " | ".join(out) + " |"

    rule = []
    for c, a in enumerate(align):
        w = widths[c]
        rule.append({"l": ":" + "-" * (w - 1), "r": "-" * (w - 1) + ":", "c": ":" + "-" * (w - 2) + ":"}[a])
    lines = [fmt(cells[0]), "| " + " | ".join(rule) + " |"] + [fmt(r) for r in cells[1:]]
    return "\n".join(lines)


# --------------------------------------------------------------------------- table


def _pick_reference(results: Sequence[RunResult], reference: str | None) -> RunResult | None:
    if not results:
        return None
    if reference is not None:
        for r in results:
            if r.name == reference:
                return r
        raise ValueError(f"reference run {reference!r} not among {[r.name for r in results]}")
    for r in results:  # default: the communication baseline, else the first run
        if r.kind == "ddp":
            return r
    return results[0]


def _derived(r: RunResult, ref: RunResult | None) -> dict:
    util = r.compute_seconds / r.wall_seconds if finite(r.wall_seconds) and r.wall_seconds > 0 else float("nan")
    d = {
        "perplexity": perplexity(r.final_eval_loss),
        "compute_utilization": util,
    }
    if ref is not None:
        d["reference"] = ref.name
        d["bytes_ratio"] = (
            r.bytes_per_worker / ref.bytes_per_worker if ref.bytes_per_worker else None
        )
        d["wall_ratio"] = r.wall_seconds / ref.wall_seconds if ref.wall_seconds else None
        d["loss_change_pct"] = (
            (r.final_eval_loss - ref.final_eval_loss) / abs(ref.final_eval_loss) * 100
            if finite(ref.final_eval_loss) and ref.final_eval_loss and finite(r.final_eval_loss)
            else None
        )
    return d


def summary_rows(results: Sequence[RunResult], reference: str | None = None) -> tuple[list[str], list[list[str]]]:
    """Headers and formatted rows of the results table (what ``results.md`` shows)."""
    ref = _pick_reference(results, reference)
    rn = ref.name if ref is not None else "ref"
    headers = [
        "run",
        "kind",
        "workers",
        "final held-out loss",
        "perplexity",
        "bytes / worker",
        "wall-clock (s)",
        "compute util.",
        f"bytes ÷ {rn}",
        f"wall ÷ {rn}",
        f"loss vs {rn}",
    ]
    rows = []
    for r in results:
        d = _derived(r, ref)
        ppl = d["perplexity"]
        rows.append(
            [
                r.name + (" (ref)" if r is ref else ""),
                r.kind,
                str(r.workers),
                f"{r.final_eval_loss:.4f}" if finite(r.final_eval_loss) else "n/a",
                (f"{ppl:.2f}" if ppl < 1e6 else f"{ppl:.3g}") if finite(ppl) else ("inf" if ppl == math.inf else "n/a"),
                format_bytes(r.bytes_per_worker),
                f"{r.wall_seconds:.1f}" if finite(r.wall_seconds) else "n/a",
                f"{d['compute_utilization'] * 100:.1f}%" if finite(d["compute_utilization"]) else "n/a",
                format_ratio(r.bytes_per_worker, ref.bytes_per_worker) if ref else "n/a",
                format_ratio(r.wall_seconds, ref.wall_seconds) if ref else "n/a",
                _format_pct_change(r.final_eval_loss, ref.final_eval_loss) if ref else "n/a",
            ]
        )
    return headers, rows


# --------------------------------------------------------------------------- report


def json_safe(x: Any) -> Any:
    """``x`` with non-finite floats, paths and array scalars made strict JSON (NaN becomes null)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "item") and callable(x.item):  # numpy / torch scalars
        try:
            return json_safe(x.item())
        except Exception:
            pass
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def save_results(out: Path, table: str, data: Any) -> None:
    """Print ``table`` and keep it in ``out/results.md``, with ``data`` in ``out/results.json`` (strict JSON)."""
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps(json_safe(data), indent=1))


def write_report(
    results: list[RunResult],
    out_dir: Path,
    reference: str | None = None,
    notes: Sequence[str] = (),
    title: str = "DiLoCo vs baselines",
) -> Path:
    """Write plots, ``results.md`` and ``results.json`` into ``out_dir``; return the markdown path.

    ``reference`` names the run the ratio columns compare against; by default the first
    ``ddp`` run, else the first run. ``notes`` are free-text lines (e.g. the measured link
    rate) written as a bullet list under "Notes".
    """
    results = list(results)
    if not results:
        raise ValueError("write_report needs at least one RunResult")
    names = [r.name for r in results]
    if len(set(names)) != len(names):
        raise ValueError(f"run names must be unique, got {names}")
    if isinstance(notes, str):
        notes = [notes]
    ref = _pick_reference(results, reference)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    for fname, spec in PLOTS.items():
        plot_curves(results, path=out_dir / fname, **spec)

    headers, rows = summary_rows(results, ref.name if ref else None)
    lines = [f"# {title}", ""]
    lines.append(markdown_table(headers, rows, align=["l", "l"] + ["r"] * (len(headers) - 2)))
    lines += [
        "",
        "Loss is the held-out cross-entropy in nats/token; perplexity = exp(loss). "
        "Bytes are those each worker sent and received for synchronisation (1 MB = 10^6 B). "
        "Compute utilisation = time spent in forward/backward/optimizer steps ÷ wall-clock. "
        f"Ratios compare with `{ref.name}`; loss vs {ref.name} is the relative change of the final loss "
        "(negative = better).",
        "",
        "## Plots",
        "",
    ]
    for fname, spec in PLOTS.items():
        lines.append(f"![{spec['title']}]({fname})")
        lines.append("")
    notes = [str(n) for n in notes if str(n).strip()]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    md_path = out_dir / "results.md"
    md_path.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")

    payload = {
        "reference": ref.name if ref else None,
        "notes": notes,
        "runs": [{**r.to_dict(), "derived": _derived(r, ref)} for r in results],
    }
    (out_dir / "results.json").write_text(json.dumps(json_safe(payload), indent=2) + "\n", encoding="utf-8")
    return md_path


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
