"""Pi0VLA: a pi0-style flow-matching VLA: a PaliGemma-shaped prefix and an action expert.

The prefix: a SigLIP vision tower (``transformers``) turns each camera image into patch
embeddings, a linear projector maps them to the language model's width, and the embedded
instruction (scaled by ``sqrt(width)``) follows. A Gemma-shaped decoder runs over them,
bidirectionally (pi0's prefix block), once per decision, keeping each layer's keys and values
(:class:`PrefixCache`). The action expert (:class:`Pi0Expert`, the flow head's velocity
model) is a second, narrower Gemma-shaped transformer with as many layers: its tokens are the
state and the ``K`` noisy actions (each mixed with the flow time by ``action_time_mlp``), and at
every layer its queries attend over ``concat(prefix K/V of that layer, its own K/V)`` under
pi0's block-causal mask: the prefix sees only itself, the state sees the prefix and itself,
the actions see everything. So the two must share ``head_dim`` and ``kv_heads``.

* ``version``: ``pi0``, or ``pi05`` (pi0.5: the expert's norms conditioned on the flow time by
  :class:`dvla.models.gemma.AdaRMSNorm`, no state token, the state in the prompt as 256-bin
  tokens made at the model's input from the instruction's bytes; docs/pi0.md).
* ``size``: ``tiny`` (trains on a CPU) or ``3b`` (pi0's shapes: SigLIP-So400m, Gemma-2B with
  PaliGemma's vocabulary and an 18-layer, 1024-wide expert: 3.2B parameters). ``vision``,
  ``lm`` and ``expert`` override single fields.
* The denoising chain runs :mod:`dvla.heads.flow` (noise at every step, exact log-probs).
  The prefix is computed once per decision; the rollout's steps and the learner's scoring
  reuse its cache. Flow time and velocity follow pi0's convention inside the expert (its time
  is ``1 - t`` and its velocity the negative), so converted checkpoints keep their meaning.
* ``pretrained_path``: a pi0 checkpoint (``model.safetensors`` in openpi's or LeRobot's
  PyTorch layout, or the file itself), mapped by :mod:`dvla.models.pi0_convert`; a
  ``tokenizer.json`` beside it replaces the built-in tokenizer. Nothing is downloaded.
* ``lora_rank > 0``: peft LoRA adapters on the prefix LM's projections (and the expert's with
  ``lora_expert``); the base weights freeze.
* ``shard_units()``: the vision tower's layers, the prefix LM's and the expert's, one FSDP unit
  each; a unit uses its weights only in its own forward (the expert layers read the prefix's
  keys and values as inputs).

Needs the ``[vla]`` extra (``transformers``, ``tokenizers``, ``peft`` for LoRA).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dvla.heads.flow import FlowMatchingHead
from dvla.models.gemma import AdaRMSNorm, GemmaBlock, GemmaLM, RMSNorm, attend, block_mask, norm, rope
from dvla.models.vlm import SiglipInput, VLMOptions, cameras_used, make_tokenizer
from dvla.policy import PolicyOutput, PolicySpec, VLAPolicy, register_policy
from dvla.tokenizers import ByteTokenizer, Prompted
from dvla.types import Observation

PI0_PROMPT = "{instruction}\n"
PI05_PROMPT = "Task: {instruction}, State: {state};\nAction: "

_SO400M = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
               patch_size=14, image_size=224)
SIZES: dict[str, dict[str, dict]] = {
    "tiny": {"vision": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            patch_size=8, image_size=32),
             "lm": dict(width=64, mlp=128, layers=2, heads=4, kv_heads=1, head_dim=16, vocab_size=0),
             "expert": dict(width=32, mlp=64, heads=2)},
    "3b": {"vision": _SO400M,
           "lm": dict(width=2048, mlp=16384, layers=18, heads=8, kv_heads=1, head_dim=256, vocab_size=257152),
           "expert": dict(width=1024, mlp=4096, heads=8)},
}


def _lerobot_config(ckpt: Path) -> dict:
    """A LeRobot checkpoint's config.json (empty where there is none)."""
    import json

    file = (ckpt if ckpt.is_dir() else ckpt.parent) / "config.json"
    try:
        return json.loads(file.read_text()) if file.is_file() else {}
    except ValueError:
        return {}


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("policy pi0_vla needs the `transformers` package: pip install 'dvla[vla]'") from exc
    return transformers


