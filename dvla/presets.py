"""Typed Python presets. ``python -m dvla.launch --preset NAME`` starts from one of these.

* ``debug``: seconds on a CPU; the pure-torch env and a small model (tests use it).
* ``fast_reach``: learns the pure-torch reaching task in about a minute on a CPU.
* ``genesis_reach`` (the default): Franka Panda reaching in genesis-world, camera RGB.
* ``genesis_lift``: Franka Panda picks up a cube and lifts it.
"""

from __future__ import annotations

from typing import Callable

from dvla.config import AlgoConfig, ConfigError, EnvConfig, JobConfig, PolicyConfig, RunConfig


def debug() -> JobConfig:
    return JobConfig(
        env=EnvConfig(name="fast_reach", n_envs=8, episode_len=8, image_size=32),
        policy=PolicyConfig(
            name="tiny_vla",
            options={"hidden_dim": 32, "vision_channels": 8, "embed_dim": 8, "n_bins": 21},
        ),
        algo=AlgoConfig(name="grpo", group_size=4, update_epochs=1, minibatches=2),
        run=RunConfig(iterations=3, out_dir="runs/debug", progress=False),
    )


def fast_reach() -> JobConfig:
    return JobConfig(
        # The goal position is also given as proprio ("privileged"): learning from pixels
        # alone works (env.options.privileged=false) but needs many more iterations.
        env=EnvConfig(name="fast_reach", n_envs=64, episode_len=12, image_size=32, reward_shaping=1.0,
                      options={"privileged": True}),
        policy=PolicyConfig(
            name="tiny_vla",
            options={"hidden_dim": 64, "vision_channels": 16, "embed_dim": 16, "n_bins": 21},
        ),
        algo=AlgoConfig(name="grpo", group_size=8, lr=1e-3, update_epochs=2, minibatches=4),
        run=RunConfig(iterations=40, out_dir="runs/fast_reach"),
    )


def genesis_reach() -> JobConfig:
    return JobConfig(
        env=EnvConfig(name="genesis_reach", n_envs=8, episode_len=20, image_size=64, reward_shaping=1.0),
        policy=PolicyConfig(name="tiny_vla", action_chunk=2, options={"n_bins": 64}),
        algo=AlgoConfig(name="grpo", group_size=4, lr=3e-4, update_epochs=2, minibatches=2),
        run=RunConfig(iterations=10, out_dir="runs/genesis_reach"),
    )


def genesis_lift() -> JobConfig:
    cfg = genesis_reach()
    cfg.env.name = "genesis_lift"
    cfg.env.episode_len = 30
    cfg.run.out_dir = "runs/genesis_lift"
    return cfg


PRESETS: dict[str, Callable[[], JobConfig]] = {
    "debug": debug,
    "fast_reach": fast_reach,
    "genesis_reach": genesis_reach,
    "genesis_lift": genesis_lift,
}
DEFAULT_PRESET = "genesis_reach"


def get_preset(name: str) -> JobConfig:
    if name not in PRESETS:
        raise ConfigError(f"--preset: unknown preset {name!r}; available: {', '.join(PRESETS)}")
    return PRESETS[name]()
