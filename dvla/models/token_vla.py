"""TokenVLA: an OpenVLA-style policy built from Hugging Face ``transformers`` configs.

A SigLIP vision tower turns the camera image into patch embeddings; a linear projector maps
them into a Llama-style causal language model's embedding space, followed by the embedded
instruction (the real tokenizer's ids, with its attention mask) and one embedding of the
proprioceptive state. Actions are tokens on the last ``n_bins`` ids of the vocabulary
(:mod:`dvla.heads.tokens`), decoded autoregressively over the KV cache or in parallel.
Every camera the env declares (the main one and ``Observation.cameras``, each at its own
resolution) is resized for the tower and its patches marked with a learned camera embedding.

* ``size``: ``tiny`` (0.26M parameters, runs on a CPU; learns fast_reach with 21 bins and 16 px images, see docs/concepts.md), ``0.5b`` (a SigLIP-B/16 tower and
  a 24-layer, 896-wide LM: 0.45B parameters with the built-in tokenizer's vocabulary) or
  ``7b`` (a SigLIP-So400m tower and a Llama-2-7B shaped LM: 6.9B). ``vision`` and ``lm`` override single fields of the
  ``SiglipVisionConfig`` and ``LlamaConfig``.
* Random init by default. ``pretrained_path``: a local directory with ``vision/`` and
  ``lm/`` (each as ``save_pretrained`` writes it; :meth:`TokenVLA.save_backbones`) and,
  optionally, ``tokenizer.json``. Nothing is downloaded.
* ``lora_rank > 0`` wraps the LM in ``peft`` LoRA adapters: the base weights freeze (and
  stay out of the optimizer), the adapters train.
* The vocabulary is the tokenizer's, plus ``n_bins`` action ids after it.

Needs the ``[vla]`` extra (``transformers``, ``tokenizers``, ``peft`` for LoRA).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from dvla.heads.tokens import TokenActionHead
from dvla.models.vlm import SiglipInput, VLMOptions, cameras_used, make_tokenizer
from dvla.policy import PolicyOutput, PolicySpec, VLAPolicy, register_policy
from dvla.types import Observation

SIZES: dict[str, dict[str, dict]] = {
    "tiny": {"vision": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            patch_size=8, image_size=32),
             "lm": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2)},
    "0.5b": {"vision": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                            patch_size=16, image_size=224),
             "lm": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                        num_key_value_heads=2)},
    "7b": {"vision": dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                          patch_size=14, image_size=224),
           "lm": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32)},
}


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("policy token_vla needs the `transformers` package: pip install 'dvla[vla]'") from exc
    return transformers


@register_policy("token_vla")
class TokenVLA(SiglipInput, VLAPolicy):
    @dataclass(kw_only=True)
    class Config(VLMOptions):
        size: Literal["tiny", "0.5b", "7b"] = "tiny"
        """Named backbone shapes (see the module docstring)."""
        vision: dict = field(default_factory=dict)
        """Overrides of the SiglipVisionConfig fields (e.g. ``num_hidden_layers``)."""
        lm: dict = field(default_factory=dict)
        """Overrides of the LlamaConfig fields."""
        n_bins: int = 256
        """Action bins per dimension: the last ids of the vocabulary."""
        decoding: Literal["autoregressive", "parallel"] = "autoregressive"
        pretrained_path: str | None = None
        """Local directory with vision/ and lm/ (save_pretrained layout); random init when unset."""

        def _validate(self) -> list[tuple[str, str]]:
            errs = self._shared_errors()
            if self.n_bins < 2:
                errs.append(("n_bins", f"must be >= 2, got {self.n_bins}"))
            if self.pretrained_path is not None and not Path(self.pretrained_path).is_dir():
                errs.append(("pretrained_path", f"not a directory: {self.pretrained_path!r}"))
            return errs

    def __init__(self, spec: PolicySpec, config: "TokenVLA.Config"):
        super().__init__(spec=spec, config=config)
        tf = _transformers()
        root = Path(config.pretrained_path) if config.pretrained_path else None
        self.cameras_used = cameras_used(spec, config)
        self.tokenizer = make_tokenizer(config, root)
        shapes = SIZES[config.size]
        v_cfg = tf.SiglipVisionConfig(**{**shapes["vision"], "num_channels": spec.image_shape[0], **config.vision})
        vocab = self.tokenizer.vocab_size + config.n_bins
        l_cfg = tf.LlamaConfig(**{**shapes["lm"], "vocab_size": vocab, "max_position_embeddings": 1024,
                                  "pad_token_id": self.tokenizer.pad_id, **config.lm})
        if root is not None:
            self.vision = tf.SiglipVisionModel.from_pretrained(root / "vision", local_files_only=True)
            self.lm = tf.LlamaForCausalLM.from_pretrained(root / "lm", local_files_only=True)
        else:
            self.vision = tf.SiglipVisionModel(v_cfg)
            self.lm = tf.LlamaForCausalLM(l_cfg)
        if self.lm.config.vocab_size < vocab:
            raise ValueError(f"token_vla: the LM's vocabulary ({self.lm.config.vocab_size}) is smaller than the "
                             f"tokenizer's plus n_bins ({vocab})")
        self.image_size = self.vision.config.image_size
        hidden = self.lm.config.hidden_size
        self.projector = nn.Sequential(nn.Linear(self.vision.config.hidden_size, hidden), nn.GELU(),
                                       nn.Linear(hidden, hidden))
        self.state_proj = nn.Linear(spec.proprio_dim, hidden)
        self.camera_embed = nn.Parameter(torch.zeros(1 + len(self.cameras_used), hidden))  # which camera a patch is from
        self.action_head = TokenActionHead(vocab_size=self.lm.config.vocab_size, n_bins=config.n_bins,
                                           action_chunk=spec.action_chunk, action_dim=spec.action_dim,
                                           hidden_size=hidden, decoding=config.decoding)
        self.value_mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1)) \
            if config.value_head else None
        self.has_value_head = config.value_head
        if config.lora_rank > 0:
            try:
                import peft
            except ImportError as exc:
                raise ImportError("token_vla lora_rank > 0 needs the `peft` package: pip install 'dvla[vla]'") from exc
            self.lm = peft.get_peft_model(self.lm, peft.LoraConfig(
                r=config.lora_rank, lora_alpha=config.lora_alpha, target_modules=list(config.lora_targets),
                lora_dropout=0.0, bias="none"))

    def shard_units(self) -> list[nn.Module]:
        """The vision encoder's and the LM's transformer blocks, one FSDP unit each."""
        return [m for m in self.modules() if type(m).__name__.endswith(("EncoderLayer", "DecoderLayer"))]

    def save_backbones(self, path: str | Path) -> None:
        """Write the vision tower and the LM where ``pretrained_path`` reads them."""
        path = Path(path)
        self.vision.save_pretrained(path / "vision")
        lm = self.lm.merge_and_unload() if hasattr(self.lm, "merge_and_unload") else self.lm
        lm.save_pretrained(path / "lm")

    def rollout_extras(self):
        return self.action_head.rollout_extras()

    def forward(self, obs: Observation) -> PolicyOutput:
        views = list(obs.images.values())  # the main camera, then cameras_used in order
        b = obs.batch_size
        patches = self.vision(pixel_values=torch.cat(views)).last_hidden_state  # all cameras in one pass
        vis = self.projector(patches).reshape(len(views), b, patches.shape[1], -1)
        vis = (vis + self.camera_embed[: len(views), None, None, :]).transpose(0, 1).reshape(b, -1, vis.shape[-1])
        text = self.lm.get_input_embeddings()(obs.instruction_ids).to(vis.dtype)
        state = self.state_proj(obs.proprio.float()).unsqueeze(1)
        prefix = torch.cat([vis, text, state], dim=1)
        ones = torch.ones(vis.shape[0], vis.shape[1], dtype=torch.bool, device=vis.device)
        mask = torch.cat([ones, obs.instruction_mask.bool(), ones[:, :1]], dim=1)
        value = None
        if self.value_mlp is not None:
            m = mask.unsqueeze(-1).to(prefix.dtype)
            value = self.value_mlp((prefix * m).sum(1) / m.sum(1)).squeeze(-1)
        return PolicyOutput(dist=self.action_head(self.lm, prefix, mask), value=value)
