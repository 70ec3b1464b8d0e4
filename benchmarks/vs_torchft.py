"""Our DiLoCo round against torchft's (``torchft.local_sgd.DiLoCo`` with its Manager and lighthouse), measured side
by side in one run.  Not a test.

    python benchmarks/vs_torchft.py                           # 9m and 40m: torchft, ours blocking, ours delayed
    python benchmarks/vs_torchft.py --sizes 9m --rounds 2     # a smoke test

Both sides: 2 replicas of 1 process each on loopback, gloo (torchft) and our peer network (ours), fp32, one torch
thread per process; the same Llama model (our ``diloco.model``, same parameter names, shapes and initial values from
the seed), the same token batches (our default data, ``stdlib``: replica i reads data shard i of 2, with the same
seed), the same inner step (our trainer core: AdamW and its schedule, clipping), Nesterov outer lr 0.7 momentum 0.9,
H = 20, batch 4, seq 128.  Sizes are ``benchmarks/averaging_scale.py``'s (9m: 9.05M parameters, 40m: 39.99M; the named
presets of ``diloco config show`` jump from ``small``, 0.9M, to ``150m``).
Ours runs as a user runs it, ``diloco simulate --islands 2`` (default ``--diloco.overlap none``, then ``delayed``),
each island started cold as ``diloco train`` starts on a server (``DILOCO_WARM_ISLANDS=0``);
torchft runs in its own virtual environment (never a dependency of diloco) through ``benchmarks/torchft_worker.py``,
on our trainer core, so that the two differ in their sync alone.  Create that environment once with::

    python3 -m venv /work/venvs/torchft && /work/venvs/torchft/bin/pip install torch==2.13.0 torchft numpy

(``--torchft-python`` for another one; torch 2.13.0 is the one diloco runs on, its CPU build).

Per round, median of rounds 2 on (the first carries the replicas' meeting): the seconds the round held the training
thread (both replicas), the same for the replica that arrived last at the round (no waiting for the other in it), and
that replica's parts: membership (torchft's quorum; our group), the exchange (torchft's all-reduce of every
parameter; our exchange of the bytes), the commit vote (torchft's ``should_commit``; ours); inner-step tokens/s of
each replica (median over the steps of those rounds); the whole run's seconds (launch to exit, as timed here); and
whether θ_global ended equal (bf16 checksum) on the two sides.  Writes ``experiments/results/vs-torchft/`` (or
``--out``): ``results.json``, ``results.md`` and ``held_per_round.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.averaging_scale import SIZES  # noqa: E402

TORCHFT_PYTHON = "/work/venvs/torchft/bin/python"
VENV_COMMAND = "python3 -m venv /work/venvs/torchft && /work/venvs/torchft/bin/pip install torch==2.13.0 torchft numpy"
PARTS_NOTE = (
    "Parts: torchft's `membership` is `start_quorum`, `pseudo_grad` the pseudo-gradient before its first all-reduce, "
    "`exchange` its all-reduces, `vote` `should_commit`, `rest` the outer step and the parameters' restore and save. "
    "Ours: `membership` is `group_seconds`, `exchange` `exchange_seconds`, `vote` `vote_seconds`, `averaging_other` "
    "the rest of `allreduce_seconds` (fingerprints, encoding, encryption, decoding, the sum), `outside_averaging` "
    "`stall_seconds` less `allreduce_seconds` (the run's position and θ_global's fingerprint checked with the other "
    "islands, the pseudo-gradient, the outer step, the write-back; negative when the round overlaps training). A "
    "`delayed` run ends on another θ_global than blocking DiLoCo's by design: each round's average lands a round "
    "later.\n")


class BenchError(RuntimeError):
    """A side could not be run; the message says which and where its log is."""


# ----------------------------------------------------------------------------------------------- running
def config_items(size: str, rounds: int, inner_steps: int, batch: int, seq_len: int) -> list[str]:
    """The config items both sides are built from (``--section.key VALUE``)."""
    items = {**{f"model.{k}": v for k, v in SIZES[size].items()}, "model.seq_len": seq_len,
             "inner.batch_size": batch, "diloco.inner_steps": inner_steps, "diloco.outer_steps": rounds,
             "diloco.outer_optimizer": "nesterov", "diloco.outer_lr": 0.7, "diloco.outer_momentum": 0.9,
             "seed": 0, "threads": 1, "data.max_bytes": 4_000_000, "logging.log_every": 1,
             "logging.eval_every": 1000, "logging.eval_batches": 1, "logging.samples": 0, "checkpoint.every": 0,
             "wandb.mode": "disabled"}
    return [x for k, v in items.items() for x in (f"--{k}", str(v))]


def timed(cmd: list[str], log: Path, env: dict[str, str], timeout: float, what: str) -> dict[str, Any]:
    """Run ``cmd`` to its end with its output in ``log``; its wall seconds, the CPU seconds of every process it
    started and reaped (a cost a machine shared with other work does not inflate as much as the wall seconds), and
    the machine's 1-minute load average when it started and ended (raises :class:`BenchError` if it fails)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    cpu = _children_cpu_seconds()
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write(shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            raise BenchError(f"{what} ran past {timeout:.0f} s and was stopped; see {log}") from None
    if code:
        raise BenchError(f"{what} exited with status {code}; see {log}")
    return {"wall_seconds": time.perf_counter() - t0, "cpu_seconds": _children_cpu_seconds() - cpu,
            "load": [load, os.getloadavg()[0]]}


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_ours(items: list[str], overlap: str, run_dir: Path, timeout: float) -> dict[str, Any]:
    """``diloco simulate --islands 2`` with ``overlap``; its replicas (:func:`ours_replicas`) and wall seconds."""
    # every island starts cold, as ``diloco train`` on a server and as torchft's workers do (simulate would fork
    # them from one warm interpreter, whose imports they would share)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "DILOCO_WARM_ISLANDS": "0"}
    cmd = [sys.executable, "-m", "diloco.cli", "simulate", "--islands", "2", *items, "--diloco.overlap", overlap,
           "--logging.run_dir", str(run_dir), "--averaging.run_id", f"vs-torchft-{run_dir.name}"]
    log = run_dir.parent / f"{run_dir.name}.log"
    try:
        ran = timed(cmd, log, env, timeout, f"ours ({overlap})")
    except BenchError:
        # an island binds its transport on the port after its DHT's, which another process of this shared
        # machine may have taken meanwhile: that failure says nothing of the round, so the case runs once more
        if "Address already in use" not in log.read_text():
            raise
        print(f"ours ({overlap}): a port was taken by another process; running the case again", flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)
        ran = timed(cmd, log, env, timeout, f"ours ({overlap})")
    return {"replicas": ours_replicas(run_dir), **ran}


def run_torchft(python: str, items: list[str], out: Path, timeout: float) -> dict[str, Any]:
    """torchft's 2 replicas (``benchmarks/torchft_worker.py run``); their replicas and wall seconds."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [python, str(REPO / "benchmarks" / "torchft_worker.py"), "run", "--replicas", "2", "--out", str(out),
           "--", *items]
    ran = timed(cmd, out.parent / f"{out.name}.log", env, timeout, "torchft")
    return {"replicas": [torchft_replica(json.loads((out / f"replica{i}.json").read_text())) for i in range(2)],
            **ran}


def torchft_ready(python: str) -> bool:
    """Whether ``python`` exists and imports torchft."""
    if not Path(python).exists():
        return False
    return subprocess.run([python, "-c", "import torchft"], capture_output=True).returncode == 0


# ----------------------------------------------------------------------------------------------- reading
def ours_replicas(run_dir: Path) -> list[dict[str, Any]]:
    """Each island's rounds and steps from its ``metrics.jsonl``, in the shape :func:`summarize` reads.  A round's
    arrival is the time of the island's last loss record before it (its last inner step towards the round, logged
    just before the round is sent; None for a round the island did not train towards: it caught up from a peer);
    its parts beyond membership, exchange and vote: the averaging's other work and what the training thread did
    outside the averaging (:data:`PARTS_NOTE`)."""
    from diloco.engine.metrics import read_metrics

    out = []
    for i in range(2):
        island = run_dir / f"island{i}"
        records = read_metrics(island)
        # a loss record's outer_step is the round its step trains towards, less one (a round in flight counts
        # as at the step it was sent at), whatever catching up did to the island's inner-step count
        steps = [r for r in records if "tokens_per_second" in r]
        arrived = {r["outer_step"] + 1: r["time"] for r in steps}  # in the order written: the last one stays
        rounds = []
        for r in (r for r in records if "round_ok" in r):
            k = r["outer_step"]
            rounds.append({"round": k, "arrived": arrived.get(k) if r["inner_steps"] else None,
                           "held": r["stall_seconds"], "membership": r["group_seconds"],
                           "exchange": r["exchange_seconds"], "vote": r["vote_seconds"],
                           "averaging_other": r["allreduce_seconds"] - r["group_seconds"] - r["exchange_seconds"]
                           - r["vote_seconds"],
                           "outside_averaging": r["stall_seconds"] - r["allreduce_seconds"],
                           "committed": bool(r["round_ok"]), "left_out": r.get("round_failure", "")})
        summary = json.loads((island / "summary.json").read_text())
        out.append({"rounds": rounds, "theta_checksum": summary["theta_checksum"],
                    "loop_seconds": summary["wall_seconds"],
                    "step_tokens_per_s": [[r["outer_step"] + 1, r["tokens_per_second"]] for r in steps]})
    return out


def torchft_replica(raw: dict[str, Any]) -> dict[str, Any]:
    """A torchft replica's ``replica{i}.json`` in the shape :func:`summarize` reads."""
    h = raw["inner_steps"]
    return {"rounds": raw["rounds"], "theta_checksum": raw["theta_checksum"], "loop_seconds": raw["wall_seconds"],
            "step_tokens_per_s": [[s // h + 1, raw["tokens_per_step"] / seconds]
                                  for s, seconds in enumerate(raw["step_seconds"])]}


# ----------------------------------------------------------------------------------------------- figures
def summarize(replicas: list[dict[str, Any]], first_round: int = 2) -> dict[str, Any]:
    """The figures of one side from its replicas, over rounds ``first_round`` on: the median hold of every
    replica's rounds; per round, the replica that arrived last, and the median of its hold and of each part of its
    round; each replica's median inner-step tokens/s; the slower replica's training loop; the rounds committed;
    θ_global's checksums."""
    rounds: dict[int, list[dict[str, Any]]] = {}
    for rep in replicas:
        for r in rep["rounds"]:
            if r["round"] >= first_round:
                rounds.setdefault(r["round"], []).append(r)
    if not rounds:
        raise BenchError(f"no round from round {first_round} on was recorded; run more rounds")
    # a replica that did not train towards a round (it caught up from a peer instead) did not arrive at it
    last = [max(rs, key=lambda r: -math.inf if r["arrived"] is None else r["arrived"])
            for _, rs in sorted(rounds.items())]
    parts = [k for k, v in last[0].items() if k not in ("round", "arrived", "held", "committed")
             and isinstance(v, (int, float)) and not isinstance(v, bool)]
    return {"held": statistics.median(r["held"] for rs in rounds.values() for r in rs),
            "held_last": statistics.median(r["held"] for r in last),
            "last": {p: statistics.median(r[p] for r in last) for p in parts},
            "tokens_per_s": [statistics.median(t for k, t in rep["step_tokens_per_s"] if k >= first_round)
                             for rep in replicas],
            "loop_seconds": max(rep["loop_seconds"] for rep in replicas),
            "rounds": len(rounds), "committed": sum(r["committed"] for rs in rounds.values() for r in rs),
            "theta_checksums": [rep["theta_checksum"] for rep in replicas]}


def table(size: str, params: int, cases: dict[str, dict[str, Any]]) -> list[str]:
    """The markdown rows of one size: each case's figures, and ours over torchft's for each of ours."""
    ref = cases["torchft"]
    names = list(cases)
    ours = [n for n in names if n != "torchft"]
    head = (f"| {size} ({params / 1e6:.1f}M), per round, median of rounds 2 on | "
            + " | ".join(names) + " | " + " | ".join(f"{n} ÷ torchft" for n in ours) + " |")
    lines = [head, "|---" * (1 + len(names) + len(ours)) + "|"]

    def row(label: str, get: Any, fmt: str = "{:.3f} s", ratio: bool = True) -> None:
        values = [get(cases[n]) for n in names]
        cells = [fmt.format(v) if v == v else "–" for v in values]
        r = [f"{get(cases[n]) / get(ref):.2f}×" if ratio and get(ref) else "–" for n in ours]
        lines.append(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(r) + " |")

    row("training held by the round", lambda c: c["summary"]["held"])
    row("held, the replica that arrived last", lambda c: c["summary"]["held_last"])
    row("the all-reduce / exchange (last to arrive)", lambda c: c["summary"]["last"]["exchange"])
    row("membership / matchmaking (last to arrive)", lambda c: c["summary"]["last"]["membership"])
    row("the commit vote (last to arrive)", lambda c: c["summary"]["last"]["vote"])
    speed = {n: statistics.mean(cases[n]["summary"]["tokens_per_s"]) for n in names}
    lines.append("| inner-step tokens/s per replica | "
                 + " | ".join(" / ".join(f"{t:,.0f}" for t in cases[n]["summary"]["tokens_per_s"]) for n in names)
                 + " | " + " | ".join(f"{speed[n] / speed['torchft']:.2f}×" for n in ours) + " |")
    row("training loop, the slower replica (first evaluation to last)", lambda c: c["summary"]["loop_seconds"],
        "{:.0f} s")
    row("whole run (launch to exit)", lambda c: c["wall_seconds"], "{:.0f} s")
    row("CPU seconds of the whole run (every process)", lambda c: c["cpu_seconds"], "{:.0f} s")
    lines.append("| the machine's load average (1 min) at start / end | "
                 + " | ".join(" / ".join(f"{x:.1f}" for x in cases[n]["load"]) for n in names) + " |"
                 + " |" * len(ours))
    lines.append("| rounds committed (of both replicas) | "
                 + " | ".join(f"{cases[n]['summary']['committed']}/{2 * cases[n]['summary']['rounds']}" for n in names)
                 + " |" + " |" * len(ours))
    lines.append("| θ_global equal to torchft's (bf16 checksum) | "
                 + " | ".join(same_theta(cases[n], ref) for n in names) + " |" + " |" * len(ours))
    return lines


def same_theta(case: dict[str, Any], ref: dict[str, Any]) -> str:
    """Whether a case's replicas all ended on torchft's θ_global ("yes"/"no"), by checksum."""
    return "yes" if set(case["summary"]["theta_checksums"]) == set(ref["summary"]["theta_checksums"]) and \
        len(set(ref["summary"]["theta_checksums"])) == 1 else "no"


def breakdown(size: str, cases: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown rows: each case's round, for the replica that arrived last, part by part."""
    lines = [f"| {size}: the last to arrive, median s | held | " + " | ".join(
        sorted({p for c in cases.values() for p in c["summary"]["last"]})) + " |"]
    parts = sorted({p for c in cases.values() for p in c["summary"]["last"]})
    lines.append("|---" * (2 + len(parts)) + "|")
    for name, c in cases.items():
        s = c["summary"]
        lines.append(f"| {name} | {s['held_last']:.3f} | "
                     + " | ".join(f"{s['last'][p]:.3f}" if p in s["last"] else "–" for p in parts) + " |")
    return lines


def plot(results: dict[str, Any], path: Path) -> None:
    """Bars: per size, each case's hold (both replicas, and the last to arrive), exchange and membership."""
    from matplotlib.figure import Figure

    sizes = list(results["sizes"])
    fig = Figure(figsize=(5 * len(sizes), 4))
    axes = fig.subplots(1, len(sizes), squeeze=False)[0]
    bars = [("held", lambda s: s["held"]), ("held, last to arrive", lambda s: s["held_last"]),
            ("exchange", lambda s: s["last"]["exchange"]), ("membership", lambda s: s["last"]["membership"])]
    for ax, size in zip(axes, sizes):
        cases = results["sizes"][size]["cases"]
        width = 0.8 / max(1, len(cases))
        for j, (name, case) in enumerate(cases.items()):
            ax.bar([i + j * width for i in range(len(bars))], [get(case["summary"]) for _, get in bars], width,
                   label=name)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(bars))], [b for b, _ in bars], fontsize=8)
        ax.set_ylabel("seconds per round (median)")
        ax.set_title(f"{size}: 2 replicas on loopback")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ----------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="9m,40m", help=f"of {', '.join(SIZES)}")
    parser.add_argument("--overlaps", default="none,delayed", help="our --diloco.overlap values to run")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--torchft-python", default=TORCHFT_PYTHON, help="the python of torchft's environment")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds each side may run")
    parser.add_argument("--out", type=Path, default=REPO / "experiments" / "results" / "vs-torchft")
    args = parser.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        print(f"unknown size {', '.join(unknown)}: choose among {', '.join(SIZES)}.", file=sys.stderr)
        return 2
    if args.rounds < 2:
        print("--rounds must be at least 2: the first round carries the replicas' meeting and is not counted.",
              file=sys.stderr)
        return 2
    if not torchft_ready(args.torchft_python):
        print(f"torchft's environment is missing ({args.torchft_python} cannot import torchft); create it with: "
              f"{VENV_COMMAND}", file=sys.stderr)
        return 2
    command = "python benchmarks/vs_torchft.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"command": command.strip(), "rounds": args.rounds, "inner_steps": args.inner_steps,
                               "batch": args.batch, "seq_len": args.seq_len, "sizes": {}}
    md = [f"# Our DiLoCo round against torchft's\n\n`{command.strip()}`\n",
          f"2 replicas of 1 process each on loopback, fp32, 1 torch thread each, on this machine "
          f"({os.cpu_count()} cores, shared); H = {args.inner_steps}, {args.rounds} rounds, batch {args.batch}, "
          f"seq {args.seq_len}; the same model, data shards, inner step and outer Nesterov (0.7, 0.9) on both sides "
          f"(see the script's docstring). Per round, median of rounds 2–{args.rounds}; the parts are those of the "
          f"replica that arrived last.\n"]
    failures = 0
    for size in sizes:
        items = config_items(size, args.rounds, args.inner_steps, args.batch, args.seq_len)
        runs = {"torchft": lambda: run_torchft(args.torchft_python, items, args.out / "runs" / f"{size}-torchft",
                                               args.timeout)}
        for overlap in (o for o in args.overlaps.split(",") if o):
            runs["ours" if overlap == "none" else f"ours {overlap}"] = \
                lambda o=overlap: run_ours(items, o, args.out / "runs" / f"{size}-ours-{o}", args.timeout)
        cases: dict[str, dict[str, Any]] = {}
        failed: dict[str, str] = {}
        for name, run in runs.items():
            print(f"{size}: {name} ...", flush=True)
            try:  # a case that fails is reported, and the others still run
                cases[name] = run()
                cases[name]["summary"] = summarize(cases[name]["replicas"])
            except BenchError as e:
                print(e, file=sys.stderr, flush=True)
                failed[name] = str(e)
                cases.pop(name, None)
        failures += len(failed)
        params = params_of(size)
        results["sizes"][size] = {"params": params, "cases": cases, "failed": failed}
        rows = table(size, params, cases) if "torchft" in cases else [f"{size}: torchft's case failed: nothing to "
                                                                       f"compare with"]
        rows += [f"\n{name} failed: {why}" for name, why in failed.items()]
        print("\n".join(rows) + "\n", flush=True)
        md += ["\n".join(rows), "", "\n".join(breakdown(size, cases)) if cases else "", ""]
        write(results, md, args.out)  # after each size: a run cut short keeps the sizes it measured
    print(f"wrote {args.out / 'results.md'}" + (f" ({failures} case(s) failed)" if failures else ""))
    return 1 if failures else 0


def write(results: dict[str, Any], md: list[str], out: Path) -> None:
    """``results.json``, ``results.md`` (``md`` and what its parts mean) and the plot, of the sizes measured so far."""
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text("\n".join(md + [PARTS_NOTE]))
    plot(results, out / "held_per_round.png")


def params_of(size: str) -> int:
    """The parameter count of a size, from the model's skeleton (no memory)."""
    import torch

    from diloco.config import ModelConfig, resolve_model
    from diloco.model.transformer import build_model

    cfg = ModelConfig(**SIZES[size])
    resolve_model(cfg)
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(cfg).parameters())


if __name__ == "__main__":
    sys.exit(main())
