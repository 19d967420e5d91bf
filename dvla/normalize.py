"""Normalisation of a policy's inputs and outputs with a dataset's statistics (``dvla sft``).

* proprio: ``(p - mean) / std`` per dimension (``std`` floored at :data:`MIN_STD`, so a
  dimension that never moved in the data stays finite), applied where observations enter
  the policy (``VLAPolicy.act``, ``evaluate``, ``value``, ``imitation_loss``); the stored
  trajectories keep the env's raw proprio.
* actions (``action="bounds"``): the dataset's ``[q01, q99]`` per dimension mapped onto
  ``[-1, 1]`` (OpenVLA's and openpi's quantile bounds), so that a head whose support is
  ``[-1, 1]`` (bins, action tokens) spends its resolution on the range the demonstrations
  use (LIBERO's rotations span a tenth of it). A dimension whose bounds (nearly) coincide is
  left as it is. The policy's heads work in the normalised space; ``act`` returns actions
  in the env's space (unnormalised) and ``evaluate`` normalises the actions it is given, so
  rollouts, learners and the env agree. The map is affine, so log-prob ratios are the same
  in either space. ``action="none"``: actions as they are (dvla's envs take ``[-1, 1]``).

A :class:`Normalizer` is kept beside the policy (``policy.normalizer``, not in its state
dict): ``dvla sft`` writes it into ``weights.safetensors``' metadata (key
``normalization``) and ``normalization.json`` in its run directory, and
:func:`dvla.state.init_weights.fit_policy` (``policy.init``, ``dvla eval``) installs it again.
An RL run keeps it as part of its state: every rank installs it at start-up (rank 0 sends it,
:func:`swimlane.assembly.build.share_normalization`), and the run writes its own ``normalization.json``
and the same metadata entry into its weights and checkpoints (their manifest), from which a
resume restores it (:func:`dvla.state.init_weights.resumed_normalization`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dvla.state.atomic_io import save_text

MIN_STD = 1e-3
MIN_HALF_RANGE = 1e-4
METADATA_KEY = "normalization"
FILE = "normalization.json"
ACTION_MODES = ("bounds", "none")


def _vec(x: Any) -> Tensor:
    return torch.as_tensor(np.asarray(x, dtype=np.float64), dtype=torch.float32).reshape(-1)


@dataclass
class Normalizer:
    proprio_mean: Tensor | None = None  # (P,)
    proprio_std: Tensor | None = None  # (P,), already floored
    action_center: Tensor | None = None  # (D,)
    action_half_range: Tensor | None = None  # (D,), 1 where a dimension is left as it is

    @classmethod
    def from_stats(cls, stats: dict, action: str = "bounds") -> "Normalizer":
        """From :func:`dvla.datasets.stats.dvla_stats` (``{"action": ..., "proprio": ...}``)."""
        if action not in ACTION_MODES:
            raise ValueError(f"action normalisation must be one of {', '.join(ACTION_MODES)}, got {action!r}")
        p = stats["proprio"]
        norm = cls(proprio_mean=_vec(p["mean"]), proprio_std=_vec(p["std"]).clamp(min=MIN_STD))
        if action == "bounds":
            a = stats["action"]
            lo, hi = _vec(a.get("q01", a["min"])), _vec(a.get("q99", a["max"]))
            half = (hi - lo) / 2
            keep = half < MIN_HALF_RANGE
            norm.action_center = torch.where(keep, torch.zeros_like(lo), (hi + lo) / 2)
            norm.action_half_range = torch.where(keep, torch.ones_like(half), half)
        return norm

    # -- applied ------------------------------------------------------------------------------
    def proprio(self, x: Tensor) -> Tensor:
        if self.proprio_mean is None:
            return x
        if x.shape[-1] != self.proprio_mean.shape[0]:
            raise ValueError(f"the policy's normalisation has {self.proprio_mean.shape[0]} proprio dimensions, the "
                             f"observation {x.shape[-1]}")
        m, s = self.proprio_mean.to(x.device), self.proprio_std.to(x.device)
        return ((x.float() - m) / s).to(x.dtype if x.is_floating_point() else torch.float32)

    def actions(self, a: Tensor) -> Tensor:
        """Env actions -> the policy's space."""
        if self.action_center is None:
            return a
        return (a - self.action_center.to(a.device)) / self.action_half_range.to(a.device)

    def unactions(self, a: Tensor) -> Tensor:
        """The policy's actions -> the env's."""
        if self.action_center is None:
            return a
        return a * self.action_half_range.to(a.device) + self.action_center.to(a.device)

    def check(self, proprio_dim: int, action_dim: int, where: str) -> None:
        """A ValueError unless it fits a policy with these dimensions."""
        dims = [("proprio", self.proprio_mean, proprio_dim), ("action", self.action_center, action_dim)]
        for name, t, want in dims:
            if t is not None and t.shape[0] != want:
                raise ValueError(f"{where}: the stored normalisation has {t.shape[0]} {name} dimensions, the policy "
                                 f"{want}")

    # -- stored -------------------------------------------------------------------------------
    def to_json(self) -> str:
        d = {k: getattr(self, k).tolist() for k in ("proprio_mean", "proprio_std", "action_center",
                                                    "action_half_range") if getattr(self, k) is not None}
        return json.dumps(d)

    def digest(self) -> str:
        """A short hash of :meth:`to_json`: ranks that hold the same normalisation report the
        same digest (a run's summaries)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def save(self, path) -> None:
        """Write :meth:`to_json` to ``path`` (``normalization.json``) so that a crash leaves the
        old file or the complete new one."""
        save_text(self.to_json(), path)

    @classmethod
    def from_json(cls, text: str) -> "Normalizer":
        d = json.loads(text)
        unknown = set(d) - {"proprio_mean", "proprio_std", "action_center", "action_half_range"}
        if unknown or ("proprio_mean" in d) != ("proprio_std" in d) or ("action_center" in d) != (
                "action_half_range" in d):
            raise ValueError(f"not a normalisation record (keys {sorted(d)})")
        return cls(**{k: _vec(v) for k, v in d.items()})
