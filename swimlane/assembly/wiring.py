"""The lanes of a rank joined by their channels, in one place (:func:`connect`), and what each
lane's thread runs around its loop (:class:`Lanes`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from swimlane.adaptation.tuning import tuner_for
from swimlane.assembly.driver import lower_thread_priority
from swimlane.assembly.parts import RankParts
from swimlane.assembly.state import POLL_S, THROTTLE_S, RunState
from swimlane.assembly.updates import Updates
from swimlane.lanes import (
    BroadcastReceiver,
    BroadcastSource,
    GradientConfig,
    GradientLane,
    InferenceLane,
    Reply,
    Request,
    SamplingConfig,
    SamplingLane,
)
from swimlane.lanes.channels import LocalChannel
from swimlane.lanes.turns import Turns
from swimlane.observation.health import StallTimer
from planes.control import SHUTDOWN
from dvla.rollout import cameras_of


def connect(parts: RankParts, state: RunState, updates: Updates) -> "Lanes":
    """Every lane the rank's plan names, built from the parts and joined by its channels:

    sampling -requests-> inference -replies-> sampling -chunks (sink ... source)-> gradient
    -snapshot slot-> broadcast -control plane / standby replica-> inference."""
    sl, plan, s = state.cfg.swimlane, parts.plan, state
    turns = Turns(sl.take_turns)  # overlapping lanes, or taking turns (an autotune knob)
    requests: LocalChannel[Request] = LocalChannel()
    replies: LocalChannel[Reply] = LocalChannel()
    sampling = inference = gradient = None
    if plan.rollout:
        inference = InferenceLane(
            requests=requests, replies=replies, weights=parts.weights, generator=parts.sample_gen, tracer=s.tracer,
            batch_all=sl.mode == "async", pool=parts.memory.inference if parts.memory is not None else None,
            poll_s=POLL_S, stream=parts.streams["inference"], groups=lambda: sampling.active, turns=turns)
        sampling = SamplingLane(
            envs=parts.envs, prepare=parts.policy.prepare, requests=requests, replies=replies, sink=parts.sink,
            weights=parts.weights, tracer=s.tracer, ledger=s.ledger, stop=s.rollout_stop, halt=s.stop_event,
            host_pool=parts.host_pool if parts.memory is not None else None, turns=turns, serve=inference.serve,
            cfg=sampling_config(parts, state))
    if plan.learner:
        adaptive = sl.roles == "adaptive" and s.rank != 0
        gradient = GradientLane(
            source=parts.source, algo=parts.algo, generator=parts.learn_gen, ledger=s.ledger, tracer=s.tracer,
            cfg=GradientConfig(need=sl.chunks_per_update if sl.mode == "async" else
                               sl.env_groups * max(1, len(parts.expected_senders)),  # sync: a chunk per group
                               max_staleness=0 if sl.reissue else sl.max_staleness,  # on-policy rounds
                               iterations=s.iterations, stop_rollouts_before_last=sl.mode == "async",
                               spec=parts.chunk_spec, independent=sl.independent_envs,
                               max_bad_updates=sl.max_bad_updates, poll_s=POLL_S,
                               senders=tuple(parts.expected_senders)),
            version=lambda: s.version, finish_update=updates.finish_update, check_health=updates.check_health,
            stall=StallTimer(sl.stall_timeout_s), idle=updates.retry_handoff, stop_rollouts=s.rollout_stop.set,
            activations=updates.activations, turn=turns, throughput=parts.balance.throughput,
            before_update=lambda: parts.order.before_update(s.version, s.stop_event),
            learning=(lambda: s.learning) if adaptive else None)
    if plan.broadcast.role == "source":
        broadcast = BroadcastSource(slot=updates.slot, publish=updates.publish, snapshot=updates.first_snapshot,
                                    last_version=s.iterations, learner_done=s.learner_done, poll_s=POLL_S)
    else:
        broadcast = BroadcastReceiver(
            broadcaster=parts.bc, weights=parts.weights, tracer=s.tracer, shutdown_marker=SHUTDOWN,
            order=parts.order if parts.order.enabled else None, stop=s.stop_event,
            on_header=(lambda words: parts.balance.apply(words, updates.apply_plan))
            if parts.balance.planning and plan.rollout else None)
    updates.sampling = sampling
    return Lanes(parts, state, updates, turns, sampling, inference, gradient, broadcast)


def sampling_config(parts: RankParts, state: RunState) -> SamplingConfig:
    cfg, sl, rank = state.cfg, state.cfg.swimlane, state.rank
    routes, rollout = parts.plan.routes, parts.placement.rollout
    return SamplingConfig(
        mode=sl.mode, n_envs=cfg.env.n_envs, group_size=cfg.algo.group_size if cfg.algo.name == "grpo" else 1,
        episode_len=cfg.env.episode_len, action_chunk=cfg.policy.action_chunk,
        has_value=parts.policy.has_value_head, chunks_per_update=sl.chunks_per_update,
        senders=sum(learner == routes[rank] for learner in routes.values()),  # ranks sending to our learner
        max_staleness=sl.max_staleness, max_env_failures=sl.max_env_failures, rank=rank,
        rollout_index=rollout.index(rank), rollout_ranks=len(rollout), extras=parts.policy.rollout_extras(),
        cameras=cameras_of(parts.policy), independent=sl.independent_envs, segment_len=sl.segment_len,
        active=sl.autotune_start_groups or sl.env_groups, reissue=sl.reissue, throttle_s=THROTTLE_S, poll_s=POLL_S)


@dataclass
class Lanes:
    """A rank's lanes (those its plan does not name are None) and what each one's thread runs."""

    parts: RankParts
    state: RunState
    updates: Updates
    turns: Turns
    sampling: SamplingLane | None
    inference: InferenceLane | None
    gradient: GradientLane | None
    broadcast: BroadcastSource | BroadcastReceiver
    tuner: object = field(default=None)

    def threads(self) -> dict[str, Callable[[], None]]:
        """Each lane's thread body, by lane name, in the plan's start order."""
        bodies = {"gradient": self._gradient, "broadcast": self._broadcast, "inference": self._inference,
                  "sampling": self._sampling}
        return {lane: bodies[lane] for lane in self.parts.plan.lanes}

    def polls(self) -> dict[str, Callable[[], bool]]:
        """The serial driver's round: every lane's non-blocking step (one process, sync mode)."""
        return {"broadcast": self.broadcast.poll, "inference": self.inference.poll, "sampling": self.sampling.poll,
                "gradient": self.gradient.poll}

    def _named(self, lane: str) -> None:
        self.state.tids[lane] = threading.get_native_id()

    def _sampling(self) -> None:
        self._named("sampling")
        self.sampling.run()

    def _inference(self) -> None:
        self._named("inference")
        self.inference.run(self.state.rollout_stopping)

    def _gradient(self) -> None:
        s, sl = self.state, self.state.cfg.swimlane
        self._named("gradient")
        if sl.gradient_nice:
            lower_thread_priority(sl.gradient_nice)
        self.updates.open_metrics()
        try:
            self.gradient.run(s.stop_event)
            self.updates.checkpoint_if_preempted()
        finally:
            self.updates.metrics.close()
            self.parts.order.ended()
            s.learner_done.set()

    def _broadcast(self) -> None:
        """The source publishes the starting weights (version 0, or the resumed version), then
        every snapshot handed over; the others receive every version."""
        s = self.state
        if isinstance(self.broadcast, BroadcastSource):
            self.broadcast.run(s.version, s.stop_event)
            if self.parts.bc is not None:
                self.parts.bc.shutdown()
        else:
            self.broadcast.run()
        s.rollout_stop.set()

    def autotune_tick(self) -> None:
        """From the supervisor: once the lanes it adjusts run, the resource manager's window."""
        s, sl = self.state, self.state.cfg.swimlane
        if self.tuner is None and sl.autotune and self.sampling is not None and "sampling" in s.tids and \
                "inference" in s.tids and (self.gradient is None or "gradient" in s.tids):
            self.tuner = self.updates.tuner = tuner_for(sl, self.sampling, self.inference, lambda: dict(s.tids),
                                                        s.ledger, s.tracer, self.turns)
        if self.tuner is not None:
            self.tuner.maybe_tick()
