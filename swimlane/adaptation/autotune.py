"""The resource manager's controller: bounded, logged adjustments of a run's knobs from
stage profiles measured while it runs (issue #20; ``swimlane.autotune``).

A :class:`Profile` is one measuring window: the env steps per second (the rollout's pace,
idle envs of ended episodes included) and, for the reasons it gives, each lane's busy
share, the idle env-step share and the process's CPU share (lanes busy for a core or more
in a process that ran on little more than one of its cores were contending for the GIL).
:class:`Controller` climbs the throughput one knob step at a time:

* it tries one move (a knob up or down by its step, within its bounds), trying first the
  knob the profile points at (:meth:`Controller.suggest`);
* it keeps a move that raised throughput by more than ``tolerance`` over the window just
  before it, and reverts one that did not, marking it tried; after a revert it measures
  the restored values again for a window before the next move, so that every move is
  judged against a neighbouring window (a lucky window does not become a bar that every
  later move fails);
* once no untried move is left it has **converged** and stops moving: a stationary workload
  sees no oscillation;
* it explores again when throughput drifts from the level it converged at by more than
  ``shift`` (the workload changed phase).

Every move and revert is a :class:`Decision` with its reason, for the metrics and the
report. The controller is pure: the caller measures and applies.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

from swimlane.observation.trace import IDLE_KINDS


@dataclass(frozen=True)
class Knob:
    """An integer setting the controller may move, within ``[low, high]``, ``step`` at a time."""

    name: str
    low: int
    high: int
    step: int = 1

    def __post_init__(self):
        if not self.low <= self.high or self.step < 1:
            raise ValueError(f"knob {self.name}: needs low <= high and step >= 1, got {self.low}, {self.high}, "
                             f"{self.step}")

    def clamp(self, v: int) -> int:
        return max(self.low, min(self.high, v))


@dataclass(frozen=True)
class Profile:
    """One measuring window of a running job."""

    steps_per_s: float  # env steps per second, of live and ended (idle) envs alike: the rollout's pace
    busy: dict[str, float] = field(default_factory=dict)  # lane -> busy share of the window, 0..1
    idle_env_share: float = 0.0  # env steps of ended episodes waiting, over all env steps
    cpu_share: float | None = None  # the process's CPU seconds per second of the window
    cores: int = 1  # the CPUs the process may run on

    @property
    def bottleneck(self) -> str | None:
        """The busiest lane (None without lane times)."""
        return max(self.busy, key=self.busy.get) if self.busy else None

    @property
    def contended(self) -> bool:
        """The lanes together were busy for about a core or more, yet the process ran on
        little more than one of its cores: their threads take turns on the GIL anyway, and
        pay for the hand-offs between them."""
        if self.cpu_share is None or self.cores < 2:
            return False
        return sum(self.busy.values()) >= 0.9 and self.cpu_share <= 1.25


@dataclass(frozen=True)
class Decision:
    window: int
    knob: str
    old: int
    new: int
    reason: str

    def as_dict(self) -> dict:
        return {"window": self.window, "knob": self.knob, "old": self.old, "new": self.new, "reason": self.reason}


class Controller:
    def __init__(self, knobs: list[Knob], values: dict[str, int], *, tolerance: float = 0.03, shift: float = 0.15,
                 prefer: dict[str, tuple[str, int]] | None = None,
                 needs: dict[str, Callable[[dict[str, int]], bool]] | None = None):
        """``values``: the knobs' starting values (clamped to their bounds); ``prefer``:
        bottleneck lane -> (knob, direction) to try first when that lane is the busiest;
        ``needs``: knob -> whether it has any effect at the current values (a wait for more
        groups' requests has none while one group steps): a knob without effect is not
        tried, so no window is spent measuring noise."""
        if not knobs:
            raise ValueError("autotune: no knob to adjust")
        self.knobs = {k.name: k for k in knobs}
        self.values = {k.name: k.clamp(int(values.get(k.name, k.low))) for k in knobs}
        self.tolerance, self.shift, self.prefer, self.needs = tolerance, shift, prefer or {}, needs or {}
        self.window = 0
        self.best: float | None = None  # throughput at the current values
        self.trial: tuple[str, int, int] | None = None  # (knob, old value, direction) being tried
        self.remeasure = False  # the last trial was reverted: measure the restored values first
        self.tried: set[tuple[str, int]] = set()  # moves from the current values that did not help
        self.converged = False
        self.decisions: list[Decision] = []

    def fix(self, name: str, value: int) -> None:
        """Hold knob ``name`` at ``value`` from now on (it cannot be set otherwise)."""
        self.knobs[name] = Knob(name, value, value)
        self.values[name] = value

    def moves(self) -> list[tuple[str, int]]:
        """Untried moves from the current values that stay within bounds, of knobs that have
        an effect there."""
        out = []
        for name, knob in self.knobs.items():
            if name in self.needs and not self.needs[name](self.values):
                continue
            for d in (1, -1):
                v = self.values[name] + d * knob.step
                if knob.low <= v <= knob.high and (name, d) not in self.tried:
                    out.append((name, d))
        return out

    def suggest(self, profile: Profile) -> tuple[str, int] | None:
        """The next move to try: the one contention (:attr:`Profile.contended`, key
        ``"contention"`` in ``prefer``) or else the bottleneck points at, else the first
        untried."""
        moves = self.moves()
        if not moves:
            return None
        hint = self.prefer.get("contention") if profile.contended else None
        if hint not in moves:
            hint = self.prefer.get(profile.bottleneck or "")
        return hint if hint in moves else moves[0]

    def _decide(self, knob: str, new: int, reason: str) -> Decision:
        d = Decision(self.window, knob, self.values[knob], new, reason)
        self.values[knob] = new
        self.decisions.append(d)
        return d

    def observe(self, profile: Profile) -> list[Decision]:
        """Take one window's profile; returns the decisions to apply now (at most one move,
        possibly after reverting the last trial)."""
        self.window += 1
        sps, out = profile.steps_per_s, []
        if self.trial is not None:  # judge the move tried during this window
            name, old, d = self.trial
            self.trial = None
            gain = sps / self.best - 1.0 if self.best else 0.0
            if gain > self.tolerance:
                self.best, self.tried = sps, {(name, -d)}  # kept: going back is known to be worse
            else:
                out.append(self._decide(name, old, f"revert: {sps:.0f} steps/s, {gain:+.1%} from {self.best:.0f}"))
                self.tried.add((name, d))
                self.remeasure = True
                return out
        elif self.remeasure:
            self.best, self.remeasure = sps, False
        elif self.best is None:
            self.best = sps
        elif self.converged:
            drift = sps / self.best - 1.0
            if abs(drift) <= self.shift:
                return out
            self.converged, self.tried, self.best = False, set(), sps  # a new phase: explore again
        else:
            self.best = sps
        move = self.suggest(profile)
        if move is None:
            self.converged = True
            return out
        name, d = move
        old = self.values[name]
        new = self.knobs[name].clamp(old + d * self.knobs[name].step)
        why = f"try: {sps:.0f} steps/s, {profile.idle_env_share:.0%} of env steps idle"
        if profile.bottleneck is not None:
            why += f", {profile.bottleneck} busiest ({profile.busy[profile.bottleneck]:.0%})"
        if profile.contended:
            why += (f", lanes busy {sum(profile.busy.values()):.2f} cores while the process ran "
                    f"{profile.cpu_share:.2f} of {profile.cores}")
        out.append(self._decide(name, new, why))
        self.trial = (name, old, d)
        return out


# -- on a live run ------------------------------------------------------------------------


class LaneClock:
    """Busy seconds per lane from a tracer's spans recorded since the last read."""

    def __init__(self, tracer):
        self.tracer, self.seen = tracer, 0

    def busy(self) -> dict[str, float]:
        spans = self.tracer.spans
        new, self.seen = spans[self.seen:], len(spans)
        out: dict[str, float] = {}
        for lane, kind, start, end in new:
            if kind not in IDLE_KINDS:
                out[lane] = out.get(lane, 0.0) + end - start
        return out


