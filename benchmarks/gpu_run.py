"""Whole runs on one GPU, as a user starts them: ``diloco train`` (one island with the round's whole host path,
``--averaging.backend local``: everything but the network) and ``diloco simulate --islands 2 --share-gpus`` (two
islands on one GPU averaging over real hivemind on loopback).  bf16 and compiled blocks; blocking and delayed
overlap.  Not a test; needs CUDA (``--smoke`` runs the same code on CPU with the tiny model).

    python benchmarks/gpu_run.py                                  # every case below, H = 100
    python benchmarks/gpu_run.py --cases 1b-delayed,1b-blocking --rounds 4
    python benchmarks/gpu_run.py --smoke                          # tiny model on CPU, H = 4: the code paths

Per case it reads each island's ``metrics.jsonl`` and ``summary.json`` and reports:

- the training thread's stall per round (``stall_seconds``: handing the round over, waiting for it, applying
  it), median over the rounds from the second on (the first carries compilation and the islands' meeting;
  with overlap the last is excluded too: the run waits for its result before it ends), as a share of the
  round's wall time;
- MFU inside the running loop: the median over the logged windows of inner steps (``mfu``, and the tokens/s
  of the same windows), and over the
  whole steady run, from the end of round 1 to the end of the last (stalls, evaluation and everything
  else counted), and over the whole run with its start-up (compilation included);
- utilization (compute seconds over wall seconds, the island's own figure), peak GPU and host memory per
  island, the round's wall time, rounds committed and whether every island ended on the same θ_global;
- recompilations and graph breaks (``TORCH_LOGS=recompiles,graph_breaks``) found in the logs.

Writes ``--out`` (default experiments/results/gpu-run/): ``results.json`` (one line per case as it ends, so a
run cut short keeps what it had), ``results.md``, and each case's logs under ``runs/``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from diloco.engine.metrics import read_metrics  # noqa: E402
from diloco.launch import tail  # noqa: E402

class Case(NamedTuple):
    """One whole run: the model, how many islands, the round's overlap, the averaging backend, where the outer
    state lives, and the island's split (``--parallel.*``; its ranks then share the one GPU, ``--parallel.gpus 1``)."""

    preset: str
    islands: int
    overlap: str
    backend: str
    outer_device: str
    parallel: dict[str, int] = {}
    rejoin: int = 0
    """Above 0: the last island is SIGKILLed in round ``rejoin``'s all-reduce and started again with --resume once
    the others committed the next round, so that it catches θ_global up from an island serving it (from the GPU,
    where the outer state lives there)."""


SHARED = {"parallel.gpus": 1}
CASES: dict[str, Case] = {
    "1b-delayed": Case("1b", 1, "delayed", "local", "cpu"),
    "150m-2-islands-hivemind": Case("150m", 2, "delayed", "hivemind", "cpu"),
    "1b-blocking": Case("1b", 1, "none", "local", "cpu"),
    "1b-delayed-outer-on-gpu": Case("1b", 1, "delayed", "local", "cuda"),
    "1b-blocking-outer-on-gpu": Case("1b", 1, "none", "local", "cuda"),
    "150m-delayed": Case("150m", 1, "delayed", "local", "cpu"),
    # an island's ranks on one GPU (gloo on CUDA tensors): the CUDA paths of sharded islands, not their speed
    "150m-dp2-one-gpu": Case("150m", 1, "delayed", "local", "cpu", {"parallel.dp": 2, **SHARED}),
    "150m-tp2-one-gpu": Case("150m", 1, "delayed", "local", "cpu", {"parallel.tp": 2, **SHARED}),
    "150m-pp2-one-gpu": Case("150m", 1, "delayed", "local", "cpu", {"parallel.pp": 2, **SHARED}),
    "150m-pp2-tp2-one-gpu": Case("150m", 1, "delayed", "local", "cpu", {"parallel.pp": 2, "parallel.tp": 2, **SHARED}),
    "150m-dp2-tp2-one-gpu": Case("150m", 1, "delayed", "local", "cpu", {"parallel.dp": 2, "parallel.tp": 2, **SHARED}),
    "150m-2-tp2-islands-hivemind": Case("150m", 2, "delayed", "hivemind", "cpu", {"parallel.tp": 2, **SHARED}),
    "1b-dp2-one-gpu": Case("1b", 1, "delayed", "local", "cpu", {"parallel.dp": 2, **SHARED}),
    # θ_global and the momentum on the GPU, served to an island that comes back behind the run
    "tiny-outer-on-gpu-serves-a-joiner": Case("tiny", 3, "none", "hivemind", "cuda", rejoin=2),
}
JOIN = {"averaging.min_group_size": 2, "averaging.matchmaking_timeout": 12.0,
        "averaging.state_download_timeout": 20.0, "averaging.member_ttl": 20.0, "checkpoint.every": 1}
