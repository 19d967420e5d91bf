"""The swimlane: four overlapping lanes per rank.

* **sampling** steps the env groups. In ``async`` mode it keeps every group's next
  action request in flight: while the inference lane computes actions for one group,
  it steps another, so the simulator does not idle waiting on the model. Finished
  batches of episodes ("chunks") go to the learner (a bounded in-process queue, or the
  ZeroMQ data plane across processes); a slow learner blocks this lane (backpressure).
* **inference** takes all pending requests, runs one batched forward on the newest
  weights (double-buffered: :mod:`swimlane.weights`) and stamps each step with the
  weights version that chose it.
* **gradient** takes chunks, drops those more than ``max_staleness`` versions old
  (counted), and updates with the decoupled PPO objective (proximal log-probs
  recomputed for stale steps, truncated importance weights). Several learner ranks
  average gradients. Every ``broadcast_every`` updates it hands a snapshot of the weights
  to the broadcast lane (one in-memory copy) and goes on learning.
* **broadcast** publishes the snapshot: into the local inference replica, and over the
  control plane (:mod:`planes.control`) to the other ranks, whose own broadcast lane
  receives it straight into their standby replica.

Roles come from :func:`launch.placement.place` over the topology (hosts discovered at
start-up or given as ``swimlane.topology``): ``swimlane.learner_ranks`` learners packed
onto as few hosts as possible, starting with rank 0 (which also publishes); rollout
lanes on the other ranks and, with ``colocate``, on the learners too. Each rollout rank
sends its chunks to one learner, on its own host (``ipc://``) when it can, else over
``tcp://``. Weights go down the placement's broadcast tree: once to a leader rank per
host, then to the host's other ranks. One process runs all four lanes.

``sync`` mode runs the same lanes with barriers: each env group is stepped only after
its actions are back, and a new round of episodes starts only once the weights learned
from the previous round have arrived. With one env group this is the synchronous
trainer exactly (the tests check it); it is the baseline of ``bench/async_vs_sync.py``.

An exception in any lane stops the run and is re-raised by :meth:`Swimlane.run` as a
:class:`LaneError` carrying that lane's traceback.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from dvla.algos import build_algorithm
from dvla.checkpoint import CheckpointManager, save_weights, weights_digest
from dvla.config import ConfigError, JobConfig, dump_yaml
from dvla.distributed import allreduce_mean_grads, mean_over_group, resolve_device
from dvla.envs import env_spec, make_env
from dvla.metrics import MetricsLogger
from dvla.policy import PolicySpec, build_policy
from dvla.rollout import episode_stats
from dvla.types import RolloutBatch
from planes.control import (
    SHUTDOWN,
    flat_buckets,
    hierarchical_stages,
    module_weights,
    new_control_group,
)
from planes.data import DataPlaneConfig
from swimlane.build import (
    build_data_plane,
    build_memory,
    build_weights,
    persistent_alloc,
    place_ranks,
)
from swimlane.checkpointing import RunCheckpoints, truncate_metrics
from swimlane.driver import LaneError, SerialDriver, ThreadedDriver
from swimlane.health import StallTimer, dead_senders
from swimlane.lanes import (
    InferenceLane,
    LearnerConfig,
    LearnerLane,
    PublishLane,
    ReceiveLane,
    Request,
    SamplingConfig,
    SamplingLane,
    SnapshotSlot,
    Update,
)
from swimlane.ledger import Ledger, chunk_accounting
from swimlane.trace import Tracer, utilization

log = logging.getLogger("dvla.swimlane")
_POLL_S = 0.05
_THROTTLE_S = 2.0  # longest a rollout rank waits for newer weights while producing nothing
# After a stop, lanes get this long to end. One blocked in a collective whose peer died never
# does: run() then leaves it behind (its thread is a daemon), so that the summary is written
# before torchrun, which stops the group with SIGTERM, follows up with SIGKILL (after 30 s).
_STOP_GRACE_S = 10.0
_JOIN_S = 5.0  # then all lanes together get this long to finish


def lower_thread_priority(nice: int) -> None:
    """Add ``nice`` to the calling thread's niceness (Linux: a thread id is a process id
    to ``setpriority``); warn and go on where that is not possible."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + nice, 19))
    except (AttributeError, OSError) as exc:
        log.warning("swimlane.gradient_nice=%d not applied to the gradient lane: %r", nice, exc)


