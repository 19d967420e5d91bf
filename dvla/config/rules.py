"""Validation: one rule for every field of every section, then each section's own rules.

Every field is checked against its annotation (``int``, ``float``, a ``Literal``, ...).
Every numeric field (``int`` or ``float``, ``None`` allowed beside them) is also checked
against the range declared in its dataclass field's metadata, under the keys ``ge``,
``gt``, ``le`` and ``lt``, and a float must be finite (NaN never passes; ``allow_inf:
True`` in the metadata lets infinities through, for a field whose meaning needs them).
The declaration is :func:`bounded` (or ``field(metadata=bounds(...))``); the layer-0
packages, which import nothing from ``dvla``, write the same keys in a plain dict::

    n_envs: int = bounded(16, ge=1)
    send_timeout_s: float = field(default=60.0, metadata={"ge": 0})

Rules that relate several fields (a mode's requirements, one field's limit set by
another) live in each section's ``_validate() -> [(field, message), ...]``. They run once
every field of the section (and, for the job, of every section) passed the rule above,
so that they may assume each value is of its type and in its range.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import types
import typing
from typing import Any, Literal

from dvla.config.errors import ConfigError

BOUND_KEYS = ("ge", "gt", "le", "lt")
_OPS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<="), "lt": (operator.lt, "<")}


def bounds(*, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None, allow_inf: bool = False) -> dict[str, Any]:
    """Field metadata declaring a numeric range: ``field(default=4, metadata=bounds(ge=1))``."""
    meta: dict[str, Any] = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    if "ge" in meta and "gt" in meta or "le" in meta and "lt" in meta:
        raise TypeError(f"bounds: give one lower and one upper bound at most, got {meta}")
    if allow_inf:
        meta["allow_inf"] = True
    return meta


def bounded(default: Any, **kwargs: Any) -> Any:
    """A dataclass field with default ``default`` and the range ``kwargs`` (see :func:`bounds`)."""
    return dataclasses.field(default=default, metadata=bounds(**kwargs))


def _members(tp: Any) -> tuple[Any, ...]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def is_numeric(tp: Any) -> bool:
    """Whether annotation ``tp`` is ``int`` or ``float`` (``None`` allowed beside them)."""
    members = [m for m in _members(tp) if m is not type(None)]
    return bool(members) and all(m in (int, float) for m in members)


def _num(x: Any) -> str:
    if isinstance(x, int) and x >= 1 << 16 and x & (x - 1) == 0:
        return f"2**{x.bit_length() - 1}"
    if isinstance(x, int) and x >= 1 << 16 and (x + 1) & x == 0:
        return f"2**{x.bit_length()} - 1"
    return repr(x)


def describe_range(meta: typing.Mapping[str, Any], is_float: bool) -> str:
    """``> 0 and finite``, ``in [0, 1]``, ``finite``: what the metadata ``meta`` allows."""
    lo = next((k for k in ("ge", "gt") if k in meta), None)
    hi = next((k for k in ("le", "lt") if k in meta), None)
    if lo and hi:
        text = f"in {'[' if lo == 'ge' else '('}{_num(meta[lo])}, {_num(meta[hi])}{']' if hi == 'le' else ')'}"
    elif lo or hi:
        key = lo or hi
        text = f"{_OPS[key][1]} {_num(meta[key])}"
    else:
        text = ""
    if is_float and not meta.get("allow_inf") and not (lo and hi):  # two bounds imply finite
        text = f"{text} and finite" if text else "finite"
    return text


def range_error(value: Any, tp: Any, meta: typing.Mapping[str, Any]) -> str | None:
    """The message if numeric ``value`` (of annotation ``tp``) is not finite or out of its range."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    is_float = float in _members(tp)
    ok = not (isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and not meta.get("allow_inf"))))
    ok = ok and all(op(value, meta[k]) for k, (op, _) in _OPS.items() if k in meta)
    return None if ok else f"must be {describe_range(meta, is_float)}, got {value!r}"


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is not None:
        tp = origin
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def validate(cfg: Any, path: str = "") -> None:
    """Check the types, ranges and cross-field rules of a (nested) config dataclass; raise
    :class:`ConfigError` listing every problem with its dotted field path, on one line."""
    errors = _collect_errors(cfg, path)
    if errors:
        raise ConfigError("invalid configuration: " + "; ".join(errors))


def _collect_errors(cfg: Any, path: str) -> list[str]:
    errors: list[str] = []
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        fpath = f"{path}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            errors += _collect_errors(value, fpath + ".")
        elif not _type_ok(value, tp):
            errors.append(f"{fpath}: expected {_describe(tp)}, got {value!r}")
        elif is_numeric(tp) and (msg := range_error(value, tp, f.metadata)):
            errors.append(f"{fpath}: {msg}")
    if not errors and hasattr(cfg, "_validate"):
        errors += [f"{path}{name}: {msg}" for name, msg in cfg._validate()]
    return errors
