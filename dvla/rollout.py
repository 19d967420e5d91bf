"""Episode collection: run one policy replica on a batched env and record a RolloutBatch."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from dvla.envs.base import BatchedEnv
from dvla.policy import VLAPolicy
from dvla.types import RolloutBatch


@dataclass
class RolloutTimes:
    sim_s: float = 0.0
    infer_s: float = 0.0
    env_steps: int = 0  # decisions x n_envs actually simulated


@torch.no_grad()
def collect_episodes(
    env: BatchedEnv,
    policy: VLAPolicy,
    episode_len: int,
    group_size: int = 1,
    policy_version: int = 0,
    group_offset: int = 0,
    generator: torch.Generator | None = None,
    times: RolloutTimes | None = None,
) -> RolloutBatch:
    """Reset ``env`` and run every env for at most ``episode_len`` decisions.

    Episodes that end early are masked (``valid``) for the rest of the batch; the
    collection stops as soon as all have ended. ``group_offset`` makes group ids
    unique across batches and ranks.
    """
    times = times if times is not None else RolloutTimes()
    policy.eval()
    b = env.n_envs
    k = policy.spec.action_chunk
    d = env.spec.action_dim
    t_len = episode_len

    t0 = time.perf_counter()
    obs = env.reset(group_size)
    times.sim_s += time.perf_counter() - t0
    obs = policy.prepare(obs)
    ids_dev = obs.instruction_ids
    ids = ids_dev.cpu()

    image = torch.zeros(t_len, b, *env.spec.image_shape, dtype=torch.uint8)
    proprio = torch.zeros(t_len, b, env.spec.proprio_dim)
    actions = torch.zeros(t_len, b, k, d)
    log_probs = torch.zeros(t_len, b)
    values = torch.zeros(t_len + 1, b)
    rewards = torch.zeros(t_len, b)
    terminated = torch.zeros(t_len, b, dtype=torch.bool)
    truncated = torch.zeros(t_len, b, dtype=torch.bool)
    valid = torch.zeros(t_len, b, dtype=torch.bool)
    done = torch.zeros(b, dtype=torch.bool)
    success = torch.zeros(b, dtype=torch.bool)

    for t in range(t_len):
        image[t] = obs.image.cpu()
        proprio[t] = obs.proprio.cpu()
        t0 = time.perf_counter()
        out = policy.act(obs, generator=generator)
        t1 = time.perf_counter()
        res = env.step(out.actions)
        t2 = time.perf_counter()
        times.infer_s += t1 - t0
        times.sim_s += t2 - t1
        times.env_steps += b
        live = ~done
        valid[t] = live
        actions[t] = out.actions.cpu()
        log_probs[t] = out.log_probs.cpu()
        values[t] = out.values.cpu()
        rewards[t] = res.reward.cpu() * live
        terminated[t] = res.terminated.cpu() & live
        truncated[t] = res.truncated.cpu() & live
        if t == t_len - 1:
            truncated[t] |= live & ~terminated[t]
        done |= terminated[t] | truncated[t]
        success |= res.success.cpu()
        # Instructions are constant within an episode: reuse the ids, skip tokenising.
        obs = dataclasses.replace(res.obs, instruction_ids=ids_dev)
        if bool(done.all()):
            break
    if policy.has_value_head:
        # Value of the observation after the last executed step (bootstraps truncation).
        t0 = time.perf_counter()
        values[t + 1] = policy.value(obs).cpu()
        times.infer_s += time.perf_counter() - t0

    groups = torch.arange(b) // group_size + group_offset
    return RolloutBatch(
        image=image,
        proprio=proprio,
        instruction_ids=ids,
        actions=actions,
        log_probs=log_probs,
        values=values,
        rewards=rewards,
        terminated=terminated,
        truncated=truncated,
        valid=valid,
        policy_version=torch.full((t_len, b), policy_version, dtype=torch.long),
        success=success,
        group_ids=groups,
    )
