"""Bytes against a byte-level BPE on the embedded corpus: what the tokenizer costs (training it, tokenizing,
the loader) and what it buys (bits per byte of the `small` model at equal compute).  Not a test.

    python benchmarks/tokenizer_bench.py                  # BPE of 4096, 400 steps each
    python benchmarks/tokenizer_bench.py --vocab 8192 --steps 600

1. `diloco tokenizer train`'s BPE on the corpus's training documents: seconds and MB/s.
2. Tokenizing the corpus (`Tokenizer.encode_documents`, every core): MB/s.
3. The loader (`ShardedBatches.next_batch`): tokens/s on one core, and its share of a `small` step.
4. The `small` model trained from the same seed for the same steps on batches of the same shape (16 x 128
   tokens), once on bytes and once on BPE tokens: held-out bits per byte as it trains.  Equal tokens per step;
   the FLOPs per token differ only by the output projection (256 vs the BPE's vocabulary), printed beside.

Writes ``--out`` (default experiments/results/tokenizers/): results.json, results.md, bits_per_byte.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from diloco.config import DataConfig, InnerOptimConfig, ModelConfig  # noqa: E402
from diloco.data.batches import ShardedBatches, heldout_batches  # noqa: E402
from diloco.data.corpus import build_corpus, documents, split_documents  # noqa: E402
from diloco.data.tokenizer import Tokenizer, fit_vocabulary, train_bpe  # noqa: E402
from diloco.model.inner import build_inner_optimizer, take_inner_step  # noqa: E402
from diloco.model.transformer import build_model, flops_per_token, lm_loss  # noqa: E402
from pipeline import ModelParts, ParallelSettings  # noqa: E402


def train_curve(tokenizer: Tokenizer, docs: list, steps: int, eval_every: int) -> dict:
    """Train `small` on ``tokenizer``'s ids of ``docs``; held-out bits per byte every ``eval_every`` steps."""
    cfg = ModelConfig(preset="small")
    fit_vocabulary(cfg, tokenizer)
    corpus = build_corpus(docs, DataConfig().heldout_fraction, "stdlib", tokenizer)
    inner = InnerOptimConfig(batch_size=16, warmup_steps=20)
    torch.manual_seed(0)
    model = ModelParts(build_model(cfg), None, ParallelSettings(), loss_fn=lm_loss, device="cpu")
    opt, sched = build_inner_optimizer(list(model.named_parameters()), inner, steps)
    batches = ShardedBatches(corpus.train, cfg.seq_len, inner.batch_size, 0, 1, 0)
    evals = heldout_batches(corpus.heldout, cfg.seq_len, inner.batch_size, 8)
    per_token = corpus.heldout_bytes_per_token
    curve, step_seconds = [], []
    for step in range(steps + 1):
        if step % eval_every == 0:
            loss = sum(model.eval_loss(x, y) for x, y in evals) / len(evals)
            curve.append((step, loss / math.log(2) / per_token))
            print(f"  {'bytes' if tokenizer.is_bytes else 'bpe':>5} step {step:4d}: {curve[-1][1]:.3f} bits/byte",
                  flush=True)
        if step < steps:
            t = time.perf_counter()
            take_inner_step(model, batches, opt, sched, inner)
            step_seconds.append(time.perf_counter() - t)
    return {"vocab": cfg.vocab_size, "bytes_per_token": per_token, "curve": curve,
            "flops_per_token": flops_per_token(cfg), "step_seconds": sorted(step_seconds)[len(step_seconds) // 2],
            "train_tokens": int(corpus.train.size), "text_seen_mb": steps * 16 * cfg.seq_len * per_token / 1e6}


def loader_tokens_per_s(tokens, seq_len: int = 128, batch: int = 16, n: int = 300) -> float:
    batches = ShardedBatches(tokens, seq_len, batch, 0, 1, 0)
    t = time.perf_counter()
    for _ in range(n):
        batches.next_batch()
    return n * batch * seq_len / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--out", default=str(REPO / "experiments" / "results" / "tokenizers"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    docs, what = documents(DataConfig())
    docs = list(docs)
    train_docs, _ = split_documents(docs, DataConfig().heldout_fraction, what)
    mb = sum(len(d) for _, d in train_docs) / 1e6
    t = time.perf_counter()
    bpe = train_bpe(train_docs, args.vocab)
    train_s = time.perf_counter() - t
    t = time.perf_counter()
    ids = bpe.encode_documents([d for _, d in train_docs])
    encode_s = time.perf_counter() - t
    print(f"BPE of {args.vocab}: trained on {mb:.1f} MB in {train_s:.1f} s ({mb / train_s:.2f} MB/s); tokenized in "
          f"{encode_s:.1f} s ({mb / encode_s:.1f} MB/s on {os.cpu_count()} cores); "
          f"{mb * 1e6 / ids.size:.2f} bytes per token", flush=True)
    loader = loader_tokens_per_s(ids)
    runs = {"bytes": train_curve(Tokenizer(), docs, args.steps, args.eval_every),
            "bpe": train_curve(bpe, docs, args.steps, args.eval_every)}
    loader_share = 16 * 128 / loader / runs["bpe"]["step_seconds"]
    result = {"corpus": what, "train_mb": mb, "vocab": args.vocab, "bpe_train_seconds": train_s,
              "encode_mb_per_s": mb / encode_s, "cores": os.cpu_count(), "loader_tokens_per_s": loader,
              "loader_share_of_step": loader_share, "steps": args.steps, "runs": runs}
    (out / "results.json").write_text(json.dumps(result, indent=2))
    lines = [f"# Bytes vs a byte-level BPE of {args.vocab} on {what}", "",
             f"`python benchmarks/tokenizer_bench.py --vocab {args.vocab} --steps {args.steps}`, "
             f"`small` model, batches of 16 x 128 tokens, {args.steps} steps, one thread.", "",
             f"- BPE trained on {mb:.1f} MB in {train_s:.1f} s; tokenizing runs at {mb / encode_s:.1f} MB/s on "
             f"{os.cpu_count()} cores.",
             f"- The loader serves {loader:,.0f} tokens/s on one core: {loader_share:.2%} of a `small` step.", "",
             "| tokens | vocab | bytes/token | text seen | FLOPs/token | step | bits/byte at start | at end |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        lines.append(f"| {name} | {r['vocab']} | {r['bytes_per_token']:.2f} | {r['text_seen_mb']:.1f} MB | "
                     f"{r['flops_per_token'] / 1e6:.1f}M | {r['step_seconds'] * 1e3:.0f} ms | {r['curve'][0][1]:.3f} | "
                     f"{r['curve'][-1][1]:.3f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in runs.items():
        ax.plot(*zip(*r["curve"]), marker="o", label=f"{name} (vocab {r['vocab']})")
    ax.set_xlabel("inner steps (same tokens per step)")
    ax.set_ylabel("held-out bits per byte")
    ax.set_title(f"small model on {what.split(' (')[0]}: bytes vs BPE")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "bits_per_byte.png", dpi=120)
    print((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
