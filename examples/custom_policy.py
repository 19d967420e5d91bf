"""Bring your own VLA model: define a policy, register it, train it with the swimlane.

What this shows
---------------
* ``PatchMixVLA``: a small model written from scratch against the ``dvla.VLAPolicy`` API,
  unlike the built-in ``tiny_vla`` (conv stack, soft-argmax keypoints, binned head):
    - vision: the image is cut into square patches, each patch is linearly embedded
      (the first layer of a ViT) and the patch tokens are pooled with attention weights
      that depend on the instruction, so the words decide where the model looks;
    - language: mean of word embeddings from the policy's download-free tokenizer;
    - proprio: one linear layer;
    - heads: a tanh-squashed diagonal Gaussian over the action chunk and a value head.
* Its ``Config`` dataclass, which is what ``policy.options.*`` may set (checked on start-up).
* Registering it with ``@register_policy`` and selecting it with ``policy.name=...``.
* Training it on the ``fast_reach`` preset through the public API (``dvla.config.presets``,
  ``dvla.config.apply_overrides``, ``swimlane.Swimlane(cfg).run()``), printing the success
  rate of every learner update through the swimlane's ``on_update`` hook.

Run it
------
    python examples/custom_policy.py                        # 40 updates, writes runs/examples/custom_policy
    python examples/custom_policy.py --iterations 5 --out /tmp/custom
    python examples/custom_policy.py algo.name=ppo policy.options.width=128   # any dvla override

Afterwards ``OUT/weights.safetensors`` holds the trained ``PatchMixVLA`` parameters (its
metadata names the policy and the weights version) and ``OUT/summary.json`` the run summary.
To use the model from ``python -m dvla.launch`` or ``torchrun``, import this file there:
``python -m dvla.launch --import examples/custom_policy.py --preset fast_reach
policy.name=patch_mix_vla``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from dvla import PolicyOutput, PolicySpec, VLAPolicy, register_policy
from dvla.config import apply_overrides
from dvla.distributions import GaussianActionDistribution
from dvla.policy import HashTokenizer
from dvla.types import Observation

POLICY_NAME = "patch_mix_vla"


@register_policy(POLICY_NAME)
class PatchMixVLA(VLAPolicy):
    """Instruction-conditioned attention pooling over linearly embedded image patches."""

    has_value_head = True  # returns a value estimate, so PPO works as well as GRPO

    @dataclass(kw_only=True)
    class Config:
        patch: int = 8
        """Side of a square image patch in pixels (the image side must be a multiple)."""
        width: int = 64
        """Size of patch, word and trunk features."""
        vocab_size: int = 512
        max_tokens: int = 12
        init_log_std: float = -0.7

        def _validate(self) -> list[tuple[str, str]]:
            # Optional hook: (field, problem) pairs are reported as policy.options.FIELD errors.
            errs = []
            for name in ("patch", "width", "max_tokens"):
                if getattr(self, name) < 1:
                    errs.append((name, f"must be >= 1, got {getattr(self, name)}"))
            if self.vocab_size < 2:
                errs.append(("vocab_size", f"must be >= 2, got {self.vocab_size}"))
            return errs

    def __init__(self, spec: PolicySpec, config: PatchMixVLA.Config):
        super().__init__(spec, config)
        c, h, w = spec.image_shape
        p, d = config.patch, config.width
        if h % p or w % p:
            raise ValueError(f"policy.options.patch: {p} does not divide the {h}x{w} image")
        self.tokenizer = HashTokenizer(config.vocab_size, config.max_tokens)
        n_patches = (h // p) * (w // p)
        self.patch_embed = nn.Conv2d(c, d, kernel_size=p, stride=p)  # one linear map per patch
        self.patch_pos = nn.Parameter(torch.randn(n_patches, d) * 0.02)
        self.word_embed = nn.Embedding(config.vocab_size, d, padding_idx=0)
        self.query = nn.Linear(d, d)  # instruction -> attention query over the patches
        self.proprio_embed = nn.Linear(spec.proprio_dim, d)
        self.trunk = nn.Sequential(nn.Linear(3 * d, d), nn.GELU(), nn.Linear(d, d), nn.GELU())
        n_act = spec.action_chunk * spec.action_dim
        self.mean_head = nn.Linear(d, n_act)
        nn.init.normal_(self.mean_head.weight, std=0.01)  # start near the centre of the action box
        nn.init.zeros_(self.mean_head.bias)
        self.log_std = nn.Parameter(torch.full((n_act,), float(config.init_log_std)))
        self.value_head = nn.Linear(d, 1)

    def forward(self, obs: Observation) -> PolicyOutput:
        # Vision: (B, 3, H, W) uint8 -> (B, N, d) patch tokens with positions.
        img = obs.image.float() * (1.0 / 255.0) - 0.5
        patches = self.patch_embed(img).flatten(2).transpose(1, 2) + self.patch_pos
        # Language: mean of the non-padding word embeddings.
        ids = obs.instruction_ids
        mask = (ids > 0).unsqueeze(-1).float()
        lang = (self.word_embed(ids) * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        # The instruction chooses which patches matter (single-query attention pooling).
        scores = torch.einsum("bnd,bd->bn", patches, self.query(lang)) / patches.shape[-1] ** 0.5
        seen = torch.einsum("bn,bnd->bd", torch.softmax(scores, dim=-1), patches)
        z = self.trunk(torch.cat([seen, lang, torch.tanh(self.proprio_embed(obs.proprio.float()))], dim=-1))
        k, a = self.spec.action_chunk, self.spec.action_dim
        mean = torch.tanh(self.mean_head(z)).view(-1, k, a)
        dist = GaussianActionDistribution(mean, self.log_std.view(1, k, a))
        return PolicyOutput(dist=dist, value=self.value_head(z).squeeze(-1))


def show(row: dict, total: int) -> None:
    """One line per learner update (the swimlane's ``on_update`` hook)."""
    # tqdm.write keeps the line clear of dvla's progress bar (run.progress).
    tqdm.write(f"update {row['iter'] + 1:4d}/{total}  success {row['success_rate']:.2f}  "
               f"return {row['return_mean']:+.3f}  version {row['version']:.0f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=40, help="learner updates (default: %(default)s)")
    parser.add_argument("--out", default="runs/examples/custom_policy",
                        help="output directory (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", help="extra dvla overrides, e.g. algo.lr=3e-4")
    args = parser.parse_args(argv)

    from dvla.config import presets
    from swimlane import Swimlane

    out = Path(args.out)
    cfg = presets.fast_reach()  # fast_reach env, GRPO, async swimlane
    cfg.policy.name = POLICY_NAME
    cfg.policy.options = {}  # the preset's options are tiny_vla's (overrides merge into them)
    cfg = apply_overrides(cfg, [f"run.iterations={args.iterations}", f"run.out_dir={out}", *args.overrides])
    cfg.validate()
    out.mkdir(parents=True, exist_ok=True)

    summary = Swimlane(cfg, on_update=functools.partial(show, total=cfg.run.iterations)).run()
    print(f"done: {summary['version']} updates, final success {summary['final_success_rate']:.2f}, "
          f"{summary['env_steps_per_s']:.0f} env steps/s; weights in {out / 'weights.safetensors'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
