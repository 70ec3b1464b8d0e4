"""The packages depend on each other in one direction, the parts of ``diloco/`` and ``peers/`` stand on floors
that import only downwards, ``diloco`` reaches ``peers`` through its front door only, and no module imports another
in a cycle, counting every import: at the top of a module, inside functions and under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent
PACKAGES = ("diloco", "outer_optim", "peers", "pipeline", "experiments", "benchmarks")
MAY_IMPORT = {  # package -> the packages of ours it may import
    "diloco": {"diloco", "outer_optim", "peers", "pipeline"},
    "outer_optim": {"outer_optim"},
    "peers": {"peers", "outer_optim"},
    "pipeline": {"pipeline"},
    "experiments": {"experiments", "diloco", "outer_optim", "peers", "pipeline"},
    "benchmarks": {"benchmarks", "diloco", "outer_optim", "peers", "pipeline", "experiments"},
}

FLOORS = {  # inside a package, its parts from the bottom up: a part imports its own floor and those below it
    "diloco": [{"diloco.errors", "diloco.progress", "diloco.files"}, {"diloco.config"}, {"diloco.command"},
               {"diloco.data"}, {"diloco.model"}, {"diloco.inference"}, {"diloco.engine"}, {"diloco.launch"},
               {"diloco.cli"}, {"diloco"}],
    "peers": [{"peers.settings", "peers.errors", "peers.result", "peers.fingerprints", "peers.proctable", "peers.identity",
               "peers.aggregation"},
              {"peers.discovery", "peers.island"}, {"peers.wire"}, {"peers.group"}, {"peers.averaging"},
              {"peers.node"}, {"peers"}],
}
FRONT_DOORS = {"peers": {"diloco"}}
"""A package whose front door is its ``__init__``: the packages that may import it only through that door."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in PACKAGES:
            name = ".".join(rel.with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module of ours ``path`` imports, wherever the import statement is."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found.update(n for n in names if n in modules)
    return found


def test_packages_import_each_other_in_one_direction():
    modules = _modules()
    wrong = [(m, i) for m, path in modules.items() for i in _imports(path, modules)
             if i.split(".")[0] not in MAY_IMPORT[m.split(".")[0]]]
    assert not wrong, f"imports against the layering: {wrong}"


def test_diloco_imports_peers_only_through_its_front_door():
    """``from peers import X`` (what ``peers/__init__.py`` exports), never ``peers.<module>``: what the trainer may
    use of the peer network is one list, and peers can move its modules without touching the trainer."""
    import peers

    modules = _modules()
    wrong, unknown = [], []
    for m, path in modules.items():
        for door, users in FRONT_DOORS.items():
            if m.split(".")[0] not in users:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    wrong += [(m, a.name) for a in node.names if a.name.startswith(door + ".")]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    if node.module.startswith(door + "."):
                        wrong.append((m, node.module))
                    elif node.module == door:
                        unknown += [(m, a.name) for a in node.names if a.name not in peers.__all__]
    assert not wrong, f"imports past the front door (import from the package itself): {wrong}"
    assert not unknown, f"names the front door does not export: {unknown}"
    for name in peers.__all__:  # every name the door lists is really there
        assert getattr(peers, name) is not None, name


def _floor(module: str) -> int:
    """The floor of ``module``'s part (its first two dotted names) inside its package."""
    part = ".".join(module.split(".")[:2])
    floors = FLOORS[module.split(".")[0]]
    found = [i for i, members in enumerate(floors) if part in members]
    assert found, f"{part} stands on no floor of FLOORS: add it"
    return found[0]


def test_the_parts_of_diloco_and_peers_import_only_downwards():
    modules = _modules()
    wrong = [(m, i) for m, path in modules.items() if m.split(".")[0] in FLOORS for i in _imports(path, modules)
             if i.split(".")[0] == m.split(".")[0] and _floor(i) > _floor(m)]
    assert not wrong, f"imports of a higher floor: {wrong}"


def test_no_module_imports_another_in_a_cycle():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"modules importing each other in a cycle: {cycles}"
