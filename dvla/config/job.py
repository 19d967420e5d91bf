"""The job's configuration: every section, composed, and the rules that relate sections.

The sections live in modules of their own (:mod:`dvla.config.env`, ``policy``, ``algo``,
``run``, ``swimlane``); the memory manager's and the data plane's belong to their packages
(:mod:`memory.config`, :mod:`planes.config`), which import nothing from ``dvla``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dvla.config.algo import AlgoConfig
from dvla.config.env import EnvConfig
from dvla.config.policy import PolicyConfig
from dvla.config.rules import validate
from dvla.config.run import RunConfig
from dvla.config.swimlane import SwimlaneConfig
from memory.config import MemoryConfig  # composed into JobConfig (memory owns it)
from planes.config import DataPlaneConfig  # composed into JobConfig (planes owns it)


@dataclass(kw_only=True)
class JobConfig:
    """Everything a training job needs."""

    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    run: RunConfig = field(default_factory=RunConfig)
    swimlane: SwimlaneConfig = field(default_factory=SwimlaneConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    data_plane: DataPlaneConfig = field(default_factory=lambda: DataPlaneConfig(send_hwm=1, recv_hwm=1))
    """Few chunks in flight by default: every buffered chunk is one that ages while it waits."""

    def _validate(self) -> list[tuple[str, str]]:
        errs = []
        if self.algo.name == "grpo" and self.env.n_envs % self.algo.group_size != 0:
            errs.append(
                (
                    "env.n_envs",
                    f"GRPO needs n_envs to be a multiple of algo.group_size "
                    f"({self.algo.group_size}), got {self.env.n_envs}",
                )
            )
        if self.swimlane.segment_len and self.algo.name != "ppo":
            errs.append(("swimlane.segment_len", f"segments need algo.name=ppo ({self.algo.name} learns from whole "
                                                 "episodes): set it to 0"))
        if self.algo.shard == "fsdp" and self.swimlane.roles == "adaptive":
            errs.append(("algo.shard", "swimlane.roles=adaptive averages gradients over the learners with samples, "
                                       "which FSDP's reduce-scatter cannot: set algo.shard=none (or auto)"))
        if self.algo.shard == "fsdp" and self.swimlane.learner_ranks < 2:
            errs.append(("algo.shard", "fsdp shards the learners over swimlane.learner_ranks, which is "
                                       f"{self.swimlane.learner_ranks}: set it to 2 or more, or algo.shard=none"))
        dp = self.data_plane
        if dp.curve_authorized_dir and not dp.curve_keys_dir:
            errs.append(("data_plane.curve_authorized_dir", "admits only listed client keys, and rollout ranks "
                                                            "without data_plane.curve_keys_dir make fresh ones: "
                                                            "set curve_keys_dir (dvla keys DIR --ranks N)"))
        return errs

    @property
    def chunk_len(self) -> int:
        """Decisions per chunk: ``swimlane.segment_len``, else ``env.episode_len``."""
        return self.swimlane.segment_len or self.env.episode_len

    @property
    def sharded_learners(self) -> bool:
        """Whether the learners are FSDP2-sharded (``algo.shard``, ``auto`` resolved)."""
        return self.algo.shard == "fsdp" or (self.algo.shard == "auto" and self.swimlane.learner_ranks > 1
                                             and self.swimlane.roles == "fixed")

    # Convenience wrappers -------------------------------------------------------------
    def validate(self) -> "JobConfig":
        validate(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
