"""Reading the configuration: field defaults < a command's defaults < a TOML file < ``--section.key VALUE``
overrides, every problem reported as one line; and writing it back (TOML with docstrings, the config
reference table)."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as the tomli package (declared for 3.10 only)
    import tomli as tomllib

from diloco.config.checks import validate
from diloco.config.schema import (
    Config,
    ConfigError,
    field_docs,
    flatten,
    is_section,
    resolve_model,
    to_dict,
)


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _leaf(cfg: Config, key: str) -> tuple[Any, str, Any]:
    """Return (owning dataclass instance, field name, declared type) for a dotted key."""
    parts = key.split(".")
    obj: Any = cfg
    for part in parts[:-1]:
        obj = getattr(obj, part)
    return obj, parts[-1], _field_types(type(obj))[parts[-1]]


def _coerce(key: str, raw: Any, typ: Any) -> Any:
    """Convert a TOML value or a command-line string to the field's type, or raise ValueError."""
    origin = typing.get_origin(typ)
    if origin in (list, tuple):
        (item,) = typing.get_args(typ) or (str,)
        what = "integers" if item is int else "strings"
        if isinstance(raw, str):
            items = [s for s in (p.strip() for p in raw.split(",")) if s]
        elif isinstance(raw, (list, tuple)):
            items = [x if item is int and isinstance(x, int) and not isinstance(x, bool) else str(x) for x in raw]
        else:
            raise ValueError(f"{key} expects a list of {what} (comma-separated on the command line), got {raw!r}")
        if item is int:
            try:
                return [int(x) for x in items]
            except ValueError:
                raise ValueError(f"{key} expects a list of integers (comma-separated on the command line), "
                                 f"got {raw!r}") from None
        return items
    if typ is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(raw, str) and raw.lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{key} expects true or false, got {raw!r}")
    numbers = {int: ((int, str), "an integer"), float: ((int, float, str), "a number")}
    if typ in numbers:
        accepted, what = numbers[typ]
        if isinstance(raw, bool) or not isinstance(raw, accepted):
            raise ValueError(f"{key} expects {what}, got {raw!r}")
        try:
            return typ(raw)
        except ValueError:
            raise ValueError(f"{key} expects {what}, got {raw!r}") from None
    if typ is str:
        if not isinstance(raw, (str, int, float)) or isinstance(raw, bool):
            raise ValueError(f"{key} expects a string, got {raw!r}")
        return str(raw)
    raise ValueError(f"{key} has an unsupported type {typ}")  # pragma: no cover


def _unknown_key_message(key: str, valid: list[str]) -> str:
    tail = key.split(".")[-1]
    # a bare or misplaced name (`--inner_steps`) most likely means the key with that exact last part
    close = [k for k in valid if k.split(".")[-1] == tail and k != key][:1]
    if not close:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean --{close[0]}?" if close else "; run `diloco config show` to list valid keys."
    return f"unknown config key --{key}{hint}"


def apply(cfg: Config, items: dict[str, Any]) -> list[str]:
    """Set dotted keys on ``cfg`` in place; return one message per unknown key or bad value."""
    valid = list(flatten(cfg))
    problems = []
    for key, raw in items.items():
        if key not in valid:
            problems.append(_unknown_key_message(key, valid))
            continue
        obj, name, typ = _leaf(cfg, key)
        try:
            setattr(obj, name, _coerce(f"--{key}", raw, typ))
        except ValueError as e:
            problems.append(str(e))
    return problems


