"""Which collectives gloo serves for GPU tensors when two ranks share one GPU (``--parallel.gpus``).

NCCL refuses two ranks on one GPU, so an island whose ranks share GPUs runs gloo on CUDA tensors; gloo stages
some collectives through pinned host memory and not others.  Each collective below runs in its own pair of
processes on GPU 0, all pairs at once, each with a timeout, so that one that crashes or hangs says so and the others
still answer.  Not a test; needs CUDA.

    python benchmarks/gloo_cuda_probe.py [--out DIR] [--timeout SECONDS]

Prints a table (collective, what torch call the island makes with it, result) and writes ``probe.json`` to
``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

# name: (which part of an island makes this call, the call)
PROBES = {
    "all_reduce": "TP's row-parallel sums, grad clipping, the island's control values",
    "broadcast": "the pipeline's loss, θ scattered at start",
    "all_gather_into_tensor": "FSDP's parameter gather; TP's logits (pipeline.tensor_parallel.gather_logits)",
    "funcol_all_gather": "DTensor Shard->Replicate (full_tensor, redistribute)",
    "reduce_scatter_tensor": "FSDP's gradient reduce-scatter",
    "send_recv": "the pipeline's activations and gradients (torch.distributed.pipelining)",
    "batch_isend_irecv": "the pipeline schedules' batched point-to-point",
    "all_to_all_single": "(not used by an island; for completeness)",
    "all_gather_object": "the island's agreement on layouts and settings",
}


def worker(name: str, rank: int, port: int, device: str) -> None:
    """Run collective ``name`` as ``rank`` of 2 on ``device`` (``cuda``: GPU 0) and check its result; exit 0 when
    right."""
    import torch
    import torch.distributed as dist

    dev, other = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu"), 1 - rank
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mine = torch.full((4, 3), float(rank + 1), device=dev)
    if name == "all_reduce":
        dist.all_reduce(mine)
        ok = torch.all(mine == 3).item()
    elif name == "broadcast":
        dist.broadcast(mine, src=0)
        ok = torch.all(mine == 1).item()
    elif name == "all_gather_into_tensor":
        out = torch.empty((8, 3), device=dev)
        dist.all_gather_into_tensor(out, mine)
        ok = torch.all(out[:4] == 1).item() and torch.all(out[4:] == 2).item()
    elif name == "funcol_all_gather":
        import torch.distributed._functional_collectives as funcol

        out = funcol.all_gather_tensor(mine, 0, dist.group.WORLD)
        out = out.wait() if hasattr(out, "wait") else out
        ok = torch.all(out[:4] == 1).item() and torch.all(out[4:] == 2).item()
    elif name == "reduce_scatter_tensor":
        full = torch.arange(8.0, device=dev).repeat_interleave(3).reshape(8, 3) * (rank + 1)
        out = torch.empty((4, 3), device=dev)
        dist.reduce_scatter_tensor(out, full)
        ok = torch.equal(out, 3 * torch.arange(8.0, device=dev).repeat_interleave(3).reshape(8, 3)[4 * rank:4 * rank + 4])
    elif name == "send_recv":
        got = torch.zeros_like(mine)
        if rank == 0:
            dist.send(mine, other)
            dist.recv(got, other)
        else:
            dist.recv(got, other)
            dist.send(mine, other)
        ok = torch.all(got == other + 1).item()
    elif name == "batch_isend_irecv":
        got = torch.zeros_like(mine)
        ops = [dist.P2POp(dist.isend, mine, other), dist.P2POp(dist.irecv, got, other)]
        for w in dist.batch_isend_irecv(ops if rank == 0 else ops[::-1]):
            w.wait()
        ok = torch.all(got == other + 1).item()
    elif name == "all_to_all_single":
        out = torch.empty_like(mine)
        dist.all_to_all_single(out, mine)
        ok = torch.all(out[:2] == 1).item() and torch.all(out[2:] == 2).item()
    elif name == "all_gather_object":
        out = [None, None]
        dist.all_gather_object(out, {"rank": rank})
        ok = out == [{"rank": 0}, {"rank": 1}]
    else:
        raise SystemExit(f"unknown probe {name}")
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dist.destroy_process_group()
    print("RESULT", "right" if ok else "WRONG VALUES", flush=True)
    sys.exit(0 if ok else 3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_all(timeout: float, device: str) -> list[dict]:
    """Start every probe's pair at once; collect each within ``timeout`` seconds."""
    pairs = {}
    for name in PROBES:
        port = free_port()
        pairs[name] = [subprocess.Popen([sys.executable, __file__, "--worker", name, str(r), str(port), device],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                       for r in (0, 1)]
    rows, deadline = [], time.monotonic() + timeout
    for name, procs in pairs.items():
        codes, outputs = [], []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                codes.append("hung")
            else:
                codes.append(p.returncode)
            outputs.append(out)
        if codes == [0, 0]:
            result = "works"
        elif "hung" in codes:
            result = f"hangs (no answer in {timeout:.0f} s)"
        elif any(isinstance(c, int) and c < 0 for c in codes):
            result = f"crashes (signal {-min(c for c in codes if isinstance(c, int))})"
        elif 3 in codes:
            result = "wrong values"
        else:
            errors = [line for o in outputs for line in o.splitlines() if "Error" in line]
            result = "raises: " + (errors[-1][:160] if errors else f"exit {codes}")
        rows.append({"collective": name, "used_for": PROBES[name], "result": result, "exit_codes": codes})
    return rows


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--cpu", action="store_true", help="the same collectives on host tensors (checks the probe)")
    args = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    rows = run_all(args.timeout, "cpu" if args.cpu else "cuda")
    print("| collective (2 ranks, one GPU, gloo) | an island uses it for | result |\n|---|---|---|")
    for r in rows:
        print(f"| {r['collective']} | {r['used_for']} | {r['result']} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
