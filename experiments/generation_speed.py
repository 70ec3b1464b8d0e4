"""Generation speed of `diloco generate`: one process against tp=2 and pp=2 islands, with and without the
KV cache, measured side by side in one run through the real command line.

    python -m experiments.generation_speed [--preset small] [--tokens 96] [--out experiments/results/generation]

The model is the preset's seeded initialisation exported with `diloco export`-style files (speed does
not depend on the weights); the prompt is held-out text of the standard library.  Each arm runs the
command once (under torchrun for tp/pp, gloo on CPU) and reads the tokens/s it reports.  Writes
``results.md``, ``results.json`` and ``speed.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from diloco.config import DataConfig, ModelConfig, resolve_model
from diloco.data.corpus import load_corpus
from diloco.model.hf import export_hf
from diloco.model.transformer import build_model
from experiments.report import markdown_table

ARMS = [("1 process", 1, 1), ("tp=2", 2, 1), ("pp=2", 1, 2)]


def run_arm(folder: Path, prompt: str, tokens: int, tp: int, pp: int, cache: bool) -> float:
    """tokens/s reported by one `diloco generate` run."""
    base = ["-m", "diloco.cli", "generate", str(folder), "--prompt", prompt, "--max-new-tokens", str(tokens),
            "--device", "cpu"] + ([] if cache else ["--no-cache"])
    if tp * pp > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp * pp),
               *base, "--parallel.tp", str(tp), "--parallel.pp", str(pp)]
    else:
        cmd = [sys.executable, *base]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    found = re.search(r"([\d.]+) tokens/s", done.stderr)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return float(found[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/generation"))
    args = parser.parse_args(argv)
    cfg = ModelConfig(preset=args.preset)
    resolve_model(cfg)
    heldout = load_corpus(DataConfig(max_bytes=2_000_000)).heldout
    start = int((heldout[:4096] == ord("\n")).nonzero()[0][0]) + 1
    prompt_len = max(1, min(cfg.seq_len - args.tokens - 1, 24))
    prompt = bytes(heldout[start:start + prompt_len]).decode("utf-8", errors="replace")
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_hf(dict(build_model(cfg).named_parameters()), cfg, Path(tmp) / "model")
        for name, tp, pp in ARMS:
            speeds = {cache: run_arm(folder, prompt, args.tokens, tp, pp, cache) for cache in (True, False)}
            print(f"{name}: {speeds[True]:.1f} tokens/s with the KV cache, {speeds[False]:.1f} without", flush=True)
            results[name] = speeds
            rows.append([name, speeds[True], speeds[False], speeds[True] / speeds[False]])
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m experiments.generation_speed " + " ".join(argv if argv is not None else sys.argv[1:])
    table = markdown_table(["island", "tokens/s (KV cache)", "tokens/s (no cache)", "cache speed-up"], rows,
                           float_fmt="{:.1f}")
    text = (f"# Generation speed\n\n`{command}`\n\n`{args.preset}` model ({cfg.dim}d, {cfg.n_layers} layers, context "
            f"{cfg.seq_len}), {args.tokens} new tokens after a {prompt_len}-byte held-out prompt, CPU, one thread per "
            f"process, gloo between processes.\n\n{table}\n")
    (args.out / "results.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps({"preset": args.preset, "tokens": args.tokens,
                                                       "tokens_per_second": results}, indent=1))
    _plot(rows, args.out / "speed.png", args.preset)
    print(text)
    return 0


def _plot(rows: list[list], path: Path, preset: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r[1] for r in rows], width=0.4, label="KV cache")
    ax.bar([i + 0.2 for i in x], [r[2] for r in rows], width=0.4, label="no cache")
    ax.set_xticks(list(x), [r[0] for r in rows])
    ax.set_ylabel("tokens / s")
    ax.set_title(f"diloco generate, {preset} model, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
