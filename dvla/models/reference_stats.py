"""A reference checkpoint's normalisation statistics as a :class:`dvla.normalize.Normalizer`.

pi0's checkpoints carry the statistics their model was trained with, and the model computes
nothing sensible without them. Both formats below are affine per dimension, as dvla's own
normalisation is, so they map onto a :class:`Normalizer` (the state's centre and scale, the
actions' centre and half range) and are applied where dvla applies its own: at rollout, on
the learner and in ``dvla eval``, and saved with the run.

* LeRobot (``policy_preprocessor.json`` and ``policy_postprocessor.json`` beside the weights,
  each naming a ``state_file`` of ``<feature>.<stat>`` tensors): the state's mode from the
  preprocessor's ``norm_map["STATE"]`` (``observation.state.*``), the actions' from the
  postprocessor's ``norm_map["ACTION"]`` (``action.*``). ``MEAN_STD``: ``(x - mean) / (std +
  eps)`` and back ``x * std + mean`` (LeRobot's asymmetric eps kept); ``MIN_MAX``,
  ``QUANTILES``, ``QUANTILE10``: ``[lo, hi]`` onto ``[-1, 1]`` (a zero range replaced by eps).
* openpi (``norm_stats.json``: ``{"norm_stats": {"state": {...}, "actions": {...}}}``, in the
  checkpoint's directory or its ``assets/<asset id>/``): z-scores ``(x - mean) / (std + 1e-6)``,
  or with ``quantile`` (pi0.5's default) ``[q01, q99]`` onto ``[-1, 1]`` with the range + 1e-6.

A statistic whose length is not the env's state or action dimension is one error naming both.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from dvla.config import ConfigError

from dvla.normalize import Normalizer

_BOUNDS = {"MIN_MAX": ("min", "max"), "QUANTILES": ("q01", "q99"), "QUANTILE10": ("q10", "q90")}
OPENPI_EPS = 1e-6


class StatsError(ConfigError):
    """Statistics that cannot be read or do not fit the env (one line)."""


def _affine(mode: str, stats: dict[str, Tensor], eps: float, what: str) -> tuple[Tensor, Tensor, Tensor] | None:
    """(centre, forward scale, inverse scale) of LeRobot's ``mode``, or None for IDENTITY."""
    if mode == "IDENTITY":
        return None
    if mode == "MEAN_STD":
        need = ("mean", "std")
    elif mode in _BOUNDS:
        need = _BOUNDS[mode]
    else:
        raise StatsError(f"{what}: normalisation mode {mode!r} is not one of IDENTITY, MEAN_STD, {', '.join(_BOUNDS)}")
    missing = [s for s in need if s not in stats]
    if missing:
        raise StatsError(f"{what}: {mode} needs the statistics {list(need)}, the file lacks {missing}")
    if mode == "MEAN_STD":
        return stats["mean"], stats["std"] + eps, stats["std"]
    lo, hi = (stats[s] for s in need)
    span = hi - lo
    span = torch.where(span == 0, torch.full_like(span, eps), span)
    return lo + span / 2, span / 2, span / 2


def _lerobot_feature(root: Path, processor: str, feature: str, kind: str) -> tuple[Tensor, Tensor, Tensor] | None:
    spec_file = root / f"{processor}.json"
    try:
        spec = json.loads(spec_file.read_text())
        steps = [s for s in spec["steps"] if "normalizer" in s.get("registry_name", "")]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StatsError(f"{spec_file}: not a LeRobot processor file ({exc})") from None
    if not steps:
        return None
    step = steps[0]
    mode = step.get("config", {}).get("norm_map", {}).get(kind, "IDENTITY")
    if mode == "IDENTITY" or "state_file" not in step:
        return None
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(root / step["state_file"]))
    except (OSError, ValueError) as exc:
        raise StatsError(f"{root / step['state_file']}: unreadable statistics ({exc})") from None
    stats = {k[len(feature) + 1:]: v.float() for k, v in tensors.items() if k.startswith(feature + ".")}
    if not stats:
        return None
    return _affine(mode, stats, float(step["config"].get("eps", 1e-8)), f"{root / step['state_file']} ({feature})")


def lerobot_normalizer(root: str | Path) -> Normalizer | None:
    """The statistics of a LeRobot policy directory (None where it normalises nothing)."""
    root = Path(root)
    state = _lerobot_feature(root, "policy_preprocessor", "observation.state", "STATE") \
        if (root / "policy_preprocessor.json").is_file() else None
    action = _lerobot_feature(root, "policy_postprocessor", "action", "ACTION") \
        if (root / "policy_postprocessor.json").is_file() else None
    return _normalizer(state, action)


def openpi_normalizer(file: str | Path, quantile: bool) -> Normalizer:
    """openpi's ``norm_stats.json``: z-scores, or ``quantile`` bounds."""
    try:
        stats = json.loads(Path(file).read_text())["norm_stats"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StatsError(f"{file}: not an openpi norm_stats.json ({exc})") from None

    def one(name: str) -> tuple[Tensor, Tensor, Tensor] | None:
        if name not in stats:
            return None
        s = {k: torch.tensor(v, dtype=torch.float32) for k, v in stats[name].items() if v is not None}
        need = ("q01", "q99") if quantile else ("mean", "std")
        if any(k not in s for k in need):
            raise StatsError(f"{file}: {name} needs {list(need)} ({'quantile' if quantile else 'z-score'} "
                             f"normalisation), has {sorted(s)}")
        if quantile:
            half = (s["q99"] - s["q01"] + OPENPI_EPS) / 2
            return s["q01"] + half, half, half
        scale = s["std"] + OPENPI_EPS
        return s["mean"], scale, scale

    return _normalizer(one("state"), one("actions"))


def _normalizer(state, action) -> Normalizer | None:
    if state is None and action is None:
        return None
    norm = Normalizer()
    if state is not None:
        norm.proprio_mean, norm.proprio_std = state[0], state[1]
    if action is not None:  # dvla's Normalizer: env = policy * half_range + centre
        norm.action_center, norm.action_half_range = action[0], action[2]
    return norm


def openpi_stats_file(root: Path) -> Path | None:
    """``norm_stats.json`` in ``root`` or in exactly one ``root/assets/*/``."""
    if (root / "norm_stats.json").is_file():
        return root / "norm_stats.json"
    found = sorted(root.glob("assets/*/norm_stats.json"))
    if len(found) > 1:
        raise StatsError(f"{root}: several norm_stats.json ({', '.join(str(f) for f in found)}): name one with "
                         "policy.options.norm_stats")
    return found[0] if found else None


def checkpoint_normalizer(root: Path, proprio_dim: int, action_dim: int, *, norm_stats: str | None = None,
                          quantile: bool = False) -> Normalizer | None:
    """The statistics a checkpoint directory carries (``norm_stats``: openpi's file, named),
    checked against the env's dimensions."""
    if norm_stats is not None:
        norm, where = openpi_normalizer(norm_stats, quantile), norm_stats
    elif (root / "policy_preprocessor.json").is_file() or (root / "policy_postprocessor.json").is_file():
        norm, where = lerobot_normalizer(root), root
    else:
        file = openpi_stats_file(root) if root.is_dir() else None
        norm, where = (openpi_normalizer(file, quantile), file) if file is not None else (None, root)
    if norm is not None:
        for what, t, dim in (("state", norm.proprio_mean, proprio_dim), ("action", norm.action_center, action_dim)):
            if t is not None and t.shape[0] != dim:
                raise StatsError(f"{where}: the checkpoint's {what} statistics have {t.shape[0]} dimensions, the "
                                 f"env's {what} has {dim}")
    return norm