"""A rejoin case's settings: two islands commit without the third, and its restart resumes from a checkpoint."""
JOIN_ROUNDS, JOIN_INNER = 10, 800
"""A rejoin case's least rounds and H: the others must still be running when the killed island is back (~25 s on the
H200, tiny model: 150 steps took 1.2 s there, and 12 rounds of them ended before it was)."""
BATCH = {"tiny": 4, "150m": 16, "1b": 4}  # sequences per step: as benchmarks/gpu_island.py, so MFU compares


def case_items(name: str, inner_steps: int, rounds: int, run_dir: Path, smoke: bool) -> dict[str, Any]:
    """The settings of one case (dotted keys)."""
    preset, islands, overlap, backend, outer_device, parallel, rejoin = CASES[name]
    if smoke:
        preset = "tiny"
    if rejoin:
        inner_steps, rounds = max(inner_steps, JOIN_INNER), max(rounds, JOIN_ROUNDS)
    items = {"model.preset": preset, "inner.batch_size": BATCH[preset], "diloco.inner_steps": inner_steps,
             "diloco.outer_steps": rounds, "diloco.overlap": overlap, "diloco.master_device": outer_device,
             "averaging.backend": backend, "parallel.param_dtype": "fp32" if smoke else "bf16",
             "parallel.compile": str(not smoke).lower(), "logging.run_dir": str(run_dir),
             "logging.eval_every": rounds, "logging.samples": 0, "logging.log_every": max(inner_steps // 10, 1),
             "checkpoint.every": 0, "wandb.mode": "disabled", "data.max_bytes": 8_000_000,
             "averaging.run_id": f"gpu-run-{name}"}
    items.update(parallel)
    if rejoin:
        items.update(JOIN)
    if smoke:
        items.update({"device": "cpu", "diloco.master_device": "cpu", "threads": 1})
        items.pop("parallel.gpus", None)
    return items


def case_args(name: str, inner_steps: int, rounds: int, run_dir: Path, smoke: bool) -> list[str]:
    """The command line of one case."""
    _, islands, _, _, _, parallel, _ = CASES[name]
    items = case_items(name, inner_steps, rounds, run_dir, smoke)
    args = [x for k, v in items.items() for x in (f"--{k}", str(v))]
    ranks = parallel.get("parallel.dp", 1) * parallel.get("parallel.tp", 1) * parallel.get("parallel.pp", 1)
    if islands == 1 and ranks > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                "-m", "diloco.cli", "train", *args]
    if islands == 1:
        return [sys.executable, "-m", "diloco.cli", "train", *args]
    return [sys.executable, "-m", "diloco.cli", "simulate", "--islands", str(islands),
            *([] if smoke else ["--share-gpus"]), *args]


def run_case(name: str, inner_steps: int, rounds: int, out: Path, timeout: float, smoke: bool) -> dict[str, Any]:
    """Run one case to its end (or its timeout) and read what its islands wrote."""
    run_dir = out / "runs" / name
    run_dir.mkdir(parents=True, exist_ok=True)
    if CASES[name].rejoin:
        return run_rejoin_case(name, inner_steps, rounds, run_dir, timeout, smoke)
    cmd = case_args(name, inner_steps, rounds, run_dir, smoke)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_LOGS": "recompiles,graph_breaks",
           "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    log = run_dir / "command.log"
    t0 = time.perf_counter()
    with log.open("w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    row: dict[str, Any] = {"case": name, "command": " ".join(cmd[2:]), "rc": rc,
                           "seconds": time.perf_counter() - t0, "timed_out": rc == -signal.SIGKILL}
    read_case(row, run_dir)
    if rc != 0:
        row["log_tail"] = tail(log, 25)
    for f in run_dir.rglob("theta_global.pt"):  # 5 GB at 1b: not kept
        f.unlink()
    return row


