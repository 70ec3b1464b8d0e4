"""An island of the run that attacks it: how far does it move the honest islands, under each aggregation rule?

    diloco experiment hostile [--islands 4] [--attackers 1] [--attacks scale,flip,claim]
                              [--aggregates mean,centered-clip,trimmed-mean] [--seeds 0,1,2] [--out DIR] [--timeout S]
                              [--section.key VALUE ...]

One run per arm, an arm being (attack × aggregate), each of ``--islands`` islands of the ``tiny`` model over
hivemind on loopback (H = 20, 10 rounds unless ``--diloco.*`` says otherwise), on the embedded text corpus.  The
last island (the last ``--attackers``, colluding: the same attack in the same rounds, fewer than half the islands)
holds the run key and attacks from round 2 to the last (``DILOCO_FAULTS``, :mod:`diloco.engine.faults`):

- ``clean``: nobody attacks (the reference of every ratio is the clean arm under ``mean`` of the same seed;
  ``--attacks ''`` runs the clean arms alone: what a robust rule costs when nobody attacks);
- ``scale``: its Δ × 1e6 (a norm the member check rejects);
- ``flip``: its Δ × −4 (within the member check's 10× the median norm: it pulls a mean the other way);
- ``claim``: its Δ × −4 declared with a million times its tokens as weight (capped at 8× the median claim);
- ``noise``: random values at its honest Δ's norm (nothing a norm check can tell apart);
- ``grow``: its Δ × 1.5 to the power of the rounds since it started (a norm that creeps up to ratchet the guard);
- ``leap``: it claims in the registry, after each round, an outer step 1000 rounds ahead of its own, holding a
  θ_global of a made-up digest (to lure the others into catching up from it or numbering rounds after it);
- ``vote``: it votes, in every round, for a result other than the one it computed (to veto the round, or split
  the group);
- ``outsider``: every island honest; a stranger without the key at every port they listen on for the whole run
  (junk, oversized length prefixes, slow handshakes: :mod:`experiments.outsider`), and an island of its own that
  tries to join with another key.

Every arm weighs by tokens (``--averaging.weighting tokens``: honest islands all declare the same tokens, so the
clean arm is what equal weights give, and a claim counts up to its cap), keeps the member check at its default
(10× the median norm) and strikes at 2.  Per arm it reports the honest islands' held-out loss at the end against
the clean arm's (a ratio), the rounds they committed, the distinct θ_global among them, the committed rounds that
rejected the attacker's Δ, the strikes the run held against it, the round from which it was left out, and its exit
code.  With several ``--seeds`` every arm runs once per seed (the model's initialisation and the data order), and
the report adds each arm's mean and worst ratio over the seeds.  It writes ``results.md``, ``results.json`` and ``hostile.png`` (held-out loss of an honest island per round,
every arm) to ``--out`` after every arm; each arm's islands keep their logs in ``runs/<arm>/island<i>/``.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from diloco.command import ArgumentParser, run_command
from diloco.config import Config, ConfigError
from diloco.config import loader as config_load
from diloco.engine.metrics import read_metrics
from diloco.files import writable_folder
from experiments.report import json_safe, markdown_table

DEFAULT_OUT = Path("experiments/results/hostile")
ATTACKS = {"clean": "", "scale": "scale@send:{span}", "flip": "flip@send:{span}",
           "claim": "claim@send:{span},flip@send:{span}", "noise": "noise@send:{span}", "grow": "grow@send:{span}",
           "leap": "leap@announce:{span}", "vote": "lie@vote:{span}", "nan": "nan@send:{span}",
           "forge-part": "forge@send:{span}", "forge-verdict": "forge@vote:{span}", "outsider": ""}
"""Each attack as the attacker's ``DILOCO_FAULTS`` (``{span}``: its rounds, 2 to the last); ``outsider`` is no
island of the run but a stranger without the key (:class:`OutsiderRun`)."""
KEYLESS = ("clean", "outsider")
"""Arms whose islands all hold the key and stay honest."""
AGGREGATES = ("mean", "centered-clip", "trimmed-mean")
DEFAULTS: dict[str, Any] = {
    "model.preset": "tiny", "diloco.inner_steps": 20, "diloco.outer_steps": 10, "inner.warmup_steps": 5,
    "logging.eval_batches": 8, "logging.samples": 0, "checkpoint.every": 0, "wandb.mode": "disabled",
    "data.max_bytes": 4_000_000, "averaging.backend": "hivemind", "averaging.weighting": "tokens",
    "averaging.strikes": 2, "averaging.min_group_size": 2, "averaging.matchmaking_time": 2.0,
    "averaging.request_timeout": 1.0, "averaging.matchmaking_timeout": 20.0, "averaging.vote_timeout": 8.0,
    "averaging.allreduce_timeout": 20.0, "averaging.next_chunk_timeout": 5.0, "threads": 1,
}
"""What each arm runs unless the command line says otherwise: small rounds, fast timeouts on loopback, no W&B."""
STRIKE = re.compile(r"gets a strike \((\d+) of \d+\)")
LEFT_OUT = "this island is left out of the run's rounds"


def arm_result(name: str, attack: str, rule: str, run_dirs: list[Path], codes: dict[int, int | None],
               wall: float, error: str = "", attackers: int = 1) -> dict[str, Any]:
    """One arm's figures from what its islands wrote (the attackers are the last ``attackers`` islands; in the clean
    arm they are honest like the others, and counted with them).  With several attackers, the round they were left
    out from is the last of theirs (every one of them out), and their exit codes and rounds committed are lists."""
    honest = run_dirs if attack in KEYLESS else run_dirs[:-attackers]
    summaries = []
    for d in run_dirs:
        try:
            summaries.append(json.loads((d / "summary.json").read_text()))
        except (OSError, ValueError):
            summaries.append(None)
    hs = [s for s in summaries[:len(honest)] if s is not None]
    honest_ids = {m.rsplit("/p2p/", 1)[-1] for d in honest if (d / "maddrs.txt").exists()
                  for m in (d / "maddrs.txt").read_text().split()}
    records = [[r for r in read_metrics(d) if "round_ok" in r] for d in honest]
    rejected = [r for r in records[0] if r.get("round_ok") == 1 and r.get("rejected")] if records else []
    strikes = [int(n) for d in honest for n in STRIKE.findall((d / "train.log").read_text(errors="replace"))] \
        if honest else []
    liars = [] if attack in KEYLESS else list(range(len(run_dirs) - attackers, len(run_dirs)))
    out_from = [min((int(m) for f in (summaries[i] or {}).get("failures", []) if LEFT_OUT in f
                     for m in re.findall(r"^round (\d+)", f)), default=None) for i in liars]
    failed = [i for i, c in sorted(codes.items()) if c != 0 and i not in liars]
    if failed and not error:
        error = f"honest island(s) {', '.join(map(str, failed))} exited with an error (see their train.log)"
    curve = [(int(r["outer_step"]), float(r["eval/loss"])) for r in read_metrics(run_dirs[0]) if "eval/loss" in r]
    return {
        "arm": name, "attack": attack, "aggregate": rule, "wall_seconds": wall, "error": error,
        "exit_codes": {str(i): c for i, c in sorted(codes.items())},
        "honest_islands": len(honest), "honest_summaries": len(hs),
        "eval_loss_end": sum(s["eval_loss_end"] for s in hs) / len(hs) if hs else float("nan"),
        "rounds_committed": [s["rounds_ok"] for s in hs],
        "theta_distinct": len({s["theta_checksum"] for s in hs}),
        "rejected_rounds": len(rejected), "rejected_ids": sorted({p for r in rejected for p in r["rejected"].split(",")}),
        "strikes": max(strikes, default=0), "attackers": len(liars),
        "honest_rejected": sum(any(i in honest_ids for i in r["rejected"].split(",")) for r in rejected),
        "forged_dropped": sum(int(s.get("transport_forged") or 0) for s in hs),
        "left_out_from": None if None in out_from else max(out_from, default=None),
        "alone_from": None if attack in KEYLESS else alone_from(records[0] if records else [], len(honest)),
        "attacker_exit": _one_or_all([codes.get(i) for i in liars]),
        "attacker_rounds_ok": _one_or_all([(summaries[i] or {}).get("rounds_ok") for i in liars]), "curve": curve,
    }


def _one_or_all(values: list[Any]) -> Any:
    """An attacker's figure (None without one), or every attacker's, in island order, when several collude."""
    return (values[0] if len(values) == 1 else values) if values else None


def run_arm(cfg: Config, n: int, attack: str, rule: str, out: Path, timeout: float, tag: str = "",
            attackers: int = 1) -> dict[str, Any]:
    """Run one arm's ``n`` islands to the end (or ``timeout``), the last ``attackers`` attacking, and return
    :func:`arm_result`; ``tag`` ends the arm's name (its seed, when there are several)."""
    from diloco.launch.simulate import Cluster, SimulationError

    name = f"{attack}-{rule}{tag}"
    cfg.logging.run_dir, cfg.averaging.run_id, cfg.averaging.aggregate = str(out / "runs" / name), name, rule
    faults = ATTACKS[attack].format(span=f"2-{cfg.diloco.outer_steps}")
    cluster = Cluster(cfg, n, env={i: {"DILOCO_FAULTS": faults} for i in range(n - attackers, n)} if faults else None,
                      fork_warm=True)
    t0, error, stranger = time.time(), "", None
    try:
        cluster.start_all()
        if attack == "outsider":
            stranger = OutsiderRun(cluster, out / "runs" / name / "outsider")
        cluster.wait(timeout=timeout, allow_failures=True)
    except SimulationError as e:
        error = str(e).splitlines()[0]
    finally:
        seen = stranger.stop() if stranger is not None else None
        cluster.stop_all()
    codes = {i: p.returncode for i, p in cluster.procs.items()}
    result = arm_result(name, attack, rule, cluster.run_dirs, codes, time.time() - t0, error, attackers)
    if seen is not None:
        result["outsider"] = seen
        result["attacker_exit"] = seen["keyless_island_exit"]
    return result


