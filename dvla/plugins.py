"""Your own policies and envs, found without a wrapper script.

Two ways, both done before the configuration is checked (so ``policy.name=my_policy``
resolves), on every rank of a torchrun job:

- ``--import MODULE`` (repeatable) on ``python -m dvla.launch``, ``torchrun -m dvla.launch``
  and the ``dvla`` command imports a module by its dotted name, or a ``.py`` file by its
  path; importing it runs its ``@register_policy`` / ``@register_env`` decorators.
- An installed package declares entry points, discovered at start-up::

      [project.entry-points."dvla.policies"]
      my_policy = "my_pkg.policy:MyPolicy"    # a VLAPolicy subclass: registered as my_policy
      [project.entry-points."dvla.envs"]
      my_env = "my_pkg.env:make_my_env"      # an env factory: registered as my_env

  Loading an entry point imports its module; a class or factory not registered by a
  decorator there is registered under the entry point's name.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import sys
from pathlib import Path

from dvla.config import ConfigError
from dvla.envs import ENV_REGISTRY, register_env
from dvla.policy import POLICY_REGISTRY, VLAPolicy, register_policy

log = logging.getLogger("dvla")
GROUPS = ("dvla.policies", "dvla.envs")


def describe(exc: BaseException) -> str:
    """``Type: message`` of ``exc`` in one line, and of its innermost cause where it has one:
    a library that re-raises (transformers' lazy imports) hides the root cause, e.g. a
    torchvision build that does not match torch, behind its own message."""
    def one(e: BaseException) -> str:
        message = " ".join(str(e).split())
        return f"{type(e).__name__}: {message}" if message else type(e).__name__

    inner, seen = exc, {id(exc)}
    while True:
        nxt = inner.__cause__ if inner.__cause__ is not None else (
            None if inner.__suppress_context__ else inner.__context__)
        if nxt is None or id(nxt) in seen:
            break
        inner = nxt
        seen.add(id(inner))
    return one(exc) if inner is exc else f"{one(exc)} (root cause: {one(inner)})"


def import_plugin(name: str) -> None:
    """Import ``name``: a dotted module name, or the path of a ``.py`` file."""
    try:
        if name.endswith(".py"):
            path = Path(name).resolve()
            if not path.is_file():
                raise FileNotFoundError(f"no such file {path}")
            module_name = f"dvla_plugin_{path.stem}"
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(module_name, None)  # not a half-run module that a retry would find
                raise
        else:
            importlib.import_module(name)
    except Exception as exc:  # the user's code: any error, said in one line
        raise ConfigError(f"--import {name}: {describe(exc)}") from exc


def load_entry_points() -> list[str]:
    """Load every ``dvla.policies`` / ``dvla.envs`` entry point; their names."""
    loaded = []
    for group in GROUPS:
        for ep in importlib.metadata.entry_points(group=group):
            try:
                obj = ep.load()
            except Exception as exc:
                raise ConfigError(f"entry point {group}:{ep.name} ({ep.value}): {describe(exc)}") from exc
            if group == "dvla.policies":
                if not (isinstance(obj, type) and issubclass(obj, VLAPolicy)):
                    raise ConfigError(f"entry point {group}:{ep.name} ({ep.value}) is not a VLAPolicy subclass")
                if POLICY_REGISTRY.get(ep.name) is not obj:
                    register_policy(ep.name)(obj)
            elif ep.name not in ENV_REGISTRY:
                register_env(ep.name)(obj)
            loaded.append(f"{group}:{ep.name}")
    return loaded


def load_plugins(imports: list[str] | None = None) -> None:
    """Entry points, then ``--import`` modules, in order."""
    found = load_entry_points()
    if found:
        log.debug("plugins from entry points: %s", ", ".join(found))
    for name in imports or []:
        import_plugin(name)