def run_rejoin_case(name: str, inner_steps: int, rounds: int, run_dir: Path, timeout: float,
                    smoke: bool) -> dict[str, Any]:
    """A case whose last island is killed and comes back (:attr:`Case.rejoin`), driven as the fault tests drive
    one: the row says whether it caught up by a download and every island ended on the same θ_global."""
    from diloco.config.loader import load
    from diloco.launch.simulate import Cluster, SimulationError

    case = CASES[name]
    victim = case.islands - 1
    items = case_items(name, inner_steps, rounds, run_dir, smoke)
    cfg = load(None, items)
    cluster = Cluster(cfg, case.islands, env={victim: {"DILOCO_FAULTS": f"kill@allreduce:{case.rejoin}"}},
                      share_gpus=not smoke)
    t0 = time.perf_counter()
    deadline = time.time() + timeout
    problem = ""

    def wait_for(done: Any, what: str) -> None:
        while not done():
            if time.time() > deadline or cluster.failed() and not cluster.procs[victim].poll():
                raise SimulationError(f"timed out waiting for {what}")
            time.sleep(0.5)

    def committed(d: Path, step: int) -> bool:
        return any(r.get("round_ok") and r["outer_step"] >= step for r in read_metrics(d))

    try:
        cluster.start_all()
        wait_for(lambda: cluster.procs[victim].poll() is not None, f"island {victim}'s scripted kill")
        wait_for(lambda: all(committed(d, case.rejoin + 1) for d in cluster.run_dirs[:victim]),
                 f"the others to commit round {case.rejoin + 1}")
        cluster.restart(victim, env={"DILOCO_FAULTS": ""})
        cluster.wait(timeout=max(deadline - time.time(), 1.0))
    except SimulationError as e:
        problem = str(e)
    finally:
        cluster.stop_all()
    rc = 1 if problem else 0
    row: dict[str, Any] = {"case": name, "command": f"rejoin case: {items}",
                           "rc": rc, "seconds": time.perf_counter() - t0, "timed_out": "timed out" in problem}
    read_case(row, run_dir)
    log = cluster.logs[victim].read_text(errors="replace") if cluster.logs[victim].exists() else ""
    row["caught_up"] = re.findall(r"caught up with the run at outer step \d+[^\n]*", log)
    if problem:
        row["log_tail"] = problem
    for f in run_dir.rglob("theta_global.pt"):
        f.unlink()
    return row


def read_case(row: dict[str, Any], run_dir: Path) -> None:
    """Fill ``row`` with what the case's islands wrote under ``run_dir``."""
    name = row["case"]
    island_dirs = [run_dir] if CASES[name][1] == 1 else sorted(run_dir.glob("island*"))
    row["islands"] = [read_island(d, CASES[name][2]) for d in island_dirs]
    logs = "".join(p.read_text(errors="replace") for p in run_dir.rglob("*.log"))
    row["recompiles"] = len(re.findall(r"Recompiling function", logs))
    row["graph_breaks"] = len(re.findall(r"Graph break", logs))
    checksums = {i.get("theta_checksum") for i in row["islands"]}
    row["theta_identical"] = (len(checksums) == 1 and None not in checksums) if len(island_dirs) > 1 else None


