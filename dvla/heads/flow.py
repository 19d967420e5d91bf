"""A flow-matching action head whose samples have an exact log-probability.

A flow-matching policy (pi0, SmolVLA) turns Gaussian noise into an action chunk by
integrating a learned velocity field over a few steps. The deterministic integration has
no tractable density, so PPO-style ratios cannot be formed. Here noise is injected at every
step (after ReinFlow and pi-RL's Flow-Noise): with ``x_0 ~ N(0, I)`` and ``N`` steps of
size ``1/N``,

    x_{i+1} = x_i + v(x_i, t_i, cond) / N + sigma * eps_i,    eps_i ~ N(0, I),

so the chain is a sequence of Gaussian transitions and the log-probability of the chain
given ``x_0`` is the sum of their Gaussian log-densities. ``x_0``'s own density has no
parameters and cancels in every ratio, so it is left out. The chain ``x_0 .. x_{N-1}`` is
recorded beside the action ``x_N`` (the extra ``chain``, ``(N, K, D)`` per decision); the
learner scores the same transitions under its weights. Per-dimension log-probs are each
dimension's share of the transitions (they sum to the joint one), which ``algo.ratio=dim``
and ``step`` use. ``sigma`` is learned per action dimension within
``[min_log_sigma, max_log_sigma]``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from dvla.distributions import ActionDistribution, Draw, Extras, ExtraSpec

CHAIN = "chain"
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _time_features(t: float, n: int, like: Tensor) -> Tensor:
    """Sinusoidal features of the flow time ``t`` in [0, 1]: ``(B, n)``."""
    freqs = torch.exp(torch.arange(n // 2, device=like.device, dtype=like.dtype) * (-math.log(1000.0) / max(n // 2, 1)))
    ang = t * 1000.0 * freqs
    return torch.cat([ang.sin(), ang.cos()]).expand(like.shape[0], -1)


class FlowMatchingHead(nn.Module):
    """``head(cond)`` with ``cond`` ``(B, cond_dim)`` gives a :class:`FlowChainDistribution`
    over ``(B, action_chunk, action_dim)`` chunks."""

    def __init__(self, cond_dim: int, action_chunk: int, action_dim: int, *, hidden_dim: int = 256, steps: int = 4,
                 init_log_sigma: float = -1.5, min_log_sigma: float = -5.0, max_log_sigma: float = 0.0,
                 time_dim: int = 16):
        super().__init__()
        if steps < 1 or not min_log_sigma <= init_log_sigma <= max_log_sigma:
            raise ValueError("FlowMatchingHead needs steps >= 1 and min_log_sigma <= init_log_sigma <= max_log_sigma")
        self.k, self.d, self.steps, self.time_dim = action_chunk, action_dim, steps, time_dim
        self.min_log_sigma, self.max_log_sigma = min_log_sigma, max_log_sigma
        n = action_chunk * action_dim
        self.velocity_net = nn.Sequential(nn.Linear(n + time_dim + cond_dim, hidden_dim), nn.SiLU(),
                                          nn.Linear(hidden_dim, hidden_dim), nn.SiLU(), nn.Linear(hidden_dim, n))
        nn.init.normal_(self.velocity_net[-1].weight, std=0.01)
        nn.init.zeros_(self.velocity_net[-1].bias)
        self.log_sigma = nn.Parameter(torch.full((action_chunk, action_dim), float(init_log_sigma)))

    def rollout_extras(self) -> dict[str, ExtraSpec]:
        """What a policy with this head returns from ``VLAPolicy.rollout_extras``."""
        return {CHAIN: ExtraSpec((self.steps, self.k, self.d), torch.float32)}

    def velocity(self, x: Tensor, i: int, cond: Tensor) -> Tensor:
        """``v(x_i, t_i, cond)`` for step ``i`` (``t_i = i / steps``): ``(B, K, D)``."""
        b = x.shape[0]
        t = _time_features(i / self.steps, self.time_dim, cond)
        return self.velocity_net(torch.cat([x.reshape(b, -1), t, cond], dim=-1)).reshape(b, self.k, self.d)

    def forward(self, cond: Tensor) -> FlowChainDistribution:
        return FlowChainDistribution(self, cond.float())


class FlowChainDistribution(ActionDistribution):
    def __init__(self, head: FlowMatchingHead, cond: Tensor):
        self.head, self.cond = head, cond
        self.log_sigma = head.log_sigma.clamp(head.min_log_sigma, head.max_log_sigma)

    def mean_of_next(self, x: Tensor, i: int) -> Tensor:
        """The mean of ``x_{i+1}`` given ``x_i``: one Euler step of the velocity field."""
        return x + self.head.velocity(x, i, self.cond) / self.head.steps

    def _transition_log_prob(self, x_next: Tensor, mean: Tensor) -> Tensor:
        z = (x_next - mean) * torch.exp(-self.log_sigma)
        return -0.5 * z.pow(2) - self.log_sigma - _HALF_LOG_2PI

    def draw(self, deterministic: bool = False, generator: torch.Generator | None = None) -> Draw:
        """Run the noisy chain (``deterministic``: the noise-free integration from ``x_0 = 0``,
        scored as if its steps were the means of the transitions)."""
        b, dev = self.cond.shape[0], self.cond.device
        shape = (b, self.head.k, self.head.d)
        x = torch.zeros(shape, device=dev) if deterministic else torch.randn(shape, generator=generator, device=dev)
        chain, elements = [], torch.zeros(shape, device=dev)
        sigma = self.log_sigma.exp()
        for i in range(self.head.steps):
            chain.append(x)
            mean = self.mean_of_next(x, i)
            x = mean if deterministic else mean + sigma * torch.randn(shape, generator=generator, device=dev)
            elements = elements + self._transition_log_prob(x, mean)
        return Draw(actions=x, log_prob=elements.sum(dim=(1, 2)), elements=elements,
                    extras={CHAIN: torch.stack(chain, dim=1)})

    def sample(self, generator: torch.Generator | None = None) -> Tensor:
        return self.draw(False, generator).actions

    def mode(self) -> Tensor:
        return self.draw(True).actions

    def log_prob_elements(self, actions: Tensor, extras: Extras | None = None) -> Tensor:
        chain = (extras or {}).get(CHAIN)
        want = (actions.shape[0], self.head.steps, self.head.k, self.head.d)
        if chain is None or tuple(chain.shape) != want:
            got = None if chain is None else tuple(chain.shape)
            raise ValueError(f"the flow head scores a chunk by its denoising chain: extras['{CHAIN}'] of shape "
                             f"{want} is needed, got {got}")
        chain = chain.float()
        elements = torch.zeros_like(actions, dtype=torch.float32)
        for i in range(self.head.steps):
            x_next = chain[:, i + 1] if i + 1 < self.head.steps else actions.float()
            elements = elements + self._transition_log_prob(x_next, self.mean_of_next(chain[:, i], i))
        return elements

    def entropy(self, extras: Extras | None = None) -> Tensor:
        """The transitions' entropy (of the chain given ``x_0``), per decision: it depends on
        sigma only."""
        per_step = (0.5 + _HALF_LOG_2PI + self.log_sigma).sum()
        return (self.head.steps * per_step).expand(self.cond.shape[0])
