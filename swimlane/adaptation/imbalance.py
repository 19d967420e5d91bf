"""A rank's part in measuring and answering imbalance between rollout ranks
(:mod:`swimlane.adaptation.balance` holds the pure parts: the window, the straggler rule, the plan).

On a learner, :meth:`RankBalance.after_update` sums each rollout rank's window over the
learners, names the stragglers (metrics, and a log line on rank 0) and, on rank 0 with
``swimlane.rebalance`` or ``swimlane.roles=adaptive``, makes the plan the next published
version carries (:attr:`RankBalance.plan_words`): shares and env groups
(:class:`swimlane.adaptation.balance.Rebalancer`), who learns and where chunks go
(:class:`swimlane.adaptation.roles.RolePlanner`). On every other rank, :meth:`RankBalance.apply` takes
a plan from a version header and hands it to the rank (its sampling lane, its sink, its
learner).
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import Any, Callable

import torch
import torch.distributed as dist

from dvla.config import SwimlaneConfig
from launch.placement import Placement
from memory import runtime
from swimlane.adaptation.balance import Rebalancer, Rebalancing, equal_shares, stragglers
from swimlane.observation.throughput import Throughput
from swimlane.adaptation.roles import RolePlanner

log = logging.getLogger("dvla.swimlane")


class RankBalance:
    def __init__(self, sl: SwimlaneConfig, rank: int, world_size: int, placement: Placement,
                 routes: dict[int, int], learner_group=None):
        """``routes``: every rollout rank's learner at the start (the rank's plan)."""
        self.sl, self.rank, self.world_size, self.learner_group = sl, rank, world_size, learner_group
        self.rollout_ranks, self.learners = placement.rollout, placement.learners
        self.throughput = Throughput(sl.balance_window_s) if rank in placement.learners else None
        self.stragglers: list[int] = []
        self.named: set[int] = set()  # every rank named a straggler so far
        self.routes = dict(routes)  # rollout rank -> the learner its chunks go to
        self.rebalancer = self.roles = None
        if sl.rebalance and rank == 0 and world_size > 1:
            self.rebalancer = Rebalancer(self.routes, sl.env_groups + sl.spare_groups, sl.env_groups,
                                         sl.straggler_factor, sl.balance_window_s)
        if sl.roles == "adaptive" and rank == 0:
            self.roles = RolePlanner([r for r in placement.learners if r != 0], placement.rollout, sl.role_low,
                                     sl.role_high, sl.balance_window_s)
        self.planning = sl.rebalance or sl.roles == "adaptive"
        self.plan_words = Rebalancing().encode(world_size) if self.planning else None  # no plan until measured

    def after_update(self, version: int, apply: Callable[[Rebalancing], None] | None, wait_s: float = 0.0,
                     learn_s: float = 0.0, consumed: int = 0, published: bool = True) -> dict[str, float]:
        """A learner's metrics after an update: each rollout rank's speed (env steps per second
        of sampling per env group, over the learners' windows) and the stragglers; with a plan,
        its shares, env groups and roles. ``apply``: the rank's, for its own part of the plan;
        ``wait_s``, ``learn_s``, ``consumed``: how this learner spent the update and the env
        steps it learned from (adaptive roles); ``published``: whether this version goes out
        (only then may roles switch)."""
        # Per rank: steps, sample_s, chunks, dropped (its window); wait_s, learn_s, consumed (this update)
        t = torch.zeros(self.world_size, 7, dtype=torch.float64)
        for r, d in self.throughput.by_rank().items():
            if 0 <= r < self.world_size:
                t[r, :4] = torch.tensor([d.steps, d.sample_s, d.chunks, d.dropped], dtype=torch.float64)
        t[self.rank, 4:] = torch.tensor([wait_s, learn_s, consumed], dtype=torch.float64)
        if self.sl.learner_ranks > 1:
            with runtime.current().collective():
                dist.all_reduce(t, group=self.learner_group)
        speed = {r: float(t[r, 0] / t[r, 1]) for r in self.rollout_ranks if t[r, 1] > 0}
        self._name(stragglers(speed, self.sl.straggler_factor), speed)
        m = {"stragglers": float(len(self.stragglers)), **{f"speed/rank{r}": v for r, v in speed.items()},
             **{f"dropped_share/rank{r}": float(t[r, 3] / t[r, 2]) for r in self.rollout_ranks if t[r, 2] > 0}}
        if self.roles is not None:
            self.roles.observe({r: (float(t[r, 4]), float(t[r, 5])) for r in self.learners}, int(t[:, 6].sum()),
                               statistics.median(speed.values()) if speed else math.nan)
            self._switch_roles(version, published)
        if self.rebalancer is not None:
            moves = len(self.rebalancer.moves)
            self.rebalancer.update(speed, version)
            for move in self.rebalancer.moves[moves:]:
                log.warning("rebalancing at version %d: an env group moves from rank %d to rank %d (%s)",
                            move.version, move.src, move.dst, move.reason)
            m["rebalance_moves"] = float(len(self.rebalancer.moves))
        if self.rebalancer is not None or self.roles is not None:
            plan = self._plan()
            self.plan_words = plan.encode(self.world_size)
            if apply is not None:
                apply(plan)
            m.update({**{f"groups/rank{r}": float(a) for r, a in plan.active.items()},
                      **{f"share/rank{r}": v for r, v in plan.shares.items()}})
        if self.roles is not None:
            m.update({"learners": float(len(self.roles.learners)), "role_switches": float(len(self.roles.switches)),
                      "role_phase_shifts": float(self.roles.phase_shifts), "role_rate": self.roles.last_rate,
                      "learner_wait_share": self.roles.last_share,
                      **{f"role/rank{r}": float(r in self.roles.learners) for r in self.roles.candidates}})
        return m

    def _switch_roles(self, version: int, published: bool) -> None:
        if self.roles.update(version, published):
            switch = self.roles.switches[-1]
            log.warning("roles at version %d: rank %d moves to %s (%s)", version, switch.rank, switch.to,
                        switch.reason)
            self.routes = self.roles.routes
            if self.rebalancer is not None:
                self.rebalancer.set_routes(self.routes)

    def _plan(self) -> Rebalancing:
        """Rank 0's plan for the next version: the rebalancer's shares and env groups (equal
        shares and every group without it), the roles' routes, and no env group on a rank that
        moved to the learners."""
        if self.rebalancer is not None:
            base = self.rebalancer.plan
            plan = Rebalancing(shares=dict(base.shares), active={r: base.active[r] for r in self.routes})
        else:
            plan = Rebalancing(shares=equal_shares(self.routes), active={r: self.sl.env_groups for r in self.routes})
        if self.roles is not None:
            plan.routes = dict(self.routes)
            plan.active.update({r: 0 for r in self.roles.learners if r not in self.routes})
        return plan

    def _name(self, slow: list[int], speed: dict[int, float]) -> None:
        """Rank 0 logs a change of the stragglers: a warning the first time a rank is named."""
        if slow != self.stragglers and self.rank == 0:
            first = set(slow) - self.named
            (log.warning if first else log.info)(
                "straggler rollout rank(s) %s: %s env steps/s per env group, the median rank %.0f "
                "(swimlane.straggler_factor=%g)", slow or "none", ", ".join(f"{speed[r]:.0f}" for r in slow) or "-",
                statistics.median(speed.values()) if speed else 0.0, self.sl.straggler_factor)
            self.named |= first
        self.stragglers = slow

    def apply(self, words: list[int], apply: Callable[[Rebalancing], None]) -> None:
        """A plan (a version header's words) to the rank's ``apply``; a plan that does not
        decode is logged and ignored."""
        try:
            plan = Rebalancing.decode(words)
        except ValueError as exc:
            log.error("ignored a rebalancing plan: %s", exc)
            return
        apply(plan)

    def summary(self) -> dict[str, Any]:
        """What the learner saw of each rollout rank and env group in its last window."""
        out: dict[str, Any] = {
            "window_s": self.sl.balance_window_s, "stragglers": self.stragglers,
            "by_rank": {str(r): vars(d) for r, d in sorted(self.throughput.by_rank().items())},
            "by_group": {f"{r}/{g}": vars(d) for (r, g), d in sorted(self.throughput.by_group().items())}}
        if self.rebalancer is not None:
            out["moves"] = [vars(m) for m in self.rebalancer.moves]
        if self.rebalancer is not None or self.roles is not None:
            plan = self._plan()
            out["plan"] = {"shares": plan.shares, "active": plan.active, "routes": plan.routes}
        if self.roles is not None:
            out["roles"] = {"learners": self.roles.learners, "switches": [vars(s) for s in self.roles.switches]}
        return out
