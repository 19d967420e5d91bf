"""Wrap Hugging Face ``transformers`` models as a dvla policy: a flow-matching VLA.

What this shows
---------------
* ``HFFlowVLA``: two ``transformers`` models built from configs (random init, nothing is
  downloaded) wrapped as a ``dvla.VLAPolicy``:
    - a ViT (``ViTModel``) turns the camera image into patch embeddings;
    - a Qwen2 decoder (``Qwen2Model``) reads the patches, the instruction and the state as
      one sequence of embeddings (the instruction through a real subword tokenizer, with
      its attention mask: ``dvla.tokenizers.builtin_tokenizer``);
    - a flow-matching head (``dvla.heads.flow.FlowMatchingHead``) denoises an action chunk
      with an MLP velocity model (``MLPVelocity``) conditioned on the decoder's last position
      and the state, with noise at every step so that each chunk has an exact
      log-probability. Its denoising chain is a *rollout extra*: it travels with the
      trajectory and the learner scores exactly the chain that was sampled. (A pi0-style
      action expert, a transformer reading the decoder's per-layer keys and values, is the
      built-in ``pi0_vla``: docs/pi0.md.)
* ``preprocess``: the image resized and normalised for the ViT.
* Training it on ``fast_reach`` with the swimlane, one line per update.

Run it
------
    python examples/hf_policy.py                          # 30 updates, runs/examples/hf_policy
    python examples/hf_policy.py --iterations 5 --out /tmp/hf
    python -m dvla.launch --import examples/hf_policy.py --preset fast_reach \\
        policy.name=hf_flow_vla 'policy.options={}'      # the same model from the launcher

Needs the ``[vla]`` extra (``pip install -e ".[vla]"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from tqdm import tqdm

from dvla import PolicyOutput, PolicySpec, VLAPolicy, register_policy
from dvla.config import apply_overrides
from dvla.heads.flow import FlowMatchingHead, MLPVelocity
from dvla.tokenizers import builtin_tokenizer
from dvla.types import Observation

POLICY_NAME = "hf_flow_vla"


@register_policy(POLICY_NAME)
class HFFlowVLA(VLAPolicy):
    @dataclass(kw_only=True)
    class Config:
        width: int = 64
        """Hidden size of the ViT and of the decoder."""
        layers: int = 2
        """Layers of each."""
        image_size: int = 16
        """The ViT's input side; camera images are resized to it."""
        patch: int = 8
        flow_steps: int = 4
        init_log_sigma: float = -0.5

    def __init__(self, spec: PolicySpec, config: HFFlowVLA.Config):
        super().__init__(spec, config)
        w = config.width
        self.tokenizer = builtin_tokenizer(max_len=16)
        self.vit = transformers.ViTModel(transformers.ViTConfig(
            hidden_size=w, num_hidden_layers=config.layers, num_attention_heads=4, intermediate_size=2 * w,
            image_size=config.image_size, patch_size=config.patch, num_channels=spec.image_shape[0]),
            add_pooling_layer=False)
        self.decoder = transformers.Qwen2Model(transformers.Qwen2Config(
            vocab_size=self.tokenizer.vocab_size, hidden_size=w, num_hidden_layers=config.layers,
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * w, max_position_embeddings=256,
            pad_token_id=self.tokenizer.pad_id))
        self.state_embed = nn.Linear(spec.proprio_dim, w)
        velocity = MLPVelocity(2 * w, spec.action_chunk, spec.action_dim, hidden_dim=w)
        self.action_expert = FlowMatchingHead(velocity, spec.action_chunk, spec.action_dim,
                                              steps=config.flow_steps, init_log_sigma=config.init_log_sigma)

    def rollout_extras(self):
        return self.action_expert.rollout_extras()  # the denoising chain

    def preprocess(self, obs: Observation) -> Observation:
        """Runs before every forward pass (rollout and learning): the camera image resized and
        normalised for the ViT. The trajectories keep the env's uint8 images."""
        size = self.config.image_size
        x = F.interpolate(obs.image.float() / 255.0, size=(size, size), mode="bilinear", align_corners=False)
        return dataclasses.replace(obs, image=(x - 0.5) / 0.5)

    def forward(self, obs: Observation) -> PolicyOutput:
        patches = self.vit(pixel_values=obs.image).last_hidden_state
        words = self.decoder.get_input_embeddings()(obs.instruction_ids)
        state = self.state_embed(obs.proprio.float()).unsqueeze(1)
        seq = torch.cat([patches, words, state], dim=1)
        ones = torch.ones(seq.shape[0], patches.shape[1], dtype=torch.bool, device=seq.device)
        mask = torch.cat([ones, obs.instruction_mask, ones[:, :1]], dim=1)
        hidden = self.decoder(inputs_embeds=seq, attention_mask=mask.long()).last_hidden_state
        # The causal decoder's last position (the state) has read the whole sequence.
        return PolicyOutput(dist=self.action_expert(torch.cat([hidden[:, -1], state[:, 0]], dim=-1)))


def show(row: dict, total: int) -> None:
    tqdm.write(f"update {row['iter'] + 1:4d}/{total}  success {row['success_rate']:.2f}  "
               f"return {row['return_mean']:+.3f}  version {row['version']:.0f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=30, help="learner updates (default: %(default)s)")
    parser.add_argument("--out", default="runs/examples/hf_policy", help="output directory (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", help="extra dvla overrides, e.g. algo.lr=3e-4")
    args = parser.parse_args(argv)

    from dvla.config import presets
    from swimlane import Swimlane

    out = Path(args.out)
    cfg = presets.fast_reach()
    cfg.policy.name = POLICY_NAME
    cfg.policy.options = {}
    cfg = apply_overrides(cfg, [f"run.iterations={args.iterations}", f"run.out_dir={out}", "env.image_size=16",
                                *args.overrides])
    cfg.validate()
    out.mkdir(parents=True, exist_ok=True)
    summary = Swimlane(cfg, on_update=functools.partial(show, total=cfg.run.iterations)).run()
    print(f"done: {summary['version']} updates, final success {summary['final_success_rate']:.2f}, "
          f"{summary['env_steps_per_s']:.0f} env steps/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
