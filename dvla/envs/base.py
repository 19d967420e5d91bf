"""The batched environment interface.

A :class:`BatchedEnv` steps ``B`` environments at once with torch tensors. Episodes of
a batch start together (``reset``) and every env keeps a latched ``done`` flag: after
an env terminates, further steps report zero reward and ``done`` stays set, so a
rollout of fixed length simply masks the tail. This is what GRPO needs (groups of
episodes from identical initial states) and PPO works on it unchanged.

One policy decision is an action chunk ``(B, K, D)``: ``step`` executes the K actions
in order and renders the observation once, after the last one. Subclasses implement
the per-action hooks; the chunk loop, done latching and reward bookkeeping live here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from dvla.config import ConfigError, EnvConfig
from dvla.types import Observation, StepResult


@dataclass(frozen=True)
class EnvSpec:
    image_shape: tuple[int, int, int]  # (C, H, W) of the main camera
    proprio_dim: int
    action_dim: int
    cameras: tuple[tuple[str, tuple[int, int, int]], ...] = ()
    """Further named cameras the observations carry (``Observation.cameras``): (name, (C, H, W))."""


class BatchedEnv(ABC):
    """Base class of all environments. ``actions`` are normalised to [-1, 1]."""

    spec: EnvSpec

    def __init__(self, cfg: EnvConfig, device: torch.device | str = "cpu", seed: int = 0):
        self.cfg = cfg
        self.n_envs = cfg.n_envs
        self.device = torch.device(device)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self._done = torch.zeros(self.n_envs, dtype=torch.bool, device=self.device)
        self._success = torch.zeros(self.n_envs, dtype=torch.bool, device=self.device)

    def _options(self, defaults: dict) -> dict:
        """``cfg.options`` over ``defaults``; an unknown key is a ConfigError naming the allowed ones."""
        return self.options_of(self.cfg, defaults)

    @staticmethod
    def options_of(cfg: EnvConfig, defaults: dict) -> dict:
        """:meth:`_options` for a config, without an env."""
        unknown = set(cfg.options) - set(defaults)
        if unknown:
            raise ConfigError(
                f"env.options: unknown option(s) {sorted(unknown)} for {cfg.name}; "
                f"allowed: {sorted(defaults)}"
            )
        return {**defaults, **cfg.options}

    @classmethod
    def spec_for(cls, cfg: EnvConfig) -> EnvSpec | None:
        """The spec an env built from ``cfg`` will have, where the class can tell without
        building one (a learner-only rank needs the spec, not a simulator); None means
        "build one to find out"."""
        return None

    # -- hooks ------------------------------------------------------------------------------
    @abstractmethod
    def _reset(self, group_size: int) -> None:
        """Put every env at the start of a new episode; consecutive blocks of
        ``group_size`` envs get an identical initial state."""

    @abstractmethod
    def _step_action(self, action: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Apply one action ``(B, D)``; return ``(reward, terminated, truncated, success)``."""

    @abstractmethod
    def _observe(self) -> Observation:
        """The current batched observation."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    # -- public API -------------------------------------------------------------------------
    def reset(self, group_size: int = 1) -> Observation:
        if self.n_envs % group_size != 0:
            raise ValueError(f"n_envs={self.n_envs} is not a multiple of group_size={group_size}")
        self._done.zero_()
        self._success.zero_()
        self._reset(group_size)
        return self._observe()

    def step(self, actions: Tensor) -> StepResult:
        if actions.dim() == 2:
            actions = actions.unsqueeze(1)
        if actions.shape[0] != self.n_envs or actions.shape[2] != self.spec.action_dim:
            raise ValueError(
                f"actions must be (n_envs={self.n_envs}, K, action_dim={self.spec.action_dim}), "
                f"got {tuple(actions.shape)}"
            )
        actions = actions.to(self.device).clamp(-1.0, 1.0)
        total = torch.zeros(self.n_envs, device=self.device)
        term = torch.zeros_like(self._done)
        trunc = torch.zeros_like(self._done)
        executed = torch.zeros(self.n_envs, dtype=torch.long, device=self.device)
        for k in range(actions.shape[1]):
            r, te, tr, su = self._step_action(actions[:, k])
            live = ~self._done
            executed += live
            total += r * live
            term |= te & live
            trunc |= tr & live & ~te
            self._success |= su & live
            self._done |= (te | tr) & live
        return StepResult(
            obs=self._observe(),
            reward=total,
            terminated=term,
            truncated=trunc,
            success=self._success.clone(),
            executed=executed,
        )

    @property
    def done(self) -> Tensor:
        return self._done


class GoalEnv(BatchedEnv, ABC):
    """An env whose task is to bring something to a goal: success when the task
    distance falls below a threshold; reward is ``success_reward`` on success plus
    ``reward_shaping`` times the decrease of the distance (a potential-based term)."""

    success_threshold: float = 0.05

    def _reset(self, group_size: int) -> None:
        self._reset_task(group_size)
        self._dist = self._distance()

    @abstractmethod
    def _reset_task(self, group_size: int) -> None: ...

    @abstractmethod
    def _apply(self, action: Tensor) -> None:
        """Advance the simulation by one control step under ``action`` ``(B, D)``."""

    @abstractmethod
    def _distance(self) -> Tensor:
        """``(B,)`` distance to task completion."""

    def _step_action(self, action: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        self._apply(action)
        dist = self._distance()
        success = dist < self.success_threshold
        reward = self.cfg.success_reward * success.float()
        if self.cfg.reward_shaping > 0:
            reward = reward + self.cfg.reward_shaping * (self._dist - dist)
        self._dist = dist
        no = torch.zeros_like(success)
        return reward, success, no, success

    def group_repeat(self, x: Tensor, group_size: int) -> Tensor:
        """Expand per-group values ``(B / G, ...)`` to per-env values ``(B, ...)``."""
        return x.repeat_interleave(group_size, dim=0)
