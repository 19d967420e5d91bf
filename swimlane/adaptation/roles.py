"""Ranks that move between rollout and learning while the run runs (``swimlane.roles=
adaptive``, Libra's reallocation of workers), as pure parts: the data routes for a set of
learners, and rank 0's planner.

The design, end to end:

* **Candidates.** Rank 0 always learns (it publishes and plans). The other learner ranks
  of the placement (``swimlane.learner_ranks``, colocated) are candidates: each builds a
  learner and its env groups at start-up, and starts on the rollout side.
* **One all-reduce, averaged over who had samples.** Every candidate takes part in every
  update, in the same collectives as the others. A candidate on the rollout side has no
  chunks: it sends a zero gradient and is left out of the average
  (:func:`dvla.distributed.allreduce_mean_grads` with ``masked``), then applies the same
  step as the learners (:meth:`dvla.algos.base.Algorithm.follow`). Every candidate so holds
  the learners' weights and optimizer state at all times, and a switch moves no state: the
  average stays exactly the mean over the learners that had data.
* **Routes.** Every rollout rank has a sender to every candidate; the plan names the one
  it sends to (:func:`routes_for`). A learner that samples sends to itself.
* **Switches at version boundaries.** The planner (:class:`RolePlanner`, rank 0) watches how
  the learners spend their time. When they hardly wait for chunks (less than
  ``swimlane.role_low`` of it: learning is the bottleneck), the next candidate stops
  sampling and joins the learners; when they wait more than ``swimlane.role_high`` of it
  (the rollouts are), the last candidate to join goes back to sampling, unless the number
  of learners it would go to was measured consuming fewer env steps per second lately. At
  most one switch per ``swimlane.balance_window_s``, and only at a published version: the plan rides in
  that version's header (:class:`swimlane.adaptation.balance.Rebalancing`), and every candidate reads it
  before its next update's collectives (:class:`swimlane.agreement.ordering.CollectiveOrder` orders
  that broadcast before them), so all agree on who learns in which update.
* **Chunks in flight.** A candidate that went back to sampling takes the chunks already
  queued for it into its next update without waiting for more; they count like any other
  learner's (stale ones are dropped and counted). Each learner consumes
  ``swimlane.chunks_per_update`` chunks per version, so a version learns from more data
  while more ranks learn.
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from dataclasses import dataclass


def routes_for(learners: list[int], samplers: list[int]) -> dict[int, int]:
    """Which learner each sampling rank sends to: a learner that samples, to itself; the
    others in rank order to the least-loaded learner (ties: the lowest rank). Raises
    ValueError when some learner would get no sender (it would wait for chunks forever)."""
    if len(samplers) < len(learners):
        raise ValueError(f"{len(learners)} learners need at least as many sampling ranks, got {samplers}")
    load = collections.Counter({learner: 0 for learner in learners})
    routes = {}
    for r in samplers:
        if r in load:
            routes[r] = r
            load[r] += 1
    for r in samplers:
        if r not in routes:
            dst = min(learners, key=lambda learner: (load[learner], learner))
            routes[r] = dst
            load[dst] += 1
    if any(n == 0 for n in load.values()):
        raise ValueError(f"learners {sorted(learner for learner, n in load.items() if not n)} get no sender "
                         f"from {samplers}")
    return routes


def initial_routes(sl, placement) -> dict[int, int]:
    """Rollout rank -> learner at the start: the placement's routes, or with adaptive roles
    (``sl.roles``) every rank to rank 0, the only learner then."""
    if sl.roles == "adaptive":
        return routes_for([0], list(placement.rollout))
    return {r: placement.routes[r] for r in placement.rollout}


@dataclass
class Switch:
    """One rank moving between rollout and learning."""

    version: int
    rank: int
    to: str  # "learner" or "rollout"
    reason: str


class RolePlanner:
    """Rank 0's half of adaptive roles (see the module's docstring). ``candidates``: the
    learner ranks other than 0, in the order they join; ``rollout``: every rank that samples
    at the start.

    What it watches, per update: the learner that waited longest for its chunks (the
    learners go in lock-step, so the others wait for it in the all-reduce), and the env
    steps all learners consumed. Its share of time waiting, over ``window_s``, decides the
    direction. It remembers the rate (env steps consumed per second) it measured with each
    number of learners, and does not switch back to a number that did worse within
    ``MEMORY_WINDOWS`` windows, so a workload whose bottleneck sits between the two
    settles instead of switching every window. When the workload moves by more than
    ``SHIFT`` from what it was when the current setting was first measured (the rollout
    ranks' sampling speed, or the seconds of learning per env step), it has changed phase:
    the other settings' rates are forgotten. (The rate itself is no sign of that: it is what
    the setting achieves, and it moves as episodes get shorter while the policy learns.)"""

    MEMORY_WINDOWS = 10
    SHIFT = 0.5  # a real phase change moves these several-fold; noise and a sampler set changing by one, less
    MIN_UPDATES = 3  # a decision rests on at least this many updates

    def __init__(self, candidates: list[int], rollout: list[int], low: float, high: float, window_s: float,
                 clock=time.monotonic):
        self.candidates, self.rollout = list(candidates), list(rollout)
        self.low, self.high, self.window_s, self.clock = low, high, window_s, clock
        self.learners = [0]
        self.switches: list[Switch] = []
        self.rates: dict[int, tuple[float, float]] = {}  # learners -> (env steps consumed/s, when measured)
        self._entered: tuple[float, ...] | None = None  # the current setting's first measured profile
        self.phase_shifts = 0  # times the rates were forgotten
        self._since = clock()  # a decision needs a whole window since the start or the last switch
        self._seen: collections.deque[tuple[float, ...]] = collections.deque()  # time, wait, learn, steps, speed
        self.last_share = math.nan  # the waiting share at the last update
        self.last_rate = math.nan  # env steps consumed per second at the last decision

    @property
    def samplers(self) -> list[int]:
        return [r for r in self.rollout if r == 0 or r not in self.learners]

    @property
    def routes(self) -> dict[int, int]:
        return routes_for(self.learners, self.samplers)

    def observe(self, times: dict[int, tuple[float, float]], consumed: int, speed: float = math.nan) -> None:
        """One update: ``times``, each learner rank's seconds waiting for chunks and learning;
        ``consumed``, env steps all learners learned from in it; ``speed``, the rollout ranks'
        median sampling speed (env steps per second of sampling per env group; NaN: unknown)."""
        now = self.clock()
        wait, learn = max(times.values(), key=lambda t: t[0])  # the learner the others waited for
        self._seen.append((now, max(wait, 0.0), max(learn, 0.0), consumed, speed))
        while len(self._seen) > self.MIN_UPDATES and self._seen[0][0] < now - self.window_s:
            self._seen.popleft()  # the window, or the last few updates where they are slower

    @property
    def wait_share(self) -> float:
        """The waiting share over the window (NaN: nothing measured)."""
        wait = sum(s[1] for s in self._seen)
        total = wait + sum(s[2] for s in self._seen)
        return wait / total if total > 0 else math.nan

    def _rate(self) -> float:
        """Env steps consumed per second over the window (its first update opens it)."""
        span = self._seen[-1][0] - self._seen[0][0]
        return sum(s[3] for s in list(self._seen)[1:]) / span if span > 0 else 0.0

    def _profile(self) -> tuple[float, ...]:
        """What the window says of the workload: the median sampling speed, and the learning
        seconds per env step consumed."""
        speeds = [s[4] for s in self._seen if not math.isnan(s[4])]
        steps = sum(s[3] for s in self._seen)
        return (statistics.median(speeds) if speeds else math.nan,
                sum(s[2] for s in self._seen) / steps if steps else math.nan)

    def _shifted(self, profile: tuple[float, ...]) -> bool:
        """Whether ``profile`` is more than ``SHIFT`` from the one the setting started with."""
        return any(a > 0 and not math.isnan(a) and not math.isnan(b) and abs(b / a - 1) > self.SHIFT
                   for a, b in zip(self._entered, profile))

    def _worse(self, learners: int, rate: float) -> bool:
        """Whether ``learners`` learners were measured doing worse than ``rate``, lately."""
        got = self.rates.get(learners)
        return got is not None and self.clock() - got[1] < self.MEMORY_WINDOWS * self.window_s and got[0] < rate

    def update(self, version: int, published: bool) -> bool:
        """Maybe switch one rank at ``version`` (only a published one: the plan must travel
        with it); True when the routes changed."""
        share = self.last_share = self.wait_share
        if not published or self.clock() - self._since < self.window_s or len(self._seen) < self.MIN_UPDATES:
            return False
        rate, n = self._rate(), len(self.learners)
        self.last_rate = rate
        profile = self._profile()
        if self._entered is None:
            self._entered = profile
        elif self._shifted(profile):  # the workload changed: what other settings did is history
            self.rates.clear()
            self._entered = profile
            self.phase_shifts += 1
        self.rates[n] = (rate, self.clock())
        joining = [r for r in self.candidates if r not in self.learners]
        if joining:
            try:
                routes_for(self.learners + joining[:1], [r for r in self.samplers if r != joining[0]])
            except ValueError:
                joining = []  # too few ranks would be left sampling
        said = f"the learners waited {share:.0%} of their time for chunks"
        if share < self.low and joining and not self._worse(n + 1, rate):
            rank, to = joining[0], "learner"
            self.learners.append(rank)
            why = f"{said} (< {self.low:.0%}): learning is the bottleneck"
        elif share > self.high and n > 1 and not self._worse(n - 1, rate):
            rank, to = self.learners.pop(), "rollout"
            why = f"{said} (> {self.high:.0%}): the rollouts are the bottleneck"
        else:
            return False
        self.switches.append(Switch(version, rank, to, f"{why}; {rate:.0f} env steps/s consumed with {n} learner(s)"))
        self._since, self._entered = self.clock(), None
        self._seen.clear()  # measured again with the new roles
        return True
