"""An env's options (``env.options``), declared like the config's own fields: each with its
default, the values it takes (type, bounds, choices) and what it does.

An env class lists them in ``OPTIONS`` as :class:`Option` values; :func:`check_options` puts
the given ones over the defaults and checks every one (a one-line ConfigError naming the
option, what it takes and what it got: NaN, infinities, a huge number, a wrong type), and
:func:`reference_rows` gives ``dvla config-ref`` a row per option. An env of a plugin may
still list plain defaults (``{"speed": 1.0}``): its numbers must then at least be finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dvla.config import ConfigError
from dvla.config.rules import describe_range

KINDS = ("int", "float", "bool", "str", "ints", "mapping")


@dataclass(frozen=True)
class Option:
    """One option: ``default``, ``doc`` and what it takes. ``kind``: ``int``, ``float``,
    ``bool``, ``str``, ``ints`` (an integer or a list of them), ``mapping``; bounds
    ``ge``/``gt``/``le``/``lt`` for numbers (every element of ``ints``), ``choices`` for
    strings; ``none``: None is a value too (its meaning in ``doc``). Floats must be finite."""

    default: Any
    doc: str
    kind: str = "float"
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] = ()
    none: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Option kind {self.kind!r}: one of {', '.join(KINDS)}")

    def takes(self) -> str:
        """What the option takes, in words: ``a number in (0, 1]``, ``one of a, b``."""
        if self.kind == "bool":
            text = "true or false"
        elif self.kind == "mapping":
            text = "a mapping"
        elif self.kind == "str":
            text = f"one of {', '.join(self.choices)}" if self.choices else "a string"
        else:
            what = {"int": "an integer", "float": "a finite number", "ints": "an integer or a list of them"}[self.kind]
            text = f"{what}{self._range()}"
        return text + (" (or null)" if self.none else "")

    def _range(self) -> str:
        bounds = {k: v for k in ("ge", "gt", "le", "lt") if (v := getattr(self, k)) is not None}
        text = describe_range(bounds, is_float=False)  # (finiteness is in "a finite number")
        return f" {text}" if text else ""

    def check(self, name: str, value: Any) -> Any:
        """``value``, checked (an int where a float is asked becomes a float)."""
        if value is None and self.none:
            return None
        bad = ConfigError(f"env.options.{name}: must be {self.takes()}, got {_shown(value)}")
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise bad
            return value
        if self.kind == "mapping":
            if not isinstance(value, dict):
                raise bad
            return value
        if self.kind == "str":
            if not isinstance(value, str) or (self.choices and value not in self.choices):
                raise bad
            return value
        if self.kind == "ints":
            items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
            if not isinstance(items, list) or not items or not all(self._number_ok(v, integer=True) for v in items):
                raise bad
            return value
        if not self._number_ok(value, integer=self.kind == "int"):
            raise bad
        return float(value) if self.kind == "float" else value

    def _number_ok(self, v: Any, integer: bool) -> bool:
        if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
            return False
        if not integer and not math.isfinite(v):
            return False
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt))


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def defaults(options: dict[str, Any]) -> dict[str, Any]:
    """The default of every option (a plain default stands for itself)."""
    return {k: o.default if isinstance(o, Option) else o for k, o in options.items()}


def check_options(env: str, given: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """``given`` over the defaults of ``options``, every value checked (ConfigError)."""
    if not isinstance(given, dict):
        raise ConfigError(f"env.options: expected a mapping, got {_shown(given)}")
    unknown = sorted(set(given) - set(options))
    if unknown:
        raise ConfigError(f"env.options: unknown option(s) {unknown} for {env}; allowed: {sorted(options)}")
    out = defaults(options)
    for key, value in given.items():
        spec = options[key]
        if isinstance(spec, Option):
            out[key] = spec.check(key, value)
        elif isinstance(spec, (int, float)) and not isinstance(spec, bool) and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
            raise ConfigError(f"env.options.{key}: must be a finite number (its default is {spec!r}), "
                              f"got {_shown(value)}")
    return out


def reference_rows(envs: dict[str, dict[str, Any]]) -> list[tuple[str, str, str]]:
    """``(env.options.<name> (<env>), default, what it takes: doc)`` for every declared option
    of ``envs`` (env name -> its ``OPTIONS``)."""
    rows = []
    for env, options in envs.items():
        for key, o in options.items():
            if isinstance(o, Option):
                default = "null" if o.default is None else repr(o.default).lower() if isinstance(o.default, bool) \
                    else f"`{o.default}`" if isinstance(o.default, (str, list, dict)) else str(o.default)
                rows.append((f"env.options.{key} ({env})", default, f"{o.takes()}: {o.doc}"))
    return rows
