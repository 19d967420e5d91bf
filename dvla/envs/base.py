"""The batched environment interface.

A :class:`BatchedEnv` steps ``B`` environments at once with torch tensors. Episodes of
a batch start together (``reset``) and every env keeps a latched ``done`` flag: after
an env terminates, further steps report zero reward and ``done`` stays set, so a
rollout of fixed length simply masks the tail. This is what GRPO needs (groups of
episodes from identical initial states) and PPO works on it unchanged.

``reset(group_size, independent=True)`` instead puts every env on its own clock: ``step``
ends an episode at ``cfg.episode_len`` decisions (truncated) and starts the next one at
once, inside the same step, for each block of ``group_size`` envs whose episodes have all
ended (a GRPO group's episodes share an initial state, so the group restarts together; a
member that ended early waits, latched, for the others). The step's ``reset`` flags say
which envs started anew; their row of ``obs`` is the new episode's first observation, and
``final_obs`` (when asked for) the observation each had before its reset. Subclasses reset
single envs in :meth:`BatchedEnv._reset_envs`.

One policy decision is an action chunk ``(B, K, D)``: ``step`` executes the K actions
in order and renders the observation once, after the last one. Subclasses implement
the per-action hooks; the chunk loop, done latching and reward bookkeeping live here.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dvla.config import ConfigError, EnvConfig
from dvla.envs.options import check_options
from dvla.types import Observation, StepResult


DEFAULT_REWARD_RANGE = (-1e4, 1e4)
"""The reward range of an env that declares none (``EnvSpec.reward_range``)."""


@contextlib.contextmanager
def seeded_numpy(seed):
    """Inside: numpy's global generator seeded with ``seed`` (an int or a sequence of ints);
    after: as it was. For simulators that draw from it (LIBERO's placements, genesis' collision
    colours): what they draw is then fixed by ``seed``, not by what the process drew before."""
    saved = np.random.get_state()
    try:
        np.random.seed(seed)
        yield
    finally:
        np.random.set_state(saved)


@dataclass(frozen=True)
class EnvSpec:
    image_shape: tuple[int, int, int]  # (C, H, W) of the main camera
    proprio_dim: int
    action_dim: int
    cameras: tuple[tuple[str, tuple[int, int, int]], ...] = ()
    """Further named cameras the observations carry (``Observation.cameras``): (name, (C, H, W))."""
    reward_range: tuple[float, float] = DEFAULT_REWARD_RANGE
    """``(low, high)``: every reward the env gives lies in it. A learner rejects chunks with
    rewards outside it (``swimlane.validate``); declare the env's real range."""

    def __post_init__(self) -> None:
        r = self.reward_range
        ok = isinstance(r, tuple) and len(r) == 2 and all(isinstance(x, (int, float)) and math.isfinite(x) for x in r)
        if not (ok and r[0] <= r[1]):
            raise ConfigError(f"EnvSpec.reward_range: expected (low, high), finite, low <= high; "
                              f"got {self.reward_range!r}")


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
        self._t = torch.zeros(self.n_envs, dtype=torch.long, device=self.device)  # decisions of each episode
        self._independent: tuple[int, bool] | None = None  # (group_size, final_obs) when on its own clock

    def _options(self, options: dict) -> dict:
        """``cfg.options`` over the defaults of ``options``, checked; an unknown key is a
        ConfigError naming the allowed ones."""
        return self.options_of(self.cfg, options)

    @staticmethod
    def options_of(cfg: EnvConfig, options: dict) -> dict:
        """:meth:`_options` for a config, without an env: ``cfg.options`` over the defaults of
        ``options`` (the class's ``OPTIONS``), each value checked
        (:func:`dvla.envs.options.check_options`)."""
        return check_options(cfg.name, cfg.options, options)

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

    @property
    def resets_single_envs(self) -> bool:
        """Whether the env implements :meth:`_reset_envs` (and so runs on its own clock)."""
        return type(self)._reset_envs is not BatchedEnv._reset_envs

    def _reset_envs(self, envs: Tensor, group_size: int) -> None:
        """Put the envs ``envs`` (sorted indices, whole consecutive blocks of ``group_size``)
        at the start of a new episode, each block with one initial state; the others go on
        untouched. Needed for ``reset(independent=True)``."""
        raise NotImplementedError(f"{type(self).__name__} cannot reset single envs, which "
                                  f"swimlane.independent_envs needs")

    @abstractmethod
    def _step_action(self, action: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Apply one action ``(B, D)``; return ``(reward, terminated, truncated, success)``."""

    def _step_unobserved(self, action: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Apply one action inside a chunk, whose observation nobody reads (only the chunk's
        last is observed): :meth:`_step_action` unless the env can skip work for it (rendering
        camera frames)."""
        return self._step_action(action)

    @abstractmethod
    def _observe(self) -> Observation:
        """The current batched observation."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    # -- public API -------------------------------------------------------------------------
    def reset(self, group_size: int = 1, *, independent: bool = False, final_obs: bool = False) -> Observation:
        """Start a new episode in every env (blocks of ``group_size`` alike). ``independent``:
        from now on each block restarts on its own as soon as its episodes have ended (see
        the module's docstring); ``final_obs``: its steps then also return the observations
        the restarted envs had before their reset (to bootstrap a value from)."""
        if self.n_envs % group_size != 0:
            raise ValueError(f"n_envs={self.n_envs} is not a multiple of group_size={group_size}")
        if independent and not self.resets_single_envs:
            raise ConfigError(f"swimlane.independent_envs: env {self.cfg.name!r} ({type(self).__name__}) cannot "
                              f"reset single envs")
        self._done.zero_()
        self._success.zero_()
        self._t.zero_()
        self._independent = (group_size, final_obs) if independent else None
        self._reset(group_size)
        return self._observe()

    def step(self, actions: Tensor) -> StepResult:
        if actions.dim() == 2:
            actions = actions.unsqueeze(1)
        if actions.shape[0] != self.n_envs or actions.shape[1] < 1 or actions.shape[2] != self.spec.action_dim:
            raise ValueError(
                f"actions must be (n_envs={self.n_envs}, K, action_dim={self.spec.action_dim}), "
                f"got {tuple(actions.shape)}"
            )
        actions = actions.to(self.device).clamp(-1.0, 1.0)
        # The first action starts the sums (small tensor ops are most of a cheap step's cost).
        # An env ends at most once per chunk: what ended and did not terminate was truncated.
        last = actions.shape[1] - 1
        for k in range(actions.shape[1]):
            r, te, tr, su = self._step_action(actions[:, k]) if k == last else self._step_unobserved(actions[:, k])
            live = ~self._done
            te, ended = te & live, (te | tr) & live
            if k == 0:
                total, term, executed, ended_any = r * live, te, live.long(), ended
            else:
                total, term, executed, ended_any = total + r * live, term | te, executed + live, ended_any | ended
            self._success |= su & live
            self._done |= ended
        trunc = ended_any & ~term
        if total.dtype != torch.float32:
            total = total.float()
        res = StepResult(obs=None, reward=total, terminated=term, truncated=trunc, success=self._success.clone(),
                         executed=executed)
        if self._independent is None:
            res.obs = self._observe()
            return res
        return self._restart_ended(res)

    def _restart_ended(self, res: StepResult) -> StepResult:
        """On its own clock: end episodes at the time limit, restart every block whose
        episodes have all ended (as many as :attr:`restart_limit` allows), then observe."""
        live = res.executed > 0
        self._t += live
        limit = live & ~self._done & (self._t >= self.cfg.episode_len)
        res.truncated |= limit
        self._done |= limit
        res.reset = torch.zeros_like(self._done)
        if self.restart_limit != 0:
            res.final_obs, res.reset = self._restart(res.truncated)
        res.obs = self._observe()
        return res

    def _restart(self, truncated: Tensor | None = None) -> tuple[Observation | None, Tensor]:
        """Reset every block whose episodes have all ended; returns the observation before
        (when asked for at ``reset`` and some env restarting was ``truncated`` in this step:
        a value bootstraps from it) and which envs restarted."""
        group_size, want_final = self._independent
        blocks = self._done.view(-1, group_size).all(dim=1)
        if self.restart_limit is not None:  # the first blocks, up to the limit
            blocks &= blocks.cumsum(0) <= self.restart_limit // group_size
        restart = blocks.repeat_interleave(group_size)
        final = None
        if bool(restart.any()):
            if want_final and truncated is not None and bool((restart & truncated).any()):
                final = self._observe()
            envs = restart.nonzero().squeeze(1)
            self._reset_envs(envs, group_size)
            self._done[envs] = False
            self._success[envs] = False
            self._t[envs] = 0
        return final, restart

    restart_limit: int | None = None
    """On its own clock: restart at most this many envs per step (whole blocks, the first
    ones); 0 holds every restart (ended episodes stay ended, see :meth:`restart_ended`);
    None: no limit."""

    def restart_ended(self) -> tuple[Observation, Tensor]:
        """Restart every block whose episodes have all ended (after restarts were held);
        returns the observation and which envs restarted."""
        _, restart = self._restart()
        return self._observe(), restart

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

    @property
    def resets_single_envs(self) -> bool:
        return type(self)._reset_task_envs is not GoalEnv._reset_task_envs

    def _reset_envs(self, envs: Tensor, group_size: int) -> None:
        self._reset_task_envs(envs, group_size)
        self._dist[envs] = self._distance()[envs]

    @abstractmethod
    def _reset_task(self, group_size: int) -> None: ...

    def _reset_task_envs(self, envs: Tensor, group_size: int) -> None:
        """:meth:`_reset_task` for the envs ``envs`` only (see :meth:`BatchedEnv._reset_envs`)."""
        BatchedEnv._reset_envs(self, envs, group_size)

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
