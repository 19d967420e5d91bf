"""Learning algorithms: GRPO (critic-free, group-relative) and PPO (GAE, value head)."""

from __future__ import annotations

import torch

from dvla.algos.base import Algorithm, GradSync
from dvla.algos.grpo import GRPO
from dvla.algos.ppo import PPO
from dvla.config import AlgoConfig, ConfigError
from dvla.policy import VLAPolicy

ALGORITHMS: dict[str, type[Algorithm]] = {"grpo": GRPO, "ppo": PPO}


def build_algorithm(cfg: AlgoConfig, policy: VLAPolicy, grad_sync: GradSync | None = None,
                    behaviour_dtype: torch.dtype | None = None, horizon: int | None = None,
                    group=None) -> Algorithm:
    """The learner ``algo.name`` names. ``behaviour_dtype``: the dtype of the weights that sample
    the rollouts (the inference replicas, ``swimlane.publish_dtype``); where their numerics
    differ from the learner's, every step's proximal log-prob is recomputed
    (:attr:`Algorithm.behaviour_exact`). None: the learner's own. ``horizon``: the updates of
    the run (``run.iterations``), over which ``algo.lr_schedule`` decays unless
    ``algo.lr_horizon`` says otherwise. ``group``: the process group of the learners whose
    gradients ``grad_sync`` averages (they stop at ``algo.target_kl`` together)."""
    if cfg.name not in ALGORITHMS:
        raise ConfigError(f"algo.name: unknown {cfg.name!r}; allowed: {', '.join(ALGORITHMS)}")
    algo = ALGORITHMS[cfg.name](cfg, policy, grad_sync, behaviour_dtype=behaviour_dtype)
    algo.horizon, algo.learner_group = horizon, group
    return algo


__all__ = ["Algorithm", "GRPO", "PPO", "ALGORITHMS", "build_algorithm"]
