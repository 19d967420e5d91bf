"""GRPO: group-relative policy optimisation, critic-free.

Episodes come in groups that start from an identical initial state. Each episode's
return is normalised within its group, and that advantage is given to every step of
the episode. Optionally a KL penalty (k3 estimator) keeps the policy near its
initial weights, which are then kept as a frozen reference copy.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from dvla.algos.base import Algorithm, extras_of, obs_of
from dvla.algos.losses import group_normalized_advantages, kl_k3
from dvla.types import RolloutBatch


class GRPO(Algorithm):
    name = "grpo"

    def __init__(self, cfg, policy, grad_sync=None, behaviour_dtype=None):
        super().__init__(cfg, policy, grad_sync, behaviour_dtype)
        self.reference = None
        if cfg.kl_coef > 0:
            self.reference = copy.deepcopy(policy).eval().requires_grad_(False)

    def advantages(self, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
        returns = batch.episode_returns()
        adv = group_normalized_advantages(returns, batch.group_ids, self.cfg.adv_eps)
        per_step = adv.unsqueeze(0) * batch.valid.float()
        return per_step, returns.unsqueeze(0) * batch.valid.float()

    def extra_loss(self, mb, out):
        if self.reference is None:
            return torch.zeros((), device=mb["adv"].device), {}
        obs = obs_of(mb)
        with torch.no_grad():
            ref_lp = self.reference.evaluate(obs, mb["actions"], mb["action_valid"], self.cfg.ratio,
                                             extras_of(mb)).log_probs
        kl = self.mean(kl_k3(out.log_probs, ref_lp), self._mask(mb, out.log_probs))
        return self.cfg.kl_coef * kl, {"kl_ref": kl.detach()}
