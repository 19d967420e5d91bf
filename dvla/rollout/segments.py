"""PPO segments: chunks of ``T`` consecutive decisions of every env, across its resets.

With ``swimlane.segment_len`` (PPO, envs on their own clock) a chunk no longer waits for
whole episodes. Every env of a group restarts as soon as its episode ends, so all of them
take one decision per step and column ``i`` of each chunk is env ``i``'s next ``T``
decisions: the rollout buffer of textbook PPO. A column may start inside an episode and
hold several, and GAE runs across the resets in it (:func:`dvla.algos.losses.gae`):

* a step that ends an episode stops the recursion;
* an episode truncated by the time limit bootstraps from the value of its last
  observation, asked for as extra rows of the next request (as in
  :class:`dvla.rollout.episodes.StreamRecorder`) and written to ``bootstrap`` at that step;
* a column cut inside an episode bootstraps from ``values[T]``: the value of the env's
  next observation, taken from the first request after the chunk is full (its first
  ``n_envs`` rows: the act request that opens the next chunk, or a value-only request).

Episode statistics stay exact although a column holds parts of episodes: the recorder
keeps each env's running return and length and adds an episode to ``episode_sums`` of the
chunk in which it ends. An env whose new episode has another instruction than its column's
(one instruction per column) leaves the column: its decisions until the next chunk are not
recorded (counted idle).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from dvla.envs.base import EnvSpec
from dvla.rollout.episodes import Alloc, ChunkRecorder, OpenChunk, step_row
from dvla.policy import ActOutput, ExtraSpec
from dvla.types import Observation, StepResult


class SegmentRecorder(ChunkRecorder):
    """Records one env group into chunks of ``segment_len`` decisions per env (see the
    module's docstring). Same protocol as :class:`dvla.rollout.episodes.StreamRecorder`:
    :meth:`begin`, then act on :meth:`request_obs`, step, :meth:`record`; once :attr:`full`,
    the next request's values (an act or a value request) complete the chunk; :meth:`pop`
    while :attr:`ready`. A new chunk opens when a decision is recorded after a full one.
    """

    def __init__(self, spec: EnvSpec, n_envs: int, action_chunk: int, segment_len: int, *,
                 prepare: Callable[[Observation], Observation],
                 lease: Callable[[], tuple[Alloc, Callable[[], None]]] | None = None,
                 extras: dict[str, ExtraSpec] | None = None, cameras: dict[str, tuple[int, ...]] | None = None,
                 group_id: Callable[[int], int] = lambda k: k):
        """``group_id(k)``: an id for the k-th column this recorder opens (unique across
        the run; PPO does not read it)."""
        self.spec, self.b, self.k, self.t_len = spec, n_envs, action_chunk, segment_len
        self.prepare, self.lease, self.group_id = prepare, lease, group_id
        self.extras, self.cameras = extras or {}, cameras or {}
        self.chunks: list[OpenChunk] = []  # the full chunk still owed values (if any), then the one filling
        self.t = 0  # decisions recorded in the newest chunk
        self.columns = 0  # columns opened so far
        self.gap = torch.zeros(n_envs, dtype=torch.bool)  # out of its column until the next chunk
        self.tails: tuple[OpenChunk, Tensor] | None = None  # (full chunk, envs cut inside an episode)
        self.pending: list[tuple[OpenChunk, int, int, Observation]] = []  # (chunk, column, step, final obs)
        self.ep_return = torch.zeros(n_envs, dtype=torch.float64)
        self.ep_len = torch.zeros(n_envs, dtype=torch.long)
        self.obs: Observation | None = None
        self.ids = self.mask = None

    def begin(self, obs: Observation) -> None:
        """``obs``: the env's prepared reset observation."""
        self._observe(obs)

    # -- chunks ----------------------------------------------------------------------------
    @property
    def full(self) -> bool:
        """The newest chunk holds ``segment_len`` decisions (or none is open): the next
        decision opens a chunk."""
        return not self.chunks or self.t == self.t_len

    @property
    def owes_values(self) -> bool:
        """Values are owed: of the next observations of envs cut inside an episode, or of
        truncated episodes' last observations."""
        return self.tails is not None or bool(self.pending)

    def _open(self) -> OpenChunk:
        chunk = self._new_chunk()
        chunk.t["instruction_ids"].copy_(self.ids.to(torch.int64).cpu())
        chunk.t["instruction_mask"].copy_(self.mask.cpu())
        chunk.t["group_ids"].copy_(torch.tensor([self.group_id(self.columns + i) for i in range(self.b)]))
        self.columns += self.b
        self.t, self.gap = 0, torch.zeros(self.b, dtype=torch.bool)
        return chunk

    # -- one step --------------------------------------------------------------------------
    def fill(self, values: Tensor) -> None:
        """The values of every row of :meth:`request_obs`: the first ``n_envs`` complete the
        columns of a full chunk cut inside an episode, the rest bootstrap truncations."""
        b = self.b
        if values.shape[0] != b + len(self.pending):
            raise ValueError(f"{values.shape[0]} values for {b} envs and {len(self.pending)} truncated episodes")
        values = values.float().cpu()
        if self.tails is not None:
            chunk, cut = self.tails
            chunk.t["values"][self.t_len, cut] = values[:b][cut]
            chunk.owed -= int(cut.sum())
            self.tails = None
        for (chunk, c, r, _), v in zip(self.pending, values[b:]):
            chunk.t["bootstrap"][r, c] = v
            chunk.owed -= 1
        self.pending = []

    def record(self, out: ActOutput, res: StepResult, version: int) -> tuple[int, int]:
        """Store the decision taken on :meth:`request_obs` and its outcome; returns ``(live,
        idle)``: decisions recorded and those not (envs out of their column)."""
        b = self.b
        if self.owes_values:
            self.fill(out.values)
        if out.actions.shape[0] > b:
            out = out.rows(0, b)
        chunk = self._open() if self.full else self.chunks[-1]
        t, rec = self.t, ~self.gap
        row = step_row(self.obs, out, res, version, rec, self.cameras, self.extras)
        cols = rec.nonzero().squeeze(1)
        for name, x in row.items():
            dst = chunk.t[name]
            dst[t, cols] = x[cols.to(x.device)].to(dst.device, dst.dtype)
        terminated, truncated = res.terminated.cpu(), res.truncated.cpu()
        ended = terminated | truncated
        self.ep_return += res.reward.cpu().double()
        self.ep_len += 1
        self.t += 1
        for i in ended.nonzero().squeeze(1).tolist():
            success = bool(res.success[i])
            chunk.t["success"][i] |= success
            chunk.t["episode_sums"][i] += torch.tensor([1.0, float(success), float(self.ep_return[i]),
                                                        float(self.ep_len[i])])
            if truncated[i] and not terminated[i] and rec[i]:
                self._owe_bootstrap(res, i, chunk, i, t)
                chunk.owed += 1
        self.ep_return[ended], self.ep_len[ended] = 0.0, 0
        restarted = (res.reset.cpu() if res.reset is not None else torch.zeros(b, dtype=torch.bool)) & ended
        self.restart(res.obs, restarted)
        self.gap |= restarted & (self.ids.to(torch.int64).cpu() != chunk.t["instruction_ids"]).any(1)
        if self.t == self.t_len:  # full: columns cut inside an episode wait for their next value
            cut = rec & ~ended
            chunk.owed += int(cut.sum())
            self.tails = (chunk, cut) if bool(cut.any()) else None
        n = int(rec.sum())
        return n, b - n

    def restart(self, obs: Observation, restarted: Tensor) -> None:
        """The env's observation ``obs`` (raw), in which the envs ``restarted`` started anew."""
        self._observe_next(obs, bool(restarted.any()))

    # -- chunks out ----------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """The oldest chunk is full and every value it needs is written."""
        return bool(self.chunks) and (len(self.chunks) > 1 or self.t == self.t_len) and self.chunks[0].owed == 0

    def close(self) -> None:
        """Drop every chunk being filled (their tensors freed) and the values owed to them."""
        super().close()
        self.tails = None
