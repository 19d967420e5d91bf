"""The run's side of every learner update, and of every version the broadcast lane sends:
metrics (``metrics.jsonl``), checkpoints, the snapshot handed to the broadcast lane, the
health checks between chunks, and a rank's part of each rebalancing plan. The gradient and
broadcast lanes call it (:func:`swimlane.assembly.wiring.connect` passes them its methods);
it holds no thread of its own."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable

from dvla.distributed import sum_over_group
from dvla.distributed.sharding import learner_bytes
from dvla.metrics import MetricsLogger
from dvla.rollout import EPISODE_TOTALS, episode_means, episode_totals
from dvla.types import RolloutBatch
from swimlane.adaptation.balance import Rebalancing
from swimlane.assembly.build import memory_metrics
from swimlane.assembly.parts import RankParts
from swimlane.assembly.state import POLL_S, RunState
from swimlane.lanes.broadcast import SnapshotSlot
from swimlane.lanes.chunks import RoutedSink
from swimlane.lanes.gradient import Update
from swimlane.lanes.snapshots import check_finite, copy_into_snapshot
from swimlane.observation.health import StallTimer, check_senders, check_stall
from swimlane.observation.ledger import chunk_accounting

log = logging.getLogger("dvla.swimlane")


class Updates:
    def __init__(self, parts: RankParts, state: RunState, on_update: Callable[[dict[str, Any]], None] | None = None):
        """``on_update(record)``: called on rank 0 after every update with the record written
        to ``metrics.jsonl`` (live displays, custom logging)."""
        self.parts, self.state, self.on_update = parts, state, on_update
        self.cfg, self.sl = state.cfg, state.cfg.swimlane
        self.slot = SnapshotSlot()  # gradient lane -> broadcast lane (rank 0)
        self.sampling = None  # the rank's sampling lane, once wired: it applies its part of a plan
        self.tuner = None  # swimlane.autotune's, once the lanes it adjusts run
        self.metrics: MetricsLogger | None = None

    def open_metrics(self) -> MetricsLogger:
        self.metrics = MetricsLogger(self.state.out_dir, self.state.iterations, enabled=self.state.rank == 0,
                                     progress=self.cfg.run.progress, initial=self.state.version,
                                     tensorboard=self.cfg.run.tensorboard)
        return self.metrics

    # -- checkpoints ------------------------------------------------------------------------

    def save_checkpoint(self) -> None:
        """From the gradient lane: the run's state at this version, atomically (rank 0 writes)."""
        s = self.state
        with s.tracer.span("gradient", "checkpoint"):
            self.parts.checkpoints.save(s.version, {"env_steps": s.env_steps, "counters": s.ledger.totals(),
                                                    "restarts": s.restarts, "config": self.cfg.to_dict()},
                                        write=s.rank == 0)
        s.last_good_version = s.version  # (weights that are not finite are never saved)

    def checkpoint_if_preempted(self) -> None:
        """After a stop that SIGTERM asked for (not an error): rank 0 checkpoints the current
        version, so that ``--resume`` goes on from it."""
        s, ckpt = self.state, self.parts.checkpoints
        if not s.preempted or s.rank != 0 or ckpt is None or s.version == 0:
            return
        if any(p.name == ckpt.manager.path_for(s.version).name for p in ckpt.manager.list()):
            return  # (the learners ended together at this version, and saved it)
        if self.cfg.sharded_learners:  # a save gathers from every learner, which may be gone
            log.warning("preempted: sharded learners write no checkpoint on the way out")
        else:
            self.save_checkpoint()

    # -- after each update --------------------------------------------------------------------

    def finish_update(self, update: Update) -> bool:
        """After one learner step: the new version's metrics, checkpoint and snapshot. True
        after the last update (or when the time is up)."""
        s, p = self.state, self.parts
        s.version += 1
        stats, steps_global = self._global_stats(update.batch, update.env_steps)
        stats.update(p.balance.after_update(
            s.version, self.apply_plan, update.wait_s, update.learn_s,
            int(update.batch.valid.sum()) if update.batch is not None else 0, p.order.published(s.version)))
        s.env_steps = steps_global
        wall = time.perf_counter() - s.start_time
        totals = s.ledger.totals()
        m = {"version": s.version, "world_size": s.world_size, "env_steps": steps_global,
             "env_steps_per_s": (steps_global - s.ledger.carried_env_steps) / wall, "learn_s": update.learn_s,
             "dropped_stale": totals["dropped_stale"], "queue_depth": p.source.depth(),
             "publish_bytes": p.bc.last_version_bytes if p.bc is not None else 0,  # the last version sent
             "learner_state_bytes": learner_bytes(p.algo),  # weights and optimizer state held here
             "chunks_consumed": totals["chunks_consumed"], "env_errors": totals["env_errors"],
             **{f"chunks_{k}": v for k, v in self.chunk_accounting().items()
                if k in ("sent", "rejected_invalid", "lost_dead_peer")},
             **stats, **update.learn, **memory_metrics(p.memory, p.host_pool),
             **(self.tuner.metrics() if self.tuner is not None else {})}
        lead, sharded = s.rank == 0, self.cfg.sharded_learners  # sharded: every learner gathers
        s.history.append(self.metrics.log(s.version - 1, m))
        if lead and self.on_update is not None:
            self.on_update(s.history[-1])
        last = s.version == s.iterations or s.time_up or s.stop_agreed
        every = self.cfg.run.save_every
        if (lead or sharded) and ((every and s.version % every == 0) or last):
            self.save_checkpoint()
        if (lead or sharded) and (s.version % self.sl.broadcast_every == 0 or last):
            # Skipping a version would break the learners' order of collectives.
            if lead:
                self.handoff(wait=self.sl.mode == "sync" or last or p.order.enabled)
            else:
                self.take_snapshot()
        p.order.updated(s.version)  # this update's collectives are done
        return last

    def _global_stats(self, batch: RolloutBatch | None, steps_total: int) -> tuple[dict[str, float], int]:
        """Episode stats averaged and consumed env steps summed over the learner ranks."""
        s, limit = self.state, self.cfg.run.time_limit_s
        time_up = float(bool(limit) and time.perf_counter() - s.start_time >= limit)
        totals = episode_totals(batch) if batch is not None else dict.fromkeys(EPISODE_TOTALS, 0.0)  # sat out
        stats = {**totals, "env_steps": float(steps_total), "time_up": time_up, "stop_asked": float(s.stop_asked)}
        if self.sl.learner_ranks > 1:  # learners agree on when the time is up, or a signal asks them to end
            stats = sum_over_group(stats, self.parts.groups.learner)
        s.time_up = stats.pop("time_up") > 0
        s.stop_agreed = stats.pop("stop_asked") > 0
        steps = s.ledger.carried_env_steps + round(stats.pop("env_steps"))
        return episode_means(stats), steps

    def check_health(self, stall: StallTimer) -> None:
        """Between chunks: a rollout rank whose heartbeats stopped, or no usable chunk for too
        long, stops the run."""
        s, p = self.state, self.parts
        if s.world_size > 1:
            check_senders(p.expected_senders, p.source.ended, p.source.receiver.dead_peers,
                          self.cfg.data_plane.peer_timeout_s, self.chunk_accounting)
        check_stall(stall, s.ledger.counts, s.version)

    def activations(self):
        """On CUDA, the learner's activations go to the transient pool's segments and its
        device work to a stream of its own (swimlane/lanes/streams.py)."""
        stack = contextlib.ExitStack()
        if self.parts.memory is not None:
            stack.enter_context(self.parts.memory.transient.activations())
        stack.enter_context(self.parts.streams["gradient"].use())
        return stack

    def chunk_accounting(self) -> dict[str, int]:
        """Where every chunk sent to this learner went (:func:`swimlane.observation.ledger.chunk_accounting`)."""
        if self.state.world_size == 1:
            return chunk_accounting(self.state.ledger.counts, local=True)
        return self.parts.source.accounting(self.state.ledger.counts, self.parts.expected_senders)

    # -- rebalancing --------------------------------------------------------------------------

    def apply_plan(self, plan: Rebalancing) -> None:
        """This rank's part of a plan: its share and env groups (the sampling lane applies them
        in its own thread), where its chunks go (the sink), and whether it learns in its next
        update (adaptive roles)."""
        s, sink = self.state, self.parts.sink
        share, active, route = (part.get(s.rank) for part in (plan.shares, plan.active, plan.routes))
        moved = isinstance(sink, RoutedSink) and route is not None and route != sink.learner
        if self.sampling is not None and (share is not None or active is not None or moved):
            self.sampling.offer_plan(share, active, anchor=moved)
        if moved:
            sink.set_route(route)
        if plan.routes and self.parts.plan.learner:
            s.learning = s.rank == 0 or s.rank in plan.routes.values()

    # -- snapshots and publishing ---------------------------------------------------------------

    def handoff(self, wait: bool) -> None:
        """Give the broadcast lane a snapshot of the current weights (one copy), unless it is
        still sending the previous one and ``wait`` is false: then this version is skipped
        and a later one goes out (newest weights win)."""
        s = self.state

        def copy() -> None:
            with s.tracer.span("gradient", "snapshot"):
                self.take_snapshot()

        if not self.slot.offer(s.version, copy, wait, s.stop_event, POLL_S) and self.slot.pending:
            s.ledger.add("publish_skipped_busy")

    def retry_handoff(self) -> None:
        if self.slot.pending and self.slot.free:
            self.handoff(wait=False)  # a version skipped while the broadcast lane was busy

    def take_snapshot(self) -> None:
        """Copy (gather, when sharded) the learner's weights for the broadcast lane; weights
        that are not finite are never published (the run stops instead)."""
        s, p = self.state, self.parts
        copy_into_snapshot(p.policy, p.snapshot, p.publish_dtype)
        if p.snapshot is not None:
            check_finite(p.snap_flats, s.version, s.ledger.counts, s.last_good_version)
            s.last_good_version = s.version

    def first_snapshot(self) -> None:
        """The broadcast source's starting weights (a sharded learner's snapshot starts as a
        copy of the whole starting weights: :func:`swimlane.assembly.build.build_weights`)."""
        if not self.cfg.sharded_learners:
            self.take_snapshot()

    def publish(self, version: int) -> None:
        """The broadcast source sends ``version``: over the control plane (with the rebalancing
        plan) and into its own standby replica."""
        s, p = self.state, self.parts
        with s.tracer.span("broadcast", "publish"):
            if p.bc is not None:
                p.bc.publish(version, p.balance.plan_words)
            if p.plan.rollout:
                p.weights.write(version, p.snap_flats)
        p.order.broadcast_done(version)
        s.ledger.add("publishes")
