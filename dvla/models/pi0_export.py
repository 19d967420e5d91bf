"""A trained :class:`dvla.models.pi0_vla.Pi0VLA` written back in pi0's own layouts.

The inverse of :mod:`dvla.models.pi0_convert`, under the names LeRobot's
``PI0Policy.save_pretrained`` writes (the fixture tests/fixtures/pi0 holds such a file):

* ``vision.*`` -> ``paligemma_with_expert.paligemma.model.vision_tower.vision_model.*``,
  ``projector.*`` -> ``...multi_modal_projector.linear.*``, ``lm.*`` ->
  ``...language_model.*`` except the embeddings, which LeRobot stores once, as the tied
  ``paligemma_with_expert.paligemma.lm_head.weight``; the expert's layers and norm ->
  ``paligemma_with_expert.gemma_expert.model.*``; its projections at the top level.
* ``lerobot``: every key under ``model.``, and the checkpoint's ``config.json``, processor
  files and tokenizer copied from the directory the run started from (LeRobot builds the
  model from that config); ``openpi``: the keys without ``model.`` (openpi's PyTorch
  ``model.safetensors``) and the run's statistics as ``assets/<asset id>/norm_stats.json``.
* LoRA adapters are merged into their base weights first; dvla's own parameters (the chain's
  noise ``log_sigma``, a value head) are left out: pi0 has none. The expert's language head,
  which pi0 holds and never uses, is the source checkpoint's where there is one, else zeros.

The run's normalisation must be the one the checkpoint came with for ``lerobot`` (its
processor files are copied as they are): an SFT run's own statistics are one error.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch
from torch import Tensor, nn

from dvla.config import ConfigError

from dvla.models.pi0_convert import _EXPERT, _OWN, _ROOT

FORMATS = ("lerobot", "openpi")
_OUT = (  # (model prefix, checkpoint prefix after the root)
    ("vision.", "paligemma.model.vision_tower.vision_model."),
    ("projector.", "paligemma.model.multi_modal_projector.linear."),
    ("lm.", "paligemma.model.language_model."),
    (_EXPERT + "layers.", "gemma_expert.model.layers."),
    (_EXPERT + "norm.", "gemma_expert.model.norm."),
)
_TIED = "paligemma.lm_head.weight"
_EXPERT_HEAD = "gemma_expert.lm_head.weight"
_COPIED = ("config.json", "policy_preprocessor.json", "policy_postprocessor.json", "tokenizer.json",
           "tokenizer_config.json", "special_tokens_map.json")


class ExportError(ConfigError):
    """What a run cannot be exported as (one line)."""


def merged_state_dict(policy: nn.Module) -> dict[str, Tensor]:
    """The policy's tensors with LoRA adapters merged into their base layers (peft's
    ``base_layer`` level removed, the adapters' own tensors left out)."""
    if not any("lora_" in name for name, _ in policy.named_parameters()):
        return {k: v.detach() for k, v in policy.state_dict().items()}
    merged = copy.deepcopy(policy)
    for module in merged.modules():
        if hasattr(module, "merge") and hasattr(module, "base_layer"):
            module.merge()
    out = {}
    for k, v in merged.state_dict().items():
        if "lora_" in k:
            continue
        out[k.replace(".base_layer.", ".")] = v.detach()
    return out


def checkpoint_key(name: str) -> str | None:
    """pi0's name (without LeRobot's ``model.``) for a parameter of the built-in model; None
    for dvla's own."""
    if name.startswith(_OWN):
        return None
    if name == "lm.embed_tokens.weight":
        return _ROOT + _TIED
    for own, theirs in _OUT:
        if name.startswith(own):
            return _ROOT + theirs + name[len(own):]
    if name.startswith(_EXPERT):
        return name[len(_EXPERT):]  # state_proj, action_in_proj, action_out_proj, action_time_mlp_*
    raise ExportError(f"pi0 export: no pi0 name for parameter {name!r}")


