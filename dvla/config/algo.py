"""The learning algorithm's section of the job configuration (``algo.*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dvla.config.rules import bounded


@dataclass(kw_only=True)
class AlgoConfig:
    """Policy-gradient algorithm and its hyper-parameters."""

    name: Literal["grpo", "ppo"] = "grpo"
    """``grpo`` (group-relative, critic-free) or ``ppo`` (GAE with a value head)."""
    lr: float = bounded(3e-4, gt=0, le=1.0)
    """Adam learning rate."""
    group_size: int = bounded(8, ge=1)
    """GRPO: rollouts per group that start from an identical initial state."""
    update_epochs: int = bounded(2, ge=1)
    """Passes over each batch."""
    minibatches: int = bounded(4, ge=1)
    """Minibatches per pass."""
    clip_eps: float = bounded(0.2, gt=0, lt=1)
    """Clip range of the PPO surrogate."""
    entropy_coef: float = bounded(0.0, ge=0)
    """Weight of the entropy bonus."""
    kl_coef: float = bounded(0.0, ge=0)
    """GRPO: weight of the KL penalty to the initial (reference) policy; 0 disables it."""
    value_coef: float = bounded(0.5, ge=0)
    """PPO: weight of the value loss."""
    value_clip: float = bounded(0.0, ge=0)
    """PPO: clip the value loss as PPO2 does: ``0.5 max((V - R)^2, (V_old + clamp(V - V_old,
    -c, c) - R)^2)`` with ``V_old`` the value the rollout recorded. 0 (the default) leaves the
    value loss unclipped, ``0.5 (V - R)^2``. In the scale of the returns, which are not
    normalised: a clip of 0.2 on returns of order 10 all but freezes the critic."""
    target_kl: float = bounded(0.0, ge=0)
    """Stop an update's epochs early: before each minibatch's optimizer step, the approximate
    KL to the proximal policy on that minibatch (averaged over the learner ranks, which stop
    together) is compared with this, exactly (Stable-Baselines3 stops at 1.5x its target);
    above it, that step and the rest of the update are skipped (logged: ``kl_early_stop``,
    ``minibatches_stepped``). 0 disables it."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate per update: ``constant``, or decayed ``linear``ly or along a ``cosine``
    from ``lr`` (each parameter group's own rate) towards 0 over ``lr_horizon`` updates (the
    last update of the horizon runs at ``lr / (lr_horizon - lr_warmup)`` with ``linear``).
    Logged as ``lr``."""
    lr_warmup: int = bounded(0, ge=0)
    """Updates of linear warmup before the schedule: update ``u`` < ``lr_warmup`` runs at
    ``lr * (u + 1) / (lr_warmup + 1)``."""
    lr_horizon: int = bounded(0, ge=0)
    """Updates the ``linear`` or ``cosine`` decay spans, warmup included (past it the rate is
    0). 0: ``run.iterations``."""
    max_abs_log_prob: float = bounded(1e4, gt=0)
    """A chunk whose log-probs (of a whole action or each step) reach beyond this in
    absolute value is rejected before any update (``rejected_range``)."""
    max_abs_value: float = bounded(1e6, gt=0)
    """A chunk whose value estimates or bootstrap values reach beyond this in absolute value
    is rejected before any update (``rejected_range``)."""
    max_abs_return: float = bounded(1e6, gt=0)
    """A chunk whose returns could reach beyond this (its largest sum of absolute rewards
    plus its largest bootstrap value) is rejected before any update (``rejected_range``)."""
    gamma: float = bounded(0.99, ge=0, le=1)
    """PPO: discount."""
    gae_lambda: float = bounded(0.95, ge=0, le=1)
    """PPO: GAE lambda."""
    max_grad_norm: float = bounded(1.0, gt=0)
    """Gradient clipping (global norm)."""
    adv_eps: float = bounded(1e-6, gt=0)
    """Added to the standard deviation when advantages are normalised."""
    max_is_weight: float = bounded(2.0, ge=1)
    """Off-policy correction: cap of the importance weight pi_proximal / pi_behaviour
    applied to steps sampled with older weights (decoupled PPO objective)."""
    proximal: Literal["recompute", "loglinear"] = "recompute"
    """Proximal log-probs of stale steps: ``recompute`` them with the learner's weights (one
    forward pass over the stale steps per update), or ``loglinear``: interpolate between the
    behaviour log-prob and the trained policy's, by version lag (AReaL's ``prox_logp_method``,
    A-3PO), which saves that forward pass."""
    ratio: Literal["joint", "step", "dim"] = "joint"
    """Granularity of the importance ratio (and of its clipping and importance weights):
    ``joint`` over the whole action chunk, ``step`` per chunk step, ``dim`` per action
    dimension (a token, for a token head). A joint ratio over many dimensions moves by
    exp(sum of their changes): at 50 x 7 dimensions, 0.01 nat each is e^3.5, and clipping
    stops meaning anything. ``step``/``dim`` need a head with ``log_prob_elements``. Actions
    the env did not apply (the episode ended inside the chunk) count in none of them."""
    weight_decay: float = bounded(0.0, ge=0)
    """Decoupled weight decay (AdamW) of every parameter group that does not set its own
    (``VLAPolicy.optim_groups``); 0 uses Adam."""
    train_mode: bool = False
    """Run the policy in train mode (dropout on, batch-norm statistics updated) while it
    learns. False: eval mode, the mode rollouts sample in, so that the importance ratio of
    unchanged weights is exactly 1 (with dropout in train mode it is not: the ratio would
    measure the dropout noise, not the policy's change)."""
    micro_batch: int = bounded(0, ge=0)
    """Samples per forward and backward pass: a minibatch larger than this accumulates the
    gradients of its micro-batches before its one optimizer step (the same update, in less
    activation memory). 0: the whole minibatch in one pass."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """``bf16``: the learner's forward passes and losses run under ``torch.autocast`` in
    bfloat16 (sharded: on parameters gathered in bfloat16, gradients reduced in fp32);
    weights and optimizer state stay fp32. Where the rollouts' replicas run in another
    precision than the learner (``swimlane.publish_dtype``), the learner recomputes every
    step's proximal log-prob, so the clipped ratio is exactly 1 at unchanged weights and the
    precision gap goes into the truncated importance weight (``max_is_weight``)."""
    activation_checkpointing: bool = False
    """Recompute the activations of each block the policy's ``shard_units()`` names during the
    backward pass instead of keeping them from the forward pass: less activation memory for
    one more forward pass of those blocks (``token_vla``: every transformer block)."""
    shard: Literal["auto", "none", "fsdp"] = "auto"
    """``fsdp``: the learner ranks (``swimlane.learner_ranks`` > 1) are FSDP2-sharded: each
    holds 1/N of the weights, gradients and optimizer state, and the weights published to
    the rollouts are gathered one tensor at a time. ``none``: every learner holds the whole
    model and gradients are all-reduced. ``auto``: ``fsdp`` with several learner ranks
    (``none`` with ``swimlane.roles=adaptive``)."""

    def _validate(self) -> list[tuple[str, str]]:
        errs = []
        if self.value_clip > 0 and self.name != "ppo":
            errs.append(("value_clip", f"clips PPO's value loss; {self.name} has none: set it to 0"))
        if self.lr_horizon and self.lr_schedule != "constant" and self.lr_warmup >= self.lr_horizon:
            errs.append(("lr_warmup", f"{self.lr_warmup} updates of warmup leave nothing of algo.lr_horizon "
                                      f"({self.lr_horizon}) to the {self.lr_schedule} decay"))
        return errs