class Swimlane:
    def __init__(self, cfg: JobConfig, rank: int = 0, world_size: int = 1,
                 data_plane: DataPlaneConfig | None = None,
                 on_update: Callable[[dict[str, Any]], None] | None = None):
        """``on_update(record)`` is called on rank 0 after every learner update with the
        record written to ``metrics.jsonl`` (for live displays and custom logging)."""
        cfg.validate()
        sl = cfg.swimlane
        if sl.learner_ranks > world_size:
            raise ConfigError(f"swimlane.learner_ranks: {sl.learner_ranks} learner ranks need at least that "
                              f"many processes, the world has {world_size}")
        if not sl.colocate and sl.learner_ranks == world_size:
            raise ConfigError("swimlane.colocate: false leaves no rank to run rollouts; add processes or "
                              "lower swimlane.learner_ranks")
        if sl.driver == "serial" and world_size > 1:
            raise ConfigError(f"swimlane.driver: serial runs one process, the world has {world_size}; "
                              f"use swimlane.driver=threads")
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.on_update = on_update
        self.sl = sl
        if cfg.run.torch_threads:
            torch.set_num_threads(cfg.run.torch_threads)
        self.device = resolve_device(cfg.run.device)
        self.topology, self.placement = place_ranks(sl, rank, world_size)
        pl = self.placement
        self.is_learner = rank in pl.learners
        self.is_rollout = rank in pl.rollout
        self.rollout_ranks = pl.rollout
        self.group_size = cfg.algo.group_size if cfg.algo.name == "grpo" else 1
        self.iterations = cfg.run.iterations
        self.out_dir = Path(cfg.run.out_dir)
        self.tracer = Tracer(sl.trace)
        self.stop_event = threading.Event()  # hard stop: error or request_stop()
        self.rollout_stop = threading.Event()  # the learner is done: rollout lanes wind down
        self.lanes_left_running: list[str] = []  # lanes (by name) still blocked when run() returned
        self.learner_done = threading.Event()
        self.driver = ThreadedDriver(stop=self.stop_event, on_error=self.request_stop, poll_s=_POLL_S)

        self.memory, self.host_pool = build_memory(cfg, self.device)

        # Same construction order as the synchronous trainer, so seeds give equal weights.
        seed = cfg.run.seed
        torch.manual_seed(seed)
        self.envs = []
        if self.is_rollout:
            self.envs = [make_env(cfg.env, self.device, seed=seed + 7919 * rank)]
            env_spec_ = self.envs[0].spec
        else:  # a learner-only rank needs the spec, not a simulator (where the env can tell)
            env_spec_ = env_spec(cfg.env, self.device, seed=seed + 7919 * rank)
        spec = PolicySpec.for_env(env_spec_, cfg.policy.action_chunk)
        self.policy = build_policy(cfg.policy.name, spec, cfg.policy.options).to(self.device).eval()
        if self.is_rollout:
            self.envs += [make_env(cfg.env, self.device, seed=seed + 7919 * rank + 15485863 * g)
                          for g in range(1, sl.env_groups)]

        # Process groups (every rank must create every group, in the same order).
        self.learner_group = self.control_group = None
        self.stages = None
        if world_size > 1:
            self.learner_group = dist.new_group(pl.learners)
            self.control_group = new_control_group()
            tree = pl.tree
            if sl.hierarchical_broadcast and len(tree.leaders) > 1:
                self.stages = hierarchical_stages(tree.leaders, tree.local_groups, tree.source)

        if self.is_learner:
            sync = None
            if sl.learner_ranks > 1:
                sync = partial(allreduce_mean_grads, group=self.learner_group)
            if self.memory is not None:  # the learner's weights live in persistent buckets
                flat_buckets(self.policy, alloc=persistent_alloc(self.memory), tag="policy")
            self.algo = build_algorithm(cfg.algo, self.policy, sync)
            if self.memory is not None:
                self.memory.persistent.adopt_optimizer(self.algo.optimizer)
            self.learn_gen = torch.Generator().manual_seed(seed + 2)
        self.sample_gen = torch.Generator(device=self.device).manual_seed(seed + 104729 * rank + 1)

        # Checkpoints: learners resume from the newest valid one (``run.resume``, or when
        # torchrun restarted this worker group); rank 0 writes them.
        self.version = 0
        self.restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self.resumed_from: int | None = None
        self.time_up = False  # run.time_limit_s reached
        self.ledger = Ledger()  # counters (a resume carries the earlier attempts' totals)
        self.ckpt = self.checkpoints = None
        if self.is_learner:
            self.ckpt = CheckpointManager(self.out_dir / "checkpoints", keep=cfg.run.keep_checkpoints)
            generators = {"learn": self.learn_gen, **({"sample": self.sample_gen} if rank == 0 else {})}
            self.checkpoints = RunCheckpoints(self.ckpt, self.policy, self.algo, generators)
            if cfg.run.resume or self.restarts > 0:
                self._resume()

        buffers = build_weights(self.policy, rank, world_size, self.control_group, self.stages,
                                persistent_alloc(self.memory))
        self.weights, self.snapshot, self.snap_flats, self.bc = (buffers.weights, buffers.snapshot,
                                                                 buffers.snap_flats, buffers.bc)
        if self.memory is not None:
            self.memory.persistent.seal()  # from here on, only the transient pool allocates
        self.source, self.sink, self.expected_senders = build_data_plane(
            sl, data_plane or cfg.data_plane, rank, world_size, self.placement)

        # Lane state.
        self._requests: queue.Queue[Request] = queue.Queue()
        self._replies: queue.Queue = queue.Queue()
        self.slot = SnapshotSlot()  # learner lane -> publish lane (rank 0)
        self.history: list[dict[str, Any]] = []
        self._start_time = time.perf_counter()
        self._start_unix = time.time()

    # -- checkpoints -----------------------------------------------------------------------
    def _save_checkpoint(self) -> None:
        """Rank 0, from the gradient lane: the run's state at this version, atomically."""
        with self.tracer.span("gradient", "checkpoint"):
            self.checkpoints.save(self.version, {"env_steps": self._env_steps, "counters": self.total_counters(),
                                                 "restarts": self.restarts, "config": self.cfg.to_dict()})

    @property
    def counters(self) -> dict[str, int]:
        """This attempt's counters (:class:`swimlane.ledger.Ledger`)."""
        return self.ledger.counts

    def total_counters(self) -> dict[str, int]:
        """This attempt's counters plus those of the attempts before a resume."""
        return self.ledger.totals()

    def _resume(self) -> None:
        got = self.checkpoints.resume(self.restarts)
        if got is None:
            return
        self.version = self.resumed_from = got.version
        self.ledger.carry(got.counters, got.env_steps)
        if self.rank == 0:
            (log.warning if self.restarts else log.info)("resumed from %s (version %d, restart %d)", got.path,
                                                         self.version, self.restarts)
            truncate_metrics(self.out_dir / "metrics.jsonl", self.version)

    # -- lane plumbing ---------------------------------------------------------------------
    @property
    def errors(self) -> list[LaneError]:
        return self.driver.errors

    def _lane(self, name: str, fn) -> threading.Thread:
        """Start ``fn`` as lane ``name`` in a thread of its own (supervised by the driver)."""
        return self.driver.start(name, fn)

    def _lanes(self) -> dict[str, Callable[[], None]]:
        """This rank's lanes, by its role: the one place that decides which lanes run."""
        lanes: dict[str, Callable[[], None]] = {}
        if self.is_learner:
            lanes["gradient"] = self._gradient_lane
        lanes["broadcast"] = self._broadcast_lane if self.rank == 0 else self._receive_lane
        if self.is_rollout:
            lanes["inference"] = self._inference_lane
            lanes["sampling"] = self._sampling_lane
        return lanes

    def request_stop(self) -> None:
        """Stop every lane soon (signal handlers call this); ``run`` then returns."""
        self.stop_event.set()
        self.rollout_stop.set()

    def _rollout_stopping(self) -> bool:
        return self.rollout_stop.is_set() or self.stop_event.is_set()

    # -- sampling and inference lanes ---------------------------------------------------
    def _sampling_lane(self) -> None:
        self._make_sampling().run()

    def _make_sampling(self) -> SamplingLane:
        return SamplingLane(
            envs=self.envs, prepare=self.policy.prepare, requests=self._requests, replies=self._replies,
            sink=self.sink, weights=self.weights, tracer=self.tracer, ledger=self.ledger,
            stop=self.rollout_stop, halt=self.stop_event,
            host_pool=self.host_pool if self.memory is not None else None,
            cfg=SamplingConfig(
                mode=self.sl.mode, n_envs=self.cfg.env.n_envs, group_size=self.group_size,
                episode_len=self.cfg.env.episode_len, action_chunk=self.cfg.policy.action_chunk,
                has_value=self.policy.has_value_head, chunks_per_update=self.sl.chunks_per_update,
                senders=len(self.placement.senders_of(self.placement.routes[self.rank])),
                max_staleness=self.sl.max_staleness, max_env_failures=self.sl.max_env_failures,
                rank=self.rank, rollout_index=self.rollout_ranks.index(self.rank),
                rollout_ranks=len(self.rollout_ranks), throttle_s=_THROTTLE_S, poll_s=_POLL_S),
        )

    def _inference_lane(self) -> None:
        self._make_inference().run(self._rollout_stopping)

    def _make_inference(self) -> InferenceLane:
        return InferenceLane(requests=self._requests, replies=self._replies, weights=self.weights,
                             generator=self.sample_gen, tracer=self.tracer, batch_all=self.sl.mode == "async",
                             pool=self.memory.transient if self.memory is not None else None, poll_s=_POLL_S)

    # -- gradient lane ---------------------------------------------------------------------
    def _chunks_per_update(self) -> int:
        """Async: ``chunks_per_update``; sync: one chunk from every group routed here."""
        if self.sl.mode == "async":
            return self.sl.chunks_per_update
        return self.sl.env_groups * max(1, len(self.expected_senders))

    def _gradient_lane(self) -> None:
        if self.sl.gradient_nice:
            lower_thread_priority(self.sl.gradient_nice)
        lane = self._make_learner()
        try:
            lane.run(self.stop_event)
        finally:
            self._logger.close()
            self.learner_done.set()

    def _make_learner(self) -> LearnerLane:
        """The learner lane, and the metrics logger its updates write to."""
        self._logger = MetricsLogger(self.out_dir, self.iterations, enabled=self.rank == 0,
                                     progress=self.cfg.run.progress, initial=self.version,
                                     tensorboard=self.cfg.run.tensorboard)
        self._env_steps = self.ledger.carried_env_steps
        return LearnerLane(
            source=self.source, algo=self.algo, generator=self.learn_gen, ledger=self.ledger, tracer=self.tracer,
            cfg=LearnerConfig(need=self._chunks_per_update(), max_staleness=self.sl.max_staleness,
                              iterations=self.iterations, stop_rollouts_before_last=self.sl.mode == "async",
                              poll_s=_POLL_S),
            version=lambda: self.version, finish_update=self._finish_update, check_health=self._check_health,
            stall=StallTimer(self.sl.stall_timeout_s), idle=self._retry_handoff,
            stop_rollouts=self.rollout_stop.set, activations=self._activations)

    def _retry_handoff(self) -> None:
        if self.slot.pending and self.slot.free:
            self._handoff(wait=False)  # a version skipped while the publish lane was busy

    def _finish_update(self, update: Update) -> bool:
        """After one learner step: the new version's metrics, checkpoint and snapshot.
        True after the last update (or when the time is up)."""
        self.version += 1
        stats, steps_global = self._global_stats(update.batch, update.env_steps)
        self._env_steps = steps_global
        wall = time.perf_counter() - self._start_time
        totals = self.total_counters()
        m = {"version": self.version, "world_size": self.world_size, "env_steps": steps_global,
             "env_steps_per_s": (steps_global - self.ledger.carried_env_steps) / wall, "learn_s": update.learn_s,
             "dropped_stale": totals["dropped_stale"], "queue_depth": self.source.depth(),
             "chunks_consumed": totals["chunks_consumed"], "env_errors": totals["env_errors"],
             **{f"chunks_{k}": v for k, v in self.chunk_accounting().items()
                if k in ("sent", "rejected_invalid", "lost_dead_peer")},
             **stats, **update.learn, **self._memory_metrics()}
        lead = self.rank == 0
        self.history.append(self._logger.log(self.version - 1, m))
        if lead and self.on_update is not None:
            self.on_update(self.history[-1])
        last = self.version == self.iterations or self.time_up
        every = self.cfg.run.save_every
        if lead and ((every and self.version % every == 0) or last):
            self._save_checkpoint()
        if lead and (self.version % self.sl.broadcast_every == 0 or last):
            self._handoff(wait=self.sl.mode == "sync" or last)
        return last

    def _check_health(self, stall: StallTimer) -> None:
        self._check_senders()
        self._check_stall(stall)

    def _check_senders(self) -> None:
        """A rollout rank whose heartbeats stopped (crashed, killed, frozen) cannot take
        part in the next weight broadcast, so the run cannot go on without it: stop with
        a report naming it (torchrun then restarts the group, which resumes from the
        last checkpoint) instead of hanging in a collective."""
        if self.world_size == 1:
            return
        dead = dead_senders(self.expected_senders, self.source.ended, self.source.receiver.dead_peers)
        if dead:
            raise RuntimeError(
                f"rollout rank(s) {', '.join(dead)} stopped sending heartbeats for "
                f"{self.cfg.data_plane.peer_timeout_s}s (data_plane.peer_timeout_s): crashed or hung. "
                f"Weights cannot be broadcast without them; stopping this attempt "
                f"(chunk accounting: {self.chunk_accounting()})")

    def _check_stall(self, stall: StallTimer) -> None:
        """No usable chunk for ``swimlane.stall_timeout_s``: something is stuck without
        crashing (a simulator step that never returns, a frozen rank, rollouts whose every
        chunk is too stale): stop and say so. Dropped chunks are not progress."""
        limit = self.sl.stall_timeout_s
        if stall.stalled_for() is not None:
            raise RuntimeError(
                f"no usable trajectory chunk for {limit}s (swimlane.stall_timeout_s): a simulator or rollout "
                f"rank is stuck, or every chunk arrives too stale; env_steps_sampled="
                f"{self.counters['env_steps_sampled']}, dropped_stale={self.counters['dropped_stale']}, "
                f"version={self.version}")

    def _activations(self):
        """On CUDA, the learner's activations go to the transient pool's segments."""
        return self.memory.transient.activations() if self.memory is not None else contextlib.nullcontext()

    def _memory_metrics(self) -> dict[str, float]:
        if self.memory is None:
            return {}
        m = self.memory.metrics()
        if self.host_pool is not self.memory.transient:
            m.update(self.host_pool.stats().as_metrics())
        return m

    def _global_stats(self, batch: RolloutBatch, steps_total: int) -> tuple[dict[str, float], int]:
        """Episode stats averaged and consumed env steps summed over the learner ranks."""
        limit = self.cfg.run.time_limit_s
        time_up = float(bool(limit) and time.perf_counter() - self._start_time >= limit)
        stats = {**episode_stats(batch), "env_steps": float(steps_total), "time_up": time_up}
        if self.sl.learner_ranks > 1:  # learners agree on when the time is up
            stats = mean_over_group(stats, self.learner_group)
        self.time_up = stats.pop("time_up") > 0
        return stats, self.ledger.carried_env_steps + round(stats.pop("env_steps") * self.sl.learner_ranks)

    def _handoff(self, wait: bool) -> None:
        """Give the publish lane a snapshot of the current weights (one copy), unless it is
        still sending the previous one and ``wait`` is false: then this version is skipped
        and a later one goes out (newest weights win)."""
        def copy() -> None:
            with self.tracer.span("gradient", "snapshot"):
                self._take_snapshot()

        if not self.slot.offer(self.version, copy, wait, self.stop_event, _POLL_S) and self.slot.pending:
            self.ledger.add("publish_skipped_busy")

    @torch.no_grad()
    def _take_snapshot(self) -> None:
        torch._foreach_copy_(module_weights(self.snapshot), module_weights(self.policy))

    # -- broadcast lane --------------------------------------------------------------------
    def _publish(self, version: int) -> None:
        with self.tracer.span("broadcast", "publish"):
            if self.bc is not None:
                self.bc.publish(version)
            if self.is_rollout:
                self.weights.write(version, self.snap_flats)
        self.ledger.add("publishes")

    def _broadcast_lane(self) -> None:
        """Rank 0: publish the starting weights (version 0, or the resumed version), then every
        snapshot handed over."""
        self._make_publisher().run(self.version, self.stop_event)
        if self.bc is not None:
            self.bc.shutdown()
        self.rollout_stop.set()

    def _make_publisher(self) -> PublishLane:
        return PublishLane(slot=self.slot, publish=lambda v: self._publish(v), snapshot=self._take_snapshot,
                           last_version=self.iterations, learner_done=self.learner_done, poll_s=_POLL_S)

    def _run_serial(self) -> None:
        """``swimlane.driver=serial``: all four lanes in this thread (sync mode, one process)."""
        sampling, inference, publisher = self._make_sampling(), self._make_inference(), self._make_publisher()
        learner = self._make_learner()
        try:
            publisher.begin(self.version)
            sampling.begin()
            SerialDriver({"broadcast": publisher.poll, "inference": inference.poll, "sampling": sampling.poll,
                          "gradient": learner.poll}).run(
                lambda: learner.done or self.version >= self.iterations, self.stop_event)
        except LaneError as exc:
            self.driver.errors.append(exc)
        finally:
            self._logger.close()
            self.learner_done.set()
            self.rollout_stop.set()

    def _receive_lane(self) -> None:
        """Other ranks: receive every published version into the standby replica."""
        ReceiveLane(broadcaster=self.bc, weights=self.weights, tracer=self.tracer, shutdown_marker=SHUTDOWN).run()
        self.rollout_stop.set()

    # -- run -------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Run until the learner has made ``run.iterations`` updates (or a stop); returns
        the run summary on every rank (rank 0's has the learning results)."""
        cfg = self.cfg
        if self.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            dump_yaml(cfg, self.out_dir / "config.yaml")
        self._start_time = time.perf_counter()
        self._start_unix = time.time()  # the same moment on the wall clock (the report aligns ranks by it)
        if self.sl.driver == "serial":
            try:
                self._run_serial()
            finally:
                self._close()
            if self.errors:
                self._finish(error=str(self.errors[0]).splitlines()[0])
                raise self.errors[0]
            return self._finish()
        driver = self.driver
        driver.grace_s, driver.join_s = _STOP_GRACE_S, _JOIN_S
        for name, fn in self._lanes().items():
            driver.start(name, fn)
        drained = False

        def tick() -> None:  # a learner of several ranks drains what rollouts still send
            nonlocal drained
            if not drained and self.is_learner and self.learner_done.is_set() and self.world_size > 1:
                self._drain()
                drained = True

        try:
            driver.supervise(tick)
        except KeyboardInterrupt:
            self.request_stop()
            raise
        finally:
            if self.errors:
                self.request_stop()
            self.lanes_left_running = driver.join()
            if self.is_learner and not self.errors:
                self._drain(wait=not drained and self.world_size > 1)
            self._close()
        if self.errors:
            try:  # best effort: the counters of a failed attempt are worth keeping
                self._finish(error=str(self.errors[0]).splitlines()[0])
            except Exception:
                log.exception("could not write the summary of the failed run")
            raise self.errors[0]
        return self._finish()

    def _drain(self, wait: bool = True) -> None:
        """After the last update: read (and discard, counted) what rollout ranks still
        send until each has said it ended (``wait``), so none stays blocked on
        backpressure; then whatever is still queued."""
        deadline = time.monotonic() + 60.0
        while wait and not self.expected_senders_ended() and time.monotonic() < deadline \
                and not self.stop_event.is_set():
            self._discard(self.source.get(timeout=_POLL_S))
        while self.source.depth() > 0:
            self._discard(self.source.get(timeout=0.0))

    def _discard(self, item) -> None:
        if item is None:
            return
        self.ledger.add("discarded_after_run")
        if self.world_size > 1:
            self.source.receiver.counters.dropped["run_ended"] += 1
        if item[2] is not None:
            item[2]()  # the rollout buffers go back to the pool

    def chunk_accounting(self) -> dict[str, int]:
        """Where every chunk sent to this learner went (:func:`swimlane.ledger.chunk_accounting`)."""
        if self.world_size == 1:
            return chunk_accounting(self.counters, local=True)
        src = self.source
        return chunk_accounting(self.counters, local=False, invalid=src.invalid, ended=src.ended,
                                reported=src.receiver.reported_sent, received=src.received,
                                dead=src.receiver.dead_peers, expected=self.expected_senders)

    def expected_senders_ended(self) -> bool:
        src = self.source
        gone = set(src.ended) | set(src.receiver.dead_peers)
        return all(s in gone for s in self.expected_senders)

    def _close(self) -> None:
        for env in self.envs:
            env.close()
        if self.sink is not None and self.world_size > 1:
            self.sink.close()
        if self.source is not None and self.world_size > 1:
            self.source.close()

    def _finish(self, error: str | None = None) -> dict[str, Any]:
        wall = time.perf_counter() - self._start_time
        util = utilization(self.tracer.spans)
        summary: dict[str, Any] = {
            "mode": self.sl.mode, "rank": self.rank, "iterations": self.iterations, "version": self.version,
            "wall_s": wall, **self.counters,
            "weight_swaps": self.weights.swaps,
            "lane_utilization": {k: round(v["utilization"], 4) for k, v in util.items()},
            "stopped_early": self.version < self.iterations, "time_limit_reached": self.time_up, "error": error,
            "lanes_left_running": self.lanes_left_running,
            "restarts": self.restarts, "resumed_from": self.resumed_from, "totals": self.total_counters(),
            "host": self.topology.hosts[self.topology.host_of(self.rank)].name,
            "role": self.placement.role(self.rank),
        }
        if self.memory is not None:
            summary["memory"] = self.memory.summary()
            if self.host_pool is not self.memory.transient:
                summary["memory"]["transient_host"] = self.host_pool.stats().as_dict()
        if self.bc is not None:
            summary["broadcast_traffic"] = dict(self.bc.traffic)
        if self.world_size > 1 and self.is_rollout:
            summary["data_route"] = {"learner": self.placement.routes[self.rank],
                                     "transport": self.placement.transports[self.rank],
                                     "address": self.sink.sender.address}
        if self.rank == 0:
            summary["topology"] = self.topology.to_dict()
            summary["placement"] = self.placement.to_dict()
        if self.is_learner:
            summary["chunk_accounting"] = self.chunk_accounting()
            steps = int(self.history[-1]["env_steps"]) if self.history else 0
            this_attempt = steps - self.ledger.carried_env_steps
            summary.update(env_steps=steps, env_steps_per_s=this_attempt / wall if wall > 0 else 0.0,
                           final_success_rate=self.history[-1]["success_rate"] if self.history else None)
            if "gradient" not in self.lanes_left_running:
                summary["weights_digest"] = weights_digest(self.policy)
        if self.sl.trace:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            name = "trace.json" if self.rank == 0 else f"trace_rank{self.rank}.json"
            self.tracer.save(self.out_dir / name, rank=self.rank, mode=self.sl.mode, run_start=self._start_time,
                             run_start_unix=self._start_unix)
        if self.rank == 0:
            if "gradient" in self.lanes_left_running:  # its weights may be mid-update
                log.warning("weights.safetensors not written: the gradient lane is still running; "
                            "the last checkpoint holds the weights")
            else:
                save_weights(self.policy, self.out_dir / "weights.safetensors", self.version)
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            attempts = self.out_dir / "attempts"  # one summary per torchrun attempt
            attempts.mkdir(exist_ok=True)
            (attempts / f"attempt{self.restarts}.json").write_text(json.dumps(summary, indent=2))
        elif self.world_size > 1:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / f"summary_rank{self.rank}.json").write_text(json.dumps(summary, indent=2))
        return summary
