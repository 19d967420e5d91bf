"""What the transformer VLAs (``token_vla``, ``pi0_vla``) share: the options both take, the
instruction tokenizer they read, the cameras they use and SigLIP's input."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch.nn.functional as F
from torch import Tensor

from dvla.tokenizers import HFTokenizer, builtin_tokenizer
from dvla.types import Observation


@dataclass(kw_only=True)
class VLMOptions:
    """The options every transformer VLA takes (each model's ``Config`` adds its own)."""

    tokenizer: str = "builtin"
    """``builtin`` (a BPE trained on dvla/data/instructions.txt) or a local tokenizer.json."""
    max_tokens: int = 24
    """Instruction tokens per episode, at most."""
    lora_rank: int = 0
    """LoRA rank on the LM's attention projections (0: full fine-tuning)."""
    lora_alpha: float = 16.0
    lora_targets: list = field(default_factory=lambda: ["q_proj", "v_proj"])
    value_head: bool = False
    """A value MLP on the pooled prefix (PPO); GRPO needs none."""
    cameras: list | None = None
    """Further cameras to read besides the main one (names from the env); None: all of them."""

    def _shared_errors(self) -> list[tuple[str, str]]:
        errs = []
        if self.max_tokens < 1:
            errs.append(("max_tokens", f"must be >= 1, got {self.max_tokens}"))
        if self.lora_rank < 0:
            errs.append(("lora_rank", f"must be >= 0, got {self.lora_rank}"))
        if self.tokenizer != "builtin" and not Path(self.tokenizer).is_file():
            errs.append(("tokenizer", f"`builtin` or a tokenizer.json file, got {self.tokenizer!r}"))
        return errs


def make_tokenizer(config: VLMOptions, root: Path | None) -> HFTokenizer:
    """``config.tokenizer`` if it names a file, else a ``tokenizer.json`` in ``root`` (a
    pretrained directory), else the built-in one."""
    path = Path(config.tokenizer) if config.tokenizer != "builtin" else None
    if path is None and root is not None and (root / "tokenizer.json").is_file():
        path = root / "tokenizer.json"
    if path is None:
        return builtin_tokenizer(max_len=config.max_tokens)
    from tokenizers import Tokenizer

    return HFTokenizer(Tokenizer.from_file(str(path)), max_len=config.max_tokens)


def cameras_used(spec, config: VLMOptions) -> tuple[str, ...]:
    """The further cameras a model reads: ``config.cameras``, or every camera the env has."""
    return tuple(name for name, _ in spec.cameras) if config.cameras is None else tuple(config.cameras)


class SiglipInput:
    """``preprocess`` for a policy with a SigLIP tower of input side ``self.image_size``: every
    camera (uint8, each its own size) scaled to [-1, 1] (SigLIP's normalisation, mean and std
    0.5) and resized to it: stretched (``image_resize = "stretch"``), or, as pi0's reference
    code does (openpi's and LeRobot's ``resize_with_pad``), resized keeping its aspect ratio
    (bilinear, ``int(side / ratio)``) and centred between bands of ``image_pad_value``."""

    image_size: int
    image_resize: str = "stretch"
    image_pad_value: float = -1.0

    def _pixels(self, image: Tensor) -> Tensor:
        x = image.float() * (1.0 / 255.0)
        side, (h, w) = self.image_size, x.shape[-2:]
        if (h, w) != (side, side):
            if self.image_resize == "pad":
                ratio = max(w / side, h / side)
                rh, rw = int(h / ratio), int(w / ratio)
                x = F.interpolate(x, size=(rh, rw), mode="bilinear", align_corners=False) * 2.0 - 1.0
                top, left = (side - rh) // 2, (side - rw) // 2
                return F.pad(x, (left, side - rw - left, top, side - rh - top), value=self.image_pad_value)
            x = F.interpolate(x, size=(side, side), mode="bilinear", align_corners=False)
        return x * 2.0 - 1.0

    def preprocess(self, obs: Observation) -> Observation:
        return dataclasses.replace(obs, image=self._pixels(obs.image),
                                   cameras={k: self._pixels(v) for k, v in obs.cameras.items()})