class OutsiderRun:
    """A stranger at the run for as long as it lasts: :class:`experiments.outsider.Outsider` at every port of the
    islands, and an island of its own that joins the run with a key of its own (a guessed or stale one)."""

    def __init__(self, cluster: Any, run_dir: Path):
        import tomli_w

        from experiments.outsider import Outsider
        from peers.discovery.run_key import new_run_key, write_private

        self.outsider = Outsider(lambda: [p.pid for p in cluster.procs.values()])
        self.outsider.start()
        run_dir.mkdir(parents=True, exist_ok=True)
        d = copy.deepcopy(cluster.configs[min(1, cluster.n - 1)])  # a joiner's: it knows island 0's address
        write_private(run_dir / "run.key", new_run_key())
        d["logging"]["run_dir"], d["checkpoint"]["dir"] = str(run_dir), str(run_dir / "checkpoints")
        d["averaging"].update(run_key_file=str(run_dir / "run.key"), maddr_file=str(run_dir / "maddrs.txt"),
                              identity_path="")
        (run_dir / "config.toml").write_text(tomli_w.dumps(d))
        self.log = run_dir / "train.log"
        with self.log.open("w") as f:
            self.island = subprocess.Popen([sys.executable, "-m", "diloco.cli", "train", "--config",
                                            str(run_dir / "config.toml")], stdout=f, stderr=subprocess.STDOUT,
                                           start_new_session=True)

    def stop(self) -> dict[str, Any]:
        """End both; what the outsider did, and how its island ended (exit code and last line)."""
        seen = self.outsider.stop()
        try:
            code = self.island.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.island.kill()
            code = self.island.wait()
        lines = [x for x in self.log.read_text(errors="replace").splitlines() if x.strip()]
        return {**seen, "keyless_island_exit": code, "keyless_island_said": lines[-1][-300:] if lines else ""}


