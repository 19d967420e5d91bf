"""Episode collection: run one policy replica on a batched env and record a RolloutBatch.

:class:`EpisodeRecorder` holds the bookkeeping of one batch of episodes (buffers,
latched ``done``, masks); :func:`collect_episodes` drives it in a plain loop (tests,
:func:`evaluate`), the swimlane's sampling lane drives it step by step with actions that
come from the inference lane.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from dvla.envs.base import BatchedEnv
from dvla.rollout.episodes import rollout_fields
from dvla.policy import ActOutput, ExtraSpec, VLAPolicy
from dvla.types import CAMERAS_PREFIX, EXTRAS_PREFIX, Observation, RolloutBatch, StepResult
from memory import runtime

PER_EPISODE = ("instruction_ids", "instruction_mask", "success", "group_ids", "episode_sums")  # set by start, build


@dataclass
class RolloutTimes:
    sim_s: float = 0.0
    infer_s: float = 0.0
    env_steps: int = 0  # decisions x n_envs actually simulated


def _copy(dst: Tensor, src: Tensor) -> None:
    dst.copy_(src)


class EpisodeRecorder:
    """Records one batch of ``B`` episodes of at most ``episode_len`` decisions.

    Call :meth:`start` with the reset observation (instruction ids filled), then
    :meth:`record` after every env step until :attr:`finished`, then :meth:`build`
    (with the bootstrap value of the last observation, if the policy has a value head).
    """

    def __init__(self, env: BatchedEnv, action_chunk: int, episode_len: int,
                 alloc: Callable[[tuple[int, ...], torch.dtype], Tensor] | None = None,
                 extras: dict[str, ExtraSpec] | None = None, cameras: dict[str, tuple[int, ...]] | None = None,
                 async_copies: bool | None = None):
        """``alloc(shape, dtype)`` provides the buffers (e.g. a transient-pool lease's
        ``empty``); they are zeroed here. Default: plain ``torch.empty``. ``extras``: what
        the policy records beside its actions (:meth:`VLAPolicy.rollout_extras`); ``cameras``:
        the further cameras it reads, name -> (C, H, W) (:attr:`VLAPolicy.cameras_used`);
        ``async_copies``: the buffers are pinned host memory that device copies fill without
        waiting (the host pool of a GPU run; default: whether they are pinned)."""
        self.b = env.n_envs
        self.t_len = episode_len
        t_len, b = episode_len, self.b
        alloc = alloc or (lambda shape, dtype: torch.empty(shape, dtype=dtype))

        fields = rollout_fields(env.spec, action_chunk, t_len, b, 0, extras, cameras)
        bufs = {name: alloc(shape, dtype).zero_() for name, (shape, dtype) in fields.items() if name not in PER_EPISODE}
        for name, buf in bufs.items():
            if "." not in name:
                setattr(self, name, buf)
        self.extras = {k[len(EXTRAS_PREFIX):]: v for k, v in bufs.items() if k.startswith(EXTRAS_PREFIX)}
        self.cameras = {k[len(CAMERAS_PREFIX):]: v for k, v in bufs.items() if k.startswith(CAMERAS_PREFIX)}
        self.done = torch.zeros(b, dtype=torch.bool)
        self.success = torch.zeros(b, dtype=torch.bool)
        self.rt = runtime.for_device(getattr(env, "device", "cpu"))  # (the env's: its outputs come from there)
        # pinned buffers take device copies without waiting
        self.async_copies = self.image.is_pinned() if async_copies is None else async_copies
        self._all_done: Tensor | None = None  # pinned host flag: every episode over (GPU envs)
        self._all_done_at = None  # CUDA event of the newest copy into _all_done
        self.t = 0
        self.ids: Tensor | None = None
        self.mask: Tensor | None = None
        self.obs: Observation | None = None
        self._k_range: Tensor | None = None

    def start(self, obs: Observation) -> None:
        """``obs``: the reset observation with ``instruction_ids`` (and mask) filled."""
        self.ids, self.mask = obs.instruction_ids, obs.instruction_mask
        if self.mask is None:
            raise ValueError("EpisodeRecorder.start needs a prepared observation (instruction ids and mask)")
        self.obs = obs

    @property
    def finished(self) -> bool:
        """Every episode has ended (or the batch is full). On a GPU the all-done flag is the
        newest one already back on the host: the batch may take one step more (its envs all
        done, every step of it invalid) rather than wait for the device."""
        if self.t >= self.t_len:
            return True
        if not self.done.is_cuda:
            return bool(self.done.all())
        return self._all_done_at is not None and self.rt.event_done(self._all_done_at) and bool(self._all_done)

    def record(self, out: ActOutput, res: StepResult, version: int) -> Observation:
        """Store the decision taken in the current observation and its outcome; returns
        the next observation (instruction ids reused: constant within an episode).

        Tensors on a GPU are copied into the buffers without waiting when the buffers are
        pinned (the host pool on a CUDA run), and the episodes' done flags stay on the env's
        device: a step never waits for the GPU (see :attr:`finished`, :meth:`build`)."""
        t, obs = self.t, self.obs
        cp = self.rt.copy_async if self.async_copies else _copy
        dev = res.reward.device
        if self.done.device != dev:  # the flags live where the env's outputs do
            self.done, self.success = self.done.to(dev), self.success.to(dev)
        cp(self.image[t], obs.image)
        cp(self.proprio[t], obs.proprio)
        for k, buf in self.cameras.items():
            cp(buf[t], obs.cameras[k])
        live = ~self.done
        cp(self.valid[t], live)
        cp(self.actions[t], out.actions)
        k = out.actions.shape[1]
        if res.executed is None:  # every action of the chunk applied in the envs still running
            mask = live.unsqueeze(1).expand(self.b, k)
        else:
            mask = (self._arange(k, dev) < res.executed.to(dev).unsqueeze(1)) & live.unsqueeze(1)  # (B, K)
        cp(self.action_valid[t], mask)
        if out.log_prob_elements is not None:  # the behaviour log-prob of what the env applied
            applied = mask.to(out.log_prob_elements.device, torch.float32).unsqueeze(-1)
            elements = out.log_prob_elements * applied
            cp(self.action_log_probs[t], elements)
            cp(self.log_probs[t], elements.sum(dim=(1, 2)))
        else:
            cp(self.log_probs[t], out.log_probs)
        cp(self.values[t], out.values)
        for k, buf in self.extras.items():
            cp(buf[t], out.extras[k])
        self.policy_version[t].fill_(version)
        terminated = res.terminated & live
        truncated = res.truncated & live
        if t == self.t_len - 1:
            truncated = truncated | (live & ~terminated)
        cp(self.rewards[t], res.reward * live)
        cp(self.terminated[t], terminated)
        cp(self.truncated[t], truncated)
        self.done |= terminated | truncated
        self.success |= res.success.to(dev)
        if self.done.is_cuda:  # all done? copied back without waiting, read once it has landed
            if self._all_done is None:
                self._all_done = self.rt.pinned_empty(1).view(torch.bool)[0]
            self.rt.copy_async(self._all_done, self.done.all())
            self._all_done_at = self.rt.record_event()
        self.t += 1
        o = res.obs  # (not dataclasses.replace: this runs every step)
        self.obs = Observation(image=o.image, proprio=o.proprio, instruction=o.instruction, instruction_ids=self.ids,
                               instruction_mask=self.mask, cameras=o.cameras)
        return self.obs

    def _arange(self, k: int, device) -> Tensor:
        """``arange(k)`` on ``device``, kept (a chunk's action indices)."""
        if self._k_range is None or self._k_range.shape[0] != k or self._k_range.device != device:
            self._k_range = torch.arange(k, device=device)
        return self._k_range

    def build(self, group_ids: Tensor, last_value: Tensor | None = None) -> RolloutBatch:
        """The recorded batch; ``last_value`` bootstraps the value after the last step. Waits
        for the copies still in flight (a GPU rollout's)."""
        if last_value is not None:
            (self.rt.copy_async if self.async_copies else _copy)(self.values[self.t], last_value)
        if self.done.is_cuda or self.async_copies:
            self.rt.synchronize()  # the copies this thread queued (on its own device: memory/runtime.py)
        # Every column is one episode, ended by its last valid step (truncated at the latest).
        torch.mul(self.values[1:], self.truncated, out=self.bootstrap)
        success = self.success.cpu()
        valid = self.valid.cpu()
        sums = torch.stack([torch.ones(self.b), success.float(), (self.rewards.cpu() * valid).sum(0),
                            valid.sum(0).float()], dim=1)
        return RolloutBatch(
            image=self.image, proprio=self.proprio, instruction_ids=self.ids.cpu(),
            instruction_mask=self.mask.cpu(), actions=self.actions,
            log_probs=self.log_probs, values=self.values, rewards=self.rewards, terminated=self.terminated,
            truncated=self.truncated, valid=self.valid, policy_version=self.policy_version,
            success=success, group_ids=group_ids, action_valid=self.action_valid,
            action_log_probs=self.action_log_probs, bootstrap=self.bootstrap, episode_sums=sums,
            cameras=dict(self.cameras), extras=dict(self.extras),
        )


def cameras_of(policy: VLAPolicy) -> dict[str, tuple[int, ...]]:
    """The further cameras ``policy`` reads, name -> (C, H, W), as the trajectories store them."""
    shapes = dict(policy.spec.cameras)
    unknown = [c for c in policy.cameras_used if c not in shapes]
    if unknown:
        raise ValueError(f"{type(policy).__qualname__} reads cameras {unknown}; the env has "
                         f"{sorted(shapes) or 'none besides the main one'}")
    return {c: tuple(shapes[c]) for c in policy.cameras_used}


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
    deterministic: bool = False,
) -> RolloutBatch:
    """Reset ``env`` and run every env for at most ``episode_len`` decisions.

    Episodes that end early are masked (``valid``) for the rest of the batch; the
    collection stops as soon as all have ended. ``group_offset`` makes group ids
    unique across batches and ranks. ``deterministic``: the policy's most likely actions
    rather than samples (evaluations).
    """
    times = times if times is not None else RolloutTimes()
    policy.eval()
    rec = EpisodeRecorder(env, policy.spec.action_chunk, episode_len, extras=policy.rollout_extras(),
                          cameras=cameras_of(policy))
    t0 = time.perf_counter()
    obs = env.reset(group_size)
    times.sim_s += time.perf_counter() - t0
    obs = policy.prepare(obs)
    rec.start(obs)
    while not rec.finished:
        t0 = time.perf_counter()
        out = policy.act(obs, deterministic, generator)
        t1 = time.perf_counter()
        res = env.step(out.actions)
        t2 = time.perf_counter()
        times.infer_s += t1 - t0
        times.sim_s += t2 - t1
        times.env_steps += env.n_envs
        obs = rec.record(out, res, policy_version)
    last_value = None
    if policy.has_value_head:
        # Value of the observation after the last executed step (bootstraps truncation).
        t0 = time.perf_counter()
        last_value = policy.value(obs)
        times.infer_s += time.perf_counter() - t0
    return rec.build(torch.arange(env.n_envs) // group_size + group_offset, last_value)


EPISODE_TOTALS = ("episodes", "successes", "return_sum", "decisions_sum")  # RolloutBatch.episode_sums' columns


def episode_totals(batch: RolloutBatch) -> dict[str, float]:
    """The episodes that ended in a batch: their count and their successes, returns and
    decisions summed (add these over batches and ranks, then divide: :func:`episode_means`)."""
    return dict(zip(EPISODE_TOTALS, batch.episode_sums.double().sum(0).tolist()))


def episode_means(totals: dict[str, float]) -> dict[str, float]:
    """Success rate, mean return and mean length from :func:`episode_totals` (NaN, logged
    as missing, where no episode ended)."""
    n = totals["episodes"]
    per = (lambda x: x / n) if n > 0 else (lambda x: float("nan"))
    return {"episodes": n, "success_rate": per(totals["successes"]), "return_mean": per(totals["return_sum"]),
            "episode_len_mean": per(totals["decisions_sum"])}


def episode_stats(batch: RolloutBatch) -> dict[str, float]:
    """Success rate, mean return and mean length of the episodes that ended in a batch."""
    return episode_means(episode_totals(batch))


def evaluate(env: BatchedEnv, policy: VLAPolicy, episode_len: int, batches: int = 4, group_size: int = 1,
             generator: torch.Generator | None = None) -> dict[str, float]:
    """Success rate, mean return and length of ``policy`` over ``batches`` fresh batches of
    episodes on ``env`` (sampled actions, no learning), averaged."""
    stats = [episode_stats(collect_episodes(env, policy, episode_len, group_size, generator=generator))
             for _ in range(batches)]
    return {k: sum(s[k] for s in stats) / batches for k in stats[0]}
