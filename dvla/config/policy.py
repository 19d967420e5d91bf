"""The policy model's section of the job configuration (``policy.*``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dvla.config.rules import bounded


@dataclass(kw_only=True)
class PolicyConfig:
    """Policy model. ``name`` picks a registered :class:`dvla.policy.VLAPolicy`;
    ``options`` are checked against that policy's own ``Config`` dataclass."""

    name: str = "tiny_vla"
    """A registered :class:`dvla.policy.VLAPolicy` (see ``POLICY_REGISTRY``)."""
    action_chunk: int = bounded(1, ge=1)
    """Actions predicted per decision (action chunking); the env executes them in order."""
    temperature: float = bounded(1.0, gt=0)
    """Sampling temperature of rollouts, and of the log-probs the learner's ratio and KL
    compare them with: a Gaussian head's std times it, logits divided by it, a flow head's
    noise times it. Below 1 an RL run explores closer to the most likely actions, which
    evaluation takes (a warm-started policy's learned std can be far wider than the spread
    that still succeeds); the most likely actions and ``dvla sft``'s loss do not depend on
    it. ``dvla eval --sample`` samples at the run's temperature."""
    options: dict[str, Any] = field(default_factory=dict)
    """The policy's own ``Config`` (tiny_vla: ``hidden_dim, vision_channels, embed_dim,
    vocab_size, max_tokens, head (bins|gaussian|flow), n_bins, flow_steps, init_log_std,
    value_head``; token_vla: ``size (tiny|0.5b|7b), vision, lm, n_bins, decoding, tokenizer,
    max_tokens, pretrained_path, lora_rank, lora_alpha, lora_targets, value_head, cameras``;
    pi0_vla: ``size (tiny|3b), vision, lm, expert, flow_steps, init_log_sigma, tokenizer,
    max_tokens, pretrained_path, lora_rank, lora_alpha, lora_targets, lora_expert, value_head,
    cameras``)."""
    init: str | None = None
    """Start from trained weights (e.g. an SFT run's): a run directory (its newest weights:
    ``weights.safetensors`` or its newest checkpoint, whichever is newer; a base directory
    means its ``latest`` run) or a ``.safetensors`` file. Loaded into the freshly built
    policy before the first update, so GRPO's KL reference (``algo.kl_coef``) is this policy.
    The policy name recorded with the weights must be ``name``, and every tensor must fit the
    policy as ``options`` build it (a one-line error otherwise). Read on rank 0; the other
    ranks receive its weights. ``--resume`` continues from the run's checkpoint and does not
    read it; null: the policy's own initialisation."""

    def _validate(self) -> list[tuple[str, str]]:
        if self.init is not None and not self.init.strip():
            return [("init", "an empty path; give a run directory or a .safetensors file, or null")]
        return []
