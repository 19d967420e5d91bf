"""Loss terms and advantage estimators shared by the algorithms, as pure functions.

They work on flat tensors so they can be checked against hand-computed values.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor | None, total: float | None = None) -> Tensor:
    """Mean of the entries of ``x`` where ``mask`` is true (all of them for None).
    ``total``: divide by this count instead of the entries counted here (a micro-batch's
    share of its minibatch's mean: the shares add up to the mean)."""
    if mask is None:
        return x.mean() if total is None else x.sum() / total
    m = mask.to(x.dtype)
    return (x * m).sum() / (m.sum().clamp(min=1.0) if total is None else total)


def clipped_policy_loss(
    new_log_probs: Tensor,
    prox_log_probs: Tensor,
    advantages: Tensor,
    clip_eps: float,
    behav_log_probs: Tensor | None = None,
    max_is_weight: float | None = None,
    mask: Tensor | None = None,
    total: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate in its decoupled form.

    The trust region is taken around the *proximal* policy (``prox_log_probs``);
    the data may come from an older *behaviour* policy, corrected by the truncated
    importance weight ``min(pi_prox / pi_behav, max_is_weight)``. With
    ``behav_log_probs=None`` (on-policy) the weight is 1 and this is plain PPO.

    Log-probs are ``(N,)`` (a joint ratio per sample) or ``(N, ...)`` (per chunk step or
    per action dimension: each entry its own ratio, clipped and weighted on its own);
    ``advantages`` ``(N,)`` is shared by a sample's entries, and ``mask`` (the shape of
    the log-probs) says which entries count. ``total``: the count to average over (a
    micro-batch's share of its minibatch, see :func:`masked_mean`).

    Returns the mean loss over the counted entries and diagnostics (with behaviour
    log-probs, also the mean importance weight before truncation and the share truncated).
    """
    advantages = advantages.reshape(-1, *([1] * (new_log_probs.dim() - 1)))

    def mean(x: Tensor) -> Tensor:
        return masked_mean(x, mask, total)

    log_ratio = new_log_probs - prox_log_probs
    ratio = log_ratio.exp()
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantages
    per_sample = -torch.minimum(surr1, surr2)
    with torch.no_grad():
        stats = {
            "approx_kl": mean((ratio - 1.0) - log_ratio),
            "clip_frac": mean(((ratio - 1.0).abs() > clip_eps).float()),
        }
    if behav_log_probs is not None:
        w = (prox_log_probs - behav_log_probs).exp().detach()
        stats["is_weight_mean"] = mean(w)
        if max_is_weight is not None:
            stats["is_weight_clipped"] = mean((w > max_is_weight).float())
            w = w.clamp(max=max_is_weight)
        per_sample = per_sample * w
    return mean(per_sample), stats


def kl_k3(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """Per-sample, non-negative, unbiased estimator of KL(pi || pi_ref) from samples of pi:
    ``exp(ref - lp) - (ref - lp) - 1``."""
    d = ref_log_probs - log_probs
    return d.exp() - d - 1.0


def group_normalized_advantages(returns: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO: ``(R - mean_group(R)) / (std_group(R) + eps)`` with the population std.

    ``returns`` and ``group_ids`` are ``(B,)``; groups of size 1 get advantage 0.
    """
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    n = torch.zeros(len(uniq), device=returns.device).index_add_(0, inv, torch.ones_like(returns))
    s = torch.zeros_like(n).index_add_(0, inv, returns)
    mean = s / n
    sq = torch.zeros_like(n).index_add_(0, inv, (returns - mean[inv]) ** 2)
    std = (sq / n).sqrt()
    return (returns - mean[inv]) / (std[inv] + eps)


def gae(
    rewards: Tensor,
    values: Tensor,
    terminated: Tensor,
    done: Tensor,
    gamma: float,
    lam: float,
    bootstrap: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over time-major ``(T, B)`` tensors.

    ``values`` is ``(T + 1, B)``: ``values[t + 1]`` is the value of the observation
    after step ``t``. A terminated step does not bootstrap; a ``done`` step (terminated
    or truncated) stops the recursion, so truncated episodes bootstrap from their
    last value: ``bootstrap[t]`` where given (the value of the episode's last observation,
    when ``values[t + 1]`` is already the next episode's first, as in a column that runs
    across resets), else ``values[t + 1]``. Returns ``(advantages, returns)``, both ``(T, B)``.
    """
    t_len = rewards.shape[0]
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[0])
    not_term = 1.0 - terminated.float()
    not_done = 1.0 - done.float()
    nxt = values[1:]
    if bootstrap is not None:
        nxt = torch.where(done & ~terminated, bootstrap, nxt)
    for t in reversed(range(t_len)):
        delta = rewards[t] + gamma * nxt[t] * not_term[t] - values[t]
        last = delta + gamma * lam * not_done[t] * last
        adv[t] = last
    return adv, adv + values[:-1]
