"""``diloco train --dry-run`` against a real island of the same shape: memory per rank, side by side.

The dry run (one process, a fake process group, fake tensors; :mod:`diloco.launch.dry_run`) predicts the peak a rank
allocates in an inner step.  This script then runs that island for real: ``dp * tp`` gloo ranks on this machine's
CPU (fp32), each building its parts with the trainer's own code (real initial values), taking one inner step so that
the optimizer holds its state, and measuring the second step with torch's profiler, whose memory events are the CPU
allocator's own (every allocation and free, with its size): the peak is what the rank held when the step began
(parameters, optimizer state) plus the highest the running sum of those events reached.

    python benchmarks/dry_run_check.py            # dp2 x tp2 of a 512-wide, 8-block model, 4 sequences of 512

Prints one line per rank (dry run, real, ratio) and the worst ratio.  (The real peak: ``allocated_peak`` of
:mod:`diloco.launch.dry_run`.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = ["--model.dim", "512", "--model.n_layers", "8", "--model.n_heads", "8", "--model.ffn_dim", "1536",
         "--model.seq_len", "512"]


def worker(args: argparse.Namespace) -> None:
    """One rank of the real island: its peak bytes over the second inner step, into ``args.out``."""
    import torch

    from diloco.config.loader import load
    from diloco.config.schema import resolve_model
    from diloco.launch.dry_run import allocated_peak
    from diloco.model.inner import build_inner_optimizer
    from diloco.model.transformer import initial_model, lm_loss
    from pipeline import ModelParts
    from pipeline.mesh import destroy_island, exit_worker, init_island_mesh

    torch.set_num_threads(1)
    cfg = load(None, [*MODEL, "--parallel.dp", str(args.dp), "--parallel.tp", str(args.tp), "--device", "cpu",
                      "--inner.batch_size", str(args.batch)])
    m = cfg.model
    resolve_model(m)
    m.vocab_size = m.vocab_size or 256
    mesh = init_island_mesh(args.tp, 1, "cpu", dp=args.dp)
    skeleton, initial = initial_model(m, 0)
    parts = ModelParts(skeleton, mesh, cfg.parallel, loss_fn=lm_loss, device="cpu", init=initial)
    opt, _ = build_inner_optimizer(list(parts.named_parameters()), cfg.inner, total_steps=10)
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    x = torch.randint(0, 256, (args.batch, m.seq_len), generator=g)

    def step() -> None:
        parts.train_step(x, x)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer's state, as every later step holds it
    held = [*parts.parameters(), *(t for state in opt.state.values() for t in state.values()
                                    if isinstance(t, torch.Tensor))]
    peak = allocated_peak(step, held)
    Path(args.out, f"rank{os.environ['RANK']}.json").write_text(json.dumps({"peak": peak}))
    destroy_island()
    exit_worker(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1",
               GLOO_SOCKET_IFNAME="lo")
    shape = ["--parallel.dp", str(args.dp), "--parallel.tp", str(args.tp), "--inner.batch_size", str(args.batch)]
    dry = subprocess.run([sys.executable, "-m", "diloco.cli", "train", "--dry-run", "--device", "cpu", *MODEL, *shape],
                         capture_output=True, text=True, env=env, cwd=REPO, check=True)
    predicted = json.loads(dry.stdout.strip().splitlines()[-1])
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                        str(args.dp * args.tp), __file__, "--worker", "--out", out, "--dp", str(args.dp), "--tp",
                        str(args.tp), "--batch", str(args.batch)], env=env, cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        real = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
    print(f"island dp={args.dp} x tp={args.tp}, model {' '.join(MODEL[1::2])} (dim, blocks, heads, ffn, seq), "
          f"{args.batch} sequences per micro-batch, fp32 on CPU; dry run answered in {predicted['seconds']:.1f} s")
    print(f"dry run, every rank: peak {predicted['peak'] / 1e6:.1f} MB (parameters {predicted['params'] / 1e6:.1f}, "
          f"optimizer {predicted['optimizer'] / 1e6:.1f}, activations {predicted['activations'] / 1e6:.1f})")
    ratios = []
    for rank, r in enumerate(real):
        ratios.append(predicted["peak"] / r["peak"])
        print(f"rank {rank}: real peak {r['peak'] / 1e6:.1f} MB; dry run / real = {ratios[-1]:.3f}")
    print(f"worst: {max(ratios, key=lambda q: abs(q - 1)):.3f}")


if __name__ == "__main__":
    main()
