"""Learning rates against DDP and DiLoCo: the report of frontier cells run at several ``--inner.lr`` and
``--diloco.outer_lr``::

    python -m experiments frontier --islands 2 --inner-steps 20 --seeds 0 --codecs '' \\
        --optimizers muon --inner.lr 4e-3 --diloco.outer_lr 0.5 --out DIR/lr4e-3-outer0.5
    ...
    python -m experiments.lr_sweep DIR

Every ``results.json`` under ``DIR`` (one frontier cell: DDP and fp32 DiLoCo of one inner optimizer, seed, k and
H) gives its DDP's and DiLoCo's held-out loss at the learning rates its config names.  Writes ``DIR/results.md``
(a table per inner optimizer: DDP and DiLoCo by inner and outer lr over the seeds run there, each one's best;
with two optimizers, the two at their best DiLoCo lrs seed by seed) and ``DIR/lr_sweep.png`` (held-out loss
against the inner lr).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from experiments.frontier import against_spread, spread
from experiments.report import markdown_table


def cells(root: Path) -> list[dict[str, Any]]:
    """One entry per frontier cell under ``root``: its inner optimizer, lrs, k, H, seed and the two losses."""
    out = []
    for path in sorted(root.rglob("results.json")):
        if path.parent == root:
            continue
        r = json.loads(path.read_text())
        if not isinstance(r, dict) or "runs" not in r or "config" not in r:
            continue
        cfg = r["config"]
        losses = {run["kind"]: run["final_eval_loss"] for run in r["runs"] if run.get("kind") in ("ddp", "diloco")}
        if len(losses) < 2:
            continue
        out.append({"optimizer": cfg["inner"]["optimizer"], "inner_lr": float(cfg["inner"]["lr"]),
                    "outer_lr": float(cfg["diloco"]["outer_lr"]), "islands": r.get("islands"),
                    "H": cfg["diloco"]["inner_steps"], "seed": cfg.get("seed"), "ddp": losses["ddp"],
                    "diloco": losses["diloco"], "cell": str(path.parent.relative_to(root))})
    return out


def report(root: Path) -> Path:
    """Write ``results.md`` and ``lr_sweep.png`` under ``root``; return ``results.md``."""
    found = cells(root)
    if not found:
        raise SystemExit(f"no frontier cell (a results.json with DDP and DiLoCo runs) under {root}")
    lines = ["# Learning rates: DDP and fp32 DiLoCo", "",
             "Held-out loss; over several seeds the mean [lowest, highest].", ""]
    best: dict[str, tuple[float, float]] = {}
    for opt in sorted({c["optimizer"] for c in found}):
        mine = [c for c in found if c["optimizer"] == opt]
        groups: dict[tuple[float, float], list[dict[str, Any]]] = {}
        for c in mine:
            groups.setdefault((c["inner_lr"], c["outer_lr"]), []).append(c)
        rows = []
        for (inner, outer), group in sorted(groups.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
            rows.append([f"{inner:g}", f"{outer:g}", ",".join(str(c["seed"]) for c in sorted(group, key=lambda c: c["seed"])),
                         spread({c["seed"]: c["ddp"] for c in group}, "{:.4f}"),
                         spread({c["seed"]: c["diloco"] for c in group}, "{:.4f}"),
                         spread({c["seed"]: 100 * (c["diloco"] / c["ddp"] - 1) for c in group}, "{:+.2f}%")])
        # DDP has no outer lr: the cells of one inner lr and seed ran the same DDP
        ddp = {inner: statistics.mean({c["seed"]: c["ddp"] for c in mine if c["inner_lr"] == inner}.values())
               for inner, _ in groups}
        best_ddp = min(ddp.items(), key=lambda kv: kv[1])
        best[opt] = min(groups, key=lambda k: statistics.mean(c["diloco"] for c in groups[k]))
        best_diloco = statistics.mean(c["diloco"] for c in groups[best[opt]])
        lines += [f"## {opt} (k = {mine[0]['islands']}, H = {mine[0]['H']})", "",
                  markdown_table(["inner lr", "outer lr", "seeds", "DDP", "DiLoCo", "DiLoCo vs DDP at its lr"], rows),
                  "", f"- best DDP: {best_ddp[1]:.4f} at inner lr {best_ddp[0]:g}; best DiLoCo: {best_diloco:.4f} at "
                  f"inner lr {best[opt][0]:g}, outer lr {best[opt][1]:g}; best DiLoCo against best DDP: "
                  f"{100 * (best_diloco / best_ddp[1] - 1):+.2f}% (means over each one's seeds)", ""]
    if len(best) == 2:
        (a, a_lrs), (b, b_lrs) = sorted(best.items(), key=lambda kv: kv[0] != "muon")
        at = {o: {c["seed"]: c["diloco"] for c in found if c["optimizer"] == o
                  and (c["inner_lr"], c["outer_lr"]) == lrs} for o, lrs in ((a, a_lrs), (b, b_lrs))}
        seeds = sorted(set(at[a]) & set(at[b]))
        if seeds:
            diffs = [100 * (at[a][s] / at[b][s] - 1) for s in seeds]
            lines += [f"## {a} against {b}, each at its best DiLoCo lrs", "",
                      f"- seeds {','.join(map(str, seeds))}: {a} {spread({s: at[a][s] for s in seeds}, '{:.4f}')}, "
                      f"{b} {spread({s: at[b][s] for s in seeds}, '{:.4f}')}; seed by seed "
                      + ", ".join(f"{d:+.2f}%" for d in diffs) + "; "
                      + (against_spread([at[a][s] for s in seeds], [at[b][s] for s in seeds], a, b)
                         if len(seeds) > 1 else "one seed: no spread to tell"), ""]
    _plot(found, root / "lr_sweep.png")
    lines += ["![held-out loss against the inner lr](lr_sweep.png)", ""]
    md = root / "results.md"
    md.write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))
    return md


def _plot(found: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, opt in enumerate(sorted({c["optimizer"] for c in found})):
        mine = [c for c in found if c["optimizer"] == opt]
        color = f"C{i}"
        ddp = [(lr, statistics.mean({c["seed"]: c["ddp"] for c in mine if c["inner_lr"] == lr}.values()))
               for lr in sorted({c["inner_lr"] for c in mine})]
        ax.plot(*zip(*ddp), color=color, ls="--", marker="s", label=f"{opt} DDP")
        for j, outer in enumerate(sorted({c["outer_lr"] for c in mine}, reverse=True)):
            at = [c for c in mine if c["outer_lr"] == outer]
            pts = [(lr, statistics.mean(c["diloco"] for c in at if c["inner_lr"] == lr))
                   for lr in sorted({c["inner_lr"] for c in at})]
            ax.plot(*zip(*pts), color=color, ls=["-", ":", "-."][j % 3], marker="o",
                    label=f"{opt} DiLoCo, outer lr {outer:g}")
    ax.set(xscale="log", xlabel="inner lr", ylabel="held-out loss (mean over seeds)",
           title="DDP and fp32 DiLoCo against the inner lr")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.lr_sweep", description=__doc__.split("\n")[0])
    parser.add_argument("root", type=Path, help="a folder holding frontier cells run at several learning rates")
    args = parser.parse_args(argv)
    report(args.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
