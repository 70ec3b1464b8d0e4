"""The README claims only what a results file holds, lists every command, keeps its set-up commands and its
recipes whole, and stays short.

The rule for figures: a measured figure on the front page (a percentage, a ``×`` factor, a held-out loss of four
decimals) is covered by the first markdown link after it in its paragraph, list item or table cell (a figure in
a link's text, by that link).  That link must point into ``experiments/results/`` and its file, or a ``.md`` or
``.json`` file under its folder, must print the same figure: the same digits and unit, and no opposite sign."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = "experiments/results/"

FIGURE = re.compile(r"(?P<sign>(?<![\w.,])[+\-−])?(?<![\w.,])(?P<number>\d[\d,]*(?:\.\d+)?)(?P<unit>%|×)"
                    r"|(?<![\w.,])(?P<loss>\d\.\d{4})(?![\d])")
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The README without its code: fenced blocks and inline code spans (flags, commands) carry no figures."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _chunks(text: str) -> list[str]:
    """Paragraphs, list items and table cells: a figure and its link must sit in the same one."""
    chunks = []
    for block in re.split(r"\n\s*\n", text):
        for item in re.split(r"\n(?=\s*- )", block):
            if item.lstrip().startswith("|"):
                for row in item.splitlines():
                    chunks += row.split("|")
            else:
                chunks.append(item.replace("\n", " "))
    return chunks


def _figures(segment: str) -> list[tuple[str, str]]:
    """(sign, figure) of each measured figure in ``segment``, the figure as printed (``2.60%``, ``1,506×``)."""
    out = []
    for m in FIGURE.finditer(segment):
        if m["loss"]:
            out.append(("", m["loss"]))
        else:
            out.append(((m["sign"] or "").replace("−", "-"), m["number"] + m["unit"]))
    return out


def claims(text: str) -> tuple[list[tuple[str, str, str]], list[str]]:
    """([(sign, figure, the link covering it)], [figures no link covers])."""
    covered, bare = [], []
    for chunk in _chunks(_prose(text)):
        pos = 0
        for link in LINK.finditer(chunk):
            for sign, figure in _figures(chunk[pos:link.start()] + " " + link[1]):
                covered.append((sign, figure, link[2]))
            pos = link.end()
        bare += [figure for _, figure in _figures(chunk[pos:])]
    return covered, bare


def _target_text(target: str) -> str:
    path = (ROOT / target.split("#")[0]).resolve()
    files = [path] if path.is_file() else sorted(p for ext in ("md", "json") for p in path.rglob(f"*.{ext}"))
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files).replace("−", "-")


def printed(sign: str, figure: str, text: str) -> bool:
    """Whether ``text`` prints ``figure`` with no sign opposite to ``sign``."""
    body = re.escape(figure).replace("%", r"\s?%")
    for m in re.finditer(rf"(?<![\w.,])([+-]?){body}" + (r"(?![\d])" if figure[-1].isdigit() else ""), text):
        if not sign or not m[1] or m[1] == sign:
            return True
    return False


def test_every_figure_on_the_front_page_is_printed_by_the_results_file_it_links():
    covered, bare = claims(README.read_text())
    assert not bare, f"figures with no link after them in their paragraph, item or cell: {bare}"
    assert len(covered) >= 20
    wrong = [(sign + figure, target) for sign, figure, target in covered
             if not target.startswith(RESULTS) or not printed(sign, figure, _target_text(target))]
    assert not wrong, f"figures whose link is not a results file printing them: {wrong}"


def test_the_rule_catches_a_figure_its_file_does_not_print_and_one_without_a_link():
    page = ("fp32 −1.92% and `sign` −0.79% at 1,506× fewer ([x](experiments/results/frontier-long/)); DiLoCo +9.99% "
            "([y](experiments/results/frontier-long/)).\n\n- a bare 3.5× claim\n\n| −1.92% ([docs](docs/results.md)) | 0.7% |")
    covered, bare = claims(page)
    text = _target_text("experiments/results/frontier-long/")
    good = [t.startswith(RESULTS) and printed(s, f, text) for s, f, t in covered]
    assert [f for (_, f, _), ok in zip(covered, good) if ok] == ["1.92%", "0.79%", "1,506×"]
    assert [f for (_, f, _), ok in zip(covered, good) if not ok] == ["9.99%", "1.92%"]  # not printed; not results
    assert bare == ["3.5×", "0.7%"]
    assert not printed("+", "1.92%", text), "a sign opposite to the file's"


def test_every_command_is_in_the_commands_table():
    from diloco.cli import USAGE
    from experiments.__main__ import USAGE as EXPERIMENTS

    table = README.read_text().split("## Commands", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    commands = {" ".join(line.split()[:2]) if line.split()[0] in ("config", "tokenizer", "data") else line.split()[0]
                for line in USAGE.split("commands:")[1].split("shortcuts:")[0].splitlines()
                if line.startswith("  ") and not line.startswith("   ") and line.strip()}
    commands -= {"experiment"}
    commands |= {f"experiment {line.split()[0]}" for line in EXPERIMENTS.split("commands:")[1].splitlines()
                 if line.startswith("  ") and line.strip()}
    missing = sorted(c for c in commands if not any(f"diloco {c}" in row for row in rows))
    assert len(commands) >= 20 and not missing, f"commands missing from README's Commands table: {missing}"


def test_the_readme_is_short_and_its_set_up_commands_are_the_ones_ci_runs():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    assert ("python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e . && .venv/bin/diloco simulate "
            "--islands 2") in text
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in text, "the README's test command is the one CI runs"
    import sys

    try:
        import tomllib
    except ModuleNotFoundError:
        import tomli as tomllib
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert declared == ">=3.10,<3.13" and "Python 3.10, 3.11 or 3.12" in text and "Linux on x86_64" in text
    assert sys.version_info[:2] in ((3, 10), (3, 11), (3, 12))


def _train_lines() -> list[str]:
    """Every ``diloco train`` command line in the README's code blocks, continuation lines joined."""
    lines = []
    for block in re.findall(r"^```bash\n(.*?)^```", README.read_text(), flags=re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#")[0]
            if "diloco" in line and " train" in line and "--config" not in line:  # (my.toml is the reader's)
                lines.append(line.split(" train", 1)[1].replace("...", ""))
    return lines


@pytest.mark.parametrize("line", _train_lines())
def test_every_train_command_in_the_readme_passes_the_config_checks(line):
    """A recipe is shown whole: each ``diloco train`` line, as printed, loads without a problem (SparseLoCo's
    two flags alone would not)."""
    from diloco import cli

    ns, rest = cli._split_args(["train", *shlex.split(line)])
    cli.load_config(ns, rest)
