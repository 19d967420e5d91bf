"""Typed Python presets. ``python -m dvla.launch --preset NAME`` starts from one of these.

* ``debug``: seconds on a CPU; the pure-torch env and a small model (tests use it).
* ``fast_reach``: learns the pure-torch reaching task in about a minute on a CPU.
* ``genesis_reach`` (the default): Franka Panda reaching in genesis-world, camera RGB; learns
  in about 3 minutes on two CPU cores.
* ``genesis_lift``: Franka Panda picks up a cube and lifts it.
* ``libero_spatial``, ``libero_10``: the LIBERO benchmark (extra ``[libero]``), one task
  (``env.options.task_ids`` picks others), TinyVLA on the agent view; ``libero_spatial_token``:
  the same with the transformer VLA (``token_vla``) on both cameras.
"""

from __future__ import annotations

from typing import Callable

from dvla.config import AlgoConfig, ConfigError, EnvConfig, JobConfig, PolicyConfig, RunConfig, apply_overrides, load_yaml


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
        # Camera RGB and the instruction go into the policy, and the goal also comes as
        # proprio ("privileged"), so that the job learns within minutes on two CPU cores
        # (README: success from about 0.05 to about 0.9 in 60 updates, under 3 minutes).
        # env.options.privileged=false leaves the goal to the pixels: far slower (one run of
        # 200 updates at 32 px: success 0.04 -> 0.17, mean of the first and last 20 updates).
        env=EnvConfig(name="genesis_reach", n_envs=64, episode_len=10, image_size=64, reward_shaping=1.0,
                      options={"privileged": True}),
        policy=PolicyConfig(
            name="tiny_vla",
            options={"hidden_dim": 64, "vision_channels": 16, "embed_dim": 16, "head": "gaussian",
                     "init_log_std": -1.0},
        ),
        algo=AlgoConfig(name="grpo", group_size=4, lr=1e-3, update_epochs=2, minibatches=4),
        # A guard for slow machines: stop (checkpoint, summary) after 9 minutes of training.
        run=RunConfig(iterations=60, out_dir="runs/genesis_reach", time_limit_s=540.0),
    )


def genesis_lift() -> JobConfig:
    cfg = genesis_reach()
    cfg.env.name = "genesis_lift"
    cfg.env.episode_len = 30
    cfg.run.out_dir = "runs/genesis_lift"
    return cfg


def libero_spatial(suite: str = "libero_spatial") -> JobConfig:
    from dvla.envs.libero_env import EVAL_STEPS  # (LIBERO itself is imported on build only)

    chunk = 4  # decisions of 4 actions: the suite's evaluation length in EVAL_STEPS / 4 decisions
    return JobConfig(
        # A 64 px camera renders at a few env steps/s per core on a CPU (llvmpipe); raise
        # env.image_size on a GPU machine. Two worker processes step the 8 envs. TinyVLA reads
        # the agent view only, so no wrist camera is rendered for it.
        env=EnvConfig(name="libero", n_envs=8, episode_len=-(-EVAL_STEPS[suite] // chunk), image_size=64,
                      options={"suite": suite, "task_ids": [0], "wrist_size": 0, "workers": 2}),
        policy=PolicyConfig(
            name="tiny_vla", action_chunk=chunk,
            options={"hidden_dim": 128, "vision_channels": 16, "embed_dim": 16, "head": "gaussian",
                     "init_log_std": -1.0},
        ),
        algo=AlgoConfig(name="grpo", group_size=4, lr=3e-4, update_epochs=2, minibatches=4),
        run=RunConfig(iterations=100, out_dir=f"runs/{suite}"),
    )


def libero_10() -> JobConfig:
    return libero_spatial("libero_10")


def libero_spatial_token() -> JobConfig:
    cfg = libero_spatial()
    cfg.env.options["wrist_size"] = 64  # it reads every camera the env has
    cfg.policy = PolicyConfig(name="token_vla", action_chunk=cfg.policy.action_chunk,
                              options={"size": "tiny", "decoding": "parallel"})
    cfg.run.out_dir = "runs/libero_spatial_token"
    return cfg


PRESETS: dict[str, Callable[[], JobConfig]] = {
    "debug": debug,
    "fast_reach": fast_reach,
    "genesis_reach": genesis_reach,
    "genesis_lift": genesis_lift,
    "libero_spatial": libero_spatial,
    "libero_10": libero_10,
    "libero_spatial_token": libero_spatial_token,
}
DEFAULT_PRESET = "genesis_reach"


def get_preset(name: str) -> JobConfig:
    if name not in PRESETS:
        raise ConfigError(f"--preset: unknown preset {name!r}; available: {', '.join(PRESETS)}")
    return PRESETS[name]()


def compose(preset: str, config_file: str | None, overrides: list[str], resume: bool = False) -> JobConfig:
    """A job's config as every command line builds it: the preset, the YAML file on top of it,
    then the ``KEY=VALUE`` overrides (and ``--resume``: ``run.resume``)."""
    cfg = get_preset(preset)
    if config_file:
        cfg = load_yaml(cfg, config_file)
    cfg = apply_overrides(cfg, overrides)
    if resume:
        cfg.run.resume = True
    return cfg
