"""How far the config travels while an island is built: the calls that receive it, module by module.

Every call made while ``Island(cfg)`` builds one single-process island (``--averaging.backend local``, on the
training thread) is watched with :func:`sys.setprofile`; a call *receives the config* when one of its arguments
(``self`` included, unless the call is a method of the config tree itself) is the :class:`~diloco.config.Config`
or one of its sections (``cfg.model``, ``cfg.diloco``, ...).  The modules of those calls, in the order they
happen, make the config's trail; consecutive calls in one module are one **stop**, and a stop in a module the
trail had already left is a **return**.  A method of the config tree itself (a property of a section) is the
config being read, not passed on: it is not a stop unless another argument is config too.  Two counts are
printed: the trail into the island's parts (calls into :mod:`diloco.config` itself, which fill in, fingerprint or
convert the config, left out), and the trail with them.

Run it from the repository root: ``python benchmarks/cfg_trail.py`` (``--calls`` lists every call); under
``torchrun --nproc-per-node 2 benchmarks/cfg_trail.py`` it follows the config of one of two islands in one torch
world (``--averaging.backend torch``), the path where each island derives its own config (rank 0 prints).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

os.environ.setdefault("DILOCO_WARM_ISLANDS", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OURS = ("diloco", "peers", "outer_optim", "pipeline")


def config_types() -> tuple[type, ...]:
    """The Config class and the classes of its sections."""
    from diloco.config import Config

    cfg = Config()
    return (Config, *{type(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
                      if dataclasses.is_dataclass(getattr(cfg, f.name))})


def trail(build) -> list[tuple[str, str]]:
    """(module, function) of every call that receives the config while ``build()`` runs."""
    kinds = config_types()
    calls: list[tuple[str, str]] = []

    def watch(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] not in OURS:
            return
        code = frame.f_code
        n = code.co_argcount + code.co_kwonlyargcount
        names = list(code.co_varnames[:n])
        if code.co_flags & 0x04:  # *args
            names.append(code.co_varnames[n])
            n += 1
        if code.co_flags & 0x08:  # **kwargs
            names.append(code.co_varnames[n])
        values = []
        if names and names[0] == "self" and isinstance(frame.f_locals.get("self"), kinds):
            names = names[1:]  # a method of the config tree itself: reading it, not passing it on
        for name in names:
            value = frame.f_locals.get(name)
            values.extend(value if isinstance(value, tuple) else
                          value.values() if isinstance(value, dict) else [value])
        if any(isinstance(v, kinds) for v in values):
            calls.append((module, code.co_qualname))

    sys.setprofile(watch)
    try:
        build()
    finally:
        sys.setprofile(None)
    return calls


def stops(calls: list[tuple[str, str]]) -> tuple[list[str], int]:
    """The trail's stops (consecutive calls in one module collapsed) and how many return to a module left."""
    out: list[str] = []
    for module, _ in calls:
        if not out or out[-1] != module:
            out.append(module)
    return out, len(out) - len(set(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", action="store_true", help="list every call that receives the config")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    from diloco.config.loader import load
    from diloco.engine.island import Island

    run_dir = tempfile.mkdtemp(prefix="cfg-trail-")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load(None, {"model.preset": "tiny", "averaging.backend": "torch" if world > 1 else "local",
                      "averaging.min_group_size": world, "wandb.mode": "disabled", "logging.run_dir": run_dir,
                      "data.max_bytes": 200_000, "threads": 1})
    built: list = []
    calls = trail(lambda: built.append(Island(cfg)))
    built[0].close()
    if int(os.environ.get("RANK", "0")):
        return
    if args.calls:
        for module, function in calls:
            print(f"  {module}: {function}")
    for title, kept in (("into the island's parts (calls into diloco.config left out)",
                         [c for c in calls if not c[0].startswith("diloco.config")]), ("every call", calls)):
        path, returns = stops(kept)
        print(f"{title}:")
        for i, module in enumerate(path, 1):
            print(f"{i:5d} {module}{'  (return)' if module in path[:i - 1] else ''}")
        print(f"  {len(kept)} calls, {len(path)} stops in {len(set(path))} modules, {returns} returns to a module left")

if __name__ == "__main__":
    main()
