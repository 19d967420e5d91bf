"""A rank's part in measuring and answering imbalance between rollout ranks
(:mod:`swimlane.balance` holds the pure parts: the window, the straggler rule, the plan).

On a learner, :meth:`RankBalance.after_update` sums each rollout rank's window over the
learners, names the stragglers (metrics, and a log line on rank 0) and, on rank 0 with
``swimlane.rebalance``, makes the plan the next published version carries
(:attr:`RankBalance.plan_words`). On a rollout rank, :meth:`RankBalance.apply` takes a plan
from a version header and hands this rank's part to its sampling lane.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any, Callable

import torch
import torch.distributed as dist

from dvla.config import SwimlaneConfig
from launch.placement import Placement
from swimlane.balance import Plan, Rebalancer, Throughput, stragglers

log = logging.getLogger("dvla.swimlane")


class RankBalance:
    def __init__(self, sl: SwimlaneConfig, rank: int, world_size: int, placement: Placement,
                 learner_group=None):
        self.sl, self.rank, self.world_size, self.learner_group = sl, rank, world_size, learner_group
        self.rollout_ranks = placement.rollout
        self.throughput = Throughput(sl.balance_window_s) if rank in placement.learners else None
        self.stragglers: list[int] = []
        self.named: set[int] = set()  # every rank named a straggler so far
        self.rebalancer = None
        if sl.rebalance and rank == 0 and world_size > 1:
            self.rebalancer = Rebalancer({r: placement.routes[r] for r in placement.rollout},
                                         sl.env_groups + sl.spare_groups, sl.env_groups, sl.straggler_factor,
                                         sl.balance_window_s)
        self.plan_words = Plan().encode(world_size) if sl.rebalance else None  # no plan until measured

    def after_update(self, version: int, offer: Callable[[float | None, int | None], None] | None) -> dict[str, float]:
        """A learner's metrics after an update: each rollout rank's speed (env steps per second
        of sampling per env group, over the learners' windows) and the stragglers; with a plan,
        its shares and env groups. ``offer``: this rank's sampling lane's, when it rolls out."""
        t = torch.zeros(self.world_size, 4, dtype=torch.float64)  # steps, sample_s, chunks, dropped
        for r, d in self.throughput.by_rank().items():
            if 0 <= r < self.world_size:
                t[r] = torch.tensor([d.steps, d.sample_s, d.chunks, d.dropped], dtype=torch.float64)
        if self.sl.learner_ranks > 1:
            dist.all_reduce(t, group=self.learner_group)
        speed = {r: float(t[r, 0] / t[r, 1]) for r in self.rollout_ranks if t[r, 1] > 0}
        self._name(stragglers(speed, self.sl.straggler_factor), speed)
        m = {"stragglers": float(len(self.stragglers)), **{f"speed/rank{r}": v for r, v in speed.items()},
             **{f"dropped_share/rank{r}": float(t[r, 3] / t[r, 2]) for r in self.rollout_ranks if t[r, 2] > 0}}
        if self.rebalancer is not None:
            moves = len(self.rebalancer.moves)
            plan = self.rebalancer.update(speed, version)
            for move in self.rebalancer.moves[moves:]:
                log.warning("rebalancing at version %d: an env group moves from rank %d to rank %d (%s)",
                            move.version, move.src, move.dst, move.reason)
            self.plan_words = plan.encode(self.world_size)
            if offer is not None:
                self.apply(self.plan_words, offer)
            m.update({"rebalance_moves": float(len(self.rebalancer.moves)),
                      **{f"groups/rank{r}": float(a) for r, a in plan.active.items()},
                      **{f"share/rank{r}": v for r, v in plan.shares.items()}})
        return m

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

    def apply(self, words: list[int], offer: Callable[[float | None, int | None], None]) -> None:
        """A plan (a version header's words): this rank's share and env groups to ``offer``
        (:meth:`swimlane.lanes.sampling.SamplingLane.offer_plan`); a plan that does not decode
        is logged and ignored."""
        try:
            plan = Plan.decode(words)
        except ValueError as exc:
            log.error("ignored a rebalancing plan: %s", exc)
            return
        share, active = plan.shares.get(self.rank), plan.active.get(self.rank)
        if share is not None or active is not None:
            offer(share, active)

    def summary(self) -> dict[str, Any]:
        """What the learner saw of each rollout rank and env group in its last window."""
        out: dict[str, Any] = {
            "window_s": self.sl.balance_window_s, "stragglers": self.stragglers,
            "by_rank": {str(r): vars(d) for r, d in sorted(self.throughput.by_rank().items())},
            "by_group": {f"{r}/{g}": vars(d) for (r, g), d in sorted(self.throughput.by_group().items())}}
        if self.rebalancer is not None:
            out["moves"] = [vars(m) for m in self.rebalancer.moves]
            out["plan"] = {"shares": self.rebalancer.plan.shares, "active": self.rebalancer.plan.active}
        return out
