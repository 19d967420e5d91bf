"""An ACT-style policy for the PPO stability bench (issue #39): a chunked diagonal Gaussian
over ``(K, D)`` with a learned, state-independent log-std, a frozen vision backbone, an MLP
decoder (ACT's transformer decoder left out) and a value head.

The backbone is a ResNet-18 at random init (torchvision's ``resnet18(weights=None)`` where
torchvision is installed, else the same architecture built here: nothing is downloaded), frozen
(``requires_grad_(False)``, eval mode: batch norm uses its running statistics) and cut before
its classifier: 512 features per image. ``backbone=conv`` swaps in a small frozen conv net
(16 and 32 channels) where resnet18 is too slow; the bench uses resnet18.

Register it with ``--import bench/act_policy.py`` and select it with ``policy.name=act_vla``::

    python -m dvla.launch --import bench/act_policy.py --preset fast_reach policy.name=act_vla \\
        'policy.options={}' policy.action_chunk=4 env.episode_len=6 algo.name=ppo
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dvla import PolicyOutput, PolicySpec, VLAPolicy, register_policy
from dvla.distributions import GaussianActionDistribution
from dvla.policy import HashTokenizer
from dvla.types import Observation

POLICY_NAME = "act_vla"


class _Block(nn.Module):
    """torchvision's ``BasicBlock``: two 3x3 convs with batch norm and a residual."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


def resnet18_features(channels: int = 3) -> nn.Module:
    """ResNet-18 without its classifier (512 features), torchvision's init."""
    try:
        from torchvision.models import resnet18
    except ImportError:
        layers: list[nn.Module] = [nn.Conv2d(channels, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                   nn.MaxPool2d(3, 2, 1)]
        cin = 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
            cin = cout
        net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        for m in net.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        return net
    net = resnet18(weights=None)
    net.fc = nn.Identity()
    return net


def frozen_backbone(kind: str, channels: int) -> tuple[nn.Module, int]:
    """A frozen feature extractor at random init and its feature size."""
    if kind == "resnet18":
        net, feat = resnet18_features(channels), 512
    else:
        net = nn.Sequential(nn.Conv2d(channels, 16, 5, stride=2, padding=2), nn.ReLU(),
                            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                            nn.AdaptiveAvgPool2d(2), nn.Flatten())
        feat = 128
    return net.requires_grad_(False).eval(), feat


@register_policy(POLICY_NAME)
class ActVLA(VLAPolicy):
    """Frozen backbone -> MLP decoder -> (K, D) Gaussian mean; learned log-std; value head."""

    has_value_head = True

    @dataclass(kw_only=True)
    class Config:
        backbone: str = "resnet18"
        """``resnet18`` (torchvision, random init) or ``conv`` (a small conv net); frozen."""
        width: int = 128
        """Width of the decoder and value MLPs."""
        init_log_std: float = -0.5
        """Initial log-std of every (chunk step, action dimension)."""
        squash_mean: bool = False
        """tanh on the mean (False: a linear mean, as ACT's)."""
        detach_value: bool = False
        """The value head reads the shared features without sending its gradient into them."""
        tied_mean: bool = False
        """One mean for the whole chunk (the decoder outputs D numbers, repeated over the K
        steps; the log-std stays per step and dimension): a diagnostic of issue #39, which
        removes the per-step directions that the return barely tells apart."""
        image: bool = True
        """False: the decoder and value head get zeros for the image features (proprio and
        instruction only): a diagnostic of issue #39."""

        def _validate(self) -> list[tuple[str, str]]:
            errs = []
            if self.backbone not in ("resnet18", "conv"):
                errs.append(("backbone", f"resnet18 or conv, got {self.backbone!r}"))
            if self.width < 1:
                errs.append(("width", f"must be >= 1, got {self.width}"))
            return errs

    def __init__(self, spec: PolicySpec, config: ActVLA.Config):
        super().__init__(spec, config)
        self.tokenizer = HashTokenizer(256, 12)
        self.backbone, feat = frozen_backbone(config.backbone, spec.image_shape[0])
        d = config.width
        self.word_embed = nn.Embedding(256, 32, padding_idx=0)
        self.feat_proj = nn.Linear(feat, d)
        self.proprio_proj = nn.Linear(spec.proprio_dim, d)
        self.decoder = nn.Sequential(nn.Linear(2 * d + 32, d), nn.GELU(), nn.Linear(d, d), nn.GELU())
        k, a = spec.action_chunk, spec.action_dim
        self.mean_head = nn.Linear(d, a if config.tied_mean else k * a)
        nn.init.normal_(self.mean_head.weight, std=0.01)
        nn.init.zeros_(self.mean_head.bias)
        self.log_std = nn.Parameter(torch.full((k * a,), float(config.init_log_std)))
        self.value_head = nn.Sequential(nn.Linear(2 * d + 32, d), nn.Tanh(), nn.Linear(d, 1))

    def train(self, mode: bool = True):
        super().train(mode)
        self.backbone.eval()  # frozen: batch norm keeps its running statistics
        return self

    def forward(self, obs: Observation) -> PolicyOutput:
        with torch.no_grad():
            img = obs.image.float() * (1.0 / 255.0) - 0.5
            feats = self.backbone(img)
            if not self.config.image:
                feats = torch.zeros_like(feats)
        ids = obs.instruction_ids
        mask = (ids > 0).unsqueeze(-1).float()
        lang = (self.word_embed(ids) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        x = torch.cat([torch.relu(self.feat_proj(feats)), torch.tanh(self.proprio_proj(obs.proprio.float())), lang],
                      dim=-1)
        k, a = self.spec.action_chunk, self.spec.action_dim
        mean = self.mean_head(self.decoder(x))
        mean = mean.unsqueeze(1).expand(-1, k, a) if self.config.tied_mean else mean.view(-1, k, a)
        if self.config.squash_mean:
            mean = torch.tanh(mean)
        dist = GaussianActionDistribution(mean, self.log_std.view(1, k, a))
        value = self.value_head(x.detach() if self.config.detach_value else x).squeeze(-1)
        return PolicyOutput(dist=dist, value=value)
