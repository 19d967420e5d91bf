"""PPO with a learned value head and GAE, advantages normalised over the batch; the value loss
is clipped where ``algo.value_clip`` says (off by default)."""

from __future__ import annotations

from torch import Tensor

from dvla.algos.base import Algorithm
from dvla.algos.guards import value_loss
from dvla.algos.losses import gae
from dvla.config import ConfigError
from dvla.types import RolloutBatch


class PPO(Algorithm):
    name = "ppo"

    def __init__(self, cfg, policy, grad_sync=None, behaviour_dtype=None):
        if not policy.has_value_head:
            raise ConfigError("algo.name: 'ppo' needs a policy with a value head (e.g. tiny_vla value_head=true)")
        super().__init__(cfg, policy, grad_sync, behaviour_dtype)

    def advantages(self, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
        done = batch.terminated | batch.truncated
        adv, ret = gae(batch.rewards, batch.values, batch.terminated, done, self.cfg.gamma, self.cfg.gae_lambda,
                       batch.bootstrap)
        valid = batch.valid
        if valid.sum() > 1:
            mean, std = adv[valid].mean(), adv[valid].std()
            adv = (adv - mean) / (std + 1e-8)
        return adv * valid.float(), ret

    def extra_loss(self, mb, out):
        """``value_coef`` times the value loss, clipped where ``algo.value_clip`` says
        (:func:`dvla.algos.guards.value_loss`)."""
        per, clipped = value_loss(out.values.float(), mb["ret"], mb["old_value"], self.cfg.value_clip)
        loss = self.mean(per)
        stats = {"value_loss": loss.detach()}
        if clipped is not None:
            stats["value_clip_frac"] = self.mean(clipped)
        return self.cfg.value_coef * loss, stats
