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

import json
import os
import logging
import time
from typing import Any, Callable

from dvla.state.checkpoint import all_finite, save_weights, weights_digest
from dvla.config import dump_yaml
from dvla.normalize import FILE as NORM_FILE, METADATA_KEY as NORM_KEY
from dvla.distributed.sharding import full_state_dict
from swimlane.driver import LaneError, SerialDriver, ThreadedDriver
from swimlane.rank import _POLL_S, RankLanes
from swimlane.status import serve_status
from swimlane.trace import utilization

log = logging.getLogger("dvla.swimlane")
# After a stop, lanes get this long to end. One blocked in a collective whose peer died never
# does: run() then leaves it behind (its thread is a daemon), so that the summary is written
# before torchrun, which stops the group with SIGTERM, follows up with SIGKILL (after 30 s).
_STOP_GRACE_S = 10.0
_JOIN_S = 5.0  # then all lanes together get this long to finish
# After SIGTERM (a preemption) rank 0's gradient lane also writes a checkpoint on its way out:
# lanes get this long instead, so that the summary is still written before torchrun's SIGKILL.
_PREEMPT_GRACE_S = 20.0


class Swimlane(RankLanes):
    """A rank's lanes (:class:`swimlane.rank.RankLanes`) and their lifecycle: which lanes
    this rank runs, the driver that runs them (threads, or one thread with
    ``swimlane.driver=serial``), draining and closing, and the summary."""

    def __init__(self, *args: Any, **kwargs: Any):
        """As :class:`swimlane.rank.RankLanes`."""
        super().__init__(*args, **kwargs)
        self.driver = ThreadedDriver(stop=self.stop_event, on_error=self.request_stop, poll_s=_POLL_S)

    def preempt(self) -> None:
        """SIGTERM: stop every lane; rank 0's gradient lane checkpoints the current version
        on its way out (:meth:`swimlane.rank.RankLanes._checkpoint_if_preempted`), within
        ``_PREEMPT_GRACE_S``."""
        self.preempted = True
        self.driver.grace_s = max(self.driver.grace_s, _PREEMPT_GRACE_S)
        self.request_stop()

    @property
    def errors(self) -> list[LaneError]:
        return self.driver.errors

    def _lanes(self) -> dict[str, Callable[[], None]]:
        """The lanes this rank's plan names (:mod:`swimlane.plan`), in start order."""
        run = {"gradient": self._gradient_lane, "broadcast": self._broadcast_lane, "receive": self._receive_lane,
               "relay": self._receive_lane, "inference": self._inference_lane, "sampling": self._sampling_lane}
        # The weights lane is called "broadcast" on every rank (traces, summaries).
        return {("broadcast" if lane in ("receive", "relay") else lane): run[lane] for lane in self.plan.lanes}

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
            self._checkpoint_if_preempted()
        except LaneError as exc:
            self.driver.errors.append(exc)
        finally:
            self._logger.close()
            self.learner_done.set()
            self.rollout_stop.set()

    def run(self) -> dict[str, Any]:
        """Run until the learner has made ``run.iterations`` updates (or a stop); returns
        the run summary on every rank (rank 0's has the learning results)."""
        cfg = self.cfg
        if self.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            dump_yaml(cfg, self.out_dir / "config.yaml")
            if self.policy.normalizer is not None:  # the run's own copy (dvla eval, a resume of an older run)
                self.policy.normalizer.save(self.out_dir / NORM_FILE)
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
        driver.grace_s, driver.join_s = _PREEMPT_GRACE_S if self.preempted else _STOP_GRACE_S, _JOIN_S
        for name, fn in self._lanes().items():
            driver.start(name, fn)
        drained = False

        def tick() -> None:  # a learner of several ranks drains what rollouts still send
            nonlocal drained
            self._autotune_tick()
            if not drained and self.is_learner and self.learner_done.is_set() and self.world_size > 1:
                self._drain()
                drained = True

        status = None
        try:
            status = serve_status(self)  # rank 0 with run.status_port: the live status endpoint
            driver.supervise(tick)
        except BaseException:  # a KeyboardInterrupt, a status port that cannot be bound
            self.request_stop()
            raise
        finally:
            if status is not None:
                status.stop()
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

    def _close(self) -> None:
        for env in self.envs:
            env.close()
        if self.sink is not None and self.world_size > 1:
            self.sink.close()
        if self.source is not None and self.world_size > 1:
            self.source.close()

    def _whole_weights(self) -> dict[str, Any] | None:
        """The learner's whole state dict, for the digest and weights.safetensors (gathered
        once from a sharded learner's shards: every learner calls this). None while the
        gradient lane may be mid-update, or when sharded learners stopped early (a gather
        could then wait for a learner that never joins it)."""
        if not hasattr(self, "_whole"):
            ok = "gradient" not in self.lanes_left_running
            if self.cfg.sharded_learners:
                ok = ok and not self.errors and not self.stop_event.is_set()
            self._whole = full_state_dict(self.policy) if ok else None
        return self._whole

    def _finish(self, error: str | None = None) -> dict[str, Any]:
        wall = time.perf_counter() - self._start_time
        util = utilization(self.tracer.spans)
        summary: dict[str, Any] = {
            "mode": self.sl.mode, "rank": self.rank, "iterations": self.iterations, "version": self.version,
            "wall_s": wall, **self.counters,
            "weight_swaps": self.weights.swaps if self.weights is not None else 0,
            "lane_utilization": {k: round(v["utilization"], 4) for k, v in util.items()},
            "stopped_early": self.version < self.iterations, "time_limit_reached": self.time_up, "error": error,
            "lanes_left_running": self.lanes_left_running,
            "restarts": self.restarts, "resumed_from": self.resumed_from, "totals": self.total_counters(),
            "host": self.topology.hosts[self.topology.host_of(self.rank)].name,
            "role": self.placement.role(self.rank),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),  # the rank's own GPU only
        }
        if self.sl.roles == "adaptive" and self.is_learner:
            summary["learning_at_end"] = self.learning  # a candidate's role when the run ended
        if self.memory is not None:
            summary["memory"] = self.memory.summary()
            if self.host_pool is not self.memory.transient:
                summary["memory"]["transient_host"] = self.host_pool.stats().as_dict()
        if self.bc is not None:
            summary["broadcast_traffic"] = dict(self.bc.traffic)
        acting = self.policy  # the normalisation this rank acts (or learns) with, as a digest
        if self.is_rollout:  # the newest weights this rank's inference replicas hold
            newest = max(range(2), key=lambda i: self.weights.versions[i])
            acting = self.weights.replicas[newest]
            summary["replica_version"] = self.weights.versions[newest]
            summary["replica_digest"] = weights_digest(self.weights.replicas[newest])
            if self._sampling is not None:  # env groups that stepped at the end, and the chunks each sent
                summary["env_groups_active"] = self._sampling.active
                summary["chunks_by_group"] = [g.chunks for g in self._sampling.groups]
        summary["normalization"] = acting.normalizer.digest() if acting.normalizer is not None else None
        if self.world_size > 1 and self.is_rollout:
            summary["data_route"] = {"learner": self.sink.learner,
                                     "transport": self.sink.sender.address.split("://")[0],  # as dialled
                                     "address": self.sink.sender.address}
        if self.rank == 0:
            summary["topology"] = self.topology.to_dict()
            summary["placement"] = self.placement.to_dict()
        if self.order.enabled:
            summary["collective_sequence"] = [f"{op} {v}" for op, v in self.order.sequence]
        if self.is_learner:
            summary["chunk_accounting"] = self.chunk_accounting()
            summary["balance"] = self.balance.summary()
            if self.world_size > 1:
                c = self.source.receiver.counters
                rc = self.source.receiver.cfg
                summary["receiver"] = {"received": c.received, "rejected": dict(c.rejected),
                                       "dropped": dict(c.dropped), "max_message_bytes": rc.max_message_bytes,
                                       "max_frame_bytes": rc.max_frame_bytes}
            steps = int(self.history[-1]["env_steps"]) if self.history else 0
            this_attempt = steps - self.ledger.carried_env_steps
            summary.update(env_steps=steps, env_steps_per_s=this_attempt / wall if wall > 0 else 0.0,
                           final_success_rate=self.history[-1]["success_rate"] if self.history else None)
            whole = self._whole_weights()
            if whole is not None:  # the learner's weights, and as the replicas receive them
                summary["weights_digest"] = weights_digest(self.policy, whole)
                summary["published_digest"] = weights_digest(self.policy, {
                    k: v.to(self.publish_dtype) if v.is_floating_point() else v for k, v in whole.items()})
        if self.sl.trace:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            name = "trace.json" if self.rank == 0 else f"trace_rank{self.rank}.json"
            self.tracer.save(self.out_dir / name, rank=self.rank, mode=self.sl.mode, run_start=self._start_time,
                             run_start_unix=self._start_unix)
        if self.rank == 0:
            whole = self._whole_weights()
            summary["last_good_version"] = self.last_good_version
            if whole is None:  # its weights may be mid-update (or in shards)
                log.warning("weights.safetensors not written: the gradient lane is still running, or the "
                            "sharded learners stopped early; the last checkpoint holds the weights")
            elif not all_finite(whole):
                log.warning("weights.safetensors not written: the weights of version %d hold NaN or inf; last good "
                            "version %d (the newest checkpoint in %s holds the last weights saved)", self.version,
                            self.last_good_version, self.out_dir / "checkpoints")
            else:
                norm = self.policy.normalizer  # with the weights, as dvla sft stores it
                save_weights(self.policy, self.out_dir / "weights.safetensors", self.version, whole,
                             **({NORM_KEY: norm.to_json()} if norm is not None else {}))
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            attempts = self.out_dir / "attempts"  # one summary per attempt: torchrun restarts and resumes
            attempts.mkdir(exist_ok=True)
            done = [int(p.stem[7:]) for p in attempts.glob("attempt*.json") if p.stem[7:].isdigit()]
            n = max(self.restarts, max(done, default=-1) + 1)  # after every earlier attempt, kept
            (attempts / f"attempt{n}.json").write_text(json.dumps(summary, indent=2))
        elif self.world_size > 1:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / f"summary_rank{self.rank}.json").write_text(json.dumps(summary, indent=2))
        return summary
