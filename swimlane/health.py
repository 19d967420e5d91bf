"""Liveness checks of a run, as plain objects the lanes consult (no threads of their own):
the learner's stall timer, the sampling lane's budget of simulator failures, and the
rollout ranks whose heartbeats stopped."""

from __future__ import annotations

import time
from typing import Callable, Iterable


class StallTimer:
    """Time since the learner last got a chunk it could use. A chunk dropped as too stale
    is not progress: rollouts that only ever send such chunks are a stall too."""

    def __init__(self, limit_s: float, clock: Callable[[], float] = time.monotonic):
        self.limit_s = limit_s
        self.clock = clock
        self.last = clock()

    def progress(self) -> None:
        self.last = self.clock()

    def stalled_for(self) -> float | None:
        """Seconds without progress once past the limit (0 disables), else None."""
        idle = self.clock() - self.last
        return idle if self.limit_s and idle > self.limit_s else None


class FailureBudget:
    """Consecutive simulator failures per env group: a failure drops the group's batch of
    episodes and resets it, until one group fails ``limit`` times in a row."""

    def __init__(self, groups: int, limit: int):
        self.limit = limit
        self.in_a_row = [0] * groups

    def failed(self, group: int) -> bool:
        """Count a failure of ``group``; True when its budget is spent."""
        self.in_a_row[group] += 1
        return self.in_a_row[group] >= self.limit

    def succeeded(self, group: int) -> None:
        self.in_a_row[group] = 0


def dead_senders(expected: Iterable[str], ended: Iterable[str], dead_peers: Iterable[str]) -> list[str]:
    """Expected senders whose heartbeats stopped before they said they had ended."""
    ended, dead = set(ended), set(dead_peers)
    return [s for s in expected if s in dead and s not in ended]
