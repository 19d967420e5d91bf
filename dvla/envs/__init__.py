"""Environments and their registry.

``make_env(cfg)`` builds the env named by ``cfg.name``:

* ``fast_reach``: pure-torch planar reaching with rendered images (tests, benchmarks).
* ``genesis_reach``, ``genesis_lift``: Franka Panda tasks in genesis-world.
* ``gym``: any ``gymnasium`` env id, vectorised (``options.gym_id``).

Add an env with ``register_env("name")`` on a factory ``(cfg, device, seed) -> BatchedEnv``.
"""

from __future__ import annotations

from typing import Callable

import torch

from dvla.config import ConfigError, EnvConfig
from dvla.envs.base import BatchedEnv, EnvSpec, GoalEnv

EnvFactory = Callable[[EnvConfig, torch.device, int], BatchedEnv]
ENV_REGISTRY: dict[str, EnvFactory] = {}


def register_env(name: str) -> Callable[[EnvFactory], EnvFactory]:
    def deco(factory: EnvFactory) -> EnvFactory:
        if name in ENV_REGISTRY and ENV_REGISTRY[name] is not factory:
            raise ValueError(f"env name {name!r} is already registered")
        ENV_REGISTRY[name] = factory
        return factory

    return deco


@register_env("fast_reach")
def _fast_reach(cfg: EnvConfig, device: torch.device, seed: int) -> BatchedEnv:
    from dvla.envs.fast import FastReachEnv

    return FastReachEnv(cfg, device, seed)


@register_env("genesis_reach")
def _genesis_reach(cfg: EnvConfig, device: torch.device, seed: int) -> BatchedEnv:
    from dvla.envs.genesis_env import GenesisReachEnv

    return GenesisReachEnv(cfg, device, seed)


@register_env("genesis_lift")
def _genesis_lift(cfg: EnvConfig, device: torch.device, seed: int) -> BatchedEnv:
    from dvla.envs.genesis_env import GenesisLiftEnv

    return GenesisLiftEnv(cfg, device, seed)


@register_env("gym")
def _gym(cfg: EnvConfig, device: torch.device, seed: int) -> BatchedEnv:
    from dvla.envs.gym_adapter import GymVectorEnv

    return GymVectorEnv(cfg, device, seed)


def make_env(cfg: EnvConfig, device: torch.device | str = "cpu", seed: int = 0) -> BatchedEnv:
    if cfg.name not in ENV_REGISTRY:
        raise ConfigError(
            f"env.name: unknown env {cfg.name!r}; registered: {', '.join(sorted(ENV_REGISTRY))}"
        )
    return ENV_REGISTRY[cfg.name](cfg, torch.device(device), seed)


__all__ = ["BatchedEnv", "EnvSpec", "GoalEnv", "ENV_REGISTRY", "register_env", "make_env"]
