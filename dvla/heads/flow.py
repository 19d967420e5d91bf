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

Padded dimensions
-----------------
pi0 denoises a chunk wider than the robot's actions (32 dimensions, the robot's first, the
rest padding) and cuts it at the end; the padded dimensions still feed back into the velocity
of the real ones. ``pad_to=P`` does the same: the chain runs in ``P`` dimensions, the action is
its first ``action_dim``, and the padded dimensions of the last step are recorded beside the
chain (the extra ``chain_pad``, ``(K, P - D)``), so that the log-probability covers everything
that was sampled. The padded dimensions' share of it is spread evenly over the real
dimensions' elements (the joint log-probability is exact; per-dimension ratios see each real
dimension with a ``1/D`` share of the padding).

The velocity model
------------------
The head owns no network of its own: it takes the velocity model ``v(x, t, cond)``, any
module or callable, with

* ``x``: the noisy chunk ``(B, K, D)``, float32;
* ``t``: the flow time, a ``(B,)`` float32 tensor on ``x``'s device, ``t_i = i / N`` (0 is
  the noise, 1 the data; pi0's own clock runs the other way, ``1 - t``);
* ``cond``: whatever the policy's ``forward`` passed to ``head(cond)``: a ``(B, C)`` tensor,
  a KV cache with its attention mask, a dataclass of them. The head never looks inside it,
  except to repeat it for the batched scoring below.

It returns the velocity ``(B, K, D)``. A module is registered inside the head (its
parameters train, shard and are saved with the policy); a plain callable (a bound method of
the policy, say) is only called. :class:`MLPVelocity` is the MLP velocity model for a policy
whose condition is one feature vector.

The policy's ``forward`` computes ``cond`` once per decision (a VLM prefix and its KV
cache, say); the rollout's ``N`` steps and the learner's scoring of the recorded chain reuse
it. The learner scores all ``N`` transitions in one call of the velocity model
(``batch_steps``): ``x`` and ``t`` are the ``N`` steps stacked step-major (``(N * B, K, D)``)
and ``cond`` is repeated ``N`` times: every tensor in it whose first dimension is ``B``
(through dataclasses, dicts, lists and tuples), or ``cond.repeat_steps(n)`` where the
condition defines it. ``batch_steps=False`` calls the model once per step instead.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from dvla.distributions import ActionDistribution, Draw, Extras, ExtraSpec, masked_step_mean

CHAIN = "chain"
CHAIN_PAD = "chain_pad"
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)

VelocityModel = Callable[[Tensor, Tensor, Any], Tensor]


