"""The swimlane: four overlapping lanes per rank.

* **sampling** steps the env groups. In ``async`` mode it keeps every group's next
  action request in flight: while the inference lane computes actions for one group,
  it steps another, so the simulator does not idle waiting on the model. Finished
  batches of episodes ("chunks") go to the learner (a bounded in-process queue, or the
  ZeroMQ data plane across processes); a slow learner blocks this lane (backpressure).
* **inference** takes all pending requests, runs one batched forward on the newest
  weights (double-buffered: :mod:`swimlane.lanes.weights`) and stamps each step with the
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
import logging
import threading
import time
from typing import Any, Callable

import torch

from dvla.config import JobConfig, dump_yaml
from dvla.distributed import resolve_device
from dvla.normalize import FILE as NORM_FILE
from memory import runtime
from planes.data import DataPlaneConfig
from swimlane.assembly.driver import LaneError, SerialDriver, ThreadedDriver
from swimlane.assembly.parts import assemble
from swimlane.assembly.state import POLL_S, RunState
from swimlane.assembly.summary import claim_attempt, write_summary
from swimlane.assembly.updates import Updates
from swimlane.assembly.wiring import connect
from swimlane.observation.status import serve_status

log = logging.getLogger("dvla.swimlane")
# After a stop, lanes get this long to end. One blocked in a collective whose peer died never
# does: run() then leaves it behind (its thread is a daemon), so that the summary is written
# before torchrun, which stops the group with SIGTERM, follows up with SIGKILL (after 30 s).
_STOP_GRACE_S = 10.0
_JOIN_S = 5.0  # then all lanes together get this long to finish
# After SIGTERM (a preemption) rank 0's gradient lane also writes a checkpoint on its way out:
# lanes get this long instead, so that the summary is still written before torchrun's SIGKILL.
_PREEMPT_GRACE_S = 20.0


class Swimlane:
    """One rank of a job: its parts (built from its plan, :func:`swimlane.assembly.parts.assemble`),
    the run's state its lanes share (:class:`swimlane.assembly.state.RunState`), the run's side of
    every update (:class:`swimlane.assembly.updates.Updates`) and its lanes
    (:func:`swimlane.assembly.wiring.connect`); :meth:`run` starts the lanes the plan names with
    the driver that runs them (threads, or one thread with ``swimlane.driver=serial``), drains
    and closes, and writes the summary."""

    def __init__(self, cfg: JobConfig, rank: int = 0, world_size: int = 1, data_plane: DataPlaneConfig | None = None,
                 on_update: Callable[[dict[str, Any]], None] | None = None):
        """``on_update(record)`` is called on rank 0 after every learner update with the
        record written to ``metrics.jsonl`` (for live displays and custom logging)."""
        from swimlane.assembly.parts import restarts_from_env

        cfg.validate()
        if cfg.run.torch_threads:
            torch.set_num_threads(cfg.run.torch_threads)
        restarts = restarts_from_env()
        # The rank's device runtime is the process's while the rank lives (memory/runtime.py);
        # the one it found comes back when run() ends.
        self._serving = contextlib.ExitStack()
        self._serving.enter_context(runtime.serving(resolve_device(cfg.run.device)))
        try:
            self.parts = assemble(cfg, rank, world_size, data_plane, restarts=restarts, poll_s=POLL_S)
            self.state = RunState(cfg, rank, world_size, self.parts.resumed, restarts)
            self.updates = Updates(self.parts, self.state, on_update)
            self.lanes = connect(self.parts, self.state, self.updates)
        except BaseException:
            self._serving.close()
            raise
        self.driver = ThreadedDriver(stop=self.state.stop_event, on_error=self.state.request_stop, poll_s=POLL_S)
        self.lanes_left_running: list[str] = []  # lanes (by name) still blocked when run() returned

    # -- what a user of the run reads ---------------------------------------------------------
    cfg = property(lambda self: self.state.cfg)
    plan = property(lambda self: self.parts.plan)
    policy = property(lambda self: self.parts.policy)
    envs = property(lambda self: self.parts.envs)
    algo = property(lambda self: self.parts.algo)
    memory = property(lambda self: self.parts.memory)
    out_dir = property(lambda self: self.state.out_dir)
    version = property(lambda self: self.state.version)
    history = property(lambda self: self.state.history)
    counters = property(lambda self: self.state.ledger.counts)

    @property
    def errors(self) -> list[LaneError]:
        return self.driver.errors

    def request_stop(self) -> None:
        """Stop every lane soon; :meth:`run` then returns."""
        self.state.request_stop()

    def preempt(self) -> None:
        """SIGTERM: stop every lane; rank 0's gradient lane checkpoints the current version
        on its way out, within ``_PREEMPT_GRACE_S``. A learner of several asks the learners to
        end together after the next update instead (each is in the others' collectives), as
        at ``run.iterations``: a normal end, whose checkpoint every learner takes part in. A
        second signal, or no update within ``_PREEMPT_GRACE_S``, stops the lanes at once."""
        s = self.state
        if self.cfg.swimlane.learner_ranks > 1 and self.plan.learner and not s.stop_asked:
            s.preempted = s.stop_asked = True
            timer = threading.Timer(_PREEMPT_GRACE_S, lambda: s.learner_done.is_set() or self._preempt_now())
            timer.daemon = True
            timer.start()
            return
        self._preempt_now()

    def _preempt_now(self) -> None:
        self.state.preempted = True
        self.driver.grace_s = max(self.driver.grace_s, _PREEMPT_GRACE_S)
        self.state.request_stop()

    # -- the run ------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Run until the learner has made ``run.iterations`` updates (or a stop); returns
        the run summary on every rank (rank 0's has the learning results)."""
        s, cfg = self.state, self.state.cfg
        if s.rank == 0:
            s.out_dir.mkdir(parents=True, exist_ok=True)
            dump_yaml(cfg, s.out_dir / "config.yaml")
            if self.parts.policy.normalizer is not None:  # the run's own copy (dvla eval, a resume of an older run)
                self.parts.policy.normalizer.save(s.out_dir / NORM_FILE)
            s.attempt = claim_attempt(s.out_dir, s.restarts, s.resumed_from)
        s.started()
        if cfg.swimlane.driver == "serial":
            return self._run_serial()
        driver = self.driver
        driver.grace_s, driver.join_s = _PREEMPT_GRACE_S if s.preempted else _STOP_GRACE_S, _JOIN_S
        for name, body in self.lanes.threads().items():
            driver.start(name, body)
        drained = False

        def tick() -> None:  # a learner of several ranks drains what rollouts still send
            nonlocal drained
            self.lanes.autotune_tick()
            if not drained and self.plan.learner and s.learner_done.is_set() and s.world_size > 1:
                self._drain()
                drained = True

        status = None
        try:
            status = serve_status(self)  # rank 0 with run.status_port: the live status endpoint
            driver.supervise(tick)
        except BaseException:  # a KeyboardInterrupt, a status port that cannot be bound
            s.request_stop()
            raise
        finally:
            if status is not None:
                status.stop()
            if self.errors:
                s.request_stop()
            self.lanes_left_running = driver.join()
            if self.plan.learner and not self.errors:
                self._drain(wait=not drained and s.world_size > 1)
            self._close()
        return self._finish()

    def _run_serial(self) -> dict[str, Any]:
        """``swimlane.driver=serial``: all four lanes in this thread (sync mode, one process)."""
        s, lanes = self.state, self.lanes
        self.updates.open_metrics()
        try:
            lanes.broadcast.begin(s.version)
            lanes.sampling.begin()
            SerialDriver(lanes.polls()).run(lambda: lanes.gradient.done or s.version >= s.iterations, s.stop_event)
            self.updates.checkpoint_if_preempted()
        except LaneError as exc:
            self.driver.errors.append(exc)
        finally:
            self.updates.metrics.close()
            s.learner_done.set()
            s.rollout_stop.set()
            self._close()
        return self._finish()

    def _finish(self) -> dict[str, Any]:
        with self._serving:
            if self.errors:
                try:  # best effort: the counters of a failed attempt are worth keeping
                    write_summary(self, error=str(self.errors[0]).splitlines()[0])
                except Exception:
                    log.exception("could not write the summary of the failed run")
                raise self.errors[0]
            return write_summary(self)

    def _drain(self, wait: bool = True) -> None:
        """After the last update: read (and discard, counted) what rollout ranks still
        send until each has said it ended (``wait``), so none stays blocked on
        backpressure; then whatever is still queued."""
        source, s = self.parts.source, self.state
        deadline = time.monotonic() + 60.0
        while wait and not source.senders_gone(self.parts.expected_senders) and time.monotonic() < deadline \
                and not s.stop_event.is_set():
            self._discard(source.get(timeout=POLL_S))
        while source.depth() > 0:
            self._discard(source.get(timeout=0.0))

    def _discard(self, item) -> None:
        if item is None:
            return
        self.state.ledger.add("discarded_after_run")
        if self.state.world_size > 1:
            self.parts.source.receiver.counters.dropped["run_ended"] += 1
        if item[2] is not None:
            item[2]()  # the rollout buffers go back to the pool

    def _close(self) -> None:
        p = self.parts
        for env in p.envs:
            env.close()
        if p.sink is not None and self.state.world_size > 1:
            p.sink.close()
        if p.source is not None and self.state.world_size > 1:
            p.source.close()
