"""Data types that travel between environments, policies and learners.

Shapes use ``B`` for the batch of environments, ``T`` for decisions in time, ``K`` for
the action chunk and ``D`` for action dimensions. Everything is a plain tensor (or a
list of strings for instructions) so that a batch can be flattened to a dict of
tensors and sent over the data plane without pickling.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Observation:
    """One batched observation.

    image: ``(B, C, H, W)`` uint8 RGB of the main camera.
    proprio: ``(B, P)`` float32 proprioceptive state (joint positions, gripper, ...).
    instruction: ``B`` natural-language instructions (kept after tokenisation).
    instruction_ids: ``(B, L)`` int64 token ids, right-padded; filled by ``VLAPolicy.prepare``.
    instruction_mask: ``(B, L)`` bool, true on real tokens; filled with the ids.
    cameras: further named cameras (e.g. ``wrist``), each ``(B, C, H', W')`` uint8 with its own
    size, as the env spec declares (``EnvSpec.cameras``).
    """

    image: Tensor
    proprio: Tensor
    instruction: list[str] | None = None
    instruction_ids: Tensor | None = None
    instruction_mask: Tensor | None = None
    cameras: dict[str, Tensor] = field(default_factory=dict)

    @property
    def images(self) -> dict[str, Tensor]:
        """Every camera by name, the main one as ``image``."""
        return {MAIN_CAMERA: self.image, **self.cameras}

    @property
    def batch_size(self) -> int:
        return self.proprio.shape[0]

    def to(self, device: torch.device | str) -> "Observation":
        """This observation on ``device`` (itself when every tensor is there already)."""
        device = torch.device(device)
        if self.image.device == device and self.proprio.device == device and all(
                t is None or t.device == device for t in (self.instruction_ids, self.instruction_mask,
                                                          *self.cameras.values())):
            return self
        return Observation(
            image=self.image.to(device, non_blocking=True),
            proprio=self.proprio.to(device, non_blocking=True),
            instruction=self.instruction,
            instruction_ids=None
            if self.instruction_ids is None
            else self.instruction_ids.to(device, non_blocking=True),
            instruction_mask=None
            if self.instruction_mask is None
            else self.instruction_mask.to(device, non_blocking=True),
            cameras={k: v.to(device, non_blocking=True) for k, v in self.cameras.items()},
        )


def cat_observations(obs: list[Observation], empty=None) -> Observation:
    """One observation batch from several (rows in order). ``empty(shape, dtype)``: where
    the joined tensors go (a pool lease's, say); default: fresh tensors."""
    if len(obs) == 1:
        return obs[0]

    def cat(ts):
        if empty is None:
            return torch.cat(ts)
        return torch.cat(ts, out=empty((sum(t.shape[0] for t in ts), *ts[0].shape[1:]), ts[0].dtype))

    def opt(name):
        ts = [getattr(o, name) for o in obs]
        return None if any(t is None for t in ts) else cat(ts)

    texts = None if any(o.instruction is None for o in obs) else [t for o in obs for t in o.instruction]
    return Observation(image=cat([o.image for o in obs]), proprio=cat([o.proprio for o in obs]), instruction=texts,
                       instruction_ids=opt("instruction_ids"), instruction_mask=opt("instruction_mask"),
                       cameras={k: cat([o.cameras[k] for o in obs]) for k in obs[0].cameras})


def observation_rows(obs: Observation, rows: Tensor) -> Observation:
    """The rows ``rows`` (an index tensor) of a batched observation."""
    def pick(t):
        return None if t is None else t[rows.to(t.device)]

    texts = None if obs.instruction is None else [obs.instruction[i] for i in rows.tolist()]
    return Observation(image=pick(obs.image), proprio=pick(obs.proprio), instruction=texts,
                       instruction_ids=pick(obs.instruction_ids), instruction_mask=pick(obs.instruction_mask),
                       cameras={k: pick(v) for k, v in obs.cameras.items()})


@dataclass
class StepResult:
    """What ``BatchedEnv.step`` returns. ``obs`` is the observation after the step."""

    obs: Observation
    reward: Tensor  # (B,) float32
    terminated: Tensor  # (B,) bool: success or failure, no bootstrap
    truncated: Tensor  # (B,) bool: time limit, bootstrap from value
    success: Tensor  # (B,) bool
    executed: Tensor | None = None  # (B,) int64: actions of the chunk applied while the episode ran
    reset: Tensor | None = None  # (B,) bool: envs on their own clock that started a new episode in this step
    final_obs: Observation | None = None  # those envs' observations before the reset (when asked for)


@dataclass
class RolloutBatch:
    """A batch of episodes collected by one policy replica, time-major.

    Every step records the ``policy_version`` of the weights that chose its action, so
    a learner can measure (and correct for) staleness. ``valid`` masks the steps
    after an episode ended (episodes of one batch start together and are padded to
    ``T`` decisions, which is what GRPO's groups need).

    A column holds one episode, except with PPO segments (``swimlane.segment_len``): then it
    holds ``T`` consecutive decisions of one env, across its resets, and may start or end
    inside an episode. ``values[T]`` bootstraps a column cut inside an episode;
    ``bootstrap`` a truncation inside the column; ``episode_sums`` counts the episodes that
    ended in it (``success`` says whether any of them reached the goal).
    """

    image: Tensor  # (T, B, C, H, W) uint8
    proprio: Tensor  # (T, B, P) float32
    instruction_ids: Tensor  # (B, L) int64, constant within an episode
    instruction_mask: Tensor  # (B, L) bool, true on real tokens
    actions: Tensor  # (T, B, K, D) float32
    log_probs: Tensor  # (T, B) float32, behaviour policy
    values: Tensor  # (T + 1, B) float32 (zeros if the policy has no value head)
    rewards: Tensor  # (T, B) float32
    terminated: Tensor  # (T, B) bool
    truncated: Tensor  # (T, B) bool
    valid: Tensor  # (T, B) bool
    policy_version: Tensor  # (T, B) int64
    success: Tensor  # (B,) bool, episode reached the goal
    group_ids: Tensor  # (B,) int64, episodes with equal ids share an initial state
    action_valid: Tensor  # (T, B, K) bool: the chunk's actions the env applied before the episode ended
    action_log_probs: Tensor  # (T, B, K, D) float32: behaviour log-prob per action dimension (masked; 0 when the
    # head does not factorise per dimension)
    bootstrap: Tensor  # (T, B) float32: at a truncated step, the value of the episode's last observation (what
    # GAE bootstraps from: values[t + 1] may belong to the next episode of the column); 0 elsewhere
    episode_sums: Tensor  # (B, 4) float32: over the episodes that ended in the column, [count, successes,
    # return, decisions] (episode statistics stay exact when a column holds several episodes or part of one)
    cameras: dict[str, Tensor] = field(default_factory=dict)  # name -> (T, B, C, H, W) uint8: the further
    # cameras the policy uses (VLAPolicy.cameras_used)
    extras: dict[str, Tensor] = field(default_factory=dict)
    """What the policy's head recorded beside each action (``(T, B, ...)`` per name, as
    :meth:`dvla.policy.VLAPolicy.rollout_extras` declares): sampled action tokens, a
    denoising chain. The learner hands them back to the head, which scores exactly what
    was sampled."""

    @property
    def num_steps(self) -> int:
        return self.rewards.shape[0]

    @property
    def num_envs(self) -> int:
        return self.rewards.shape[1]

    def episode_returns(self) -> Tensor:
        return (self.rewards * self.valid).sum(0)

    def to_dict(self) -> dict[str, Tensor]:
        """Every tensor by name, cameras as ``cameras.<name>`` and extras as ``extras.<name>``
        (how a chunk travels)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in NESTED}
        for field_name, prefix in NESTED.items():
            out.update({prefix + k: v for k, v in getattr(self, field_name).items()})
        return out

    @classmethod
    def from_dict(cls, tensors: dict[str, Tensor]) -> "RolloutBatch":
        """The inverse of :meth:`to_dict` (no checks: see ``swimlane.lanes.chunks.batch_from_tensors``)."""
        plain = {k: v for k, v in tensors.items() if not any(k.startswith(p) for p in NESTED.values())}
        nested = {name: {k[len(p):]: v for k, v in tensors.items() if k.startswith(p)} for name, p in NESTED.items()}
        return cls(**plain, **nested)

    def to(self, device: torch.device | str) -> "RolloutBatch":
        return RolloutBatch.from_dict({k: v.to(device) for k, v in self.to_dict().items()})


MAIN_CAMERA = "image"
EXTRAS_PREFIX = "extras."
CAMERAS_PREFIX = "cameras."
NESTED = {"cameras": CAMERAS_PREFIX, "extras": EXTRAS_PREFIX}
