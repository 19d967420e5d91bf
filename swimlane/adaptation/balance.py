"""Imbalance between rollout ranks, seen from the learners, and the plan that answers it.

A rollout rank that is several times slower than the others (a heavier scene, a shared host)
holds the whole run back in async mode: admission gives every rank routed to a learner an
equal share of the chunks each version consumes (:mod:`swimlane.lanes.admission`), so the fast
ranks wait for weights the slow one has not yet earned. Two parts fix that:

* :class:`swimlane.observation.throughput.Throughput` (every learner's gradient lane counts
  what each rollout rank and env group delivers): a rank's *speed* is env steps per second
  of sampling per env group; :func:`stragglers` names the ranks slower than ``1/k`` of the
  median.
* :class:`Rebalancer` (rank 0, ``swimlane.rebalance``): a :class:`Rebalancing` per published
  version. Each rank's share of its learner's chunks follows its measured capacity (its
  speed times its active groups, with :data:`HEADROOM`), so admission stops holding fast
  ranks back; and a
  straggler hands one active env group at a time to the fastest rank that has a spare one
  built (``swimlane.spare_groups``), at most one move per window. The plan travels in the
  weights version's header on the control plane (:class:`planes.control.WeightBroadcaster`),
  so a rank applies it when the version arrives, without a collective of its own: the moved
  group's running batch finishes and is sent on the old rank, then it parks; a spare group
  on the new rank starts fresh episodes.
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from dataclasses import dataclass, field

SHARE_SCALE = 1_000_000  # shares travel as integers in millionths
HEADROOM = 1.2
"""A rank's share is its measured share of capacity times this: with exact shares every bit of
noise in the measurement would hold some rank back; a fifth more never binds in the steady
state and still bounds how far a rank runs ahead of the learner."""
NO_PLAN = -1


def stragglers(speed: dict[int, float], k: float) -> list[int]:
    """The ranks whose speed is below ``1/k`` of the median (none with fewer than 2 ranks)."""
    if len(speed) < 2:
        return []
    median = statistics.median(speed.values())
    return sorted(r for r, s in speed.items() if s < median / k)


WORDS_PER_RANK = 3  # share, env groups, route


@dataclass
class Rebalancing:
    """Per rollout rank: its share of its learner's chunks (admission), how many env groups
    step (0: a rank that moved to the learners, :mod:`swimlane.adaptation.roles`) and the learner its
    chunks go to (adaptive roles; else its placement's route)."""

    shares: dict[int, float] = field(default_factory=dict)
    active: dict[int, int] = field(default_factory=dict)
    routes: dict[int, int] = field(default_factory=dict)

    def encode(self, world_size: int) -> list[int]:
        """``3 * world_size`` integers for the version header: per rank, share in millionths,
        active groups and route (``NO_PLAN`` where the plan says nothing)."""
        out = [NO_PLAN] * (WORDS_PER_RANK * world_size)
        n = WORDS_PER_RANK
        for r, s in self.shares.items():
            out[n * r] = round(s * SHARE_SCALE)
        for r, a in self.active.items():
            out[n * r + 1] = a
        for r, learner in self.routes.items():
            out[n * r + 2] = learner
        return out

    @classmethod
    def decode(cls, words: list[int]) -> "Rebalancing":
        """The inverse of :meth:`encode`; raises ValueError on words no plan produces."""
        if len(words) % WORDS_PER_RANK:
            raise ValueError(f"a plan has {WORDS_PER_RANK} words per rank, got {len(words)}")
        plan, world = cls(), len(words) // WORDS_PER_RANK
        for r in range(world):
            share, active, route = words[WORDS_PER_RANK * r : WORDS_PER_RANK * (r + 1)]
            if share != NO_PLAN:
                if not 0 < share <= SHARE_SCALE:
                    raise ValueError(f"plan: rank {r}'s share {share} is outside (0, {SHARE_SCALE}]")
                plan.shares[r] = share / SHARE_SCALE
            if active != NO_PLAN:
                if active < 0:
                    raise ValueError(f"plan: rank {r} would run {active} env groups")
                plan.active[r] = active
            if route != NO_PLAN:
                if not 0 <= route < world:
                    raise ValueError(f"plan: rank {r} would send to rank {route} of {world}")
                plan.routes[r] = route
        return plan


def equal_shares(routes: dict[int, int]) -> dict[int, float]:
    """Each rollout rank's share of its learner's chunks when every rank sends alike."""
    senders = collections.Counter(routes.values())
    return {r: 1.0 / senders[learner] for r, learner in routes.items()}


@dataclass
class Move:
    """One env group handed from a straggler to a faster rank."""

    version: int
    src: int
    dst: int
    reason: str


class Rebalancer:
    """Rank 0's planner (see the module's docstring). ``routes``: rollout rank -> its
    learner; ``built``: env groups each rollout rank has; ``active``: how many step at the
    start."""

    def __init__(self, routes: dict[int, int], built: int, active: int, k: float, window_s: float,
                 clock=time.monotonic):
        self.routes, self.built, self.k, self.window_s, self.clock = dict(routes), built, k, window_s, clock
        self.start_active = active
        self.plan = Rebalancing(shares=equal_shares(self.routes), active={r: active for r in routes})
        self.moves: list[Move] = []
        self._last_move = -math.inf

    def set_routes(self, routes: dict[int, int]) -> None:
        """Ranks moved between rollout and learning (:mod:`swimlane.adaptation.roles`): ``routes`` are
        the sampling ranks' learners now. A rank that comes back gets its env groups back;
        the shares are equal again until the ranks are measured."""
        self.routes = dict(routes)
        for r in routes:
            self.plan.active.setdefault(r, self.start_active)
        self.plan.shares = equal_shares(self.routes)

    def update(self, speed: dict[int, float], version: int) -> Rebalancing:
        """The plan for ``version`` from the ranks' measured speeds (env steps per second
        of sampling per env group; ranks not yet measured keep what they have)."""
        plan = self.plan
        measured = {r: s for r, s in speed.items() if r in self.routes and s > 0}
        if len(measured) == len(self.routes):
            capacity = {r: measured[r] * plan.active[r] for r in self.routes}
            per_learner = collections.defaultdict(float)
            for r, c in capacity.items():
                per_learner[self.routes[r]] += c
            plan.shares = {r: min(max(HEADROOM * c / per_learner[self.routes[r]], 1.0 / SHARE_SCALE), 1.0)
                           for r, c in capacity.items()}
            self._maybe_move(measured, version)
        return plan

    def _maybe_move(self, speed: dict[int, float], version: int) -> None:
        now = self.clock()
        if now - self._last_move < self.window_s:  # the last move's effect is not measured yet
            return
        slow = [r for r in stragglers(speed, self.k) if self.plan.active[r] > 1]
        room = [r for r in self.routes if self.plan.active[r] < self.built and r not in slow]
        if not slow or not room:
            return
        src = min(slow, key=lambda r: speed[r])
        dst = max(room, key=lambda r: speed[r])
        if speed[dst] <= speed[src] * self.k:
            return
        median = statistics.median(speed.values())
        self.plan.active[src] -= 1
        self.plan.active[dst] += 1
        self.moves.append(Move(version, src, dst, f"rank {src} samples {speed[src]:.0f} env steps/s per group, "
                                                  f"below 1/{self.k:g} of the median {median:.0f}; rank {dst}: "
                                                  f"{speed[dst]:.0f}"))
        self._last_move = now
