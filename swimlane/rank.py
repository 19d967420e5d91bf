"""A rank: its parts (built from its plan by :func:`swimlane.assemble.assemble`), its four
lanes wired to their channels, and the run's side of each learner update (metrics,
checkpoint, snapshot). :class:`swimlane.runner.Swimlane` runs them."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from dvla.config import JobConfig
from dvla.distributed import sum_over_group
from dvla.metrics import MetricsLogger
from dvla.rollout import EPISODE_TOTALS, cameras_of, episode_means, episode_totals
from dvla.distributed.sharding import learner_bytes
from dvla.types import RolloutBatch
from planes.control import SHUTDOWN
from planes.data import DataPlaneConfig
from swimlane.assemble import assemble, restarts_from_env
from swimlane.balance import Plan
from swimlane.build import memory_metrics
from swimlane.channels import LocalChannel
from swimlane.chunks import RoutedSink
from swimlane.driver import lower_thread_priority
from swimlane.health import StallTimer, check_senders, check_stall
from swimlane.lanes import (
    InferenceLane,
    LearnerConfig,
    LearnerLane,
    PublishLane,
    ReceiveLane,
    Reply,
    Request,
    SamplingConfig,
    SamplingLane,
    SnapshotSlot,
    Update,
)
from swimlane.lanes.turns import Turns
from swimlane.ledger import Ledger, chunk_accounting
from swimlane.snapshots import check_finite, copy_into_snapshot
from swimlane.trace import Tracer
from swimlane.tuning import tuner_for

log = logging.getLogger("dvla.swimlane")
_POLL_S = 0.05
_THROTTLE_S = 2.0  # longest a rollout rank waits for newer weights while producing nothing


class RankLanes:
    def __init__(self, cfg: JobConfig, rank: int = 0, world_size: int = 1,
                 data_plane: DataPlaneConfig | None = None,
                 on_update: Callable[[dict[str, Any]], None] | None = None):
        """``on_update(record)`` is called on rank 0 after every learner update with the
        record written to ``metrics.jsonl`` (for live displays and custom logging)."""
        cfg.validate()
        sl = cfg.swimlane
        self.cfg, self.rank, self.world_size, self.sl = cfg, rank, world_size, sl
        self.on_update = on_update
        if cfg.run.torch_threads:
            torch.set_num_threads(cfg.run.torch_threads)
        self.restarts = restarts_from_env()
        parts = assemble(cfg, rank, world_size, data_plane, restarts=self.restarts, poll_s=_POLL_S)
        self.plan, self.device = parts.plan, parts.device  # what this rank is made of (swimlane/plan.py)
        self.topology, self.placement = parts.topology, parts.placement
        self.is_learner, self.is_rollout = self.plan.learner, self.plan.rollout
        self.rollout_ranks = self.placement.rollout
        self.memory, self.host_pool, self.streams, self.groups = (parts.memory, parts.host_pool, parts.streams,
                                                                  parts.groups)
        self.envs, self.policy, self.algo = parts.envs, parts.policy, parts.algo
        self.sample_gen, self.learn_gen, self.chunk_spec = parts.sample_gen, parts.learn_gen, parts.chunk_spec
        self.checkpoints, self.balance, self.order = parts.checkpoints, parts.balance, parts.order
        self.ckpt = self.checkpoints.manager if self.checkpoints is not None else None
        self.weights, self.snapshot, self.snap_flats, self.bc = (parts.weights, parts.snapshot, parts.snap_flats,
                                                                 parts.bc)
        self.source, self.sink, self.expected_senders = parts.source, parts.sink, parts.expected_senders
        self.publish_dtype = torch.bfloat16 if self.plan.publish_dtype == "bf16" else torch.float32

        self.group_size = cfg.algo.group_size if cfg.algo.name == "grpo" else 1
        self.iterations = cfg.run.iterations
        self.out_dir = Path(cfg.run.out_dir)
        self.tracer = Tracer(sl.trace)
        self.stop_event = threading.Event()  # hard stop: error or request_stop()
        self.rollout_stop = threading.Event()  # the learner is done: rollout lanes wind down
        self.lanes_left_running: list[str] = []  # lanes (by name) still blocked when run() returned
        self.learner_done = threading.Event()
        self.ledger = Ledger()  # counters (a resume carries the earlier attempts' totals)
        self.version, self.resumed_from = 0, None
        if parts.resumed is not None:
            self.version = self.resumed_from = parts.resumed.version
            self.ledger.carry(parts.resumed.counters, parts.resumed.env_steps)
        self.time_up = False  # run.time_limit_s reached
        self.preempted = False  # the launcher's SIGTERM handler: checkpoint on the way out
        self.last_good_version = self.version  # the newest version whose weights were finite when checked
        self.learning = rank == 0 or sl.roles == "fixed"  # this rank learns in the next update

        # Lane state.
        self._sampling: SamplingLane | None = None
        self._inference: InferenceLane | None = None
        self._tids: dict[str, int] = {}  # the lanes' native thread ids, for swimlane.autotune
        self.tuner = None  # swimlane.autotune's, once the lanes it adjusts run
        self.turns = Turns(self.sl.take_turns)  # overlapping lanes, or taking turns (an autotune knob)
        self._requests: LocalChannel[Request] = LocalChannel()  # sampling -> inference
        self._replies: LocalChannel[Reply] = LocalChannel()  # inference -> sampling
        self.slot = SnapshotSlot()  # learner lane -> publish lane (rank 0)
        self.history: list[dict[str, Any]] = []
        self._start_time = time.perf_counter()
        self._start_unix = time.time()

    # -- checkpoints -----------------------------------------------------------------------

    def _save_checkpoint(self) -> None:
        """Rank 0, from the gradient lane: the run's state at this version, atomically."""
        with self.tracer.span("gradient", "checkpoint"):
            self.checkpoints.save(self.version, {"env_steps": self._env_steps, "counters": self.total_counters(),
                                                 "restarts": self.restarts, "config": self.cfg.to_dict()},
                                  write=self.rank == 0)
        self.last_good_version = self.version  # (weights that are not finite are never saved)

    def _checkpoint_if_preempted(self) -> None:
        """After a stop that SIGTERM asked for (``preempted``, set by the launcher; not an
        error): rank 0 checkpoints the current version, so that ``--resume`` goes on from it."""
        if not self.preempted or self.rank != 0 or self.checkpoints is None or self.version == 0:
            return
        if self.cfg.sharded_learners:  # a save gathers from every learner, which may be gone
            log.warning("preempted: sharded learners write no checkpoint on the way out")
        elif not any(p.name == self.ckpt.path_for(self.version).name for p in self.ckpt.list()):
            self._save_checkpoint()

    @property
    def counters(self) -> dict[str, int]:
        """This attempt's counters (:class:`swimlane.ledger.Ledger`)."""
        return self.ledger.counts

    def total_counters(self) -> dict[str, int]:
        """This attempt's counters plus those of the attempts before a resume."""
        return self.ledger.totals()

    # -- lane plumbing ---------------------------------------------------------------------

    def request_stop(self) -> None:
        """Stop every lane soon (signal handlers call this); ``run`` then returns."""
        self.stop_event.set()
        self.rollout_stop.set()

    def _rollout_stopping(self) -> bool:
        return self.rollout_stop.is_set() or self.stop_event.is_set()

    # -- sampling and inference lanes ---------------------------------------------------

    def _sampling_lane(self) -> None:
        self._tids["sampling"] = threading.get_native_id()
        self._sampling = self._make_sampling()
        self._sampling.run()

    def _autotune_tick(self) -> None:
        """From the supervisor: once the lanes it adjusts run, the resource manager's window."""
        if self.tuner is None and self.sl.autotune and self._sampling is not None and self._inference is not None and (
                not self.is_learner or "gradient" in self._tids):
            self.tuner = tuner_for(self.sl, self._sampling, self._inference, lambda: dict(self._tids), self.ledger,
                                   self.tracer, self.turns)
        if self.tuner is not None:
            self.tuner.maybe_tick()

    def _make_sampling(self) -> SamplingLane:
        return SamplingLane(
            envs=self.envs, prepare=self.policy.prepare, requests=self._requests, replies=self._replies,
            sink=self.sink, weights=self.weights, tracer=self.tracer, ledger=self.ledger,
            stop=self.rollout_stop, halt=self.stop_event,
            host_pool=self.host_pool if self.memory is not None else None, turns=self.turns,
            serve=lambda: self._inference is not None and self._inference.serve(),
            cfg=SamplingConfig(
                mode=self.sl.mode, n_envs=self.cfg.env.n_envs, group_size=self.group_size,
                episode_len=self.cfg.env.episode_len, action_chunk=self.cfg.policy.action_chunk,
                has_value=self.policy.has_value_head, chunks_per_update=self.sl.chunks_per_update,
                senders=sum(learner == self.balance.routes[self.rank] for learner in self.balance.routes.values()),
                max_staleness=self.sl.max_staleness, max_env_failures=self.sl.max_env_failures,
                rank=self.rank, rollout_index=self.rollout_ranks.index(self.rank),
                rollout_ranks=len(self.rollout_ranks), extras=self.policy.rollout_extras(),
                cameras=cameras_of(self.policy), independent=self.sl.independent_envs, segment_len=self.sl.segment_len,
                active=self.sl.autotune_start_groups or self.sl.env_groups, reissue=self.sl.reissue, throttle_s=_THROTTLE_S,
                poll_s=_POLL_S),
        )

    def _inference_lane(self) -> None:
        self._tids["inference"] = threading.get_native_id()
        self._inference = self._make_inference()
        self._inference.run(self._rollout_stopping)

    def _make_inference(self) -> InferenceLane:
        return InferenceLane(requests=self._requests, replies=self._replies, weights=self.weights,
                             generator=self.sample_gen, tracer=self.tracer, batch_all=self.sl.mode == "async",
                             pool=self.memory.inference if self.memory is not None else None, poll_s=_POLL_S,
                             stream=self.streams["inference"], groups=self._groups_stepping, turns=self.turns)

    def _groups_stepping(self) -> int:
        """The env groups that step now (autotune and rebalancing plans move the count)."""
        return self._sampling.active if self._sampling is not None else self.sl.env_groups

    # -- gradient lane ---------------------------------------------------------------------

    def _chunks_per_update(self) -> int:
        """Async: ``chunks_per_update``; sync: one chunk from every group routed here."""
        if self.sl.mode == "async":
            return self.sl.chunks_per_update
        return self.sl.env_groups * max(1, len(self.expected_senders))

    def _gradient_lane(self) -> None:
        self._tids["gradient"] = threading.get_native_id()
        if self.sl.gradient_nice:
            lower_thread_priority(self.sl.gradient_nice)
        lane = self._make_learner()
        try:
            lane.run(self.stop_event)
            self._checkpoint_if_preempted()
        finally:
            self._logger.close()
            self.order.ended()
            self.learner_done.set()

    def _make_learner(self) -> LearnerLane:
        """The learner lane, and the metrics logger its updates write to."""
        self._logger = MetricsLogger(self.out_dir, self.iterations, enabled=self.rank == 0,
                                     progress=self.cfg.run.progress, initial=self.version,
                                     tensorboard=self.cfg.run.tensorboard)
        self._env_steps = self.ledger.carried_env_steps
        return LearnerLane(
            source=self.source, algo=self.algo, generator=self.learn_gen, ledger=self.ledger, tracer=self.tracer,
            cfg=LearnerConfig(need=self._chunks_per_update(),
                              max_staleness=0 if self.sl.reissue else self.sl.max_staleness,  # on-policy rounds
                              iterations=self.iterations, stop_rollouts_before_last=self.sl.mode == "async",
                              spec=self.chunk_spec, independent=self.sl.independent_envs,
                              max_bad_updates=self.sl.max_bad_updates, poll_s=_POLL_S),
            version=lambda: self.version, finish_update=self._finish_update, check_health=self._check_health,
            stall=StallTimer(self.sl.stall_timeout_s), idle=self._retry_handoff,
            stop_rollouts=self.rollout_stop.set, activations=self._activations,
            turn=self.turns, before_update=lambda: self.order.before_update(self.version, self.stop_event),
            throughput=self.balance.throughput,
            learning=(lambda: self.learning) if self.sl.roles == "adaptive" and self.rank != 0 else None)

    def _retry_handoff(self) -> None:
        if self.slot.pending and self.slot.free:
            self._handoff(wait=False)  # a version skipped while the publish lane was busy

    def _finish_update(self, update: Update) -> bool:
        """After one learner step: the new version's metrics, checkpoint and snapshot.
        True after the last update (or when the time is up)."""
        self.version += 1
        stats, steps_global = self._global_stats(update.batch, update.env_steps)
        stats.update(self.balance.after_update(
            self.version, self._apply_plan, update.wait_s, update.learn_s,
            int(update.batch.valid.sum()) if update.batch is not None else 0, self.order.published(self.version)))
        self._env_steps = steps_global
        wall = time.perf_counter() - self._start_time
        totals = self.total_counters()
        m = {"version": self.version, "world_size": self.world_size, "env_steps": steps_global,
             "env_steps_per_s": (steps_global - self.ledger.carried_env_steps) / wall, "learn_s": update.learn_s,
             "dropped_stale": totals["dropped_stale"], "queue_depth": self.source.depth(),
             "publish_bytes": self.bc.last_version_bytes if self.bc is not None else 0,  # the last version sent
             "learner_state_bytes": learner_bytes(self.algo),  # weights and optimizer state held here
             "chunks_consumed": totals["chunks_consumed"], "env_errors": totals["env_errors"],
             **{f"chunks_{k}": v for k, v in self.chunk_accounting().items()
                if k in ("sent", "rejected_invalid", "lost_dead_peer")},
             **stats, **update.learn, **memory_metrics(self.memory, self.host_pool),
             **(self.tuner.metrics() if self.tuner is not None else {})}
        lead, sharded = self.rank == 0, self.cfg.sharded_learners  # sharded: every learner gathers
        self.history.append(self._logger.log(self.version - 1, m))
        if lead and self.on_update is not None:
            self.on_update(self.history[-1])
        last = self.version == self.iterations or self.time_up
        every = self.cfg.run.save_every
        if (lead or sharded) and ((every and self.version % every == 0) or last):
            self._save_checkpoint()
        if (lead or sharded) and (self.version % self.sl.broadcast_every == 0 or last):
            # Skipping a version would break the learners' order of collectives.
            if lead:
                self._handoff(wait=self.sl.mode == "sync" or last or self.order.enabled)
            else:
                self._take_snapshot()
        self.order.updated(self.version)  # this update's collectives are done
        return last

    def _check_health(self, stall: StallTimer) -> None:
        if self.world_size > 1:
            src = self.source
            check_senders(self.expected_senders, src.ended, src.receiver.dead_peers,
                          self.cfg.data_plane.peer_timeout_s, self.chunk_accounting)
        check_stall(stall, self.counters, self.version)

    def _activations(self):
        """On CUDA, the learner's activations go to the transient pool's segments and its
        device work to a stream of its own (swimlane/streams.py)."""
        stack = contextlib.ExitStack()
        if self.memory is not None:
            stack.enter_context(self.memory.transient.activations())
        stack.enter_context(self.streams["gradient"].use())
        return stack

    def _global_stats(self, batch: RolloutBatch, steps_total: int) -> tuple[dict[str, float], int]:
        """Episode stats averaged and consumed env steps summed over the learner ranks."""
        limit = self.cfg.run.time_limit_s
        time_up = float(bool(limit) and time.perf_counter() - self._start_time >= limit)
        totals = episode_totals(batch) if batch is not None else dict.fromkeys(EPISODE_TOTALS, 0.0)  # sat out
        stats = {**totals, "env_steps": float(steps_total), "time_up": time_up}
        if self.sl.learner_ranks > 1:  # learners agree on when the time is up
            stats = sum_over_group(stats, self.groups.learner)
        self.time_up = stats.pop("time_up") > 0
        steps = self.ledger.carried_env_steps + round(stats.pop("env_steps"))
        return episode_means(stats), steps

    def _apply_plan(self, plan: Plan) -> None:
        """This rank's part of a plan: its share and env groups (sampling lane), where its
        chunks go (sink), and whether it learns in its next update (adaptive roles)."""
        share, active, route = (part.get(self.rank) for part in (plan.shares, plan.active, plan.routes))
        moved = isinstance(self.sink, RoutedSink) and route is not None and route != self.sink.learner
        if self._sampling is not None and (share is not None or active is not None or moved):
            self._sampling.offer_plan(share, active, anchor=moved)
        if moved:
            self.sink.set_route(route)
        if plan.routes and self.is_learner:
            self.learning = self.rank == 0 or self.rank in plan.routes.values()

    def _handoff(self, wait: bool) -> None:
        """Give the publish lane a snapshot of the current weights (one copy), unless it is
        still sending the previous one and ``wait`` is false: then this version is skipped
        and a later one goes out (newest weights win)."""
        def copy() -> None:
            with self.tracer.span("gradient", "snapshot"):
                self._take_snapshot()

        if not self.slot.offer(self.version, copy, wait, self.stop_event, _POLL_S) and self.slot.pending:
            self.ledger.add("publish_skipped_busy")

    def _take_snapshot(self) -> None:
        """Copy (gather, when sharded) the learner's weights for the publish lane; weights
        that are not finite are never published (the run stops instead)."""
        copy_into_snapshot(self.policy, self.snapshot, self.publish_dtype)
        if self.snapshot is not None:
            check_finite(self.snap_flats, self.version, self.counters, self.last_good_version)
            self.last_good_version = self.version

    # -- broadcast lane --------------------------------------------------------------------

    def _publish(self, version: int) -> None:
        with self.tracer.span("broadcast", "publish"):
            if self.bc is not None:
                self.bc.publish(version, self.balance.plan_words)
            if self.is_rollout:
                self.weights.write(version, self.snap_flats)
        self.order.broadcast_done(version)
        self.ledger.add("publishes")

    def _broadcast_lane(self) -> None:
        """Rank 0: publish the starting weights (version 0, or the resumed version), then every
        snapshot handed over."""
        self._make_publisher().run(self.version, self.stop_event)
        if self.bc is not None:
            self.bc.shutdown()
        self.rollout_stop.set()

    def _make_publisher(self) -> PublishLane:
        # A sharded learner's snapshot starts as a copy of the whole starting weights (build_weights).
        first = self._take_snapshot if not self.cfg.sharded_learners else lambda: None
        return PublishLane(slot=self.slot, publish=lambda v: self._publish(v), snapshot=first,
                           last_version=self.iterations, learner_done=self.learner_done, poll_s=_POLL_S)

    def _receive_lane(self) -> None:
        """Other ranks: receive every published version into the standby replica."""
        ReceiveLane(broadcaster=self.bc, weights=self.weights, tracer=self.tracer, shutdown_marker=SHUTDOWN,
                    order=self.order if self.order.enabled else None, stop=self.stop_event,
                    on_header=(lambda words: self.balance.apply(words, self._apply_plan))
                    if self.balance.planning and self.is_rollout else None).run()
        self.rollout_stop.set()

    # -- run -------------------------------------------------------------------------------

    def chunk_accounting(self) -> dict[str, int]:
        """Where every chunk sent to this learner went (:func:`swimlane.ledger.chunk_accounting`)."""
        if self.world_size == 1:
            return chunk_accounting(self.counters, local=True)
        return self.source.accounting(self.counters, self.expected_senders)

    def expected_senders_ended(self) -> bool:
        return self.source.senders_gone(self.expected_senders)
