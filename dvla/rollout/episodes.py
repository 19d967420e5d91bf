"""Per-env independent episodes: the bookkeeping of an env group on its own clock.

With ``swimlane.independent_envs`` an env group never waits for its slowest episode. The
env restarts each env (each block of ``group_size`` envs: a GRPO group) as soon as its
episode has ended, inside the step (``BatchedEnv.reset(independent=True)``), and
:class:`StreamRecorder` writes every env's decisions into a column of a chunk being filled.
A chunk has the shape of a batch of episodes, ``T = env.episode_len`` decisions by
``B = env.n_envs`` columns, one episode per column with its tail masked, so the learner,
its checks and both algorithms take it unchanged. It leaves once every column holds an
episode that has ended:

* PPO (``group_size=1``): any B episodes. An episode ended by the time limit (truncated)
  bootstraps from the value of its last observation: the env returns that observation
  (``StepResult.final_obs``) and the next request asks for its value in extra rows after
  the env's B (:meth:`StreamRecorder.request_obs`), which :meth:`StreamRecorder.record`
  (or :meth:`StreamRecorder.fill`, for a value request) writes after the episode's last
  step (``bootstrap``). GAE then runs per column, as on a batch.
* GRPO: ``B / G`` groups of G episodes, each group from one initial state and all G ended.
  A member that ends early waits (idle, latched) for the others.

Columns are handed out in the order episodes start, chunk after chunk, and chunks leave
in that order: a chunk holds the oldest episodes in flight. Every step keeps the weights
version that chose it (staleness per step, as always).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import Tensor

from dvla.envs.base import EnvSpec
from dvla.policy import ActOutput, ExtraSpec
from dvla.types import (
    CAMERAS_PREFIX,
    EXTRAS_PREFIX,
    Observation,
    RolloutBatch,
    StepResult,
    cat_observations,
    observation_rows,
)

Alloc = Callable[[tuple[int, ...], torch.dtype], Tensor]


def rollout_fields(spec: EnvSpec, action_chunk: int, t_len: int, b: int, tokens: int,
                   extras: dict[str, ExtraSpec] | None = None,
                   cameras: dict[str, tuple[int, ...]] | None = None) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor of a :class:`RolloutBatch` of ``t_len`` x ``b``
    (``tokens``: instruction ids per episode), as :meth:`RolloutBatch.to_dict` names them."""
    k, d, f32 = action_chunk, spec.action_dim, torch.float32
    out = {"image": ((t_len, b, *spec.image_shape), torch.uint8), "proprio": ((t_len, b, spec.proprio_dim), f32),
           "instruction_ids": ((b, tokens), torch.int64), "instruction_mask": ((b, tokens), torch.bool),
           "actions": ((t_len, b, k, d), f32), "log_probs": ((t_len, b), f32), "values": ((t_len + 1, b), f32),
           "rewards": ((t_len, b), f32), "terminated": ((t_len, b), torch.bool), "truncated": ((t_len, b), torch.bool),
           "valid": ((t_len, b), torch.bool), "policy_version": ((t_len, b), torch.int64),
           "success": ((b,), torch.bool), "group_ids": ((b,), torch.int64),
           "action_valid": ((t_len, b, k), torch.bool), "action_log_probs": ((t_len, b, k, d), f32),
           "bootstrap": ((t_len, b), f32), "episode_sums": ((b, 4), f32)}
    out.update({CAMERAS_PREFIX + n: ((t_len, b, *shape), torch.uint8) for n, shape in (cameras or {}).items()})
    out.update({EXTRAS_PREFIX + n: ((t_len, b, *e.shape), e.dtype) for n, e in (extras or {}).items()})
    return out