def alone_from(records: list[dict], honest: int) -> int | None:
    """The round from which every round an honest island committed (its ``records``) averaged ``honest`` islands or
    fewer: the attackers' Δ no longer in its group (None if its last committed round still held more).  The
    attacker's own log says so later, or never: a struck island that keeps catching up is seldom refused."""
    start = None
    for r in records:
        if r.get("round_ok") != 1:
            continue
        start = (start or int(r["outer_step"])) if 0 < int(r.get("num_peers", honest + 1)) <= honest else None
    return start


def _ratio(x: float, ref: float) -> str:
    return f"{x / ref:.3f}" if ref == ref and ref > 0 and x == x else "–"


HEADERS = ["attack", "aggregate", "seed", "honest loss end", "vs clean mean", "rounds committed (honest)",
           "distinct θ_global (honest)", "attacker's Δ rejected (rounds)", "honest Δ rejected (rounds)",
           "forged messages dropped", "strikes", "left out from round", "honest alone from round", "attacker exit",
           "wall s"]


def row(r: dict[str, Any], ref: float) -> list[Any]:
    committed = r["rounds_committed"]
    span = f"{min(committed)}–{max(committed)}" if committed and min(committed) != max(committed) else \
        (str(committed[0]) if committed else "–")
    clean = r["attack"] == "clean"
    return [r["attack"], r["aggregate"], r.get("seed", 0), f"{r['eval_loss_end']:.4f}", _ratio(r["eval_loss_end"], ref),
            f"{span} of {r['rounds']}", r["theta_distinct"], "–" if clean else r["rejected_rounds"],
            r.get("honest_rejected", "–"), r.get("forged_dropped", "–"), "–" if clean else r["strikes"], "–" if clean or r["left_out_from"] is None else r["left_out_from"],
            "–" if clean or r.get("alone_from") is None else r["alone_from"],
            "–" if clean else _listed(r["attacker_exit"]), f"{r['wall_seconds']:.0f}"]


