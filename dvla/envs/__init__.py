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


def _fast_spec(cfg: EnvConfig) -> EnvSpec:
    from dvla.envs.fast import FastReachEnv

    return FastReachEnv.spec_for(cfg)


def _genesis_spec(cfg: EnvConfig) -> EnvSpec:
    from dvla.envs.genesis_env import GenesisFrankaEnv  # genesis itself is imported on build only

    return GenesisFrankaEnv.spec_for(cfg)


def check_option_keys(cfg: EnvConfig, allowed) -> None:
    """A ConfigError naming the first key of ``cfg.options`` not in ``allowed`` (and the allowed ones)."""
    for key in cfg.options:
        if key not in allowed:
            raise ConfigError(f"env.options.{key}: unknown option for env {cfg.name!r}; allowed: "
                              f"{', '.join(sorted(allowed))}")


def _fast_check(cfg: EnvConfig) -> None:
    from dvla.envs.fast import FastReachEnv

    check_option_keys(cfg, FastReachEnv.OPTIONS)
    FastReachEnv.check_config(cfg)


def _genesis_check(cfg: EnvConfig) -> None:
    from dvla.envs.genesis_env import GenesisFrankaEnv

    check_option_keys(cfg, GenesisFrankaEnv.OPTIONS)
    GenesisFrankaEnv.check_config(cfg)


def _gym_check(cfg: EnvConfig) -> None:
    from dvla.envs.gym_adapter import GymVectorEnv

    check_option_keys(cfg, GymVectorEnv.OPTIONS)
    GymVectorEnv.check_config(cfg)


@register_env("fast_reach", spec=_fast_spec, check=_fast_check)
def _fast_reach(cfg: EnvConfig, device: torch.device, seed: int) -> BatchedEnv:
    from dvla.envs.fast import FastReachEnv

    return FastReachEnv(cfg, device, seed)


@register_env("genesis_reach", spec=_genesis_spec, check=_genesis_check)
def _genesis_reach(cfg: EnvConfig, device: torch.device, seed: int) -> BatchedEnv:
    from dvla.envs.genesis_env import GenesisReachEnv

    return GenesisReachEnv(cfg, device, seed)


@register_env("genesis_lift", spec=_genesis_spec, check=_genesis_check)
def _genesis_lift(cfg: EnvConfig, device: torch.device, seed: int) -> BatchedEnv:
    from dvla.envs.genesis_env import GenesisLiftEnv

    return GenesisLiftEnv(cfg, device, seed)


@register_env("gym", check=_gym_check)
def _gym(cfg: EnvConfig, device: torch.device, seed: int) -> BatchedEnv:
    from dvla.envs.gym_adapter import GymVectorEnv

    return GymVectorEnv(cfg, device, seed)


def _libero_spec(cfg: EnvConfig) -> EnvSpec:
    from dvla.envs.libero_env import LiberoEnv  # LIBERO itself is imported on build only

    return LiberoEnv.spec_for(cfg)


def _libero_check(cfg: EnvConfig) -> None:
    from dvla.envs.libero_env import LiberoEnv

    check_option_keys(cfg, LiberoEnv.OPTIONS)
    LiberoEnv.check_config(cfg)


@register_env("libero", spec=_libero_spec, check=_libero_check)
def _libero(cfg: EnvConfig, device: torch.device, seed: int) -> BatchedEnv:
    from dvla.envs.libero_env import LiberoEnv

    return LiberoEnv(cfg, device, seed)


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