def step_row(obs: Observation, out: ActOutput, res: StepResult, version: int, live: Tensor,
             cameras, extras) -> dict[str, Tensor]:
    """One decision of every env of a group (``(B, ...)`` per chunk field): what it saw, did
    and got. ``live``: the envs whose decision counts (the others' actions are masked)."""
    b, k = live.shape[0], out.actions.shape[1]
    executed = res.executed.cpu() if res.executed is not None else torch.full((b,), k)
    action_valid = (torch.arange(k) < executed.unsqueeze(1)) & live.unsqueeze(1)
    if out.log_prob_elements is not None:  # the behaviour log-prob of what the env applied
        elements = out.log_prob_elements.cpu() * action_valid.unsqueeze(-1).to(torch.float32)
        log_probs = elements.sum(dim=(1, 2))
    else:
        elements, log_probs = torch.zeros(b, k, out.actions.shape[2]), out.log_probs
    return {"image": obs.image, "proprio": obs.proprio, "actions": out.actions, "action_valid": action_valid,
            "action_log_probs": elements, "log_probs": log_probs, "values": out.values, "rewards": res.reward,
            "terminated": res.terminated, "truncated": res.truncated, "valid": live,
            "policy_version": torch.full((b,), version, dtype=torch.long),
            **{CAMERAS_PREFIX + n: obs.cameras[n] for n in cameras},
            **{EXTRAS_PREFIX + n: out.extras[n] for n in extras}}


class OpenChunk:
    """A chunk being filled: its tensors, who frees them, and its progress: for the
    :class:`StreamRecorder`, the columns handed out and those holding an ended episode (its
    bootstrap value written); for :class:`dvla.rollout.segments.SegmentRecorder`, the values still
    owed to it."""

    def __init__(self, tensors: dict[str, Tensor], release: Callable[[], None] | None):
        self.t, self.release = tensors, release
        self.assigned = 0
        self.ended = 0
        self.owed = 0


class ChunkRecorder:
    """What the recorders of envs on their own clock share: the env's current (prepared)
    observation, the chunks being filled, oldest first, taken out once :attr:`ready`, and the
    final observations of truncated episodes whose bootstrap values are owed (:attr:`pending`,
    asked for after the env's rows by :meth:`request_obs`)."""

    spec: EnvSpec
    b: int  # envs of the group
    k: int  # action chunk
    t_len: int  # decisions per chunk
    prepare: Callable[[Observation], Observation]
    lease: Callable[[], tuple[Alloc, Callable[[], None]]] | None
    extras: dict[str, ExtraSpec]
    cameras: dict[str, tuple[int, ...]]
    chunks: list[OpenChunk]
    pending: list[tuple[OpenChunk, int, int, Observation]]  # (chunk, column, row, final obs)
    obs: Observation | None
    ids: Tensor | None
    mask: Tensor | None

    def _observe(self, obs: Observation) -> None:
        if obs.instruction_mask is None:
            raise ValueError(f"{type(self).__name__} needs prepared observations (instruction ids and mask)")
        self.obs, self.ids, self.mask = obs, obs.instruction_ids, obs.instruction_mask

    def _observe_next(self, obs: Observation, restarted: bool) -> None:
        """The env's next observation ``obs`` (raw): instructions tokenised again when some
        env ``restarted``, else kept."""
        keep = not restarted
        self._observe(self.prepare(dataclasses.replace(obs, instruction_ids=self.ids if keep else None,
                                                       instruction_mask=self.mask if keep else None)))

    def _new_chunk(self) -> OpenChunk:
        """A chunk's tensors, zeroed, from a fresh lease (plain tensors without one)."""
        alloc, release = self.lease() if self.lease is not None else (None, None)
        alloc = alloc or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
        fields = rollout_fields(self.spec, self.k, self.t_len, self.b, self.ids.shape[1], self.extras, self.cameras)
        chunk = OpenChunk({name: alloc(shape, dtype).zero_() for name, (shape, dtype) in fields.items()}, release)
        self.chunks.append(chunk)
        return chunk

    def _owe_bootstrap(self, res: StepResult, i: int, chunk: OpenChunk, col: int, row: int) -> None:
        """Env ``i``'s episode was truncated at ``row`` of ``chunk``'s column ``col``: ask for
        the value of its last observation (the step's, or the one before its restart)."""
        restarted_now = res.reset is not None and bool(res.reset[i])  # then res.obs is the new episode's
        final = dataclasses.replace(observation_rows(res.final_obs if restarted_now else res.obs, torch.tensor([i])),
                                    instruction_ids=self.ids[i:i + 1], instruction_mask=self.mask[i:i + 1])
        self.pending.append((chunk, col, row, self.prepare(final)))

    def request_obs(self) -> Observation:
        """What to act on: the env's observation, then the final observations of truncated
        episodes whose bootstrap values are still to come."""
        return cat_observations([self.obs] + [p[3] for p in self.pending])

    @property
    def ready(self) -> bool:
        raise NotImplementedError

    def pop(self) -> tuple[RolloutBatch, Callable[[], None] | None]:
        """The oldest chunk (once :attr:`ready`) and the callback that frees its tensors."""
        if not self.ready:
            raise RuntimeError("no chunk is complete yet")
        chunk = self.chunks.pop(0)
        return RolloutBatch.from_dict(chunk.t), chunk.release

    def close(self) -> None:
        """Drop every chunk being filled (their tensors freed)."""
        for chunk in self.chunks:
            if chunk.release is not None:
                chunk.release()
        self.chunks, self.pending = [], []


