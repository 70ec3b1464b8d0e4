"""``python -m experiments compare|sweeps [...]``: the experiment commands."""

from __future__ import annotations

import os
import sys

USAGE = """python -m experiments COMMAND [options] [--section.key VALUE ...]

commands:
  compare   single worker vs synchronous data parallelism vs DiLoCo (python -m experiments compare --help)
  sweeps    H, islands and outer-optimizer sweeps next to the paper's numbers (... sweeps --help)
  overlap   compute utilization and wall-clock against link rate, blocking vs rounds in flight (... overlap --help)
  hetero    islands of unequal speed: fixed H vs time-budgeted and adaptive rounds vs DDP (... hetero --help)
  plan-check  diloco plan's predictions against runs over emulated links (... plan-check --help)
  horizon   the gap of overlapped rounds and codecs to blocking DiLoCo over a longer run (... horizon --help)
  auto-codec  --averaging.compression auto against fixed codecs over a link that slows down (... auto-codec --help)
  frontier  held-out loss against bytes per inner optimizer and codec, over seeds, vs DDP (... frontier --help)
  partition  a run cut in two by a network partition and healed: one side commits, then one θ_global (... partition --help)
  scale-sim  simulated rounds at 100-1,000+ islands: roster rounds vs flat all-reduce vs gossip (... scale-sim --help)
  islands   8 to 64 islands on this machine: rounds committed, distinct θ_global, bytes, round time (... islands --help)
  hostile   an attacking island, per attack and aggregation rule: honest loss against a clean run, strikes (... hostile --help)
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "compare":
        from experiments.compare import main as run
    elif command == "sweeps":
        from experiments.sweeps import main as run
    elif command == "overlap":
        from experiments.overlap_sweep import main as run
    elif command == "hetero":
        from experiments.hetero import main as run
    elif command == "plan-check":
        from experiments.plan_check import main as run
    elif command == "horizon":
        from experiments.horizon import main as run
    elif command == "auto-codec":
        from experiments.auto_codec import main as run
    elif command == "frontier":
        from experiments.frontier import main as run
    elif command == "partition":
        from experiments.partition import main as run
    elif command == "scale-sim":
        from experiments.scale_sim import main as run
    elif command == "islands":
        from experiments.many_islands import main as run
    elif command == "hostile":
        from experiments.hostile import main as run
    else:
        print(f"error: unknown experiment {command!r}; `diloco experiment --help` lists them", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