# -- the action expert: the flow head's velocity model ---------------------------------------------------------

@dataclass
class PrefixCache:
    """What the expert reads, computed once per decision: each prefix layer's keys and values
    ``(B, kv_heads, L, head_dim)``, the prefix's valid tokens ``(B, L)`` and the state ``(B, P)``."""

    keys: tuple[Tensor, ...]
    values: tuple[Tensor, ...]
    mask: Tensor
    state: Tensor


def time_embedding(tau: Tensor, width: int, min_period: float = 4e-3, max_period: float = 4.0) -> Tensor:
    """pi0's sine-cosine embedding of its flow time ``tau`` ``(B,)``: ``(B, width)``."""
    frac = torch.linspace(0.0, 1.0, width // 2, device=tau.device, dtype=torch.float64)
    period = min_period * (max_period / min_period) ** frac
    ang = (2 * math.pi / period)[None] * tau.double()[:, None]
    return torch.cat([ang.sin(), ang.cos()], dim=1).float()


class Pi0Expert(nn.Module):
    """``v(x, t, cache)``: the velocity of the noisy chunk ``x`` ``(B, K, D)`` at flow time ``t``
    ``(B,)`` given a :class:`PrefixCache`. pi0: a state token, then the actions, each mixed with
    the time by ``action_time_mlp``. pi0.5 (``adaptive``): the actions alone (the state is in the
    prompt), and the time, through ``time_mlp``, conditions every norm (:class:`AdaRMSNorm`)."""

    def __init__(self, layers: int, width: int, mlp: int, heads: int, kv_heads: int, head_dim: int,
                 proprio_dim: int, action_dim: int, adaptive: bool = False):
        super().__init__()
        cond = width if adaptive else None
        self.adaptive = adaptive
        self.layers = nn.ModuleList(GemmaBlock(width, mlp, heads, kv_heads, head_dim, cond) for _ in range(layers))
        self.norm = AdaRMSNorm(width, width) if adaptive else RMSNorm(width)
        self.head_dim = head_dim
        self.action_in_proj = nn.Linear(action_dim, width)
        if adaptive:
            self.time_mlp_in = nn.Linear(width, width)
            self.time_mlp_out = nn.Linear(width, width)
        else:
            self.state_proj = nn.Linear(proprio_dim, width)
            self.action_time_mlp_in = nn.Linear(2 * width, width)
            self.action_time_mlp_out = nn.Linear(width, width)
        self.action_out_proj = nn.Linear(width, action_dim)
        nn.init.normal_(self.action_out_proj.weight, std=0.01)
        nn.init.zeros_(self.action_out_proj.bias)

    def embed_suffix(self, x: Tensor, t: Tensor, state: Tensor) -> tuple[Tensor, Tensor | None]:
        """The suffix's tokens (pi0: the state's, then the K actions'; pi0.5: the actions') and
        the norms' condition (pi0.5's time embedding; None for pi0). pi0's time runs from 1,
        noise, to 0."""
        a = self.action_in_proj(x)
        temb = time_embedding(1.0 - t, a.shape[-1]).to(a.dtype)
        if self.adaptive:
            return a, F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(temb))))
        a = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat([a, temb[:, None].expand_as(a)], -1))))
        return torch.cat([self.state_proj(state).to(a.dtype)[:, None], a], dim=1), None

    def velocity(self, out: Tensor, k: int, cond: Tensor | None = None) -> Tensor:
        """The last ``k`` tokens' outputs (the actions') -> the velocity in dvla's time (pi0's, negated)."""
        return -self.action_out_proj(norm(self.norm, out[:, -k:], cond)).float()

    def suffix_blocks(self, k: int, device) -> Tensor:
        """pi0: the state token its own block, the actions the next; pi0.5: the actions one block."""
        return torch.tensor([1] * k if self.adaptive else [1] + [2] * k, device=device)

    def forward(self, x: Tensor, t: Tensor, cache: PrefixCache) -> Tensor:
        h, cond = self.embed_suffix(x, t, cache.state)
        b, s, L = h.shape[0], h.shape[1], cache.mask.shape[1]
        pos = cache.mask.sum(1, keepdim=True) + torch.arange(s, device=h.device)
        cos, sin = rope(pos, self.head_dim)
        own = block_mask(torch.ones(b, s, dtype=torch.bool, device=h.device), self.suffix_blocks(x.shape[1], h.device))
        mask = torch.cat([cache.mask[:, None, :].expand(b, s, L), own], dim=2)
        for layer, keys, values in zip(self.layers, cache.keys, cache.values):
            h, _, _ = layer(h, mask, cos, sin, past=(keys, values), cond=cond)
        return self.velocity(h, x.shape[1], cond)


