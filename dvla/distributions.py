"""Action distributions over action chunks ``(B, K, D)`` with values in ``[-1, 1]``.

A policy head returns one of these; ``log_prob`` and ``entropy`` are summed over the
chunk and action dimensions so that one decision has one log-probability.

A head whose actions come out of a longer sampling process (action tokens decoded one by
one, a denoising chain) returns what that process drew beside the actions as *extras*
(:meth:`ActionDistribution.draw`); they travel with the rollout, and the learner passes
them back to ``log_prob_elements``/``log_prob``/``entropy`` so that the head scores
exactly what was sampled. Heads without extras ignore the argument.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

Extras = dict[str, Tensor]


@dataclass(frozen=True)
class ExtraSpec:
    """One per-decision tensor a head records beside its actions (shape without the batch)."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    high: int | None = None  # integer extras (token ids) lie in [0, high): the learner rejects others


@dataclass
class Draw:
    """What one sampling pass produced."""

    actions: Tensor  # (B, K, D)
    log_prob: Tensor  # (B,)
    elements: Tensor | None = None  # (B, K, D), where the head factorises per dimension
    extras: Extras = field(default_factory=dict)  # name -> (B, ...)


class ActionDistribution:
    """Interface every policy head returns."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in ("log_prob_elements", "log_prob", "entropy"):
            method = cls.__dict__.get(name)
            if method is not None and "extras" not in inspect.signature(method).parameters:
                raise TypeError(f"{cls.__qualname__}.{name} must accept `extras=None` (what draw() recorded "
                                f"beside the actions; ignore it if the head records none)")

    def sample(self, generator: torch.Generator | None = None) -> Tensor:  # (B, K, D)
        raise NotImplementedError

    def mode(self) -> Tensor:  # (B, K, D)
        raise NotImplementedError

    def draw(self, deterministic: bool = False, generator: torch.Generator | None = None) -> Draw:
        """Actions with their log-probs (and extras) in one pass: what the rollout calls.
        The default samples (or takes the mode) and scores the result; a head that gets
        the log-probs while sampling (autoregressive tokens, a noisy denoising chain)
        overrides this instead of paying for a second pass."""
        actions = self.mode() if deterministic else self.sample(generator)
        elements = self.log_prob_elements(actions)
        log_prob = elements.sum(dim=(1, 2)) if elements is not None else self.log_prob(actions)
        return Draw(actions, log_prob, elements)

    def log_prob_elements(self, actions: Tensor, extras: Extras | None = None) -> Tensor | None:  # (B, K, D)
        """Log-prob of every action dimension of every chunk step, where the head factorises
        that way (per-step and per-dimension ratios, masking actions after an episode's end
        inside a chunk need it); None where it does not."""
        return None

    def log_prob(self, actions: Tensor, extras: Extras | None = None) -> Tensor:  # (B,)
        elements = self.log_prob_elements(actions, extras)
        if elements is None:
            raise NotImplementedError(f"{type(self).__name__} implements neither log_prob nor log_prob_elements")
        return elements.sum(dim=(1, 2))

    def entropy(self, extras: Extras | None = None) -> Tensor:  # (B,)
        raise NotImplementedError

    def tempered(self, temperature: float) -> "ActionDistribution":
        """This distribution at a sampling temperature (``policy.temperature``): its spread
        scaled by ``temperature`` and its mode unchanged (a Gaussian's std times it, logits
        divided by it, a flow chain's noise times it). A head without one says so."""
        raise NotImplementedError(f"{type(self).__name__} has no sampling temperature: implement tempered() "
                                  "or leave policy.temperature at 1")

    def imitation_loss(self, actions: Tensor, valid: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        """The supervised loss of demonstrated chunks ``actions`` (B, K, D) (``dvla sft``), with
        ``valid`` (B, K) false on steps past an episode's end, and its stats: by default the
        negative log-likelihood of each valid chunk step (summed over the action dimensions),
        averaged over the valid steps. Heads without exact log-probs of bare actions (a flow
        chain, sampled tokens) override it."""
        elements = self.log_prob_elements(actions)
        if elements is None:
            raise NotImplementedError(f"{type(self).__name__} has no log_prob_elements for the default imitation "
                                      "loss: override imitation_loss (the distribution's or the policy's)")
        nll = -masked_step_mean(elements.sum(-1), valid)
        return nll, {"nll": float(nll.detach())}


def masked_step_mean(per_step: Tensor, valid: Tensor | None) -> Tensor:
    """The mean of ``per_step`` (B, K) over the steps ``valid`` (B, K) marks (all: None)."""
    if valid is None:
        return per_step.mean()
    w = valid.to(per_step.dtype)
    return (per_step * w).sum() / w.sum().clamp(min=1.0)


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

    def log_prob_elements(self, actions: Tensor, extras: Extras | None = None) -> Tensor:
        idx = self._to_bins(actions).unsqueeze(-1)
        return self._log_p.gather(-1, idx).squeeze(-1)

    def entropy(self, extras: Extras | None = None) -> Tensor:
        return -(self._log_p.exp() * self._log_p).sum(-1).sum(dim=(1, 2))

    def tempered(self, temperature: float) -> "BinnedActionDistribution":
        return BinnedActionDistribution(self.logits / _positive(temperature, "bins"))


def _positive(temperature: float, what: str) -> float:
    if not temperature > 0:
        raise ValueError(f"the sampling temperature of {what} must be > 0, got {temperature} (0, the noise at the "
                         "start of a flow chain only, is a flow head's)")
    return temperature


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

    def log_prob_elements(self, actions: Tensor, extras: Extras | None = None) -> Tensor:
        z = (actions - self.mean) * torch.exp(-self.log_std)
        return -0.5 * z.pow(2) - self.log_std - 0.5 * math.log(2 * math.pi)

    def entropy(self, extras: Extras | None = None) -> Tensor:
        ent = 0.5 + 0.5 * math.log(2 * math.pi) + self.log_std
        return ent.sum(dim=(1, 2))

    def tempered(self, temperature: float) -> "GaussianActionDistribution":
        return GaussianActionDistribution(self.mean, self.log_std + math.log(_positive(temperature, "a Gaussian")))
