"""Environments and their registry.

``make_env(cfg)`` builds the env named by ``cfg.name``:

* ``fast_reach``: pure-torch planar reaching with rendered images (tests, benchmarks).
* ``genesis_reach``, ``genesis_lift``: Franka Panda tasks in genesis-world.
* ``gym``: any ``gymnasium`` env id, vectorised (``options.gym_id``).
* ``libero``: the LIBERO benchmark's suites (extra ``[libero]``; ``options.suite``, ``options.task_ids``).

Add an env with ``register_env("name")`` on a factory ``(cfg, device, seed) -> BatchedEnv``;
``register_env("name", spec=fn)`` also tells :func:`env_spec` the env's spec without building
one (``fn(cfg) -> EnvSpec``, usually the class's ``spec_for``), so that a learner-only rank
needs no simulator; ``check=fn`` (``fn(cfg)``, raising :class:`~dvla.config.ConfigError`)
lets :func:`check_env_config` validate ``env.options`` before anything is built (the
launcher calls it, also for ``--print-config``).
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

from dvla.config import ConfigError, EnvConfig
from dvla.envs.base import BatchedEnv, EnvSpec, GoalEnv

EnvFactory = Callable[[EnvConfig, torch.device, int], BatchedEnv]
SpecFn = Callable[[EnvConfig], "EnvSpec | None"]
CheckFn = Callable[[EnvConfig], object]
ENV_REGISTRY: dict[str, EnvFactory] = {}
ENV_SPECS: dict[str, SpecFn] = {}
ENV_CHECKS: dict[str, CheckFn] = {}


def register_env(name: str, spec: SpecFn | None = None,
                 check: CheckFn | None = None) -> Callable[[EnvFactory], EnvFactory]:
    def deco(factory: EnvFactory) -> EnvFactory:
        if name in ENV_REGISTRY and ENV_REGISTRY[name] is not factory:
            raise ValueError(f"env name {name!r} is already registered")
        ENV_REGISTRY[name] = factory
        if spec is not None:
            ENV_SPECS[name] = spec
        if check is not None:
            ENV_CHECKS[name] = check
        return factory

    return deco


def check_env_config(cfg: EnvConfig) -> None:
    """Validate ``env.name`` and ``env.options`` without building an env: a
    :class:`ConfigError` names an unknown env (and the registered ones) or an unknown or
    invalid option (and the allowed ones). Envs registered without ``check`` are only
    checked by name here (their own constructor checks the rest)."""
    if cfg.name not in ENV_REGISTRY:
        raise ConfigError(
            f"env.name: unknown env {cfg.name!r}; registered: {', '.join(sorted(ENV_REGISTRY))}"
        )
    if not isinstance(cfg.options, dict):
        raise ConfigError(f"env.options: expected a mapping, got {cfg.options!r}")
    if cfg.name in ENV_CHECKS:
        ENV_CHECKS[cfg.name](cfg)


def env_options(cfg: EnvConfig) -> dict:
    """``env.options`` as the env reads them: every declared option, the given ones over the
    defaults (``--print-config`` shows these); the given ones alone for an env that declares
    none."""
    check_env_config(cfg)
    got = ENV_CHECKS[cfg.name](cfg) if cfg.name in ENV_CHECKS else None
    return got if isinstance(got, dict) else dict(cfg.options)


def check_option_keys(cfg: EnvConfig, allowed) -> None:
    """A ConfigError naming the first key of ``cfg.options`` not in ``allowed`` (and the allowed ones)."""
    for key in cfg.options:
        if key not in allowed:
            raise ConfigError(f"env.options.{key}: unknown option for env {cfg.name!r}; allowed: "
                              f"{', '.join(sorted(allowed))}")


def register_builtin(name: str, module: str, cls: str) -> None:
    """Register the env class ``module.cls`` under ``name``, imported only when used (the
    simulators behind genesis and LIBERO are heavy, and optional): its factory, its
    ``spec_for`` (None: build one to find out) and its checks (``OPTIONS`` keys, then
    ``check_config``)."""

    def env_class():
        return getattr(importlib.import_module(module), cls)

    def check(cfg: EnvConfig) -> dict:
        klass = env_class()
        check_option_keys(cfg, klass.OPTIONS)
        return klass.check_config(cfg)

    def factory(cfg: EnvConfig, device: torch.device, seed: int) -> BatchedEnv:
        return env_class()(cfg, device, seed)

    register_env(name, spec=lambda cfg: env_class().spec_for(cfg), check=check)(factory)


register_builtin("fast_reach", "dvla.envs.fast", "FastReachEnv")
register_builtin("genesis_reach", "dvla.envs.genesis_env", "GenesisReachEnv")
register_builtin("genesis_lift", "dvla.envs.genesis_env", "GenesisLiftEnv")
register_builtin("gym", "dvla.envs.gym_adapter", "GymVectorEnv")
register_builtin("libero", "dvla.envs.libero_env", "LiberoEnv")


def make_env(cfg: EnvConfig, device: torch.device | str = "cpu", seed: int = 0) -> BatchedEnv:
    if cfg.name not in ENV_REGISTRY:
        raise ConfigError(
            f"env.name: unknown env {cfg.name!r}; registered: {', '.join(sorted(ENV_REGISTRY))}"
        )
    return ENV_REGISTRY[cfg.name](cfg, torch.device(device), seed)


def env_spec(cfg: EnvConfig, device: torch.device | str = "cpu", seed: int = 0) -> EnvSpec:
    """The spec of the env ``cfg`` names: from its registered ``spec`` function where it has
    one (nothing is built), otherwise from an env built for the purpose and closed again."""
    spec = ENV_SPECS[cfg.name](cfg) if cfg.name in ENV_SPECS else None
    if spec is not None:
        return spec
    env = make_env(cfg, device, seed)
    try:
        return env.spec
    finally:
        env.close()


__all__ = ["BatchedEnv", "EnvSpec", "GoalEnv", "ENV_REGISTRY", "ENV_SPECS", "ENV_CHECKS", "register_env",
           "check_env_config", "make_env", "env_spec"]
