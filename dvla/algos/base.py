"""Policy-gradient learner shared by GRPO and PPO.

An :class:`Algorithm` turns a :class:`RolloutBatch` into per-step advantages (the
part that differs between algorithms) and then runs the common update: several
epochs of shuffled minibatches over the valid steps, clipped surrogate, optional
extra loss terms, gradient averaging across learner ranks, norm clipping.

The surrogate is the decoupled PPO objective (:func:`clipped_policy_loss`): on-policy
data uses the behaviour log-probs as the proximal ones, which is exactly PPO.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch
from torch import Tensor

from dvla.algos.losses import clipped_policy_loss
from dvla.config import AlgoConfig
from dvla.policy import VLAPolicy
from dvla.types import Observation, RolloutBatch

GradSync = Callable[[list[torch.nn.Parameter]], None]


class Algorithm(ABC):
    name: str

    def __init__(self, cfg: AlgoConfig, policy: VLAPolicy, grad_sync: GradSync | None = None):
        self.cfg = cfg
        self.policy = policy
        self.params = [p for p in policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.params, lr=cfg.lr, eps=1e-5)
        self.grad_sync = grad_sync

    @abstractmethod
    def advantages(self, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
        """Per-step ``(advantages, returns)``, each ``(T, B)``."""

    def extra_loss(self, mb: dict[str, Tensor], out) -> tuple[Tensor, dict[str, Tensor]]:
        """Algorithm-specific loss terms added to the policy loss."""
        return torch.zeros((), device=mb["adv"].device), {}

    def _flatten(self, batch: RolloutBatch, adv: Tensor, ret: Tensor) -> dict[str, Tensor]:
        t_idx, b_idx = batch.valid.nonzero(as_tuple=True)
        return {
            "image": batch.image[t_idx, b_idx],
            "proprio": batch.proprio[t_idx, b_idx],
            "ids": batch.instruction_ids[b_idx],
            "actions": batch.actions[t_idx, b_idx],
            "behav_logp": batch.log_probs[t_idx, b_idx],
            "adv": adv[t_idx, b_idx],
            "ret": ret[t_idx, b_idx],
            "old_value": batch.values[t_idx, b_idx],
        }

    def update(self, batch: RolloutBatch, generator: torch.Generator | None = None) -> dict[str, float]:
        """Learn from one batch; returns averaged diagnostics."""
        device = self.policy.device
        batch = batch.to(device)
        adv, ret = self.advantages(batch)
        data = self._flatten(batch, adv, ret)
        n = data["adv"].shape[0]
        if n == 0:
            return {"samples": 0.0}
        self.policy.train()
        sums: dict[str, float] = {}
        count = 0
        mb_size = max(1, (n + self.cfg.minibatches - 1) // self.cfg.minibatches)
        for _ in range(self.cfg.update_epochs):
            perm = torch.randperm(n, generator=generator).to(device)
            for start in range(0, n, mb_size):
                idx = perm[start : start + mb_size]
                mb = {k: v[idx] for k, v in data.items()}
                stats = self._step(mb)
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        self.policy.eval()
        out = {k: v / count for k, v in sums.items()}
        out["samples"] = float(n)
        out["adv_mean"] = float(adv[batch.valid].mean())
        out["adv_std"] = float(adv[batch.valid].std()) if n > 1 else 0.0
        return out

    def _step(self, mb: dict[str, Tensor]) -> dict[str, float]:
        obs = Observation(image=mb["image"], proprio=mb["proprio"], instruction_ids=mb["ids"])
        out = self.policy.evaluate(obs, mb["actions"])
        pl, pstats = clipped_policy_loss(out.log_probs, mb["behav_logp"], mb["adv"], self.cfg.clip_eps)
        entropy = out.entropy.mean()
        extra, estats = self.extra_loss(mb, out)
        loss = pl - self.cfg.entropy_coef * entropy + extra
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.grad_sync is not None:
            self.grad_sync(self.params)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
        self.optimizer.step()
        stats = {"loss": loss.item(), "policy_loss": pl.item(), "entropy": entropy.item(),
                 "grad_norm": float(grad_norm)}
        stats.update({k: float(v) for k, v in pstats.items()})
        stats.update({k: float(v) for k, v in estats.items()})
        return stats
