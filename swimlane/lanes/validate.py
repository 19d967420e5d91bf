"""What the learner checks of every chunk before it learns from it.

A chunk comes from another process (or host): a bug, a broken simulator or a hostile peer
can send one that decodes fine (:func:`swimlane.lanes.chunks.batch_from_tensors` checks names,
dtypes and leading dims) and still crashes the learner or poisons its weights: a proprio
of the wrong width, an instruction id past the vocabulary, a NaN reward, a version newer
than the learner's (a negative lag turns ``algo.proximal=loglinear`` into NaN), or values
that are finite but absurd (a reward of 3e38 overflows the returns, and three non-finite
updates in a row stop the run). Rewards must lie in the env's declared
``EnvSpec.reward_range``; log-probs, values and returns within ``algo.max_abs_log_prob``,
``algo.max_abs_value`` and ``algo.max_abs_return`` (a return is bounded by the sum of a
chunk's absolute rewards plus its largest bootstrap value). Each is rejected with a reason
(:data:`REASONS`), counted, and never reaches the update; the learner's log names the
sender (``meta["rank"]``, checked against the connection by the data plane).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dvla.distributions import ExtraSpec
from dvla.envs.base import DEFAULT_REWARD_RANGE, EnvSpec
from dvla.rollout.episodes import rollout_fields
from dvla.rollout import cameras_of
from dvla.types import CAMERAS_PREFIX, EXTRAS_PREFIX, RolloutBatch
from swimlane.lanes.chunks import DTYPES

REASONS = ("shape", "instruction_ids", "non_finite", "range", "version", "extras", "episodes")
"""Why a chunk was rejected; the ledger counts ``rejected_<reason>``."""


@dataclass(frozen=True, kw_only=True)
class ChunkSpec:
    """The shapes and ranges of a legal chunk, from the job (env, policy, episode length)."""

    image_shape: tuple[int, int, int]  # (C, H, W)
    proprio_dim: int
    action_dim: int
    action_chunk: int
    n_envs: int  # episodes per chunk
    max_steps: int  # decisions per episode, at most
    vocab_size: int | None = None  # instruction ids lie in [0, vocab_size)
    max_tokens: int = 64  # instruction ids per episode, at most (for the size bound)
    extras: tuple[tuple[str, tuple[int, ...], torch.dtype, int | None], ...] = ()
    """(name, shape, dtype, high) of each of the policy's ``rollout_extras()``."""
    cameras: tuple[tuple[str, tuple[int, int, int]], ...] = ()
    """(name, (C, H, W)) of each further camera the policy reads."""
    reward_range: tuple[float, float] = DEFAULT_REWARD_RANGE
    """The env's declared reward range (``EnvSpec.reward_range``)."""
    max_abs_log_prob: float = 1e4
    """Bounds from the job (``algo.max_abs_log_prob``, ``max_abs_value``, ``max_abs_return``)."""
    max_abs_value: float = 1e6
    max_abs_return: float = 1e6

    @classmethod
    def for_policy(cls, policy, n_envs: int, episode_len: int, *, env_spec: EnvSpec | None = None,
                   algo=None) -> ChunkSpec:
        """``env_spec``: the env's spec (its reward range); ``algo``: the job's ``AlgoConfig``
        (value bounds). Either left out: the defaults."""
        s = policy.spec
        bounds = {}
        if env_spec is not None:
            bounds["reward_range"] = tuple(env_spec.reward_range)
        if algo is not None:
            bounds.update(max_abs_log_prob=algo.max_abs_log_prob, max_abs_value=algo.max_abs_value,
                          max_abs_return=algo.max_abs_return)
        return cls(**bounds, image_shape=tuple(s.image_shape), proprio_dim=s.proprio_dim, action_dim=s.action_dim,
                   action_chunk=s.action_chunk, n_envs=n_envs, max_steps=episode_len,
                   vocab_size=getattr(policy.tokenizer, "vocab_size", None),
                   max_tokens=getattr(policy.tokenizer, "max_len", 64),
                   extras=tuple((k, tuple(e.shape), e.dtype, e.high) for k, e in policy.rollout_extras().items()),
                   cameras=tuple(cameras_of(policy).items()))

    def shapes(self, t: int, max_tokens: int) -> dict[str, tuple[int, ...]]:
        env = EnvSpec(image_shape=self.image_shape, proprio_dim=self.proprio_dim, action_dim=self.action_dim)
        extras = {n: ExtraSpec(tuple(shape), dtype, high) for n, shape, dtype, high in self.extras}
        fields = rollout_fields(env, self.action_chunk, t, self.n_envs, max_tokens, extras, dict(self.cameras))
        return {name: shape for name, (shape, _) in fields.items()}

    def optional_fields(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The job's further chunk tensors, name -> (dtype, shape per step and env): the
        policy's cameras and rollout extras."""
        return {**{CAMERAS_PREFIX + n: (torch.uint8, tuple(shape)) for n, shape in self.cameras},
                **{EXTRAS_PREFIX + n: (d, tuple(shape)) for n, shape, d, _ in self.extras}}

    def dtype(self, name: str) -> torch.dtype:
        optional = self.optional_fields()
        return optional[name][0] if name in optional else DTYPES.get(name, torch.float32)

    def tensor_bytes(self) -> dict[str, int]:
        """Bytes of each tensor of the largest legal chunk (the data plane's dtypes)."""
        return {name: math.prod(shape) * self.dtype(name).itemsize
                for name, shape in self.shapes(self.max_steps, self.max_tokens).items()}

    def message_limits(self) -> tuple[int, int]:
        """``(max_message_bytes, max_frame_bytes)`` for the data plane: the largest legal
        chunk and its largest tensor, each plus an eighth and 64 KiB."""
        sizes = self.tensor_bytes()
        total, largest = sum(sizes.values()), max(sizes.values())
        return total + total // 8 + (64 << 10), largest + largest // 8 + (64 << 10)


def check_chunk(batch: RolloutBatch, spec: ChunkSpec, learner_version: int) -> tuple[str, str] | None:
    """``(reason, detail)`` when ``batch`` must not be learned from, else None."""
    t = batch.rewards.shape[0] if batch.rewards.dim() == 2 else -1
    if not 1 <= t <= spec.max_steps:
        return "shape", f"{t} steps, expected 1 to {spec.max_steps}"
    ids = batch.instruction_ids
    want = spec.shapes(t, ids.shape[1] if ids.dim() == 2 else -1)
    tensors = batch.to_dict()
    if tensors.keys() != want.keys():
        return "shape", f"tensors {sorted(tensors.keys() ^ want.keys())} unexpected or missing"
    for name, shape in want.items():
        got = tuple(tensors[name].shape)
        if got != shape:
            return "shape", f"{name} has shape {got}, expected {shape}"
    if ids.numel() and (int(ids.min()) < 0 or (spec.vocab_size is not None and int(ids.max()) >= spec.vocab_size)):
        return "instruction_ids", (f"ids in [{int(ids.min())}, {int(ids.max())}], the vocabulary is "
                                   f"[0, {spec.vocab_size})")
    floats = ["rewards", "log_probs", "values", "proprio", "actions", "action_log_probs", "bootstrap", "episode_sums"]
    floats += [EXTRAS_PREFIX + n for n, _, d, _ in spec.extras if d.is_floating_point]
    for name in floats:
        if not bool(torch.isfinite(tensors[name]).all()):
            return "non_finite", f"{name} holds NaN or inf"
    bad = check_ranges(tensors, spec)
    if bad is not None:
        return "range", bad
    for name, _, dtype, high in spec.extras:
        x = tensors[EXTRAS_PREFIX + name]
        if high is not None and x.numel() and (int(x.min()) < 0 or int(x.max()) >= high):
            return "extras", f"{name} holds values in [{int(x.min())}, {int(x.max())}], expected [0, {high})"
    count, successes, _, decisions = batch.episode_sums.unbind(1)
    if bool((successes < 0).any() | (successes > count).any() | (decisions < count).any()):
        return "episodes", "episode_sums: successes outside [0, episodes] or fewer decisions than episodes"
    if batch.valid.any():
        versions = batch.policy_version[batch.valid]
        lo, hi = int(versions.min()), int(versions.max())
        if lo < 0 or hi > learner_version:
            return "version", f"policy versions {lo}..{hi}, the learner is at {learner_version}"
    return None


def check_ranges(tensors: dict[str, torch.Tensor], spec: ChunkSpec) -> str | None:
    """Why finite values are still absurd (None: they are not)."""
    lo, hi = spec.reward_range
    r = tensors["rewards"]
    if r.numel() and (float(r.min()) < lo or float(r.max()) > hi):
        return f"rewards in [{float(r.min()):.4g}, {float(r.max()):.4g}], the env declares [{lo:.4g}, {hi:.4g}]"
    for names, bound, what in ((("log_probs", "action_log_probs"), spec.max_abs_log_prob, "algo.max_abs_log_prob"),
                               (("values", "bootstrap"), spec.max_abs_value, "algo.max_abs_value")):
        for name in names:
            x = tensors[name]
            if x.numel() and float(x.abs().max()) > bound:
                return f"{name} reaches {float(x.abs().max()):.4g}, beyond {what}={bound:.4g}"
    if r.numel():
        # |return| <= sum of |rewards| + the largest |bootstrap| (discount <= 1)
        reach = float(r.double().abs().sum(0).max()) + float(tensors["bootstrap"].double().abs().max())
        if reach > spec.max_abs_return:
            return f"returns may reach {reach:.4g}, beyond algo.max_abs_return={spec.max_abs_return:.4g}"
    return None