@dataclass
class Setting:
    """A knob and how to read and change it on the running job."""

    knob: Knob
    get: Callable[[], int]
    set: Callable[[int], None]
    needs: Callable[[dict[str, int]], bool] | None = None  # whether it has an effect at these knob values


class Tuner:
    """The controller on a live run: every ``window_s`` a :class:`Profile` (env steps per
    second and idle share from the ledger, lane busy shares from the trace), the
    controller's decisions applied and logged.

    Env steps are counted a chunk at a time, so a rate over a fixed window would be off by
    up to a chunk (8% for a 1 s window of 12 chunks). The rate is therefore measured from
    the last chunk counted before a window to the last one counted in it: whole chunks
    over the time they took. A window in which no chunk was counted is extended."""

    def __init__(self, settings: list[Setting], *, ledger, tracer, window_s: float, log=None,
                 prefer: dict[str, tuple[str, int]] | None = None, min_chunks: int = 4):
        """A window lasts ``window_s`` and at least ``min_chunks`` chunks sent: a rate over one
        or two chunks of a pipelined rank varies by a fifth from window to window (genesis,
        2 s windows), which no tolerance tells from a move's effect."""
        self.settings = {s.knob.name: s for s in settings}
        self.controller = Controller([s.knob for s in settings], {s.knob.name: s.get() for s in settings},
                                     prefer=prefer, needs={s.knob.name: s.needs for s in settings if s.needs})
        for name, s in self.settings.items():  # start from the clamped values
            if s.get() != self.controller.values[name]:
                s.set(self.controller.values[name])
        self.ledger, self.clock, self.window_s, self.log = ledger, LaneClock(tracer), window_s, log
        now = time.perf_counter()
        self.last = (now, ledger["env_steps_live"], ledger["env_steps_idle"], now)  # (chunk time, counts, wall)
        self.cpu = time.process_time()  # CPU seconds of every thread of the process
        self.warm = False  # the first window has passed
        self.min_chunks, self.chunks = min_chunks, ledger["chunks_sent"]
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.clock.busy()  # spans before the first window do not count

    def profile(self) -> Profile | None:
        """The window since the last profile; None (the window goes on) while no chunk has
        been counted in it."""
        now, live, idle = time.perf_counter(), self.ledger["env_steps_live"], self.ledger["env_steps_idle"]
        t0, live0, idle0, wall0 = self.last
        if live == live0:
            return None
        stamp = self.ledger.changed.get("env_steps_live", now)
        self.last = (stamp, live, idle, now)
        cpu, self.cpu = self.cpu, time.process_time()
        wall = max(now - wall0, 1e-9)
        busy = {lane: s / wall for lane, s in self.clock.busy().items()}
        steps = (live - live0) + (idle - idle0)
        # Every env step counts: as the policy improves, more episodes end early and wait for
        # their batch, so useful steps per second fall while the knobs stay put; judged by them,
        # every move would look worse than the window before it.
        return Profile(steps_per_s=steps / max(stamp - t0, 1e-9), busy=busy,
                       idle_env_share=(idle - idle0) / max(steps, 1), cpu_share=(self.cpu - cpu) / wall,
                       cores=self.cores)

    def tick(self) -> list[Decision]:
        """Measure the window that just ended and apply what the controller decides. The
        first window, while the pipeline fills (no update may have run yet), only starts
        the clock."""
        profile = self.profile()
        if profile is None:
            return []
        if not self.warm:
            self.warm = True
            return []
        decisions = self.controller.observe(profile)
        for d in decisions:
            try:
                self.settings[d.knob].set(d.new)
            except OSError as exc:  # e.g. raising a thread's priority needs privileges
                self.settings.pop(d.knob)
                self.controller.fix(d.knob, d.old)
                if self.log is not None:
                    self.log.warning("autotune: cannot set %s to %d (%r); it stays %d", d.knob, d.new, exc, d.old)
                continue
            if self.log is not None:
                self.log.info("autotune: %s %d -> %d (%s)", d.knob, d.old, d.new, d.reason)
        return decisions

    def maybe_tick(self) -> list[Decision]:
        """:meth:`tick` once ``window_s`` has passed since the last window began and
        ``min_chunks`` chunks have been sent."""
        if time.perf_counter() - self.last[3] < self.window_s or (
                self.ledger["chunks_sent"] - self.chunks < self.min_chunks):
            return []
        self.chunks = self.ledger["chunks_sent"]
        return self.tick()

    def metrics(self) -> dict[str, float]:
        """The knobs' current values and the decisions so far, for the metrics rows."""
        return {**{f"autotune_{k}": float(v) for k, v in self.controller.values.items()},
                "autotune_decisions": float(len(self.controller.decisions))}
