"""Launching the islands of an experiment's run, and the config variants each run uses."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any, Callable

from diloco.config import Config, ConfigError
from diloco.config import checks as config_checks
from diloco.config import loader as config_load


class CompareError(RuntimeError):
    """A run of the comparison failed; the message points at its log."""


def require_emulation(what: str) -> None:
    """Raise :class:`CompareError` saying that ``what`` needs emulated links or hosts, and why this machine cannot
    give them (not root, no ``ip`` or ``tc``)."""
    from experiments import netns

    ok, why = netns.available()
    if not ok:
        raise CompareError(f"{what} needs emulated links: {why}")


# ------------------------------------------------------------------------------------ island launcher


def launch_islands(cfg: Config, n: int, network: Any = None, *,
                   wrap: Callable[[list[str], int], list[str]] | None = None,
                   startup_timeout: float = 180.0, progress: bool = True) -> dict[str, Any]:
    """Run ``n`` islands (``diloco train`` processes) to completion; return their summaries.

    :func:`diloco.launch.simulate.simulate` with, when ``network`` is given, island ``i`` listening on emulated
    host ``i``'s address and its command wrapped with ``network.wrap(cmd, i)`` (or ``wrap``).  Every
    island is stopped on failure, Ctrl-C/SIGTERM and at the end.
    """
    from diloco.launch.simulate import simulate

    hosts = None
    if network is not None:
        if len(network.hosts) < n:
            raise CompareError(f"the emulated network has {len(network.hosts)} hosts but {n} islands need one each")
        wrap = wrap or network.wrap
        hosts = [h.local_address for h in network.hosts[:n]]
    t0 = time.time()
    out = simulate(cfg, n, startup_timeout, wrap=wrap, host_addresses=hosts, quiet=not progress)
    out["launcher_wall_seconds"] = time.time() - t0
    out["run_dirs"] = [str(Path(cfg.logging.run_dir) / f"island{i}") for i in range(n)]
    return out


def variant(cfg: Config, **items: Any) -> Config:
    """A deep copy of ``cfg`` with dotted keys set (validated)."""
    c = copy.deepcopy(cfg)
    problems = config_load.apply(c, items) + config_checks.validate(c)
    if problems:
        raise ConfigError(problems)
    return c


def island_summaries(run_dir: Path) -> list[dict[str, Any]]:
    """The ``summary.json`` of every island under ``run_dir`` that finished, in island order."""
    return [json.loads(f.read_text()) for f in sorted(run_dir.glob("island*/summary.json"))]