class StreamRecorder(ChunkRecorder):
    """Records the episodes of one env group on its own clock into chunks of ``n_envs``
    episodes (see the module's docstring).

    Call :meth:`begin` with the prepared reset observation, then in a loop: act on
    :meth:`request_obs`, step the env with the first ``n_envs`` rows of the actions,
    :meth:`record`; take each chunk out with :meth:`pop` once :attr:`ready`. When the oldest
    chunk waits only for bootstrap values (:attr:`waiting_for_values`), ask for the values
    of :meth:`request_obs` and hand them to :meth:`fill`.
    """

    def __init__(self, spec: EnvSpec, n_envs: int, action_chunk: int, episode_len: int, *,
                 prepare: Callable[[Observation], Observation], group_size: int = 1, has_value: bool = False,
                 lease: Callable[[], tuple[Alloc, Callable[[], None]]] | None = None,
                 extras: dict[str, ExtraSpec] | None = None, cameras: dict[str, tuple[int, ...]] | None = None,
                 group_id: Callable[[int], int] = lambda k: k):
        """``prepare``: the policy's (tokenises new instructions); ``lease()``: a fresh
        ``(alloc, release)`` for each chunk's tensors (a transient-pool lease), default plain
        tensors; ``group_id(k)``: the id of the k-th episode group this recorder starts
        (unique across the run)."""
        if n_envs % group_size:
            raise ValueError(f"n_envs={n_envs} is not a multiple of group_size={group_size}")
        self.spec, self.b, self.k, self.t_len = spec, n_envs, action_chunk, episode_len
        self.group_size, self.has_value, self.prepare = group_size, has_value, prepare
        self.lease, self.extras, self.cameras, self.group_id = lease, extras or {}, cameras or {}, group_id
        self.chunks: list[OpenChunk] = []
        self.where: list[OpenChunk | None] = [None] * n_envs  # the chunk of each env's episode
        self.col = torch.zeros(n_envs, dtype=torch.long)
        self.pos = torch.zeros(n_envs, dtype=torch.long)  # decisions recorded of each env's episode
        self.live = torch.zeros(n_envs, dtype=torch.bool)  # False: ended, waiting for its group's restart
        self.pending: list[tuple[OpenChunk, int, int, Observation]] = []  # (chunk, column, row, final obs): bootstraps
        self.groups = 0  # episode groups started
        self.obs: Observation | None = None
        self.ids = self.mask = None

    # -- episodes and columns ------------------------------------------------------------
    def begin(self, obs: Observation) -> None:
        """``obs``: the env's prepared reset observation; every env starts an episode."""
        self._observe(obs)
        self._start(torch.arange(self.b))


    def _start(self, envs: Tensor) -> None:
        """New episodes in ``envs`` (whole blocks of ``group_size``): a column each."""
        g = self.group_size
        for block in envs.view(-1, g):
            chunk = self.chunks[-1] if self.chunks and self.chunks[-1].assigned < self.b else self._new_chunk()
            cols = torch.arange(chunk.assigned, chunk.assigned + g)
            chunk.assigned += g
            chunk.t["group_ids"][cols] = self.group_id(self.groups)
            self.groups += 1
            chunk.t["instruction_ids"][cols] = self.ids[block].to(torch.int64).cpu()
            chunk.t["instruction_mask"][cols] = self.mask[block].cpu()
            for i, c in zip(block.tolist(), cols.tolist()):
                self.where[i] = chunk
            self.col[block], self.pos[block] = cols, 0
        self.live[envs] = True

    # -- one step --------------------------------------------------------------------------
    def record(self, out: ActOutput, res: StepResult, version: int) -> tuple[int, int]:
        """Store the decision taken on :meth:`request_obs` and its outcome (``out``'s rows past
        ``n_envs`` are the bootstrap values asked for); returns ``(live, idle)``: the envs
        that took a decision and those that waited for their group."""
        b = self.b
        if out.actions.shape[0] > b:
            self.fill(out.values)
            out = out.rows(0, b)
        live = self.live.clone()
        self._write(out, res, version, live)
        ended = live & (res.terminated | res.truncated).cpu()
        truncated = ended & ~res.terminated.cpu()
        self.pos += live
        for i in ended.nonzero().squeeze(1).tolist():
            chunk, c = self.where[i], int(self.col[i])
            chunk.t["success"][c] = bool(res.success[i])
            chunk.t["episode_sums"][c] = torch.tensor([1.0, float(res.success[i]), float(chunk.t["rewards"][:, c].sum()),
                                                       float(self.pos[i])])
            if self.has_value and truncated[i]:
                self._owe_bootstrap(res, i, chunk, c, int(self.pos[i]))
            else:
                chunk.ended += 1
        self.live &= ~ended
        restarted = res.reset if res.reset is not None else torch.zeros(b, dtype=torch.bool)
        self.restart(res.obs, restarted)
        n_live = int(live.sum())
        return n_live, b - n_live

    def restart(self, obs: Observation, restarted: Tensor) -> None:
        """The env's observation ``obs`` (raw), in which the envs ``restarted`` started anew."""
        restarted = restarted.cpu()
        self._observe_next(obs, bool(restarted.any()))
        if bool(restarted.any()):
            self._start(restarted.nonzero().squeeze(1))

    def _write(self, out: ActOutput, res: StepResult, version: int, live: Tensor) -> None:
        """The step's row of every live env's column."""
        row = step_row(self.obs, out, res, version, live, self.cameras, self.extras)
        envs = live.nonzero().squeeze(1)
        for chunk in {id(self.where[i]): self.where[i] for i in envs.tolist()}.values():
            mine = envs[torch.tensor([self.where[i] is chunk for i in envs.tolist()])]
            r, c = self.pos[mine], self.col[mine]
            for name, x in row.items():
                chunk.t[name][r, c] = x[mine.to(x.device)].to(chunk.t[name].device, chunk.t[name].dtype)

    def fill(self, values: Tensor) -> None:
        """The values of every row of :meth:`request_obs`: those past ``n_envs`` bootstrap
        the pending final observations, in order."""
        values = values[self.b:]
        if values.shape[0] != len(self.pending):
            raise ValueError(f"{values.shape[0]} bootstrap values for {len(self.pending)} truncated episodes")
        for (chunk, c, r, _), v in zip(self.pending, values.float().cpu()):
            chunk.t["bootstrap"][r - 1, c] = v
            chunk.ended += 1
        self.pending = []

    # -- chunks out ----------------------------------------------------------------------
    @property
    def room(self) -> int:
        """Columns left in the chunk being filled (0: a new episode would open another)."""
        return self.b - self.chunks[-1].assigned if self.chunks else 0

    @property
    def drained(self) -> bool:
        """No episode running and no bootstrap value owed (restarts were held)."""
        return not bool(self.live.any()) and not self.pending

    def flush(self) -> None:
        """Once :attr:`drained`: close the chunk being filled as it is, its columns never
        handed out left empty (masked, in a group id of their own: -1), so that every chunk
        can leave."""
        if not self.drained:
            raise RuntimeError("flush needs every episode ended and every bootstrap value written")
        if self.chunks:
            last = self.chunks[-1]
            last.t["group_ids"][last.assigned:] = -1
            last.ended += self.b - last.assigned
            last.assigned = self.b

    @property
    def ready(self) -> bool:
        """The oldest chunk holds ``n_envs`` ended episodes, bootstraps written."""
        return bool(self.chunks) and self.chunks[0].ended == self.b

    @property
    def waiting_for_values(self) -> bool:
        """The oldest chunk's episodes have all ended; some wait for their bootstrap value."""
        if not self.chunks or not self.pending:
            return False
        first = self.chunks[0]
        return first.ended + sum(p[0] is first for p in self.pending) == self.b

