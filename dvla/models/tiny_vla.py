"""TinyVLA: a small vision-language-action policy that trains on a CPU.

image ``(B, 3, H, W)`` -> conv stack -> spatial soft-argmax keypoints (where things are)
instruction ids ``(B, L)`` -> embedding, mean over words -> FiLM scale/shift of the keypoints
proprio ``(B, P)`` -> MLP
concat -> MLP trunk -> action head (binned, OpenVLA-style; Gaussian; or a flow-matching
head with noisy denoising steps, :mod:`dvla.heads.flow`) and value head.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from dvla.distributions import BinnedActionDistribution, GaussianActionDistribution
from dvla.heads.flow import FlowMatchingHead, MLPVelocity
from dvla.tokenizers import HashTokenizer
from dvla.policy import PolicyOutput, PolicySpec, VLAPolicy, register_policy
from dvla.types import Observation


class SpatialSoftmax(nn.Module):
    """Per-channel expected image coordinates of a softmax over pixels: ``(B, 2C)``."""

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        att = torch.softmax(x.reshape(b, c, h * w), dim=-1).reshape(b, c, h, w)
        ys = torch.linspace(-1.0, 1.0, h, device=x.device, dtype=x.dtype)
        xs = torch.linspace(-1.0, 1.0, w, device=x.device, dtype=x.dtype)
        ey = (att.sum(3) * ys).sum(-1)
        ex = (att.sum(2) * xs).sum(-1)
        return torch.cat([ex, ey], dim=1)


@register_policy("tiny_vla")
class TinyVLA(VLAPolicy):
    @dataclass(kw_only=True)
    class Config:
        hidden_dim: int = 128
        vision_channels: int = 32
        embed_dim: int = 32
        vocab_size: int = 1024
        max_tokens: int = 16
        head: Literal["bins", "gaussian", "flow"] = "bins"
        n_bins: int = 256
        """Bins per action dimension for the binned head."""
        flow_steps: int = 4
        """Denoising steps of the flow head."""
        init_log_std: float = -0.5
        """Initial log standard deviation of the Gaussian head and of the flow head's noise."""
        value_head: bool = True
        learn_wait_ms: float = 0.0
        """Milliseconds each forward pass that records gradients (the learner's) waits
        without using a core: a larger model learning on an accelerator of its own, so that
        one CPU machine can stand in for learners with hardware of their own in benchmarks
        (as ``fast_reach``'s ``render_wait_ms`` does for simulators). 0: none."""

        def _validate(self) -> list[tuple[str, str]]:
            errs = []
            for name in ("hidden_dim", "vision_channels", "embed_dim", "max_tokens"):
                if getattr(self, name) < 1:
                    errs.append((name, f"must be >= 1, got {getattr(self, name)}"))
            if self.vocab_size < 2:
                errs.append(("vocab_size", f"must be >= 2, got {self.vocab_size}"))
            if self.n_bins < 2:
                errs.append(("n_bins", f"must be >= 2, got {self.n_bins}"))
            if self.flow_steps < 1:
                errs.append(("flow_steps", f"must be >= 1, got {self.flow_steps}"))
            if self.learn_wait_ms < 0:
                errs.append(("learn_wait_ms", f"must be >= 0, got {self.learn_wait_ms}"))
            return errs

    def __init__(self, spec: PolicySpec, config: "TinyVLA.Config"):
        super().__init__(spec=spec, config=config)
        self.tokenizer = HashTokenizer(config.vocab_size, config.max_tokens)
        c_in = spec.image_shape[0]
        ch = config.vision_channels
        self.vision = nn.Sequential(
            nn.Conv2d(c_in, ch, 5, stride=2, padding=2),
            nn.ReLU(),
            nn.Conv2d(ch, ch, 3, stride=1, padding=1),
            nn.ReLU(),
            nn.Conv2d(ch, ch, 3, stride=1, padding=1),
            SpatialSoftmax(),
        )
        vis_dim = 2 * ch
        self.embed = nn.Embedding(config.vocab_size, config.embed_dim, padding_idx=0)
        self.film = nn.Linear(config.embed_dim, 2 * vis_dim)
        nn.init.zeros_(self.film.weight)
        nn.init.zeros_(self.film.bias)
        h = config.hidden_dim
        self.proprio = nn.Sequential(nn.Linear(spec.proprio_dim, h), nn.Tanh())
        self.trunk = nn.Sequential(
            nn.Linear(vis_dim + config.embed_dim + h, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh()
        )
        self.n_act = spec.action_chunk * spec.action_dim
        if config.head == "flow":
            velocity = MLPVelocity(h, spec.action_chunk, spec.action_dim, hidden_dim=h)
            self.action_head = FlowMatchingHead(velocity, spec.action_chunk, spec.action_dim,
                                                steps=config.flow_steps, init_log_sigma=config.init_log_std)
        else:
            self.action_head = nn.Linear(h, self.n_act * (config.n_bins if config.head == "bins" else 1))
            # Start from a (near) uniform / centred action distribution.
            nn.init.normal_(self.action_head.weight, std=0.01)
            nn.init.zeros_(self.action_head.bias)
        if config.head == "gaussian":
            self.log_std = nn.Parameter(torch.full((self.n_act,), float(config.init_log_std)))
        self.value_head = nn.Linear(h, 1) if config.value_head else None
        self.has_value_head = config.value_head

    def rollout_extras(self):
        return self.action_head.rollout_extras() if self.config.head == "flow" else {}

    def forward(self, obs: Observation) -> PolicyOutput:
        if self.config.learn_wait_ms and torch.is_grad_enabled():
            time.sleep(self.config.learn_wait_ms / 1000.0)
        img = obs.image.float() * (1.0 / 255.0) - 0.5
        kp = self.vision(img)
        ids = obs.instruction_ids
        mask = (obs.instruction_mask if obs.instruction_mask is not None else ids > 0).float().unsqueeze(-1)
        lang = (self.embed(ids) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        scale, shift = self.film(lang).chunk(2, dim=-1)
        kp = kp * (1.0 + scale) + shift
        z = self.trunk(torch.cat([kp, lang, self.proprio(obs.proprio.float())], dim=-1))
        b = z.shape[0]
        k, d = self.spec.action_chunk, self.spec.action_dim
        if self.config.head == "flow":
            dist = self.action_head(z)
        elif self.config.head == "bins":
            dist = BinnedActionDistribution(self.action_head(z).reshape(b, k, d, self.config.n_bins))
        else:
            mean = torch.tanh(self.action_head(z)).reshape(b, k, d)
            dist = GaussianActionDistribution(mean, self.log_std.reshape(1, k, d))
        value = self.value_head(z).squeeze(-1) if self.value_head is not None else None
        return PolicyOutput(dist=dist, value=value)
