"""Job configuration: nested keyword-only dataclasses with validation.

Every component owns a small ``@dataclass(kw_only=True)`` config, one module per section
(:mod:`~dvla.config.env`, :mod:`~dvla.config.policy`, :mod:`~dvla.config.algo`,
:mod:`~dvla.config.run`, :mod:`~dvla.config.swimlane`; ``memory`` and ``data_plane`` are
owned by their packages). The top-level :class:`JobConfig` (:mod:`~dvla.config.job`) nests
them. A config is built from a Python preset (:mod:`dvla.config.presets`), optionally merged with
a YAML file and command-line overrides of the form ``env.n_envs=8`` (or ``--env.n_envs=8``)
(:mod:`~dvla.config.loading`).

One rule (:mod:`~dvla.config.rules`) checks every field of every section: its type, and
for a number its range declared in the field's metadata (``bounded(16, ge=1)``) and that
it is finite; each section's ``_validate`` adds the rules that relate several fields.
Errors are raised as :class:`ConfigError` and always name the offending field by its dotted
path, the value that was given and what is allowed.
"""

from dvla.config.algo import AlgoConfig
from dvla.config.env import EnvConfig
from dvla.config.errors import ConfigError
from dvla.config.job import JobConfig
from dvla.config.loading import apply_overrides, dump_yaml, from_dict, load_yaml, merge, parse_override
from dvla.config.policy import PolicyConfig
from dvla.config.rules import (BOUND_KEYS, _collect_errors, _describe, _type_ok, bounded, bounds, describe_range,
                               is_numeric, range_error, validate)
from dvla.config.run import RunConfig
from dvla.config.swimlane import SwimlaneConfig
from memory.config import MemoryConfig
from planes.config import DataPlaneConfig

__all__ = [
    "AlgoConfig", "BOUND_KEYS", "ConfigError", "DataPlaneConfig", "EnvConfig", "JobConfig", "MemoryConfig",
    "PolicyConfig", "RunConfig", "SwimlaneConfig", "apply_overrides", "bounded", "bounds", "describe_range",
    "dump_yaml", "from_dict", "is_numeric", "load_yaml", "merge", "parse_override", "range_error", "validate",
]
