"""Building configs: from dicts, YAML files and ``a.b.c=value`` command-line overrides,
and writing them back as YAML. Nothing here validates values (:func:`dvla.config.rules.validate`
does); unknown keys are rejected by name as they are met."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from dvla.config.errors import ConfigError


def from_dict(cls: type, data: dict[str, Any], path: str = "") -> Any:
    """Build dataclass ``cls`` from a plain dict, rejecting unknown keys by name."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path.rstrip('.') or '<root>'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(
                f"{path}{key}: unknown field; allowed: {', '.join(sorted(names))}"
            )
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(tp, value, f"{path}{key}.")
        else:
            kwargs[key] = value
    return cls(**kwargs)


def merge(cfg: Any, data: dict[str, Any], path: str = "") -> Any:
    """Return a copy of ``cfg`` with the (possibly partial, nested) ``data`` applied."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path.rstrip('.') or '<root>'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(type(cfg))
    names = {f.name for f in dataclasses.fields(cfg)}
    changes = {}
    if "options" in names and data.get("name", getattr(cfg, "name", None)) != getattr(cfg, "name", None):
        # Options belong to the component they were written for: switching the env or
        # policy (``env.name=gym``) starts from none, plus any given with it.
        cfg = dataclasses.replace(cfg, options={})
    for key, value in data.items():
        if key not in names:
            raise ConfigError(
                f"{path}{key}: unknown field; allowed: {', '.join(sorted(names))}"
            )
        if dataclasses.is_dataclass(hints[key]):
            changes[key] = merge(getattr(cfg, key), value, f"{path}{key}.")
        elif isinstance(value, dict) and isinstance(getattr(cfg, key), dict):
            changes[key] = {**getattr(cfg, key), **value}
        else:
            changes[key] = value
    return dataclasses.replace(cfg, **changes)


def load_yaml(cfg: Any, path: str | Path) -> Any:
    """Apply the YAML file at ``path`` on top of ``cfg``. A missing or unreadable file and a
    YAML syntax error are :class:`ConfigError` (the latter naming ``file:line:column``)."""
    try:
        with open(path, "rb") as fh:
            text = fh.read().decode("utf-8")
        data = yaml.safe_load(text)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start} is {exc.object[exc.start:exc.start + 1]!r}); "
                          "save the file as UTF-8") from None
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ConfigError(f"{where}: invalid YAML: {what}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config sections (env:, run:, ...), "
                          f"got {type(data).__name__}")
    try:
        return merge(cfg, data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def parse_override(item: str) -> dict[str, Any]:
    """Turn ``a.b.c=value`` (leading ``--`` allowed) into ``{"a": {"b": {"c": value}}}``.

    The value is parsed as YAML, so ``8`` is an int, ``1e-3`` a float, ``true`` a bool
    and ``[1, 2]`` a list; anything else stays a string.
    """
    text = item[2:] if item.startswith("--") else item
    if "=" not in text:
        raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. env.n_envs=8")
    key, raw = text.split("=", 1)
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r}: malformed key {key!r}")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str):
        # YAML 1.1 reads ``1e-3`` as a string; accept scientific notation for floats.
        try:
            value = float(value)
        except ValueError:
            pass
    out: dict[str, Any] = {}
    node = out
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def apply_overrides(cfg: Any, overrides: list[str]) -> Any:
    for item in overrides:
        cfg = merge(cfg, parse_override(item))
    return cfg


def dump_yaml(cfg: Any, path: str | Path) -> None:
    with open(path, "w") as fh:
        yaml.safe_dump(dataclasses.asdict(cfg), fh, sort_keys=False)
