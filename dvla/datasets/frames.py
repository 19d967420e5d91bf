"""``dvla sft``'s data: every frame of a demonstration dataset in memory with its action chunk
(:class:`Frames`), and the run's global minibatches (:class:`GlobalBatches`), which each rank
of a job cuts into its own share (:func:`shard`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dvla.config import ConfigError
from dvla.types import MAIN_CAMERA, Observation


@dataclass
class Frames:
    """Every frame of a dataset in memory (storage form), with its action chunk."""

    images: dict[str, np.ndarray]  # camera -> (N, H, W, 3) uint8
    proprio: np.ndarray  # (N, P) float32
    chunks: torch.Tensor  # (N, K, D)
    valid: torch.Tensor  # (N, K) bool
    instructions: list[str]  # (N,)
    episodes: int
    actions: np.ndarray | None = None  # (N, D): each frame's own action (its statistics)

    def __len__(self) -> int:
        return len(self.proprio)

    def batch(self, idx: np.ndarray) -> tuple[Observation, torch.Tensor, torch.Tensor]:
        def chw(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a[idx]).permute(0, 3, 1, 2).contiguous()

        obs = Observation(image=chw(self.images[MAIN_CAMERA]), proprio=torch.from_numpy(self.proprio[idx]),
                          instruction=[self.instructions[i] for i in idx],
                          cameras={k: chw(v) for k, v in self.images.items() if k != MAIN_CAMERA})
        t = torch.from_numpy(idx)
        return obs, self.chunks[t], self.valid[t]

    def valid_steps(self, idx: np.ndarray) -> int:
        """The chunk steps of the frames ``idx`` that lie within their episode."""
        return int(self.valid[torch.from_numpy(idx)].sum())


def load_frames(reader, k: int, per_task: int | None = None) -> Frames:
    """Every frame of ``reader``'s episodes with its chunk of ``k`` actions; with ``per_task``
    only each task's (instruction's) first ``per_task`` episodes."""
    images: dict[str, list] = {}
    proprio, chunks, valid, instr, actions = [], [], [], [], []
    taken: dict[str, int] = {}
    for ep in reader:
        if per_task is not None:
            if taken.get(ep.instruction, 0) >= per_task:
                continue
            taken[ep.instruction] = taken.get(ep.instruction, 0) + 1
        for cam, a in ep.images.items():
            images.setdefault(cam, []).append(a)
        proprio.append(ep.proprio.astype(np.float32))
        actions.append(np.asarray(ep.actions, np.float32))
        c, v = ep.action_chunks(k)
        chunks.append(c)
        valid.append(v)
        instr += [ep.instruction] * len(ep)
    if not proprio:
        raise ConfigError("--data: the dataset holds no episodes")
    return Frames({cam: np.concatenate(a) for cam, a in images.items()}, np.concatenate(proprio),
                  torch.cat(chunks), torch.cat(valid), instr, len(proprio), np.concatenate(actions))


class GlobalBatches:
    """The run's minibatches: ``size`` frames at a time from random permutations of all ``n``
    frames (a fresh one when what is left of the current cannot fill a batch), drawn from
    ``run.seed`` alone, so that the sequence is the same whatever the number of ranks, and a
    resumed run finds its place by replaying the steps done (:meth:`skip`)."""

    def __init__(self, n: int, size: int, seed: int):
        self.n, self.size = n, size
        self.rng = np.random.default_rng(seed)
        self.order, self.at = self.rng.permutation(n), 0

    def _advance(self) -> int:
        if self.at + self.size > self.n:
            self.order, self.at = self.rng.permutation(self.n), 0
        self.at += self.size
        return self.at - self.size

    def next(self) -> np.ndarray:
        """The next global minibatch's frame indices (``min(size, n)`` of them)."""
        at = self._advance()
        return self.order[at:at + self.size]

    def skip(self, steps: int) -> None:
        """Move past ``steps`` minibatches (the steps a resumed run has done)."""
        for _ in range(steps):
            self._advance()


def shard(idx: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank ``rank``'s share of a global minibatch: consecutive pieces whose sizes differ by
    at most one, disjoint, together the whole batch."""
    return np.array_split(idx, world)[rank]
