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


def check_senders(expected: Iterable[str], ended: Iterable[str], dead_peers: Iterable[str], peer_timeout_s: float,
                  accounting: Callable[[], dict[str, int]]) -> None:
    """A rollout rank whose heartbeats stopped (crashed, killed, frozen) cannot take part in
    the next weight broadcast, so the run cannot go on without it: raise, naming it
    (torchrun then restarts the group, which resumes from the last checkpoint), instead of
    hanging in a collective."""
    dead = dead_senders(expected, ended, dead_peers)
    if dead:
        raise RuntimeError(
            f"rollout rank(s) {', '.join(dead)} stopped sending heartbeats for {peer_timeout_s}s "
            f"(data_plane.peer_timeout_s): crashed or hung. Weights cannot be broadcast without them; "
            f"stopping this attempt (chunk accounting: {accounting()})")


def check_stall(stall: StallTimer, counters: dict[str, int], version: int) -> None:
    """No usable chunk for ``swimlane.stall_timeout_s``: something is stuck without crashing
    (a simulator step that never returns, a frozen rank, rollouts whose every chunk is too
    stale): raise and say so. Dropped chunks are not progress."""
    if stall.stalled_for() is not None:
        rejected = ", ".join(f"{k}={v}" for k, v in counters.items() if k.startswith("rejected_") and v)
        raise RuntimeError(
            f"no usable trajectory chunk for {stall.limit_s}s (swimlane.stall_timeout_s): a simulator or rollout "
            f"rank is stuck, or every chunk arrives too stale or is rejected; env_steps_sampled="
            f"{counters['env_steps_sampled']}, dropped_stale={counters['dropped_stale']}, "
            f"{rejected + ', ' if rejected else ''}version={version}")