# -- the policy --------------------------------------------------------------------------------------------------

@register_policy("pi0_vla")
class Pi0VLA(SiglipInput, VLAPolicy):
    @dataclass(kw_only=True)
    class Config(VLMOptions):
        size: Literal["tiny", "3b"] = "tiny"
        """Named shapes (see the module docstring)."""
        version: Literal["pi0", "pi05"] = "pi0"
        """``pi05``: pi0.5's expert (adaptive RMS norms conditioned on the flow time, no state
        token) and its prompt, which carries the state as 256-bin tokens (see ``prompt``)."""
        prompt_tokens: int = 200
        """pi0.5: the prompt's length in tokens (LeRobot's and openpi's ``tokenizer_max_length``)."""
        instruction_bytes: int = 256
        """pi0.5: the longest instruction, in UTF-8 bytes (they travel with the episode, and the
        prompt is made from them and the state at the model's input)."""
        vision: dict = field(default_factory=dict)
        """Overrides of the SiglipVisionConfig fields (e.g. ``image_size``)."""
        lm: dict = field(default_factory=dict)
        """Overrides of the prefix LM's shape: width, mlp, layers, heads, kv_heads, head_dim, vocab_size."""
        expert: dict = field(default_factory=dict)
        """Overrides of the expert's shape: width, mlp, heads (it shares layers, kv_heads, head_dim)."""
        flow_steps: int = 10
        """Denoising steps (pi0: 10)."""
        init_log_sigma: float = -1.0
        """Initial log std of the noise injected at every step."""
        pretrained_path: str | None = None
        """A pi0 checkpoint: a directory with model.safetensors, or the file (see pi0_convert)."""
        lora_expert: bool = False
        """Adapters on the expert's layers too (their base weights freeze)."""
        pad_action_dim: int | None = None
        """The width the chunk is denoised in (pi0: 32, the robot's dims first, zeros after; the
        padded dims feed back into the real ones and are cut at the end). None: the
        checkpoint's (``pretrained_path``), else the env's action dim (no padding)."""
        prompt: str | None = None
        """How an instruction becomes the prompt (the tokenizer adds its own BOS). None: pi0's
        ``"{instruction}\n"``, or pi0.5's ``"Task: {instruction}, State: {state};\nAction: "``
        (``{state}``: the normalised state, zero-padded to ``pad_state_dim``, in 256 bins of
        [-1, 1], as ``np.digitize`` puts it; the instruction stripped, ``_`` and newlines spaces)."""
        image_resize: Literal["pad", "stretch"] = "pad"
        """Cameras to the tower's side: ``pad`` keeps the aspect ratio (pi0's resize_with_pad)."""
        image_pad_value: float | None = None
        """The bands' value in [-1, 1] space. None: openpi's -1.0 (black), or -3.0 for a
        LeRobot checkpoint (its pi0 pads with -1 before scaling [0, 1] to [-1, 1])."""
        checkpoint_stats: bool = True
        """Act with the checkpoint's normalisation statistics (LeRobot's processor files,
        openpi's norm_stats.json; :mod:`dvla.models.reference_stats`), as its model was trained."""
        norm_stats: str | None = None
        """openpi's norm_stats.json, named (default: in the checkpoint's directory or assets/*/)."""
        quantile_norm: bool = False
        """openpi's statistics as quantile bounds (pi0.5's default) instead of z-scores."""
        pad_state_dim: int | None = None
        """The width the state is zero-padded to before the expert's ``state_proj`` (pi0: 32).
        None: the checkpoint's, else the env's proprio dim."""

        def _validate(self) -> list[tuple[str, str]]:
            errs = self._shared_errors()
            if self.flow_steps < 1:
                errs.append(("flow_steps", f"must be >= 1, got {self.flow_steps}"))
            if self.norm_stats is not None and not Path(self.norm_stats).is_file():
                errs.append(("norm_stats", f"no such file: {self.norm_stats!r}"))
            if self.prompt is not None and "{instruction}" not in self.prompt:
                errs.append(("prompt", f"needs {{instruction}}, got {self.prompt!r}"))
            if self.prompt is not None and "{state}" in self.prompt and self.version != "pi05":
                errs.append(("prompt", "{state} is pi0.5's (version=pi05)"))
            for name in ("prompt_tokens", "instruction_bytes"):
                if getattr(self, name) < 1:
                    errs.append((name, f"must be >= 1, got {getattr(self, name)}"))
            if self.image_resize not in ("pad", "stretch"):
                errs.append(("image_resize", f"`pad` or `stretch`, got {self.image_resize!r}"))
            for name in ("pad_action_dim", "pad_state_dim"):
                value = getattr(self, name)
                if value is not None and (not isinstance(value, int) or value < 1):
                    errs.append((name, f"must be a positive int or null, got {value!r}"))
            if self.pretrained_path is not None and not Path(self.pretrained_path).exists():
                errs.append(("pretrained_path", f"no such file or directory: {self.pretrained_path!r}"))
            for name, allowed in (("lm", SIZES["tiny"]["lm"]), ("expert", SIZES["tiny"]["expert"])):
                unknown = sorted(set(getattr(self, name)) - set(allowed))
                if unknown:
                    errs.append((name, f"unknown fields {unknown}; allowed: {sorted(allowed)}"))
            return errs

    def __init__(self, spec: PolicySpec, config: "Pi0VLA.Config"):
        super().__init__(spec=spec, config=config)
        tf = _transformers()
        ckpt = Path(config.pretrained_path) if config.pretrained_path else None
        self.cameras_used = cameras_used(spec, config)
        root = ckpt if ckpt is None or ckpt.is_dir() else ckpt.parent
        self.version = config.version
        if config.version == "pi05":  # the instruction travels as its bytes; the prompt is made at the input
            self.prompt = config.prompt or PI05_PROMPT
            self.tokenizer = ByteTokenizer(config.instruction_bytes)
            self.prompt_tokenizer = make_tokenizer(dataclasses.replace(config, max_tokens=config.prompt_tokens), root)
            self.prompt_tokenizer.caching = False
        else:
            self.prompt = config.prompt or PI0_PROMPT
            self.tokenizer = Prompted(make_tokenizer(config, root), self.prompt)
        lm = {**SIZES[config.size]["lm"], **config.lm}
        ex = {**SIZES[config.size]["expert"], **config.expert}
        if lm["heads"] % lm["kv_heads"] or ex["heads"] % lm["kv_heads"]:
            raise ValueError(f"pi0_vla: the prefix's heads ({lm['heads']}) and the expert's ({ex['heads']}) must be "
                             f"multiples of kv_heads ({lm['kv_heads']}), which they share")
        self.vision = tf.SiglipVisionModel(tf.SiglipVisionConfig(**{
            **SIZES[config.size]["vision"], "num_channels": spec.image_shape[0], "vision_use_head": False,
            **config.vision}))
        self.image_size = self.vision.config.image_size
        self.image_resize = config.image_resize
        lerobot = ckpt is not None and ckpt.is_dir() and (ckpt / "policy_preprocessor.json").is_file()
        self.image_pad_value = config.image_pad_value if config.image_pad_value is not None \
            else -3.0 if lerobot else -1.0
        self.projector = nn.Linear(self.vision.config.hidden_size, lm["width"])
        vocab = max(getattr(self, "prompt_tokenizer", self.tokenizer).vocab_size, lm["vocab_size"])
        self.lm = GemmaLM(vocab, lm["width"], lm["mlp"], lm["layers"], lm["heads"], lm["kv_heads"], lm["head_dim"])
        self.state_width, action_width = self._padded_dims(spec, config, ckpt)
        expert = Pi0Expert(lm["layers"], ex["width"], ex["mlp"], ex["heads"], lm["kv_heads"], lm["head_dim"],
                           self.state_width, action_width, adaptive=config.version == "pi05")
        self.action_head = FlowMatchingHead(expert, spec.action_chunk, spec.action_dim, steps=config.flow_steps,
                                            init_log_sigma=config.init_log_sigma, pad_to=action_width)
        self.value_mlp = nn.Sequential(nn.Linear(lm["width"], lm["width"]), nn.Tanh(), nn.Linear(lm["width"], 1)) \
            if config.value_head else None
        self.has_value_head = config.value_head
        if ckpt is not None:
            from dvla.models.pi0_convert import load_pi0_checkpoint

            load_pi0_checkpoint(self, ckpt)
            if config.checkpoint_stats:
                from dvla.models.reference_stats import checkpoint_normalizer

                self.normalizer = checkpoint_normalizer(ckpt if ckpt.is_dir() else ckpt.parent, spec.proprio_dim,
                                                        spec.action_dim, norm_stats=config.norm_stats,
                                                        quantile=config.quantile_norm)
        if config.lora_rank > 0:
            self._add_lora(config)

    @staticmethod
    def _padded_dims(spec: PolicySpec, config: "Pi0VLA.Config", ckpt: Path | None) -> tuple[int, int]:
        """The state's and the chain's widths: the options, else the checkpoint's, else the env's."""
        found = {}
        if ckpt is not None and (config.pad_state_dim is None or config.pad_action_dim is None):
            from dvla.models.pi0_convert import padded_dims

            found = padded_dims(ckpt)
        state = config.pad_state_dim or found.get("state", spec.proprio_dim)
        if config.version == "pi05" and config.pad_state_dim is None and ckpt is not None:
            state = _lerobot_config(ckpt).get("max_state_dim", 32)  # pi0.5 has no state_proj to read it from
        action = config.pad_action_dim or found.get("action", spec.action_dim)
        for what, width, dim in (("state", state, spec.proprio_dim), ("action", action, spec.action_dim)):
            if width < dim:
                raise ValueError(f"pi0_vla: the {what} is padded to {width} dims, fewer than the env's {dim}")
        return state, action

    def preprocess(self, obs: Observation) -> Observation:
        """The cameras as pi0's reference resizes them; for pi0.5, the prompt too, from the
        instruction's bytes and the (normalised) state."""
        obs = super().preprocess(obs)
        if self.version != "pi05":
            return obs
        texts = ByteTokenizer.decode(obs.instruction_ids, obs.instruction_mask)
        bins = np.digitize(self.padded_state(obs.proprio).cpu().numpy(), bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
        prompts = [self.prompt.replace("{instruction}", t.strip().replace("_", " ").replace("\n", " "))
                   .replace("{state}", " ".join(map(str, row))) for t, row in zip(texts, bins)]
        ids, mask = self.prompt_tokenizer.encode_batch(prompts)
        return dataclasses.replace(obs, instruction_ids=ids.to(obs.proprio.device),
                                   instruction_mask=mask.to(obs.proprio.device))

    def padded_state(self, proprio: Tensor) -> Tensor:
        """The state zero-padded to the expert's width (pi0's ``pad_vector``)."""
        x = proprio.float()
        return F.pad(x, (0, self.state_width - x.shape[-1])) if x.shape[-1] < self.state_width else x

    @property
    def expert(self) -> Pi0Expert:
        return self.action_head.velocity_model

    def _add_lora(self, config: "Pi0VLA.Config") -> None:
        try:
            import peft
        except ImportError as exc:
            raise ImportError("pi0_vla lora_rank > 0 needs the `peft` package: pip install 'dvla[vla]'") from exc
        lora = peft.LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=0.0, bias="none",
                               target_modules=list(config.lora_targets))
        peft.inject_adapter_in_model(lora, self.lm)  # freezes the LM's base weights
        if config.lora_expert:
            peft.inject_adapter_in_model(lora, self.expert.layers)

    def shard_units(self) -> list[nn.Module]:
        """The vision tower's layers, then the prefix LM's, then the expert's: one FSDP unit each."""
        return [m for m in self.modules() if isinstance(m, GemmaBlock) or type(m).__name__.endswith("EncoderLayer")]

    def rollout_extras(self):
        return self.action_head.rollout_extras()  # the denoising chain

    def embed_prefix(self, obs: Observation) -> tuple[Tensor, Tensor]:
        """The prefix's embeddings ``(B, L, W)``, image patches of every camera then the
        instruction, and its valid tokens ``(B, L)``."""
        views, b = list(obs.images.values()), obs.batch_size
        patches = self.projector(self.vision(pixel_values=torch.cat(views)).last_hidden_state)
        img = patches.reshape(len(views), b, patches.shape[1], -1).transpose(0, 1).reshape(b, -1, patches.shape[-1])
        text = self.lm.embed_tokens(obs.instruction_ids) * math.sqrt(self.lm.embed_tokens.embedding_dim)
        mask = torch.cat([torch.ones(img.shape[:2], dtype=torch.bool, device=img.device),
                          obs.instruction_mask.bool()], dim=1)
        return torch.cat([img, text.to(img.dtype)], dim=1), mask

    def encode_prefix(self, obs: Observation) -> tuple[PrefixCache, Tensor]:
        """One pass of the prefix (bidirectional within it): its cache and last hidden states."""
        h, mask = self.embed_prefix(obs)
        cos, sin = rope(mask.long().cumsum(1) - 1, self.lm.layers[0].self_attn.head_dim)
        full = block_mask(mask, torch.zeros(mask.shape[1], dtype=torch.long, device=mask.device))
        keys, values = [], []
        for layer in self.lm.layers:
            h, k, v = layer(h, full, cos, sin)
            keys.append(k)
            values.append(v)
        return PrefixCache(tuple(keys), tuple(values), mask, self.padded_state(obs.proprio)), h

    def forward(self, obs: Observation) -> PolicyOutput:
        cache, h = self.encode_prefix(obs)
        value = None
        if self.value_mlp is not None:
            m = cache.mask.unsqueeze(-1).to(h.dtype)
            value = self.value_mlp((self.lm.norm(h) * m).sum(1) / m.sum(1)).squeeze(-1).float()
        return PolicyOutput(dist=self.action_head(cache, batch_size=obs.batch_size), value=value)

    def joint_velocity(self, obs: Observation, x: Tensor, t: Tensor) -> tuple[Tensor, list[Tensor]]:
        """The velocity from one pass over the whole sequence (prefix, state, actions) under the
        block-causal mask, as pi0 trains, without a cache: a reference for the cached path
        (it uses a prefix layer and an expert layer together, so it is no FSDP path). Returns
        the velocity and each layer's prefix keys."""
        hp, pmask = self.embed_prefix(obs)
        hs, cond = self.expert.embed_suffix(x, t, self.padded_state(obs.proprio))
        L = hp.shape[1]
        pad = torch.cat([pmask, torch.ones(hs.shape[:2], dtype=torch.bool, device=hs.device)], dim=1)
        blocks = torch.cat([torch.zeros(L, dtype=torch.long, device=pad.device),
                            self.expert.suffix_blocks(x.shape[1], pad.device)])
        mask = block_mask(pad, blocks)
        cos, sin = rope(pad.long().cumsum(1) - 1, self.expert.head_dim)
        keys = []
        for pl, el in zip(self.lm.layers, self.expert.layers):
            qp, kp, vp = pl.qkv(hp, cos[:, :, :L], sin[:, :, :L])
            qs, ks, vs = el.qkv(hs, cos[:, :, L:], sin[:, :, L:], cond)
            k, v = torch.cat([kp, ks.to(kp.dtype)], 2), torch.cat([vp, vs.to(vp.dtype)], 2)
            hp, hs = pl.finish(hp, attend(qp, k, v, mask[:, :L])), el.finish(hs, attend(qs, k, v, mask[:, L:]), cond)
            keys.append(kp)
        return self.expert.velocity(hs, x.shape[1], cond), keys