def _listed(value: Any) -> str:
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)


def reference(results: list[dict[str, Any]], seed: int = 0) -> float:
    """The held-out loss of the clean arm under ``mean`` of ``seed``: what every arm of that seed is compared with."""
    return next((r["eval_loss_end"] for r in results if r["attack"] == "clean" and r["aggregate"] == "mean"
                 and r.get("seed", 0) == seed), float("nan"))


def rows(results: list[dict[str, Any]]) -> list[list[Any]]:
    """Every arm's :func:`row`, each against the clean arm under ``mean`` of its seed."""
    return [row(r, reference(results, r.get("seed", 0))) for r in results]


def over_seeds(results: list[dict[str, Any]]) -> list[str]:
    """Per arm run with more than one seed: its mean and worst ratio to the clean ``mean`` arm of the same seed."""
    ratios: dict[tuple[str, str], list[float]] = {}
    for r in results:
        ref = reference(results, r.get("seed", 0))
        if ref == ref and ref > 0 and r["eval_loss_end"] == r["eval_loss_end"]:
            ratios.setdefault((r["attack"], r["aggregate"]), []).append(r["eval_loss_end"] / ref)
    return [f"{attack} under {rule}, over {len(v)} seeds: {sum(v) / len(v):.4f}× the clean mean arm on average, "
            f"{max(v):.4f}× at worst"
            for (attack, rule), v in ratios.items() if len(v) > 1 and (attack, rule) != ("clean", "mean")]


