"""The batched environment's section of the job configuration (``env.*``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dvla.config.rules import bounded


@dataclass(kw_only=True)
class EnvConfig:
    """Batched environment. ``name`` picks a registered env (see ``dvla.envs.ENV_REGISTRY``)."""

    name: str = "fast_reach"
    """A registered env: ``fast_reach``, ``genesis_reach``, ``genesis_lift``, ``gym``, ``libero``."""
    n_envs: int = bounded(16, ge=1)
    """Parallel environments stepped as one batch (for GRPO: ``n_groups * group_size``)."""
    episode_len: int = bounded(32, ge=1)
    """Policy decisions per episode (each decision executes one action chunk)."""
    image_size: int = bounded(64, ge=8, le=1024)
    """Square camera resolution in pixels."""
    render: bool = True
    """Produce camera images. When false, images are all zeros (state-only experiments)."""
    reward_shaping: float = bounded(0.0, ge=0, le=1e6)
    """Weight of the dense shaping term (progress towards the goal); 0 gives the sparse reward."""
    success_reward: float = bounded(1.0, ge=0, le=1e6)
    """Reward on the step that reaches the goal."""
    options: dict[str, Any] = field(default_factory=dict)
    """Backend-specific options, declared by the env with their types and bounds and checked
    by it (``dvla.envs.options``); the rows ``env.options.<name> (<env>)`` below list them."""
    rank_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Options of single ranks over ``options``, keyed by global rank (``"2": {render_cost_ms:
    12}``): a heterogeneous cluster, or one rank slowed down on purpose (tests, benches)."""

    def for_rank(self, rank: int) -> "EnvConfig":
        """This config as rank ``rank`` builds its envs (its ``rank_options`` applied)."""
        extra = self.rank_options.get(str(rank))
        return dataclasses.replace(self, options={**self.options, **extra}) if extra else self

    def _validate(self) -> list[tuple[str, str]]:
        errs = []
        bad = [k for k, v in self.rank_options.items() if not (k.isdigit() and isinstance(v, dict))]
        if bad:
            errs.append(("rank_options", f"keys are global ranks (\"0\", \"1\", ...) mapping to option dicts; "
                                         f"got {bad}"))
        return errs
