"""Stability guards of the policy-gradient update (issue #39), each off by default.

* **Learning-rate schedule** (``algo.lr_schedule``, ``algo.lr_warmup``, ``algo.lr_horizon``):
  the optimizer's learning rate of update ``u`` (0-based: the learner's weights version) is
  each parameter group's base rate times :func:`lr_factor`. Warmup ramps it up linearly over
  the first ``lr_warmup`` updates; ``linear`` and ``cosine`` then decay it over the rest of
  the horizon (``algo.lr_horizon``, or ``run.iterations`` where that is 0).
* **Target KL** (``algo.target_kl``): before each minibatch's optimizer step, the approximate
  KL between the policy being trained and the proximal one, measured on that minibatch by its
  forward pass (:func:`dvla.algos.losses.clipped_policy_loss`'s ``approx_kl``), is compared
  with ``target_kl`` itself (no factor: Stable-Baselines3 stops at ``1.5 * target_kl``, so its
  0.01 is 0.015 here). Above it, that step and every remaining one of the update are skipped.
  Several learner ranks decide together: each adds its minibatch's KL times its samples and
  its sample count into one all-reduce, and all of them stop on the samples-weighted mean, so
  they leave the update after the same minibatch (their gradient collectives stay paired).
* **Value clipping** (``algo.value_clip``, PPO): :func:`value_loss`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dvla.algos.optim import all_reduce_small


def lr_factor(schedule: str, update: int, horizon: int, warmup: int = 0) -> float:
    """The learning rate of update ``update`` (0-based) relative to the base rate.

    Warmup: ``(update + 1) / (warmup + 1)`` for the first ``warmup`` updates. Then ``constant``
    1; ``linear`` ``1 - p`` and ``cosine`` ``(1 + cos(pi p)) / 2``, with ``p = (update -
    warmup) / (horizon - warmup)`` the share of the decay done (clamped to [0, 1]): the first
    update after the warmup runs at the base rate, the last of the horizon at ``1 / (horizon
    - warmup)`` of it (linear), and updates past the horizon at 0."""
    if update < warmup:
        return (update + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    p = min(max((update - warmup) / max(horizon - warmup, 1), 0.0), 1.0)
    if schedule == "linear":
        return 1.0 - p
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"unknown learning-rate schedule {schedule!r}")


def value_loss(values: Tensor, returns: Tensor, old_values: Tensor, clip: float) -> tuple[Tensor, Tensor | None]:
    """Per-sample value loss ``0.5 (V - R)^2``; with ``clip > 0`` PPO2's clipped form
    ``0.5 max((V - R)^2, (V_old + clamp(V - V_old, -clip, clip) - R)^2)``, where ``V_old`` is
    the value the rollout recorded (the behaviour weights'), and which samples were clipped
    (None without clipping)."""
    if clip <= 0:
        return 0.5 * (values - returns).pow(2), None
    delta = values - old_values
    clipped = old_values + delta.clamp(-clip, clip)
    per = 0.5 * torch.maximum((values - returns).pow(2), (clipped - returns).pow(2))
    return per, (delta.abs() > clip).float()


def kl_over_group(kl_sum: float, samples: float, group, device: torch.device) -> float:
    """The samples-weighted mean KL over the learner ranks of ``group`` (None: this rank's):
    ``kl_sum`` is this rank's minibatch KL times its ``samples`` (both 0 for a rank without
    samples in the step). NaN when no rank had samples."""
    if group is not None:
        kl_sum, samples = all_reduce_small([kl_sum, samples], torch.float64, group, device)
    return kl_sum / samples if samples > 0 else float("nan")