def markdown(results: list[dict[str, Any]], command: str, notes: list[str]) -> str:
    lines = ["# An island of the run that attacks it", "", f"`{command}`", "",
             markdown_table(HEADERS, rows(results)), "", "![held-out loss per arm](hostile.png)", ""]
    lines += [f"- {n}" for n in over_seeds(results) + notes]
    problems = [f"{r['arm']}: {r['error']}" for r in results if r["error"]]
    if problems:
        lines += ["", "Problems:", ""] + [f"- {p}" for p in problems]
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Held-out loss of island 0 (honest in every arm) per round: a colour per attack, a line style per rule."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colours = dict(zip(ATTACKS, ("black", "tab:red", "tab:blue", "tab:orange", "tab:green", "tab:purple",
                                 "tab:olive", "tab:cyan", "tab:pink", "tab:gray", "gold", "tab:brown")))
    styles = dict(zip(AGGREGATES, ("-", "--", ":")))
    for r in results:
        if r["curve"]:
            xs, ys = zip(*r["curve"])
            ax.plot(xs, ys, styles.get(r["aggregate"], "-"), color=colours.get(r["attack"], "grey"), label=r["arm"])
    ax.set_xlabel("round")
    ax.set_yscale("log")  # a diverged arm ends 25x above the others
    ax.set_ylabel("held-out loss (an honest island, log scale)")
    ax.set_title("one attacking island: held-out loss per arm")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(results: list[dict[str, Any]], out: Path, command: str, cfg: Config, n: int,
                 attackers: int = 1) -> None:
    """``results.md``, ``results.json`` and ``hostile.png`` for the arms run so far (``n`` islands an arm, the last
    ``attackers`` attacking)."""
    rounds = cfg.diloco.outer_steps
    who = f"island {n - 1} attacks" if attackers == 1 else \
        f"islands {', '.join(map(str, range(n - attackers, n)))} attack together (the same attack in the same rounds)"
    notes = [
        f"{n} islands of `{cfg.model.preset}` (H = {cfg.diloco.inner_steps}, {rounds} rounds) over hivemind on "
        f"loopback, the embedded text corpus; {who} from round 2 to {rounds} (the clean arms: nobody does)",
        "scale: Δ × 1e6; flip: Δ × −4; claim: Δ × −4 declared with 1e6 × its tokens as weight; noise: random values "
        "at its Δ's norm; grow: Δ × 1.5^k in the k-th round it attacks; leap: its registry record claims a step 1000 "
        "rounds ahead with a made-up θ_global digest; vote: it votes for another result than it computed; nan: its "
        "parts are NaN; forge-part / forge-verdict: each of its parts / verdicts goes once more in another member's "
        "name (a field naming it, and as if a relay passed it on from it, under a proof the attacker signed), "
        "holding junk / a verdict for another result (the verdict also in the vote's DHT record, under the other's "
        "name); every arm weighs by tokens (capped at 8× the median claim), member check 10× the median norm, "
        "strikes 2",
        "honest loss end: the honest islands' mean held-out loss after the last round; vs clean mean: against the "
        "clean arm under `mean`; rounds committed: per honest island (min–max); attacker's Δ rejected: committed "
        "rounds (as island 0 recorded them) whose result counted its Δ for nothing or outvoted it; honest Δ "
        "rejected: the same for an honest island's; forged messages dropped: by the honest islands, nothing proving "
        "the sender they claimed; strikes: the most the honest "
        "islands' logs gave it (strikes are kept under robust rules only); left out from: the first round it "
        "was refused as struck out (its own log); honest alone from: the first round from which island 0's every "
        "committed round held the honest islands alone",
        "outsider: no island of the run; a stranger without the key sends junk, oversized length prefixes and "
        "slow handshakes to every port the islands listen on for the whole run, and starts an island of its own "
        "with another key (its exit is in the attacker's column)",
        *[f"{r['arm']}: the outsider reached {len(o['ports'])} ports: {o['junk']} junk and {o['oversized']} "
          f"oversized connections, {o['slow_opened']} slow ones (the longest an island let one live: "
          f"{o['longest_slow_s']} s; {o['slow_open_at_end']} still open at the end; by listener: "
          f"{'; '.join(f'{k} {v}' for k, v in o.get('by_process', {}).items())}), {o['refused']} refused; its "
          f"island exited {o['keyless_island_exit']}: \"{o['keyless_island_said']}\""
          for r in results if (o := r.get("outsider"))],
        "one run per arm and seed on a shared 2-core machine: arms whose attacker counts for nothing still average "
        "other vectors (one fewer member, or another rule) and end a few percent apart; a ratio within a few "
        "percent of 1 is noise, a ratio of 3 or 25 is not",
    ]
    (out / "results.md").write_text(markdown(results, command, notes))
    (out / "results.json").write_text(json.dumps(json_safe({"command": command, "notes": notes, "results": results}),
                                                 indent=1) + "\n")
    plot(results, out / "hostile.png")


