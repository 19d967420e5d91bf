"""``dvla record``: run a trained policy (a run directory) or a scripted expert in an env and
write the episodes as a LeRobot v3.0 dataset (:mod:`dvla.datasets.lerobot_format`).

    dvla record RUN_DIR [KEY=VALUE ...] --episodes N --out DIR        the run's policy, its env
    dvla record --expert NAME --preset P [KEY=VALUE ...] --episodes N --out DIR

Every action is its own frame: a policy's chunk of K actions is executed one action at a time,
each on the observation before it (what a dataset of (frame, action) pairs needs; the policy
still decides every K actions). ``--success-only`` keeps successful episodes, collecting until
there are N (at most ``--max-tries`` episodes in all).

Experts register with :func:`register_expert` (``fn(env) -> actor``, the actor has
``reset()`` and ``act(obs) -> (B, K, D)`` actions); built in: ``fast_reach`` (straight to
the goal) and ``libero`` (:mod:`dvla.envs.libero_expert`'s pick-and-place expert).
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from dvla.datasets.core import DatasetError, Episode
from dvla.datasets.lerobot_format import LeRobotWriter
from dvla.types import MAIN_CAMERA

EXPERTS: dict[str, Callable] = {}
EXPERT_ENVS: dict[str, tuple[str, ...]] = {}  # the envs an expert drives (checked before one is built)
FPS = {"libero": 20}  # control steps per second (LIBERO: robosuite's control_freq); others: 10
LIBERO_STATE = ["x", "y", "z", "axis_angle_x", "axis_angle_y", "axis_angle_z", "gripper_left", "gripper_right"]
LIBERO_ACTION = ["dx", "dy", "dz", "drot_x", "drot_y", "drot_z", "gripper"]


def register_expert(name: str, envs: tuple[str, ...] = ()):
    """Register ``fn(env) -> actor`` as expert ``name``; ``envs``: the env names it drives
    (empty: any)."""
    def deco(fn):
        EXPERTS[name], EXPERT_ENVS[name] = fn, tuple(envs)
        return fn
    return deco


class FastReachExpert:
    """Straight at the goal as fast as ``max_delta`` allows (reads the env's goal: privileged)."""

    def __init__(self, env):
        self.env = env

    def reset(self) -> None:
        pass

    def act(self, obs) -> torch.Tensor:
        e = self.env
        step = e.max_delta / e.slowness[:, None]
        return ((e.goal - e.pos) / step).clamp(-1.0, 1.0).unsqueeze(1)


@register_expert("fast_reach", envs=("fast_reach",))
def _fast_reach(env):
    return FastReachExpert(env)


@register_expert("libero", envs=("libero",))
def _libero(env):
    try:
        from dvla.envs.libero_expert import LiberoExpert
    except ImportError as exc:
        raise DatasetError(f"--expert libero: dvla.envs.libero_expert is not available ({exc})") from None

    class Actor:
        def __init__(self):
            self.expert = LiberoExpert(env)

        def reset(self):
            self.expert.reset()

        def act(self, obs):
            return self.expert.act()

    return Actor()


class PolicyActor:
    def __init__(self, policy, deterministic: bool = True, generator: torch.Generator | None = None):
        self.policy, self.deterministic, self.generator = policy, deterministic, generator

    def reset(self) -> None:
        pass

    def act(self, obs) -> torch.Tensor:
        return self.policy.act(obs, self.deterministic, self.generator).actions


def record_batch(env, actor, max_steps: int) -> list[Episode]:
    """One episode in every env of ``env``, one action per frame, until each ended or
    ``max_steps`` actions: the episodes in env order."""
    obs = env.reset()
    actor.reset()
    b = env.n_envs
    steps: list[tuple] = []
    live_at: list[torch.Tensor] = []
    success = torch.zeros(b, dtype=torch.bool)
    chunk, k = None, 0
    while len(steps) < max_steps and not bool(env.done.all()):
        if chunk is None or k == chunk.shape[1]:
            chunk, k = actor.act(obs).detach().float().cpu(), 0
        action = chunk[:, k:k + 1].clamp(-1.0, 1.0)  # what the env applies
        k += 1
        live_at.append((~env.done).cpu())
        images = {n: v.detach().cpu().permute(0, 2, 3, 1).numpy() for n, v in obs.images.items()}
        res = env.step(action)
        success |= res.success.cpu()
        steps.append((images, obs.proprio.detach().cpu().float().numpy(), action[:, 0].numpy(),
                      res.reward.detach().cpu().numpy(), list(obs.instruction or [""] * b)))
        obs = res.obs
    lengths = torch.stack(live_at).sum(0).tolist()
    episodes = []
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        episodes.append(Episode(
            images={c: np.stack([s[0][c][i] for s in steps[:n]]) for c in steps[0][0]},
            proprio=np.stack([s[1][i] for s in steps[:n]]), actions=np.stack([s[2][i] for s in steps[:n]]),
            instruction=steps[0][4][i], success=bool(success[i]),
            rewards=np.array([s[3][i] for s in steps[:n]], np.float32)))
    return episodes


def record(env, actor, out, episodes: int, max_steps: int, fps: float, success_only: bool = False,
           max_tries: int | None = None, log=print, **writer_kwargs) -> dict:
    """Record ``episodes`` episodes of ``actor`` in ``env`` into a new dataset at ``out``."""
    spec = env.spec
    cams = {MAIN_CAMERA: spec.image_shape, **dict(spec.cameras)}
    writer = LeRobotWriter(out, fps, {n: (h, w, c) for n, (c, h, w) in cams.items()}, spec.proprio_dim,
                           spec.action_dim, **writer_kwargs)
    max_tries = max_tries or (10 * episodes if success_only else episodes)
    kept = tried = successes = 0
    start = time.perf_counter()
    while kept < episodes and tried < max_tries:
        for ep in record_batch(env, actor, max_steps):
            tried += 1
            successes += bool(ep.success)
            if kept < episodes and (ep.success or not success_only):
                writer.add(ep)
                kept += 1
        log(f"dvla record: {kept}/{episodes} episodes kept, {successes}/{tried} succeeded "
            f"({time.perf_counter() - start:.0f} s)")
    if kept < episodes:
        if writer.episodes:
            writer.close()
        raise DatasetError(f"dvla record: {kept} of {episodes} episodes after {tried} tries ({successes} "
                           f"succeeded); the {kept} are in {out}")
    return writer.close()
