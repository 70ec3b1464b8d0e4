"""A run cut in two by a network partition and healed: does it stay one run?

``--islands`` islands (default 8) of the ``tiny`` model train, each on its own emulated host
(:class:`experiments.netns.EmulatedNetwork`).  Once every island has committed round ``--split-at`` (or a later one),
the network is cut (:meth:`~experiments.netns.EmulatedNetwork.partition`): the first ``--split`` islands on one side,
the rest on the other; packets across the cut vanish (connections time out, nothing is refused, as in a real
partition).  The cut heals once the larger side has committed ``--heal-after`` more rounds; when no island commits
(neither side holds a majority), once every island of it has recorded that many rounds; and at the latest after
``--heal-timeout`` seconds.  Then the run goes on to its end::

    sudo python -m experiments partition [--islands 8] [--split 5] [--split-at 2] [--heal-after 3] [--out DIR]

The rule under test (:func:`peers.group.roster.quorum_problem`): a round commits only when its group holds a
majority of the islands that committed the round before, less those known to have left or to be gone (their address
refuses connections; an island beyond a partition refuses nothing).  So at most one side of a cut may commit, none
of a cut into halves, and after the heal the islands that could not commit catch up with those that did.

Per island it reports the rounds committed during the cut, why the others failed (the islands' own words), the first
round after the heal from which it holds the θ_global the others hold, and at the end the number of distinct
θ_global (1 when the run is one run).  θ_global of every round comes from the islands' checkpoints
(``--checkpoint.every 1``, all kept): the checksum of their ``outer_optimizer`` master weights, the same checksum as
the summary's ``theta_checksum``.  Writes ``README.md``, ``results.json`` and ``timeline.png`` into ``--out``; the
islands' logs and metrics stay under ``--out``/runs.  Needs root (network namespaces and ``tc``).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco.command import ArgumentParser, run_command
from diloco.config import Config, ConfigError
from diloco.config import loader as config_load
from diloco.files import writable_folder
from diloco.launch.simulate import SimulationError
from diloco.model import checkpoint
from experiments import netns
from experiments.islands import CompareError, launch_islands, require_emulation, variant
from experiments.nat import round_records_so_far
from experiments.report import markdown_table, save_results
from experiments.soak import log_lines
from outer_optim import checksum

DEFAULTS: dict[str, Any] = {
    "model.preset": "tiny", "inner.batch_size": 4, "threads": 1, "data.max_bytes": 2_000_000,
    # rounds of several seconds, as a real run's are long next to the registry's heartbeat (member_ttl / 3)
    "diloco.inner_steps": 300, "diloco.outer_steps": 12,
    "logging.eval_every": 1000, "logging.eval_batches": 2, "logging.samples": 0,
    "checkpoint.every": 1, "checkpoint.keep": 1000, "wandb.mode": "disabled",
    # 8 islands share 2 cores: every wait is generous
    "averaging.matchmaking_time": 5.0, "averaging.request_timeout": 3.0, "averaging.matchmaking_timeout": 30.0,
    "averaging.vote_timeout": 30.0, "averaging.allreduce_timeout": 120.0, "averaging.next_chunk_timeout": 60.0,
    "averaging.state_download_timeout": 60.0,
    # how often an island apart from part of its committed roster looks whether the other side answers again:
    # a third of the default, for rounds a tenth of a real run's
    "averaging.rejoin_after": 10.0,
}
QUORUM = "no majority of the run"
"""How a round that failed the quorum rule begins its reason (:func:`peers.group.roster.quorum_problem`)."""


@dataclass
class Cut:
    """When the network was cut and healed, and why then (wall-clock times, ``time.time()``)."""

    sides: list[list[int]]
    split_at: int
    heal_after: int
    heal_timeout: float
    split_time: float = 0.0
    heal_time: float = 0.0
    healed_because: str = ""
    steps_at_split: list[int] = field(default_factory=list)
    steps_at_heal: list[int] = field(default_factory=list)

    @property
    def larger(self) -> list[int]:
        """The side with more islands (the first of equal ones)."""
        return max(self.sides, key=len)


def _last_step(records: list[dict[str, Any]]) -> int:
    return max((int(r["outer_step"]) for r in records), default=0)


def heal_reason(cut: Cut, records: list[list[dict[str, Any]]], now: float) -> str:
    """Why the cut should heal now ('' while it should hold), from every island's round records: the larger side
    committed ``heal_after`` rounds since the cut (counted by their outer step: an island of it that caught up instead
    does not hold the heal back); or nobody committed one and its islands each recorded that many (neither side can
    commit); or ``heal_timeout`` passed."""
    since = [[r for r in rs if r["time"] > cut.split_time] for rs in records]
    committed = len({r["outer_step"] for i in cut.larger for r in since[i] if r["round_ok"]})
    recorded = min(len(since[i]) for i in cut.larger)
    if committed >= cut.heal_after:
        return f"the larger side committed {cut.heal_after} rounds during the cut"
    if recorded >= cut.heal_after and not any(r["round_ok"] for rs in since for r in rs):
        return f"no island committed a round during the cut, and every island of the larger side failed {recorded}"
    if now - cut.split_time >= cut.heal_timeout:
        return f"{cut.heal_timeout:.0f} s passed since the cut (the time limit)"
    return ""


def cut_and_heal(network: netns.EmulatedNetwork, run_dirs: list[Path], cut: Cut,
                 done: threading.Event) -> threading.Thread:
    """A thread that cuts ``network`` into ``cut.sides`` once every island under ``run_dirs`` committed round
    ``cut.split_at`` or a later one (so that the run holds a committed roster), and heals it when :func:`heal_reason`
    says so (filling in ``cut``'s times)."""
    def committed(d: Path) -> int:
        return max((int(r["outer_step"]) for r in round_records_so_far(d) if r["round_ok"]), default=0)

    def watch() -> None:
        while min(committed(d) for d in run_dirs) < cut.split_at:
            if done.wait(0.5):
                return
        network.partition(cut.sides)
        cut.split_time = time.time()
        cut.steps_at_split = [_last_step(round_records_so_far(d)) for d in run_dirs]
        print(f"   network cut: islands {cut.sides[0]} | {cut.sides[1]} (rounds recorded: {cut.steps_at_split})",
              flush=True)
        while not (reason := heal_reason(cut, [round_records_so_far(d) for d in run_dirs], time.time())):
            if done.wait(0.5):
                return
        network.heal()
        cut.heal_time, cut.healed_because = time.time(), reason
        cut.steps_at_heal = [_last_step(round_records_so_far(d)) for d in run_dirs]
        print(f"   network healed after {cut.heal_time - cut.split_time:.0f} s: {reason} (rounds recorded: "
              f"{cut.steps_at_heal})", flush=True)

    thread = threading.Thread(target=watch, name="partition", daemon=True)
    thread.start()
    return thread


def theta_by_round(run_dir: Path) -> dict[int, str]:
    """Outer step → the checksum of the θ_global an island held after it (from its checkpoints; the same checksum
    as its summary's ``theta_checksum``)."""
    out = {}
    for path in checkpoint.list_checkpoints(run_dir / "checkpoints"):
        out[int(path.stem.split("-")[-1])] = checksum(checkpoint.load(path)["outer_optimizer"]["master"])
    return out


def in_step_from(thetas: list[dict[int, str]], island: int, after: int) -> int | None:
    """The first outer step past ``after`` from which ``island`` holds, at every step it checkpointed, the θ_global
    most islands hold at that step (None: never)."""
    steps = sorted(s for s in thetas[island] if s > after)
    first = None
    for s in steps:
        common, _ = Counter(t[s] for t in thetas if s in t).most_common(1)[0]
        if thetas[island][s] == common:
            first = s if first is None else first
        else:
            first = None
    return first


def held_since(thetas: list[dict[int, str]], theta: str | None) -> int | None:
    """The first outer step after which most islands held ``theta`` (None: never): which round of the run an
    island's θ_global is."""
    for s in sorted({s for t in thetas for s in t}):
        if Counter(t[s] for t in thetas if s in t).most_common(1)[0][0] == theta:
            return s
    return None


def island_rows(cut: Cut, records: list[list[dict[str, Any]]], thetas: list[dict[int, str]],
                summaries: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """What each island did during the cut and after it (see the module's docstring)."""
    rows = []
    for i, rs in enumerate(records):
        during = [r for r in rs if cut.split_time < r["time"] <= cut.heal_time]
        after = [r for r in rs if cut.heal_time and r["time"] > cut.heal_time]
        failures = Counter(r["round_failure"] for r in during if not r["round_ok"])
        healed_at = cut.steps_at_heal[i] if cut.steps_at_heal else None
        in_step = in_step_from(thetas, i, healed_at) if healed_at is not None else None
        s = summaries[i] or {}
        rows.append({
            "island": i, "side": next(k for k, side in enumerate(cut.sides) if i in side),
            "rounds_during_cut": len(during), "committed_during_cut": sum(bool(r["round_ok"]) for r in during),
            "committed_during_cut_steps": [int(r["outer_step"]) for r in during if r["round_ok"]],
            "failures_during_cut": dict(failures),
            "quorum_failures": sum(n for why, n in failures.items() if QUORUM in why),
            "first_common_step_after_heal": in_step,
            "rounds_after_heal": None if in_step is None else in_step - healed_at,
            "rounds_after": len(after), "committed_after": sum(bool(r["round_ok"]) for r in after),
            "groups_after": sorted({int(r["num_peers"]) for r in after if r.get("num_peers")}),
            "step_at_cut": cut.steps_at_split[i] if cut.steps_at_split else None,
            "step_at_heal": cut.steps_at_heal[i] if cut.steps_at_heal else None,
            "rounds_ok": s.get("rounds_ok"), "rounds_caught_up": s.get("rounds_caught_up"),
            "outer_step": s.get("outer_step", _last_step(rs)), "theta_checksum": s.get("theta_checksum"),
            "theta_is_round": held_since(thetas, s.get("theta_checksum") or thetas[i].get(max(thetas[i], default=0))),
            "theta_by_step": {str(k): v for k, v in sorted(thetas[i].items())},
        })
    return rows


def logged_during(log: Path, start: float, end: float, t0: float, limit: int = 12) -> list[str]:
    """An island's warnings and errors from ``start`` to ``end``, each prefixed by its second since ``t0``."""
    if not log.exists():
        return []
    lines = [(t, line) for t, line in log_lines(log, t0)
             if start - 1 <= t <= end + 1 and any(k in line for k in (" WARN", " ERROR", "FAILED", "left out"))]
    return [f"{t - t0:5.0f}s {line}" for t, line in lines[:limit]]


def plot_timeline(records: list[list[dict[str, Any]]], cut: Cut, t0: float, path: Path) -> None:
    """Each island's outer step against wall-clock: committed rounds as dots, failed or caught-up ones as crosses,
    the cut shaded."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if cut.split_time:
        ax.axvspan(cut.split_time - t0, (cut.heal_time or max(r["time"] for rs in records for r in rs)) - t0,
                   color="0.9", zorder=0, label="network cut")
    for i, rs in enumerate(records):
        side = next(k for k, s in enumerate(cut.sides) if i in s)
        for ok, marker in ((1, "o" if side == 0 else "s"), (0, "x")):
            pts = [(r["time"] - t0, r["outer_step"] + (i - len(records) / 2) * 0.03) for r in rs if r["round_ok"] == ok]
            if pts:
                ax.scatter(*zip(*pts), s=14 if ok else 28, marker=marker, color=f"C{i}",
                           label=f"island {i} (side {'AB'[side]})" if ok else None)
    ax.set_xlabel("wall-clock (s)")
    ax.set_ylabel("outer step")
    sizes = "/".join(str(len(s)) for s in cut.sides)
    ax.set_title(f"A {sizes} partition: rounds committed (dots, squares) and failed or caught up (crosses)")
    ax.legend(loc="upper left", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(cut: Cut, rows: list[dict[str, Any]], t0: float, wall: float, failure: str, logged: list[list[str]],
           command: str, cfg: Config) -> tuple[str, dict[str, Any]]:
    """The README's markdown and the JSON of a run."""
    sizes = "/".join(str(len(s)) for s in cut.sides)
    ends = {r["theta_checksum"] for r in rows if r["theta_checksum"]}
    table = markdown_table(
        ["island", "side", "rounds recorded at the cut → at the heal", "rounds during the cut", "committed during the cut", "of them: no majority",
         "other failures", "rounds after the heal: committed / recorded (their groups)", "in step again at round",
         "rounds after the heal", "rounds committed (whole run)",
         "θ_global at the end", "that is the run's θ_global after round"],
        [[r["island"], "AB"[r["side"]], f"{r['step_at_cut']} → {r['step_at_heal']}", r["rounds_during_cut"],
          f"{r['committed_during_cut']} {r['committed_during_cut_steps'] or ''}".strip(), r["quorum_failures"],
          r["rounds_during_cut"] - r["committed_during_cut"] - r["quorum_failures"],
          f"{r['committed_after']} / {r['rounds_after']}" + (f" (groups of {', '.join(map(str, r['groups_after']))})"
                                                              if r["groups_after"] else ""),
          r["first_common_step_after_heal"] if r["first_common_step_after_heal"] is not None else "never",
          r["rounds_after_heal"] if r["rounds_after_heal"] is not None else "–",
          r["rounds_ok"] if r["rounds_ok"] is not None else "–", r["theta_checksum"] or "(no summary)",
          r["theta_is_round"] if r["theta_is_round"] is not None else "–"]
         for r in rows])
    reasons = Counter()
    for r in rows:
        for why, n in r["failures_during_cut"].items():
            reasons[(r["side"], why)] += n
    side_commits = [sum(r["committed_during_cut"] for r in rows if r["side"] == k) for k in range(len(cut.sides))]
    a = cfg.averaging
    lines = [
        f"# A network partition of {len(rows)} islands, {sizes}, healed", "",
        f"`{command}`", "",
        f"{len(rows)} islands of `{cfg.model.preset}` (H = {cfg.diloco.inner_steps}, {cfg.diloco.outer_steps} rounds), "
        f"each on its own emulated host; once every island committed round {cut.split_at}, packets between side A "
        f"(islands {cut.sides[0]}) and side B (islands {cut.sides[1]}) vanish (`tc` on each host's interface: "
        f"connections time out, nothing is refused). Averaging timeouts: matchmaking {a.matchmaking_timeout:g} s, "
        f"request {a.request_timeout:g} s, vote {a.vote_timeout:g} s.", "",
        f"- cut at {cut.split_time - t0:.0f} s (rounds recorded then: {cut.steps_at_split}); healed at "
        f"{cut.heal_time - t0:.0f} s, {cut.heal_time - cut.split_time:.0f} s later, because {cut.healed_because} "
        f"(rounds recorded then: {cut.steps_at_heal})" if cut.heal_time else
        f"- the cut {'came at ' + format(cut.split_time - t0, '.0f') + ' s but never healed' if cut.split_time else 'never came'}",
        f"- rounds committed during the cut: side A {side_commits[0]}, side B {side_commits[1]} (summed over its "
        f"islands)",
        f"- \"in step again at round\": the first outer step after the last one the island had recorded at the heal "
        f"from which its θ_global checksum (from its checkpoint after each round) is the one most islands hold at that "
        f"step and every later one; \"rounds after the heal\" counts from the island's step at the heal",
        f"- distinct θ_global at the end: {len(ends)} ({', '.join(sorted(ends))})",
        f"- wall-clock: {wall:.0f} s" + (f"; the run failed: {failure}" if failure else ""), "",
        table, "",
        "## Why the rounds of the cut failed, in the islands' words (round_failure of metrics.jsonl)", "",
    ]
    for (side, why), n in sorted(reasons.items()):
        lines.append(f"- side {'AB'[side]}, {n} round(s): \"{why}\"")
    if not reasons:
        lines.append("- (none failed)")
    lines += ["", "## What the islands logged during the cut (warnings, failed rounds; the first lines of each)", ""]
    for i, lines_i in enumerate(logged):
        if lines_i:
            lines += [f"island {i}:", "", "```", *lines_i, "```", ""]
    lines += ["![timeline](timeline.png)", ""]
    data = {"command": command, "sides": cut.sides, "split_at": cut.split_at, "heal_after": cut.heal_after,
            "split_s": cut.split_time - t0 if cut.split_time else None,
            "heal_s": cut.heal_time - t0 if cut.heal_time else None, "healed_because": cut.healed_because,
            "t0": t0, "split_time": cut.split_time, "heal_time": cut.heal_time, "heal_timeout": cut.heal_timeout,
            "steps_at_split": cut.steps_at_split, "steps_at_heal": cut.steps_at_heal,
            "committed_during_cut_by_side": side_commits, "distinct_theta_at_end": len(ends),
            "wall_s": wall, "failure": failure, "islands": rows}
    return "\n".join(lines), data


def run(cfg: Config, islands: int, split: int, split_at: int, heal_after: int, heal_timeout: float, rate: str,
        out: Path, command: str) -> int:
    """One partitioned run; writes the report into ``out``; returns 0 when the run ended as one run (one θ_global,
    at most one side committed during the cut, and every island committed rounds again after the heal), else 1."""
    run_dir = out / "runs"
    c = variant(cfg, **{"logging.run_dir": str(run_dir), "averaging.run_id": f"partition-{split}-{islands - split}"})
    run_dirs = [run_dir / f"island{i}" for i in range(islands)]
    cut = Cut([list(range(split)), list(range(split, islands))], split_at, heal_after, heal_timeout)
    done = threading.Event()
    failure, summaries = "", [None] * islands
    t0 = time.time()
    with netns.EmulatedNetwork(islands, rate=rate) as network:
        watcher = cut_and_heal(network, run_dirs, cut, done)
        try:
            summaries = launch_islands(c, islands, network=network, startup_timeout=300)["islands"]
        except SimulationError as e:  # an island failed: report what the run left on disk
            failure = str(e).splitlines()[0]
        finally:
            done.set()
            watcher.join(5)
    return write_report(out, cut, t0, time.time() - t0, failure, command, c)


def write_report(out: Path, cut: Cut, t0: float, wall: float, failure: str, command: str, cfg: Config) -> int:
    """Read what the islands of the run under ``out``/runs left (metrics, checkpoints, logs, summaries) and write
    ``README.md``, ``results.json`` and ``timeline.png``; returns the run's exit code (see :func:`run`)."""
    run_dirs = sorted((out / "runs").glob("island*"), key=lambda d: int(d.name.removeprefix("island")))
    summaries = [json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else None
                 for d in run_dirs]
    records = [round_records_so_far(d) for d in run_dirs]
    thetas = [theta_by_round(d) for d in run_dirs]
    rows = island_rows(cut, records, thetas, summaries)
    logged = [logged_during(d / "train.log", cut.split_time, cut.heal_time or time.time(), t0)
              if cut.split_time else [] for d in run_dirs]
    text, data = report(cut, rows, t0, wall, failure, logged, command, cfg)
    save_results(out, text, data)
    (out / "results.md").replace(out / "README.md")
    plot_timeline(records, cut, t0, out / "timeline.png")
    print(f"results in {out}/ (README.md, results.json, timeline.png)")
    one_side = sum(bool(n) for n in data["committed_during_cut_by_side"]) <= 1
    healed = all(r["committed_after"] for r in rows)
    return 0 if data["distinct_theta_at_end"] == 1 and one_side and healed and not failure else 1


def rewrite_report(out: Path) -> int:
    """:func:`write_report` again for the finished run under ``out`` (from its ``results.json`` and what its islands
    left), e.g. after the report learnt a new column."""
    try:
        data = json.loads((out / "results.json").read_text())
        cut = Cut(data["sides"], data["split_at"], data["heal_after"], data["heal_timeout"], data["split_time"],
                  data["heal_time"], data["healed_because"], data["steps_at_split"], data["steps_at_heal"])
        cfg = config_load.load(str(out / "runs" / "island0" / "config.toml"), [])
        return write_report(out, cut, data["t0"], data["wall_s"], data["failure"], data["command"], cfg)
    except (OSError, ValueError, KeyError) as e:
        raise CompareError(f"{out} holds no finished partition run to report again ({type(e).__name__}: {e}); run "
                           f"the experiment with --out {out}") from None


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments partition [--islands N] [--split K] [--split-at R] [--heal-after R] [--out DIR]``."""
    parser = ArgumentParser(prog="python -m experiments partition", description=__doc__.split("\n\n")[0])
    parser.add_argument("--islands", type=int, default=8, help="islands of the run, each on its own emulated host")
    parser.add_argument("--split", type=int, default=5, help="islands on the first side of the cut (the first ones)")
    parser.add_argument("--split-at", type=int, default=2, help="cut once every island committed this round")
    parser.add_argument("--heal-after", type=int, default=3,
                        help="heal once every island of the larger side committed this many rounds during the cut")
    parser.add_argument("--heal-timeout", type=float, default=400.0,
                        help="heal at the latest this many seconds after the cut")
    parser.add_argument("--rate", default="100mbit", help="every host's link rate")
    parser.add_argument("--out", type=Path, default=Path("runs/partition"), help="output directory")
    parser.add_argument("--config", help="TOML config file (applied over this command's defaults)")
    parser.add_argument("--report-only", action="store_true",
                        help="write the report of the run already under --out again, without running anything")
    args, rest = parser.parse_known_args(argv)

    def body() -> int:
        if args.report_only:
            return rewrite_report(args.out)
        cfg = config_load.load(args.config, rest, defaults=DEFAULTS)
        problems = []
        if not 2 <= args.islands <= 32:
            problems.append(f"--islands must be between 2 and 32, got {args.islands}")
        if not 1 <= args.split < args.islands:
            problems.append(f"--split must leave islands on both sides: between 1 and --islands − 1 "
                            f"({args.islands - 1}), got {args.split}")
        if args.split_at < 1 or args.heal_after < 1:
            problems.append(f"--split-at and --heal-after must be at least 1, got {args.split_at} and {args.heal_after}")
        if args.split_at + args.heal_after + 2 > cfg.diloco.outer_steps:
            problems.append(f"--diloco.outer_steps ({cfg.diloco.outer_steps}) leaves no rounds after the heal: make it "
                            f"at least --split-at + --heal-after + 2 ({args.split_at + args.heal_after + 2})")
        if args.heal_timeout <= 0:
            problems.append(f"--heal-timeout must be positive, got {args.heal_timeout:g}")
        try:
            netns.parse_rate(args.rate)
        except ValueError as e:
            problems.append(f"--rate: {e}")
        if problems:
            raise ConfigError(problems)
        require_emulation("partition")
        writable_folder(args.out)
        command = " ".join(["sudo python -m experiments partition", *(sys.argv[1:] if argv is None else argv)])
        return run(cfg, args.islands, args.split, args.split_at, args.heal_after, args.heal_timeout, args.rate,
                   args.out, command)

    return run_command(body, (CompareError, SimulationError, netns.NetworkSetupError),
                       "interrupted: every island and emulated link was removed")


if __name__ == "__main__":
    sys.exit(main())
