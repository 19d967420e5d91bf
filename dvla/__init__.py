"""dvla: distributed, asynchronous reinforcement learning for Vision-Language-Action policies."""

from dvla.config import AlgoConfig, ConfigError, EnvConfig, JobConfig, PolicyConfig, RunConfig
from dvla.policy import (
    POLICY_REGISTRY,
    ActOutput,
    EvalOutput,
    PolicyOutput,
    PolicySpec,
    VLAPolicy,
    build_policy,
    register_policy,
)
from dvla.types import Observation, RolloutBatch, StepResult

import dvla.models  # noqa: E402,F401  (registers the built-in policies; any dvla import runs this)

__version__ = "0.1.0"

__all__ = [
    "AlgoConfig", "ConfigError", "EnvConfig", "JobConfig", "PolicyConfig", "RunConfig",
    "POLICY_REGISTRY", "ActOutput", "EvalOutput", "PolicyOutput", "PolicySpec", "VLAPolicy",
    "build_policy", "register_policy", "Observation", "RolloutBatch", "StepResult",
]