def read_island(run_dir: Path, overlap: str) -> dict[str, Any]:
    """One island's figures from its metrics and summary (empty when it wrote no metrics; an island that died
    before its summary: the rounds it logged, with ``outer_step`` None)."""
    summary = run_dir / "summary.json"
    records = read_metrics(run_dir)
    if not records:
        return {}
    rounds = [r for r in records if "round_ok" in r]
    s = json.loads(summary.read_text()) if summary.exists() else {
        "rounds_ok": sum(r["round_ok"] for r in rounds), "tokens": rounds[-1]["tokens"] if rounds else 0,
        "compute_seconds": 0.0, "wall_seconds": 0.0,
        "peak_memory_gb": max((r["peak_memory_gb"] for r in records if "peak_memory_gb" in r), default=None)}
    steady = rounds[1:-1] if overlap != "none" and len(rounds) > 2 else rounds[1:]
    out: dict[str, Any] = {k: s.get(k) for k in ("outer_step", "rounds_ok", "tokens", "compute_seconds",
                                                   "stall_seconds", "wall_seconds", "theta_checksum",
                                                   "peak_memory_gb", "peak_host_memory_gb", "eval_loss_start",
                                                   "eval_loss_end")}
    out["utilization"] = s["compute_seconds"] / s["wall_seconds"] if s["wall_seconds"] else None
    if steady:
        out["stall_median_s"] = statistics.median(r["stall_seconds"] for r in steady)
        out["send_median_s"] = statistics.median(r["send_seconds"] for r in steady)
    # the steady run: from the end of round 1 to the end of the last steady round
    window = [rounds[0], *steady] if steady else []
    if len(window) >= 2:
        walls = [b["time"] - a["time"] for a, b in zip(window, window[1:])]
        out["round_wall_s"] = statistics.median(walls)
        out["stall_share"] = out["stall_median_s"] / out["round_wall_s"]
    steps = [r for r in records if "mfu" in r]
    if steps:
        flops_share = steps[-1]["mfu"] / steps[-1]["tokens_per_second_per_device"]  # FLOPs per token / peak
        after_round_1 = steps[len(steps) // max(len(rounds), 1):] or steps  # a run cut short in round 2: all
        out["mfu_steps_median"] = statistics.median(r["mfu"] for r in after_round_1)
        out["tokens_per_s_steps_median"] = statistics.median(r["tokens_per_second_per_device"] for r in after_round_1)
        if len(window) >= 2:
            tokens = window[-1]["tokens"] - window[0]["tokens"]
            out["mfu_steady"] = tokens / (window[-1]["time"] - window[0]["time"]) * flops_share
        if s["wall_seconds"]:
            out["mfu_whole_run"] = s["tokens"] / s["wall_seconds"] * flops_share
    return out


def fmt(x: Any, pattern: str = "{:.3f}") -> str:
    return "–" if x is None else pattern.format(x)


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    """The cases as a table, one line per island."""
    lines = [header, "", "| case | island | rounds ok | median stall / round | of the round | send (training thread) "
             "| round wall | MFU: steps / steady run / whole run | tokens/s (steps) | utilization | peak GPU GB | peak host GB | "
             "recompiles, graph breaks | θ identical (islands) |", "|" + "---|" * 14]
    for r in rows:
        for i, isl in enumerate(r["islands"] or [{}]):
            if not isl:
                lines.append(f"| {r['case']} | {i} | failed (rc {r['rc']}) | | | | | | | | | | | |")
                continue
            mfu = " / ".join(fmt(isl.get(k), "{:.1%}") for k in ("mfu_steps_median", "mfu_steady", "mfu_whole_run"))
            done = f"{isl['rounds_ok']}/{isl['outer_step']}" if isl["outer_step"] is not None else \
                f"{isl['rounds_ok']}, then rc {r['rc']}"
            lines.append(f"| {r['case']} | {i} | {done} | "
                         f"{fmt(isl.get('stall_median_s'))} s | {fmt(isl.get('stall_share'), '{:.2%}')} | "
                         f"{fmt(isl.get('send_median_s'))} s | {fmt(isl.get('round_wall_s'), '{:.2f}')} s | {mfu} | "
                         f"{fmt(isl.get('tokens_per_s_steps_median'), '{:,.0f}')} | "
                         f"{fmt(isl['utilization'], '{:.1%}')} | {fmt(isl.get('peak_memory_gb'), '{:.1f}')} | "
                         f"{fmt(isl.get('peak_host_memory_gb'), '{:.1f}')} | {r['recompiles']}, {r['graph_breaks']} | "
                         f"{ {None: '–', True: 'yes', False: 'NO'}[r['theta_identical']]} |")
    return "\n".join(lines) + "\n"


def card() -> str:
    """The GPU's name and torch's version, from a child process (this driver imports no torch)."""
    code = ("import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() "
            "else 'cpu')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()


def report(out: Path) -> int:
    """Read again the cases a run left in ``out`` (its figures recomputed from the islands' files)."""
    path = out / "results.json"
    if not path.exists():
        print(f"{path} does not exist: run the cases first (without --report-only)", file=sys.stderr)
        return 2
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        read_case(row, out / "runs" / row["case"])
    header = (out / "results.md").read_text().split("\n\n| case")[0] if (out / "results.md").exists() else ""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "results.md").write_text(markdown(rows, header))
    print(markdown(rows, header))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--inner-steps", type=int, default=100, help="H")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--case-timeout", type=float, default=240.0, help="seconds before a case is killed")
    ap.add_argument("--out", type=Path, default=REPO / "experiments" / "results" / "gpu-run")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, H = 4: check the code paths")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: read the cases of --out's results.json and runs/ again and rewrite results.md")
    args = ap.parse_args(argv)
    if args.report_only:
        return report(args.out)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        print(f"unknown case {unknown[0]!r}: pick from {', '.join(CASES)}", file=sys.stderr)
        return 2
    if args.smoke:
        args.inner_steps = min(args.inner_steps, 4)
    args.out.mkdir(parents=True, exist_ok=True)
    header = (f"# Whole runs on one GPU ({card()})\n\n`python benchmarks/gpu_run.py --cases {','.join(cases)} "
              f"--inner-steps {args.inner_steps} --rounds {args.rounds}{' --smoke' if args.smoke else ''}`")
    (args.out / "results.json").write_text("")
    rows = []
    for name in cases:
        row = run_case(name, args.inner_steps, args.rounds, args.out, args.case_timeout, args.smoke)
        rows.append(row)
        with (args.out / "results.json").open("a") as f:
            f.write(json.dumps(row) + "\n")
        (args.out / "results.md").write_text(markdown(rows, header))
        print(f"{name}: rc {row['rc']} in {row['seconds']:.0f} s", flush=True)
        if row["rc"]:
            print(row.get("log_tail", ""), flush=True)
    print(markdown(rows, header))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
