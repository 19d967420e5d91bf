"""dvla: distributed, asynchronous reinforcement learning for Vision-Language-Action policies.

``dvla`` is the library a model author imports: :data:`__all__` is its surface (configs, the
policy API and its registry, observations and batches, envs, action distributions and heads,
the policy contract, presets). Its sub-packages hold the rest by concern: ``dvla.config``,
``dvla.models``, ``dvla.heads``, ``dvla.envs``, ``dvla.datasets``, ``dvla.algos``,
``dvla.contract``, ``dvla.rollout``, ``dvla.state``, ``dvla.distributed``, ``dvla.evaluation``;
the commands are the applications in ``dvla.app``, above the swimlane
(docs/architecture.md).
"""

import sys as _sys
from pathlib import Path as _Path

from dvla import _imports

try:  # before anything imports planes, memory or launch: another project's may shadow them
    _imports.check_top_level(_Path(__file__).resolve().parents[1])
except _imports.ShadowedPackageError:
    _sys.excepthook = _imports.one_line_hook(_sys.excepthook)
    raise
_imports.install()  # the modules' old names (dvla._imports.MOVED)

from dvla.config import AlgoConfig, ConfigError, EnvConfig, JobConfig, PolicyConfig, RunConfig  # noqa: E402
from dvla.policy import (  # noqa: E402
    POLICY_REGISTRY,
    ActOutput,
    EvalOutput,
    PolicyOutput,
    PolicySpec,
    VLAPolicy,
    build_policy,
    register_policy,
)
from dvla.types import Observation, RolloutBatch, StepResult  # noqa: E402

import dvla.models  # noqa: E402,F401  (registers the built-in policies; any dvla import runs this)

__version__ = "0.1.0"

# Names of the surface that live in heavier modules: imported on first use (``from dvla import
# make_env``), so that ``import dvla`` stays light.
_LAZY = {
    "BatchedEnv": "dvla.envs", "EnvSpec": "dvla.envs", "make_env": "dvla.envs", "env_spec": "dvla.envs",
    "register_env": "dvla.envs",
    "ActionDistribution": "dvla.distributions", "GaussianActionDistribution": "dvla.distributions",
    "BinnedActionDistribution": "dvla.distributions", "ExtraSpec": "dvla.distributions",
    "FlowMatchingHead": "dvla.heads.flow", "MLPVelocity": "dvla.heads.flow", "TokenActionHead": "dvla.heads.tokens",
    "check_policy": "dvla.contract", "assert_policy_contract": "dvla.contract",
    "Normalizer": "dvla.normalize", "HashTokenizer": "dvla.tokenizers",
    "get_preset": "dvla.config.presets", "apply_overrides": "dvla.config",
}

__all__ = [
    "AlgoConfig", "ConfigError", "EnvConfig", "JobConfig", "PolicyConfig", "RunConfig",
    "POLICY_REGISTRY", "ActOutput", "EvalOutput", "PolicyOutput", "PolicySpec", "VLAPolicy",
    "build_policy", "register_policy", "Observation", "RolloutBatch", "StepResult", *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dvla' has no attribute {name!r}")