def export_tensors(policy: nn.Module, fmt: str) -> dict[str, Tensor]:
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: one of {', '.join(FORMATS)}")
    prefix = "model." if fmt == "lerobot" else ""
    out = {}
    for name, value in merged_state_dict(policy).items():
        key = checkpoint_key(name)
        if key is not None:
            out[prefix + key] = value.float().contiguous().cpu()
    vocab, width = policy.lm.embed_tokens.weight.shape[0], policy.expert.action_in_proj.out_features
    out[prefix + _ROOT + _EXPERT_HEAD] = torch.zeros(vocab, width)
    return out


def export_pi0(policy: nn.Module, out: Path, fmt: str, source: Path | None, run_normalizer=None) -> list[str]:
    """Write ``policy`` into ``out`` in ``fmt``; the files written, relative to ``out``."""
    from safetensors.torch import save_file

    tensors = export_tensors(policy, fmt)
    if fmt == "lerobot":
        if source is None or not (source / "config.json").is_file():
            raise ExportError("--format lerobot: LeRobot builds the model from the config.json of the checkpoint "
                              "the run started from (policy.options.pretrained_path, a LeRobot directory); the "
                              f"run has {source or 'none'}")
        _same_normalisation(policy, source, run_normalizer)
    if source is not None and (source / "model.safetensors").is_file():
        from safetensors import safe_open

        with safe_open(str(source / "model.safetensors"), "pt") as f:
            for key in f.keys():
                if key.endswith(_EXPERT_HEAD) and key.removeprefix("model.") == _ROOT + _EXPERT_HEAD:
                    theirs = f.get_tensor(key)
                    mine = next(k for k in tensors if k.endswith(_EXPERT_HEAD))
                    if theirs.shape == tensors[mine].shape:
                        tensors[mine] = theirs.float().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    written = ["model.safetensors"]
    if fmt == "lerobot":
        for name in _COPIED:
            if (source / name).is_file():
                shutil.copy2(source / name, out / name)
                written.append(name)
        for step in ("policy_preprocessor.json", "policy_postprocessor.json"):
            if (source / step).is_file():
                for s in json.loads((source / step).read_text()).get("steps", []):
                    if "state_file" in s:
                        shutil.copy2(source / s["state_file"], out / s["state_file"])
                        written.append(s["state_file"])
        if (source / "tokenizer").is_dir():
            shutil.copytree(source / "tokenizer", out / "tokenizer", dirs_exist_ok=True)
            written.append("tokenizer/")
    elif run_normalizer is not None:
        written.append(_write_norm_stats(run_normalizer, out))
    return written


def _same_normalisation(policy: nn.Module, source: Path, run_normalizer) -> None:
    from dvla.models.reference_stats import lerobot_normalizer

    theirs = lerobot_normalizer(source)
    if (theirs is None) != (run_normalizer is None) or (
            theirs is not None and theirs.digest() != run_normalizer.digest()):
        raise ExportError(f"--format lerobot: the run acts with another normalisation than {source}'s processor "
                          "files hold (an SFT run's own statistics, say); LeRobot would read the checkpoint's")


def _write_norm_stats(norm, out: Path) -> str:
    """openpi's z-score statistics of the run's affine normalisation (``std`` less its 1e-6)."""
    from dvla.models.reference_stats import OPENPI_EPS

    stats = {}
    if norm.proprio_mean is not None:
        stats["state"] = {"mean": norm.proprio_mean.tolist(), "std": (norm.proprio_std - OPENPI_EPS).tolist()}
    if norm.action_center is not None:
        stats["actions"] = {"mean": norm.action_center.tolist(), "std": (norm.action_half_range - OPENPI_EPS).tolist()}
    path = out / "assets" / "dvla" / "norm_stats.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"norm_stats": stats}, indent=1))
    return str(path.relative_to(out))
