"""Load a public pi0 checkpoint into :class:`dvla.models.pi0_vla.Pi0VLA`.

The PyTorch pi0 checkpoints (openpi's ``models_pytorch`` port and LeRobot's ``pi0`` policy)
are one ``model.safetensors`` whose keys name a PaliGemma with a Gemma action expert:

* ``paligemma_with_expert.paligemma.model.vision_tower.vision_model.*``: the SigLIP tower
  as transformers 4 names it (older exports: ``paligemma.vision_tower.vision_model.*``) ->
  ``vision.*`` (transformers 5's ``SiglipVisionModel`` has no ``vision_model`` level);
* ``...paligemma.model.multi_modal_projector.linear.*`` -> ``projector.*``;
* ``...paligemma.model.language_model.{embed_tokens,layers.N,norm}.*`` (older:
  ``paligemma.language_model.model.*``) -> ``lm.*``; where ``embed_tokens`` was left out as
  the tied copy of ``paligemma.lm_head.weight``, that is taken instead;
* ``...gemma_expert.model.{layers.N,norm}.*`` -> the expert's (``action_head.velocity_model.*``);
* ``state_proj``, ``action_in_proj``, ``action_out_proj``, ``action_time_mlp_in/out`` -> the
  expert's. pi0 zero-pads state and actions to 32 dimensions and denoises all 32:
  the model keeps those widths (:func:`padded_dims`, ``pad_state_dim`` / ``pad_action_dim``)
  and the projections are taken whole, so that the converted sampler is pi0's.

LeRobot's keys carry a leading ``model.``. The language heads (``lm_head``) are not used.
Whatever else does not fit (a missing or unexpected key, a shape) is one error naming it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from dvla.config import ConfigError

_ROOT = "paligemma_with_expert."
_EXPERT = "action_head.velocity_model."
_RENAMES = (  # (checkpoint prefix after the root, model prefix); first match wins
    ("paligemma.model.vision_tower.vision_model.", "vision."),
    ("paligemma.vision_tower.vision_model.", "vision."),
    ("paligemma.model.vision_tower.", "vision."),
    ("paligemma.vision_tower.", "vision."),
    ("paligemma.model.multi_modal_projector.linear.", "projector."),
    ("paligemma.multi_modal_projector.linear.", "projector."),
    ("paligemma.model.language_model.", "lm."),
    ("paligemma.language_model.model.", "lm."),
    ("gemma_expert.model.layers.", _EXPERT + "layers."),
    ("gemma_expert.model.norm.", _EXPERT + "norm."),
)
_TOP = ("state_proj.", "action_in_proj.", "action_out_proj.", "action_time_mlp_in.", "action_time_mlp_out.",
        "time_mlp_in.", "time_mlp_out.")  # (the last two: pi0.5's)
_UNUSED = ("paligemma.lm_head.", "paligemma.language_model.lm_head.", "gemma_expert.lm_head.")
_TIED = ("paligemma.lm_head.weight", "paligemma.language_model.lm_head.weight")
# Parameters of the built-in model that a pi0 checkpoint has no counterpart for.
_OWN = ("action_head.log_sigma", "value_mlp.")


class CheckpointError(ConfigError):
    """A checkpoint that does not fit: a mistake in what the run was given (one line)."""


def checkpoint_file(path: str | Path) -> Path:
    path = Path(path)
    file = path / "model.safetensors" if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(f"pi0 checkpoint: no model.safetensors in {path}")
    return file


def model_key(key: str) -> str | None:
    """The built-in model's name for a checkpoint key; None for a key it does not use; the key
    itself (marked unexpected later) when it is not a pi0 key."""
    key = key[len("model."):] if key.startswith(("model." + _ROOT, "model.action_", "model.state_proj.",
                                                 "model.time_mlp_")) else key
    if key.startswith(_TOP):
        return _EXPERT + key
    if key.startswith(_ROOT):
        rest = key[len(_ROOT):]
        if rest.startswith(_UNUSED):
            return None
        for old, new in _RENAMES:
            if rest.startswith(old):
                return new + rest[len(old):]
    return "?" + key


def padded_dims(path: str | Path) -> dict[str, int]:
    """The state's and the actions' padded widths a checkpoint was trained at (the input
    widths of ``state_proj`` and ``action_in_proj``), read from its header only."""
    from safetensors import safe_open

    found = {}
    with safe_open(str(checkpoint_file(path)), "pt") as f:
        for key in f.keys():
            name = model_key(key) or ""
            for what, proj in (("state", "state_proj.weight"), ("action", "action_in_proj.weight")):
                if name == _EXPERT + proj:
                    found[what] = int(f.get_slice(key).get_shape()[1])
    return found


def convert_state_dict(tensors: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """A pi0 checkpoint's tensors renamed for ``model``; a :class:`CheckpointError`
    names the missing and unexpected keys and the shape mismatches."""
    own = model.state_dict()
    out: dict[str, Tensor] = {}
    unexpected, mismatched, tied, seen = [], [], None, set()
    for key, value in tensors.items():
        name = model_key(key)
        if name is None:
            if key.removeprefix("model.").removeprefix(_ROOT) in _TIED:
                tied = value
            continue
        if name not in own:
            unexpected.append(key)
            continue
        seen.add(name)
        if value.shape != own[name].shape:
            mismatched.append(f"{key} {tuple(value.shape)} vs {tuple(own[name].shape)}")
        else:
            out[name] = value
    if "lm.embed_tokens.weight" not in out and tied is not None:
        if tied.shape != own["lm.embed_tokens.weight"].shape:
            mismatched.append(f"lm_head (tied embeddings) {tuple(tied.shape)} vs "
                              f"{tuple(own['lm.embed_tokens.weight'].shape)}")
        else:
            out["lm.embed_tokens.weight"] = tied
    missing = [k for k in own if k not in out and k not in seen and not k.startswith(_OWN)]
    if missing or unexpected or mismatched:
        parts = [f"{label} ({len(items)}): {', '.join(items[:4])}{', ...' if len(items) > 4 else ''}"
                 for label, items in (("missing", missing), ("unexpected", unexpected),
                                      ("shape mismatches", mismatched)) if items]
        pi05 = any("time_mlp_in" in k and "action_time" not in k for k in unexpected)
        pi0 = any("action_time_mlp_in" in k or "state_proj" in k for k in unexpected)
        hint = " (a pi0.5 checkpoint, with time_mlp_* and adaptive norms: policy.options.version=pi05)" if pi05 \
            else " (a pi0 checkpoint: policy.options.version=pi0)" if pi0 else ""
        raise CheckpointError("pi0 checkpoint does not fit pi0_vla: " + "; ".join(parts) + hint)
    return out


def load_pi0_checkpoint(model: nn.Module, path: str | Path) -> None:
    """Read ``path`` (a directory with ``model.safetensors``, or the file) into ``model``."""
    from safetensors.torch import load_file

    file = checkpoint_file(path)
    converted = convert_state_dict(load_file(str(file)), model)
    with torch.no_grad():
        own = model.state_dict()
        for name, value in converted.items():
            own[name].copy_(value.to(own[name].dtype))
