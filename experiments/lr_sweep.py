"""Learning rates against DDP and DiLoCo: the report of frontier cells run at several ``--inner.lr`` and
``--diloco.outer_lr``::

    python -m experiments frontier --islands 2 --inner-steps 20 --seeds 0 --codecs '' \\
        --optimizers muon --inner.lr 4e-3 --diloco.outer_lr 0.5 --out DIR/lr4e-3-outer0.5
    ...
    python -m experiments.lr_sweep DIR

Every ``results.json`` under ``DIR`` (one frontier cell: DDP and fp32 DiLoCo of one inner optimizer, seed, k and
H) gives its DDP's and DiLoCo's held-out loss at the learning rates its config names.  Writes ``DIR/results.md``
(a table per inner optimizer: DDP by inner lr, DiLoCo by inner and outer lr, and each one's best) and
``DIR/lr_sweep.png`` (held-out loss against the inner lr).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

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
    lines = ["# Learning rates: DDP and fp32 DiLoCo", ""]
    for opt in sorted({c["optimizer"] for c in found}):
        mine = [c for c in found if c["optimizer"] == opt]
        ddp = {c["inner_lr"]: c["ddp"] for c in mine}
        rows = [[f"{c['inner_lr']:g}", f"{c['outer_lr']:g}", f"{c['ddp']:.4f}", f"{c['diloco']:.4f}",
                 f"{100 * (c['diloco'] / c['ddp'] - 1):+.2f}%", c["cell"]]
                for c in sorted(mine, key=lambda c: (c["inner_lr"], -c["outer_lr"]))]
        best_ddp = min(ddp.items(), key=lambda kv: kv[1])
        best = min(mine, key=lambda c: c["diloco"])
        lines += [f"## {opt} (k = {mine[0]['islands']}, H = {mine[0]['H']}, seeds {sorted({c['seed'] for c in mine})})",
                  "", markdown_table(["inner lr", "outer lr", "DDP", "DiLoCo", "DiLoCo vs DDP at its lr", "cell"], rows),
                  "", f"- best DDP: {best_ddp[1]:.4f} at inner lr {best_ddp[0]:g}; best DiLoCo: {best['diloco']:.4f} at "
                  f"inner lr {best['inner_lr']:g}, outer lr {best['outer_lr']:g}; best DiLoCo against best DDP: "
                  f"{100 * (best['diloco'] / best_ddp[1] - 1):+.2f}%", ""]
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
        ddp = sorted({(c["inner_lr"], c["ddp"]) for c in mine})
        ax.plot(*zip(*ddp), color=color, ls="--", marker="s", label=f"{opt} DDP")
        for j, outer in enumerate(sorted({c["outer_lr"] for c in mine}, reverse=True)):
            pts = sorted((c["inner_lr"], c["diloco"]) for c in mine if c["outer_lr"] == outer)
            ax.plot(*zip(*pts), color=color, ls=["-", ":", "-."][j % 3], marker="o",
                    label=f"{opt} DiLoCo, outer lr {outer:g}")
    ax.set(xscale="log", xlabel="inner lr", ylabel="held-out loss", title="DDP and fp32 DiLoCo against the inner lr")
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