def parse_list(text: str, allowed: tuple[str, ...], flag: str, empty: bool = False) -> list[str]:
    """``a,b`` → [a, b], each one of ``allowed`` (none at all only when ``empty``); ConfigError naming the flag
    otherwise."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not (items or empty):
        raise ConfigError([f"{flag} takes some of {', '.join(allowed)} separated by commas, got {text!r}"])
    return items


def parse_seeds(text: str) -> list[int] | None:
    """``0,1,2`` → [0, 1, 2] (distinct integers); None for an empty text; ConfigError naming ``--seeds`` otherwise."""
    if not text.strip():
        return None
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError([f"--seeds takes distinct integers separated by commas (e.g. 0,1,2), got {text!r}"])
    return seeds


def run_hostile(config_file: str | None, overrides: list[str], islands: int, attacks: list[str],
                aggregates: list[str], out: Path, timeout: float, command: str,
                seeds: list[int] | None = None, attackers: int = 1) -> list[dict[str, Any]]:
    """Every arm in turn, seed after seed (each seed's clean arm under ``mean`` first: its reference); the report
    rewritten after each.  ``seeds`` None: the config's seed alone, arms named without it."""
    cfg = config_load.load(config_file, overrides, defaults=DEFAULTS)  # checked before the first arm runs
    arms = [("clean", "mean")] + [(a, r) for a in ["clean", *attacks] for r in aggregates
                                  if (a, r) != ("clean", "mean")]
    results: list[dict[str, Any]] = []
    for seed in seeds or [cfg.seed]:
        for attack, rule in arms:
            arm = config_load.load(config_file, overrides, defaults=DEFAULTS)
            arm.seed = seed
            tag = f"-seed{seed}" if seeds else ""
            print(f"== {attack} under {rule}, seed {seed}: {islands} islands, {arm.diloco.outer_steps} rounds; logs "
                  f"in {out / 'runs' / f'{attack}-{rule}{tag}'}/island<i>/train.log", flush=True)
            r = run_arm(arm, islands, attack, rule, out, timeout, tag, attackers)
            r["rounds"], r["seed"] = arm.diloco.outer_steps, seed
            results.append(r)
            print("   " + " | ".join(str(c) for c in row(r, reference(results, seed))), flush=True)
            write_report(results, out, command, cfg, islands, attackers)
    print(markdown_table(HEADERS, rows(results)), flush=True)
    for line in over_seeds(results):
        print(line, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    """``diloco experiment hostile [--islands 4] [--attacks ...] [--aggregates ...] [--out DIR]``."""
    argv = sys.argv[1:] if argv is None else argv
    parser = ArgumentParser(prog="diloco experiment hostile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--islands", type=int, default=4, help="islands per arm, the last one the attacker "
                                                               "(default 4)")
    parser.add_argument("--attackers", type=int, default=1, help="the last islands that attack, together "
                                                                 "(fewer than half of --islands; default 1)")
    parser.add_argument("--attacks", default="scale,flip,claim",
                        help=f"attacks besides clean, of {', '.join(a for a in ATTACKS if a != 'clean')} ('': the clean "
                             "arms alone)")
    parser.add_argument("--aggregates", default=",".join(AGGREGATES), help="aggregation rules, each an arm per attack")
    parser.add_argument("--seeds", default="", help="seeds, comma-separated: every arm once per seed (default: the "
                                                   "config's seed)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds an arm may run (default 600)")
    parser.add_argument("--config", help="TOML config file (applied over this command's defaults)")
    args, rest = parser.parse_known_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def body() -> int:
        attacks = parse_list(args.attacks, tuple(a for a in ATTACKS if a != "clean"), "--attacks", empty=True)
        seeds = parse_seeds(args.seeds)
        aggregates = parse_list(args.aggregates, AGGREGATES, "--aggregates")
        if args.islands < 3 or args.timeout <= 0:
            raise ConfigError([f"--islands must be at least 3 (a majority of honest islands) and --timeout above 0, "
                               f"got {args.islands} and {args.timeout:g}"])
        if not 1 <= args.attackers < args.islands / 2:
            raise ConfigError([f"--attackers must be at least 1 and fewer than half of --islands (the honest islands "
                               f"a majority), got {args.attackers} of {args.islands}"])
        out = writable_folder(args.out)
        results = run_hostile(args.config, rest, args.islands, attacks, aggregates, out, args.timeout,
                              "diloco experiment hostile " + shlex.join(argv), seeds, args.attackers)
        print(f"report: {out / 'results.md'}", flush=True)
        return 0 if not any(r["error"] for r in results) else 1

    from diloco.launch.simulate import SimulationError

    return run_command(body, (SimulationError,), "interrupted: every island was stopped")


if __name__ == "__main__":
    sys.exit(main())
