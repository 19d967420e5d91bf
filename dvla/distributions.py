"""Action distributions over action chunks ``(B, K, D)`` with values in ``[-1, 1]``.

A policy head returns one of these; ``log_prob`` and ``entropy`` are summed over the
chunk and action dimensions so that one decision has one log-probability.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class ActionDistribution:
    """Interface every policy head returns."""

    def sample(self, generator: torch.Generator | None = None) -> Tensor:  # (B, K, D)
        raise NotImplementedError

    def mode(self) -> Tensor:  # (B, K, D)
        raise NotImplementedError

    def log_prob_elements(self, actions: Tensor) -> Tensor | None:  # (B, K, D)
        """Log-prob of every action dimension of every chunk step, where the head factorises
        that way (per-step and per-dimension ratios, masking actions after an episode's end
        inside a chunk need it); None where it does not."""
        return None

    def log_prob(self, actions: Tensor) -> Tensor:  # (B,)
        elements = self.log_prob_elements(actions)
        if elements is None:
            raise NotImplementedError(f"{type(self).__name__} implements neither log_prob nor log_prob_elements")
        return elements.sum(dim=(1, 2))

    def entropy(self) -> Tensor:  # (B,)
        raise NotImplementedError


class BinnedActionDistribution(ActionDistribution):
    """Each action dimension is discretised into ``n_bins`` uniform bins over [-1, 1]
    (as RT-2/OpenVLA tokenise actions). Actions are bin centres."""

    def __init__(self, logits: Tensor):
        if logits.dim() != 4:
            raise ValueError(f"binned logits must be (B, K, D, bins), got {tuple(logits.shape)}")
        self.logits = logits.float()
        self.n_bins = logits.shape[-1]
        self._log_p = torch.log_softmax(self.logits, dim=-1)

    def _to_actions(self, idx: Tensor) -> Tensor:
        return idx.float() * (2.0 / (self.n_bins - 1)) - 1.0

    def _to_bins(self, actions: Tensor) -> Tensor:
        idx = torch.round((actions.float() + 1.0) * ((self.n_bins - 1) / 2.0))
        return idx.clamp_(0, self.n_bins - 1).long()

    def sample(self, generator: torch.Generator | None = None) -> Tensor:
        probs = self._log_p.exp().reshape(-1, self.n_bins)
        idx = torch.multinomial(probs, 1, generator=generator).reshape(self.logits.shape[:-1])
        return self._to_actions(idx)

    def mode(self) -> Tensor:
        return self._to_actions(self.logits.argmax(-1))

    def log_prob_elements(self, actions: Tensor) -> Tensor:
        idx = self._to_bins(actions).unsqueeze(-1)
        return self._log_p.gather(-1, idx).squeeze(-1)

    def entropy(self) -> Tensor:
        return -(self._log_p.exp() * self._log_p).sum(-1).sum(dim=(1, 2))


class GaussianActionDistribution(ActionDistribution):
    """Diagonal Gaussian; samples are clamped to [-1, 1] by the environment, and the
    log-probability is that of the unclamped sample stored in the trajectory."""

    def __init__(self, mean: Tensor, log_std: Tensor):
        self.mean = mean.float()
        self.log_std = log_std.float().expand_as(self.mean)

    def sample(self, generator: torch.Generator | None = None) -> Tensor:
        noise = torch.randn(self.mean.shape, generator=generator, device=self.mean.device)
        return self.mean + noise * self.log_std.exp()

    def mode(self) -> Tensor:
        return self.mean

    def log_prob_elements(self, actions: Tensor) -> Tensor:
        z = (actions - self.mean) * torch.exp(-self.log_std)
        return -0.5 * z.pow(2) - self.log_std - 0.5 * math.log(2 * math.pi)

    def entropy(self) -> Tensor:
        ent = 0.5 + 0.5 * math.log(2 * math.pi) + self.log_std
        return ent.sum(dim=(1, 2))
