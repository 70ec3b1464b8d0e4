"""What ``pip install`` brings is what the code imports: every third-party package a module of ours imports is a
distribution ``pyproject.toml`` declares (with a floor), and every module imports in an interpreter that can see
only the declared distributions and what they require, as on a fresh machine."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("diloco", "outer_optim", "peers", "pipeline", "experiments")
"""What ``pip install`` installs (``[tool.setuptools.packages.find]``)."""


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(spec: str) -> str:
    return _normal(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)[1])


def _declared() -> dict[str, str]:
    """{distribution: the requirement as declared}: the dependencies and every extra's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    return {_requirement_name(s): s for s in specs}


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _third_party_imports() -> dict[str, set[str]]:
    """{top-level name: the modules of ours importing it}, wherever the import statement is."""
    found: dict[str, set[str]] = {}
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in PACKAGES and top not in sys.stdlib_module_names and top != "tomllib":
                    found.setdefault(top, set()).add(module)
    return found


def test_every_third_party_import_is_a_declared_distribution_with_a_floor():
    declared = _declared()
    providers = metadata.packages_distributions()
    missing = {}
    for name, importers in sorted(_third_party_imports().items()):
        dists = {_normal(d) for d in providers.get(name, [name])}  # not installed here: named as it is imported
        if not dists & declared.keys():
            missing[name] = sorted(importers)[:3]
    assert not missing, f"imported but not declared in pyproject.toml (import name: importers): {missing}"
    unbounded = [spec for spec in declared.values() if not re.search(r"(>=|==|~=)", spec)]
    assert not unbounded, f"declared without a floor: {unbounded}"
    # the tomllib fallback of Python 3.10 is declared for 3.10 only
    assert "python_version < '3.11'" in declared["tomli"]


def _closure(roots: set[str]) -> set[str]:
    """The installed distributions ``roots`` need, with what they require in turn (markers as on this Python,
    extras not taken)."""
    from packaging.requirements import Requirement

    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for spec in requires:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_normal(req.name))
    return seen


BLOCKER = """
import importlib, importlib.abc, sys
BLOCKED = set(sys.argv[1].split(","))

class Undeclared(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (installed here, but not by pip install)")
        return None

sys.meta_path.insert(0, Undeclared())
failed = []
for name in sys.argv[2].split(","):
    try:
        importlib.import_module(name)
    except Exception as e:
        failed.append(f"{name}: {type(e).__name__}: {e}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_with_only_the_declared_distributions():
    """Runs in its own interpreter, in which a top-level package that an installed distribution provides, but
    neither a declared one nor one those require, fails to import as if it were not installed."""
    base = {_requirement_name(s) for s in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
            ["dependencies"]}
    wanted = _closure(base)
    blocked = {name for name, dists in metadata.packages_distributions().items()
               if name not in PACKAGES and not any(_normal(d) in wanted for d in dists)}
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", BLOCKER, ",".join(sorted(blocked)), ",".join(_modules())],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    assert out.returncode == 0, f"modules that do not import from a fresh install:\n{out.stdout}{out.stderr[-2000:]}"