def _flatten_toml(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, dict):
            out.update(_flatten_toml(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def parse_overrides(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """Turn ``["--a.b", "1", "--c=2"]`` into ``{"a.b": "1", "c": "2"}``; also return problems."""
    items: dict[str, str] = {}
    problems: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            problems.append(f"unexpected argument {arg!r}: options are written --section.key VALUE")
            i += 1
            continue
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        elif i + 1 < len(args) and not (args[i + 1].startswith("--") and len(args[i + 1]) > 2):
            value = args[i + 1]
            i += 2
        else:
            problems.append(f"--{key} needs a value: write --{key} VALUE")
            i += 1
            continue
        items[key.replace("-", "_")] = value
    return items, problems


def _read_file(config_file: str) -> dict[str, Any]:
    """The dotted keys of a TOML config file, or :class:`ConfigError` in one line."""
    path = Path(config_file)
    try:
        return _flatten_toml(tomllib.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        raise ConfigError([f"config file {path} does not exist; check the path passed to --config"]) from None
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise ConfigError([f"config file {path} cannot be read ({why}); pass a TOML file to --config"]) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"config file {path} is not valid TOML ({e}); fix the syntax"]) from None


def load(config_file: str | None = None, overrides: list[str] | dict[str, Any] | None = None,
         defaults: dict[str, Any] | None = None) -> Config:
    """Build a validated :class:`Config`: field defaults < ``defaults`` (a command's own, dotted keys) <
    an optional TOML file < overrides (``--section.key VALUE`` list or dotted-key dict).

    Raises :class:`ConfigError` listing every problem found.
    """
    return load_given(config_file, overrides, defaults)[0]


def load_given(config_file: str | None = None, overrides: list[str] | dict[str, Any] | None = None,
               defaults: dict[str, Any] | None = None) -> tuple[Config, set[str]]:
    """:func:`load`, and the keys the file and the overrides set: for a command that reads only part of the
    config (``diloco plan`` its model) and takes the rest as train would, checked alike, so that the same
    flags and files work everywhere and a typo is refused the same way."""
    cfg = Config()
    problems: list[str] = apply(cfg, defaults) if defaults else []
    given: set[str] = set()
    if config_file:
        items = _read_file(config_file)
        given.update(items)
        problems += apply(cfg, items)
    if isinstance(overrides, dict):
        given.update(overrides)
        problems += apply(cfg, overrides)
    elif overrides:
        items, parse_problems = parse_overrides(overrides)
        given.update(items)
        problems += parse_problems
        problems += apply(cfg, items)
    resolve_model(cfg.model)
    problems += validate(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg, given


def describe(cfg: Config) -> str:
    """The effective config as TOML, each key preceded by its docstring as a comment; the values are
    :func:`~diloco.config.schema.to_dict`'s, so that a secret is never shown."""
    lines: list[str] = []

    def emit(section: Any, values: dict[str, Any], name: str | None) -> None:
        docs = field_docs(type(section))
        if name:
            lines.append(f"\n[{name}]")
        subsections = []
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if is_section(value):
                subsections.append((value, values[f.name], f.name if not name else f"{name}.{f.name}"))
                continue
            if f.name in docs:
                lines.append(f"# {docs[f.name]}")
            lines.append(f"{f.name} = {_toml_value(values[f.name])}")
        for value, sub_values, sub in subsections:
            emit(value, sub_values, sub)

    emit(cfg, to_dict(cfg), None)
    return "\n".join(lines).lstrip() + "\n"


REFERENCE_HEADER = """# Config reference

Every key of the configuration, its default and what it means, generated from the docstrings of the config
classes (`diloco config reference > docs/config.md`; a test checks that this file is current). Set a key in
a TOML file (`--config FILE`, sections as tables) or on the command line as `--section.key VALUE`; lists
are comma-separated there. `diloco config show` prints the effective values of a command line.

"""


def reference_markdown() -> str:
    """``docs/config.md``: a markdown table of every key with its default and docstring."""
    cfg = Config()
    rows = [REFERENCE_HEADER + "| key | default | meaning |", "| --- | --- | --- |"]

    def walk(section: Any, prefix: str) -> None:
        docs = field_docs(type(section))
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if is_section(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                rows.append(f"| `--{prefix}{f.name}` | `{_toml_value(value)}` | {docs.get(f.name, '')} |")

    walk(cfg, "")
    return "\n".join(rows) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


REMOVED_KEYS = ("averaging.sharded",)
"""Keys of earlier versions that checkpoints may still hold; every island now averages shard-wise."""



def from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a Config from :func:`to_dict` output (e.g. stored in a checkpoint)."""
    cfg = Config()
    items = {k: v for k, v in _flatten_toml(data).items() if k not in REMOVED_KEYS}
    problems = apply(cfg, items)
    if problems:
        raise ConfigError(problems)
    return cfg


__all__ = ["load", "load_given", "apply", "parse_overrides", "from_dict", "describe", "reference_markdown"]