def time_features(t: Tensor | float, n: int, like: Tensor | None = None) -> Tensor:
    """Sinusoidal features of the flow time ``t`` in [0, 1] (a float, or ``(B,)``):
    ``(B, n)`` (``(1, n)`` for a float, or ``(like.shape[0], n)`` with ``like``)."""
    ref = like if isinstance(like, Tensor) else t if isinstance(t, Tensor) else None
    device = ref.device if ref is not None else None
    dtype = like.dtype if isinstance(like, Tensor) else torch.float32
    freqs = torch.exp(torch.arange(n // 2, device=device, dtype=dtype) * (-math.log(1000.0) / max(n // 2, 1)))
    t = torch.as_tensor(t, device=device, dtype=torch.float64).reshape(-1, 1)
    ang = (t * 1000.0).to(dtype) * freqs
    feats = torch.cat([ang.sin(), ang.cos()], dim=-1)
    return feats.expand(like.shape[0], -1) if like is not None and feats.shape[0] == 1 else feats


class MLPVelocity(nn.Module):
    """The velocity of a condition that is one feature vector ``(B, cond_dim)``: an MLP on
    ``concat(x flattened, time features, cond)``."""

    def __init__(self, cond_dim: int, action_chunk: int, action_dim: int, *, hidden_dim: int = 256,
                 time_dim: int = 16):
        super().__init__()
        self.k, self.d, self.time_dim = action_chunk, action_dim, time_dim
        n = action_chunk * action_dim
        self.net = nn.Sequential(nn.Linear(n + time_dim + cond_dim, hidden_dim), nn.SiLU(),
                                 nn.Linear(hidden_dim, hidden_dim), nn.SiLU(), nn.Linear(hidden_dim, n))
        nn.init.normal_(self.net[-1].weight, std=0.01)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, x: Tensor, t: Tensor, cond: Tensor) -> Tensor:
        b = x.shape[0]
        feats = time_features(t, self.time_dim, x).to(cond.dtype)
        return self.net(torch.cat([x.reshape(b, -1).to(cond.dtype), feats, cond], dim=-1)).reshape(b, self.k, self.d)


def cond_tensors(cond: Any) -> Iterator[Tensor]:
    """The tensors of a condition, through dataclasses, dicts, lists and tuples."""
    if isinstance(cond, Tensor):
        yield cond
    elif dataclasses.is_dataclass(cond) and not isinstance(cond, type):
        for f in dataclasses.fields(cond):
            yield from cond_tensors(getattr(cond, f.name))
    elif isinstance(cond, dict):
        for v in cond.values():
            yield from cond_tensors(v)
    elif isinstance(cond, (list, tuple)):
        for v in cond:
            yield from cond_tensors(v)


def repeat_cond(cond: Any, n: int, batch: int) -> Any:
    """``cond`` for ``n`` stacked copies of the batch: each tensor whose first dimension is
    ``batch`` repeated ``n`` times along it (step-major), ``cond.repeat_steps(n)`` where defined."""
    if hasattr(cond, "repeat_steps"):
        return cond.repeat_steps(n)
    if isinstance(cond, Tensor):
        return cond.repeat(n, *(1,) * (cond.dim() - 1)) if cond.dim() and cond.shape[0] == batch else cond
    if dataclasses.is_dataclass(cond) and not isinstance(cond, type):
        return dataclasses.replace(cond, **{f.name: repeat_cond(getattr(cond, f.name), n, batch)
                                            for f in dataclasses.fields(cond) if f.init})
    if isinstance(cond, dict):
        return {k: repeat_cond(v, n, batch) for k, v in cond.items()}
    if isinstance(cond, (list, tuple)):
        return type(cond)(repeat_cond(v, n, batch) for v in cond)
    return cond


class FlowMatchingHead(nn.Module):
    """``head(cond)`` gives a :class:`FlowChainDistribution` over ``(B, action_chunk,
    action_dim)`` chunks, denoised by ``velocity(x, t, cond)`` (see the module docstring);
    ``pad_to``: the chain's width where it is wider than the actions (pi0's 32)."""

    def __init__(self, velocity: nn.Module | VelocityModel, action_chunk: int, action_dim: int, *, steps: int = 4,
                 init_log_sigma: float = -1.5, min_log_sigma: float = -5.0, max_log_sigma: float = 0.0,
                 batch_steps: bool = True, pad_to: int | None = None):
        super().__init__()
        if not callable(velocity):
            raise TypeError(f"FlowMatchingHead takes a velocity model v(x, t, cond) (a module or callable), got "
                            f"{velocity!r}; for an MLP on a (B, cond_dim) condition pass MLPVelocity(cond_dim, ...)")
        if steps < 1 or not min_log_sigma <= init_log_sigma <= max_log_sigma:
            raise ValueError("FlowMatchingHead needs steps >= 1 and min_log_sigma <= init_log_sigma <= max_log_sigma")
        if pad_to is not None and pad_to < action_dim:
            raise ValueError(f"FlowMatchingHead: pad_to ({pad_to}) must be at least action_dim ({action_dim})")
        self.k, self.d, self.steps, self.batch_steps = action_chunk, action_dim, steps, batch_steps
        self.width = pad_to or action_dim  # the chain's dimensions: the actions', then the padding
        self.min_log_sigma, self.max_log_sigma = min_log_sigma, max_log_sigma
        if isinstance(velocity, nn.Module):
            self.velocity_model = velocity  # a submodule: trained, sharded, saved
        else:
            self.velocity_model = None
            self._velocity_fn = velocity  # not a submodule: a bound method of the policy makes no cycle
        self.log_sigma = nn.Parameter(torch.full((action_chunk, self.width), float(init_log_sigma)))

    @property
    def padded(self) -> int:
        """How many padded dimensions the chain has beyond the actions'."""
        return self.width - self.d

    def rollout_extras(self) -> dict[str, ExtraSpec]:
        """What a policy with this head returns from ``VLAPolicy.rollout_extras``."""
        extras = {CHAIN: ExtraSpec((self.steps, self.k, self.width), torch.float32)}
        if self.padded:
            extras[CHAIN_PAD] = ExtraSpec((self.k, self.padded), torch.float32)
        return extras

    def fold(self, elements: Tensor) -> Tensor:
        """Per-dimension log-probs over the chain's width -> over the actions' (the padding's
        share spread evenly, so that they still sum to the joint one)."""
        if not self.padded:
            return elements
        return elements[..., : self.d] + elements[..., self.d:].sum(-1, keepdim=True) / self.d

    def velocity(self, x: Tensor, t: Tensor, cond: Any) -> Tensor:
        """``v(x, t, cond)``, checked to be ``x``'s shape."""
        fn = self.velocity_model if self.velocity_model is not None else self._velocity_fn
        v = fn(x, t, cond)
        if not isinstance(v, Tensor) or v.shape != x.shape:
            got = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
            raise ValueError(f"the flow head's velocity model returned {got} for x of shape {tuple(x.shape)}: "
                             "it must return a tensor of x's shape")
        return v

    def forward(self, cond: Any, batch_size: int | None = None) -> FlowChainDistribution:
        """``batch_size``: the decisions (default: the first dimension of ``cond``'s first tensor)."""
        if isinstance(cond, Tensor):
            cond = cond.float()
        return FlowChainDistribution(self, cond, batch_size)


class FlowChainDistribution(ActionDistribution):
    noise_free = False  # tempered(0): noise at x_0 only (pi0's sampler)

    def __init__(self, head: FlowMatchingHead, cond: Any, batch_size: int | None = None):
        self.head, self.cond = head, cond
        # The condition's tensors, where a sharded learner finds what starts the backward pass.
        self.cond_tensors = tuple(cond_tensors(cond))
        self.log_sigma = head.log_sigma.clamp(head.min_log_sigma, head.max_log_sigma)
        if batch_size is None:
            if not self.cond_tensors or self.cond_tensors[0].dim() == 0:
                raise ValueError("the flow head cannot tell the batch size from a condition without a batched "
                                 "tensor: pass head(cond, batch_size=B)")
            batch_size = self.cond_tensors[0].shape[0]
        self.batch_size = batch_size

    def _time(self, i: int, like: Tensor) -> Tensor:
        return torch.full((like.shape[0],), i / self.head.steps, device=like.device, dtype=torch.float32)

    def mean_of_next(self, x: Tensor, i: int) -> Tensor:
        """The mean of ``x_{i+1}`` given ``x_i``: one Euler step of the velocity field."""
        return x + self.head.velocity(x, self._time(i, x), self.cond) / self.head.steps

    def _transition_log_prob(self, x_next: Tensor, mean: Tensor) -> Tensor:
        z = (x_next - mean) * torch.exp(-self.log_sigma)
        return -0.5 * z.pow(2) - self.log_sigma - _HALF_LOG_2PI

    def draw(self, deterministic: bool = False, generator: torch.Generator | None = None,
             start: Tensor | None = None) -> Draw:
        """Run the noisy chain (``deterministic``: the noise-free integration from ``x_0 = 0``,
        scored as if its steps were the means of the transitions). ``start``: ``x_0`` given,
        ``(B, K, width)``: with ``deterministic``, the reference samplers' integration of
        given noise (pi0's ``sample_actions(noise=)``)."""
        dev = self.log_sigma.device
        shape = (self.batch_size, self.head.k, self.head.width)
        if start is not None and tuple(start.shape) != shape:
            raise ValueError(f"the flow head's start x_0 must be {shape}, got {tuple(start.shape)}")
        x = start.float().to(dev) if start is not None else torch.zeros(shape, device=dev) if deterministic \
            else torch.randn(shape, generator=generator, device=dev)
        chain, elements = [], torch.zeros(shape, device=dev)
        sigma, noise_free = self.log_sigma.exp(), deterministic or self.noise_free
        for i in range(self.head.steps):
            chain.append(x)
            mean = self.mean_of_next(x, i)
            x = mean if noise_free else mean + sigma * torch.randn(shape, generator=generator, device=dev)
            elements = elements + self._transition_log_prob(x, mean)
        extras = {CHAIN: torch.stack(chain, dim=1)}
        if self.head.padded:
            extras[CHAIN_PAD] = x[..., self.head.d:]
        return Draw(actions=x[..., : self.head.d], log_prob=elements.sum(dim=(1, 2)), elements=self.head.fold(elements),
                    extras=extras)

    def sample(self, generator: torch.Generator | None = None) -> Tensor:
        return self.draw(False, generator).actions

    def mode(self) -> Tensor:
        return self.draw(True).actions

    def log_prob_elements(self, actions: Tensor, extras: Extras | None = None) -> Tensor:
        extras = extras or {}
        chain, head = extras.get(CHAIN), self.head
        b, n = actions.shape[0], head.steps
        for key, want in ((CHAIN, (b, n, head.k, head.width)), (CHAIN_PAD, (b, head.k, head.padded))):
            got = extras.get(key)
            if (key == CHAIN or head.padded) and (got is None or tuple(got.shape) != want):
                raise ValueError(f"the flow head scores a chunk by its denoising chain: extras['{key}'] of shape "
                                 f"{want} is needed, got {None if got is None else tuple(got.shape)}")
        chain, last = chain.float(), actions.float()
        if head.padded:
            last = torch.cat([last, extras[CHAIN_PAD].float()], dim=-1)
        nexts = torch.cat([chain[:, 1:], last[:, None]], dim=1)  # x_{i+1} of every transition
        if head.batch_steps and n > 1:  # all N transitions in one call of the velocity model
            xs = chain.transpose(0, 1).reshape(n * b, head.k, head.width)
            ts = torch.tensor([i / n for i in range(n)], device=xs.device).repeat_interleave(b)
            v = head.velocity(xs, ts, repeat_cond(self.cond, n, b))
            means = chain + v.reshape(n, b, head.k, head.width).transpose(0, 1) / n
            return head.fold(self._transition_log_prob(nexts, means).sum(dim=1))
        elements = torch.zeros_like(last)
        for i in range(n):
            elements = elements + self._transition_log_prob(nexts[:, i], self.mean_of_next(chain[:, i], i))
        return head.fold(elements)

    def imitation_loss(self, actions: Tensor, valid: Tensor | None = None,
                       generator: torch.Generator | None = None) -> tuple[Tensor, dict[str, float]]:
        """Conditional flow matching (``dvla sft``): per decision a time ``t ~ U(0, 1)`` and
        noise ``x0 ~ N(0, I)``, ``x_t = (1 - t) x0 + t a`` (0 is the noise, 1 the data, as the
        chain runs) and the squared error of ``v(x_t, t, cond)`` to the straight path's
        velocity ``a - x0``, averaged over the action dimensions and the ``valid`` steps. It
        trains the velocity model only (the chain's noise ``sigma`` is RL's). With padded
        dimensions the actions are zero-padded and the error is over the real ones (as
        LeRobot's pi0 trains)."""
        a = actions.float()
        if self.head.padded:
            a = torch.cat([a, a.new_zeros(*a.shape[:-1], self.head.padded)], dim=-1)
        b = a.shape[0]
        where = generator.device if generator is not None else a.device
        t = torch.rand(b, generator=generator, device=where).to(a.device)
        x0 = torch.randn(a.shape, generator=generator, device=where).to(a.device)
        tt = t.view(b, 1, 1)
        v = self.head.velocity((1 - tt) * x0 + tt * a, t, self.cond)
        err = (v.float() - (a - x0))[..., : self.head.d].pow(2).mean(-1)
        loss = masked_step_mean(err, valid)
        return loss, {"flow_mse": float(loss.detach())}

    def tempered(self, temperature: float) -> "FlowChainDistribution":
        """The chain's noise ``sigma`` times ``temperature`` (the noise-free integration, the
        mode, is unchanged). ``0``: pi0's own sampler, noise ``x_0 ~ N(0, I)`` and then the
        noise-free integration (``dvla eval --sample --temperature 0``: as the reference's
        evaluation scripts act); its steps are scored as the means of the transitions, at the
        chain's own ``sigma``."""
        if temperature < 0:
            raise ValueError(f"a flow chain's temperature must be >= 0, got {temperature}")
        out = copy.copy(self)
        if temperature == 0:
            out.noise_free = True
        else:
            out.log_sigma = self.log_sigma + math.log(temperature)
        return out

    def entropy(self, extras: Extras | None = None) -> Tensor:
        """The transitions' entropy (of the chain given ``x_0``), per decision: it depends on
        sigma only."""
        per_step = (0.5 + _HALF_LOG_2PI + self.log_sigma).sum()
        return (self.head.steps * per_step).expand(self.batch_size)
