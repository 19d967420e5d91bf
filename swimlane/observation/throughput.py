"""What each rollout rank and env group delivered to a learner over a sliding window of
``window_s`` seconds: chunks, env steps and stale chunks dropped, and the time its chunks took
to sample (``sample_s`` in the chunk's metadata: from the group's start or its previous
chunk, parked time excluded, so admission's waits do not count against a rank). Every
learner's gradient lane counts each chunk here; the rebalancing plan
(:mod:`swimlane.adaptation.balance`) and the stragglers are made from it."""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass


@dataclass
class Delivered:
    """What one rollout rank (or env group) delivered in the window."""

    chunks: int = 0
    steps: int = 0
    dropped: int = 0  # chunks too stale to learn from
    sample_s: float = 0.0  # seconds its chunks took to sample, summed

    @property
    def speed(self) -> float:
        """Env steps per second of sampling (0 before any chunk)."""
        return self.steps / self.sample_s if self.sample_s > 0 else 0.0


class Throughput:
    """Chunks that reached a learner, per (rollout rank, env group), over the last
    ``window_s`` seconds."""

    def __init__(self, window_s: float = 10.0, clock=time.monotonic):
        self.window_s, self.clock = window_s, clock
        self.events: collections.deque[tuple[float, int, int, int, bool, float]] = collections.deque()

    def add(self, meta: dict, steps: int, dropped: bool) -> None:
        """A chunk (its metadata as sent: ``rank``, ``group``, ``sample_s``; a chunk whose
        metadata does not say is not counted)."""
        rank, group, sample_s = meta.get("rank"), meta.get("group"), meta.get("sample_s")
        if not (isinstance(rank, int) and isinstance(group, int) and isinstance(sample_s, (int, float))
                and not isinstance(rank, bool) and math.isfinite(sample_s) and sample_s >= 0):
            return
        self.events.append((self.clock(), rank, group, steps, dropped, float(sample_s)))

    def _trim(self) -> None:
        old = self.clock() - self.window_s
        while self.events and self.events[0][0] < old:
            self.events.popleft()

    def by_group(self) -> dict[tuple[int, int], Delivered]:
        self._trim()
        out: dict[tuple[int, int], Delivered] = collections.defaultdict(Delivered)
        for _, rank, group, steps, dropped, sample_s in self.events:
            d = out[(rank, group)]
            d.chunks += 1
            d.steps += steps
            d.dropped += dropped
            d.sample_s += sample_s
        return dict(out)

    def by_rank(self) -> dict[int, Delivered]:
        out: dict[int, Delivered] = collections.defaultdict(Delivered)
        for (rank, _), g in self.by_group().items():
            d = out[rank]
            d.chunks += g.chunks
            d.steps += g.steps
            d.dropped += g.dropped
            d.sample_s += g.sample_s
        return dict(out)
