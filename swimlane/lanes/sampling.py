"""The sampling lane: steps the env groups, asks the inference lane for actions, records
episodes and sends each finished batch of episodes (a chunk) to the learner.

Every env group has its own state (:class:`GroupState`): its recorder, its buffer lease,
the number of chunks it has sent. In async mode each group's next request is in flight
while another group simulates; a group starts a new batch of episodes only when the
weights are fresh enough for the learner to accept its data (:mod:`swimlane.lanes.admission`).
In sync mode the groups run one after the other in rounds, each round on the weights
learned from the one before.

With ``independent`` (``swimlane.independent_envs``) a group is never reset as a whole
after its first start: every env restarts on its own, and :mod:`swimlane.lanes.own_clock`
steps it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dvla.rollout.episodes import ChunkRecorder, StreamRecorder
from dvla.rollout.segments import SegmentRecorder
from dvla.rollout import EpisodeRecorder
from swimlane.lanes.own_clock import OwnClock
from swimlane.lanes.admission import Admission
from swimlane.lanes.channels import Channel, Chunk
from swimlane.observation.health import FailureBudget
from swimlane.lanes.messages import Reply, Request
from swimlane.lanes.turns import Turns
from swimlane.observation.ledger import Ledger
from swimlane.observation.trace import Tracer
from swimlane.lanes.weights import DoubleBufferedWeights

log = logging.getLogger("dvla.swimlane")


@dataclass(kw_only=True)
class SamplingConfig:
    """What the lane needs to know of the run."""

    mode: str  # "async" | "sync"
    n_envs: int  # per env group
    group_size: int
    episode_len: int
    action_chunk: int
    has_value: bool
    chunks_per_update: int
    senders: int  # rollout ranks whose chunks go to our learner (admission)
    max_staleness: int
    max_env_failures: int
    rank: int
    rollout_index: int  # this rank's position among the rollout ranks (episode group ids)
    rollout_ranks: int
    extras: dict = field(default_factory=dict)  # name -> ExtraSpec: what the policy records beside actions
    cameras: dict = field(default_factory=dict)  # name -> (C, H, W): the further cameras the policy reads
    independent: bool = False  # every env on its own clock (swimlane.independent_envs)
    segment_len: int = 0  # with independent: PPO segments of this many decisions (swimlane.segment_len)
    active: int | None = None  # async: env groups that step at the start (None: all; spare groups wait)
    reissue: bool = False  # sync: while waiting for the next round's weights, sample the round's work again
    throttle_s: float = 2.0
    poll_s: float = 0.05


@dataclass
class GroupState:
    recorder: EpisodeRecorder | StreamRecorder | SegmentRecorder | None = None
    lease: Any = None
    chunks: int = 0  # chunks this group has sent
    clock: float = 0.0  # when it started sampling its next chunk (its start, resume or last chunk)


class SamplingLane:
    def __init__(self, *, envs: list, prepare: Callable, requests: Channel[Request], replies: Channel[Reply], sink,
                 weights: DoubleBufferedWeights, tracer: Tracer, ledger: Ledger, cfg: SamplingConfig,
                 stop: threading.Event, halt: threading.Event, host_pool=None, turns: Turns | None = None,
                 serve: Callable[[], bool] = lambda: False):
        """``stop``: the rollouts should stop (also set when the run stops); ``halt``: the
        whole run is stopping (then the sink is not told that this rank ended); ``turns``:
        the rank's switch between overlapping lanes and taking turns
        (:mod:`swimlane.lanes.turns`); ``serve()``: the inference lane's answer in this
        thread while turns are on."""
        self.envs, self.prepare = envs, prepare
        self.requests, self.replies, self.sink = requests, replies, sink
        self.weights, self.tracer, self.ledger, self.cfg = weights, tracer, ledger, cfg
        self.stop, self.halt, self.host_pool = stop, halt, host_pool
        self.groups = [GroupState() for _ in envs]
        self.failures = FailureBudget(len(envs), cfg.max_env_failures)
        self.admission: Admission | None = None
        self.parked: list[int] = []  # async: groups waiting to start a new batch of episodes
        self.active = cfg.active or len(envs)  # async: the groups that step (the first ones; swimlane.autotune and
        # rebalancing plans move it)
        self.own_clock = OwnClock(self)  # the groups' steps with independent envs
        self.turns, self.serve = turns or Turns(), serve
        self.plan: tuple[float | None, int | None, bool] | None = None  # a plan's part for this rank, to apply

    def stopping(self) -> bool:
        return self.stop.is_set() or self.halt.is_set()

    # -- one group ------------------------------------------------------------------------
    def start(self, g: int) -> None:
        """Reset group ``g`` and ask for its first actions."""
        self.groups[g].clock = time.perf_counter()
        if self.cfg.independent:
            self.own_clock.resume(g)
            return
        self.admission.start()
        state, env = self.groups[g], self.envs[g]
        with self.tracer.span("sampling", "reset"):
            while True:
                try:
                    raw = env.reset(self.cfg.group_size)
                    break
                except Exception as exc:  # the reset failed: count it, maybe give up, try again
                    self.recover(g, exc)
            obs = self.prepare(raw)
            alloc = None
            if self.host_pool is not None:  # rollout buffers from the transient pool
                state.lease = self.host_pool.lease()
                alloc = state.lease.empty
            state.recorder = EpisodeRecorder(env, self.cfg.action_chunk, self.cfg.episode_len, alloc=alloc,
                                             extras=self.cfg.extras, cameras=self.cfg.cameras,
                                             async_copies=self.host_pool is not None and self.host_pool.pin_memory)
            state.recorder.start(obs)
        self.requests.put(Request(g, "act", obs))

    def recover(self, g: int, exc: Exception) -> None:
        """A simulator error in group ``g``: drop its batch of episodes, count it, and reset
        the group, unless it keeps failing (then the run stops with the error)."""
        spent = self.failures.failed(g)
        self.ledger.add("env_errors")
        now = time.perf_counter()
        self.tracer.add("sampling", "env_error", now, now)
        state = self.groups[g]
        if state.lease is not None:
            state.lease.release()
        if isinstance(state.recorder, ChunkRecorder):
            state.recorder.close()
        state.recorder = state.lease = None
        n = self.failures.in_a_row[g]
        if spent:
            raise RuntimeError(f"env group {g} failed {n} times in a row "
                               f"(swimlane.max_env_failures={self.cfg.max_env_failures}): {exc!r}") from exc
        log.error("env group %d failed (%d in a row), resetting it: %r", g, n, exc)

    def emit(self, g: int, last_value) -> None:
        """Send group ``g``'s finished batch of episodes to the learner."""
        c, state = self.cfg, self.groups[g]
        if c.independent:
            self.admission.start()  # admission counts the chunks sent
            batch, on_done = state.recorder.pop()
        else:
            n_groups = c.n_envs // c.group_size  # GRPO groups per batch: ids unique across the run
            offset = ((state.chunks * c.rollout_ranks + c.rollout_index) * len(self.envs) + g) * n_groups
            batch = state.recorder.build(torch.arange(c.n_envs) // c.group_size + offset, last_value)
            live = int(batch.valid.sum())
            self.ledger.add("env_steps_live", live)
            self.ledger.add("env_steps_idle", state.recorder.t * c.n_envs - live)
            on_done = state.lease.release if state.lease is not None else None
            state.recorder = state.lease = None
        now = time.perf_counter()
        meta = {"rank": c.rank, "group": g, "chunk": state.chunks, "sample_s": now - state.clock}
        state.clock = now
        state.chunks += 1
        with self.tracer.span("sampling", "send"):
            if self.sink.put(Chunk(batch, meta, on_done), self.stop):
                self.ledger.add("chunks_sent")

    def on_reply(self, reply: Reply) -> bool:
        """Advance the reply's group; True when its batch of episodes is complete."""
        g, state = reply.group, self.groups[reply.group]
        if self.cfg.independent:
            return self.own_clock.on_reply(reply)
        if reply.kind == "value":
            self.emit(g, reply.out)
            return True
        res = self.simulate(g, reply.out.actions)
        if res is None:
            return False
        obs = state.recorder.record(reply.out, res, reply.version)
        if not state.recorder.finished:
            self.requests.put(Request(g, "act", obs))
            return False
        if self.cfg.has_value:
            self.requests.put(Request(g, "value", obs))
            return False
        self.emit(g, None)
        return True

    def simulate(self, g: int, actions):
        """Step group ``g``'s env; None when the simulator failed (the group was reset and
        asked for its first actions again)."""
        try:
            with self.turns(), self.tracer.span("sampling", "sim"):
                res = self.envs[g].step(actions)
        except Exception as exc:
            self.recover(g, exc)
            self.start(g)  # a fresh batch of episodes for this group
            return None
        self.failures.succeeded(g)
        return res

    def next_reply(self) -> Reply | None:
        """The next reply (None once the lane stops). While the lanes take turns, answer our
        own requests first, and again after each wait: the inference lane may not exist yet,
        or its thread may hold a request it took just before the switch."""
        while not self.stopping():
            if self.turns.on:
                with self.turns():
                    self.serve()
                if (reply := self.replies.get(0.0)) is not None:
                    return reply
            with self.tracer.span("sampling", "wait"):
                reply = self.replies.get(self.cfg.poll_s)
            if reply is not None:
                return reply
        return None

    # -- the lane -------------------------------------------------------------------------
    def run(self) -> None:
        with self.tracer.span("sampling", "wait"):
            if not self.weights.wait_for(0, self.stop):
                return
        self.begin()
        if self.cfg.mode == "async":
            self.parked = list(range(len(self.envs)))
            self.start_admitted()
            while not self.stopping() and self.step():
                pass
        else:
            while not self.stopping():
                self.poll(block=True)
        if self.sink is not None and not self.halt.is_set():
            self.sink.end({"rank": self.cfg.rank, "chunks": self.ledger["chunks_sent"]})

    def start_admitted(self) -> None:
        """Start parked active groups, in order, while admission allows."""
        while (ready := [g for g in self.parked if g < self.active]) and self.admission.admits(
                self.weights.latest_version):
            self.parked.remove(ready[0])
            self.start(ready[0])

    def offer_plan(self, share: float | None, active: int | None, anchor: bool = False) -> None:
        """From another thread: a rebalancing plan's share of this rank (admission) and env
        groups that step (0: the rank learns now, :mod:`swimlane.adaptation.roles`), applied by the
        lane's own thread before its next unit of work. ``anchor``: the rank's chunks go to
        another learner now: admission counts from the newest weights on."""
        self.plan = (share, active, anchor or bool(self.plan and self.plan[2]))

    def _apply_plan(self) -> None:
        share, active, anchor = self.plan
        self.plan = None
        if anchor:
            self.admission.anchor(self.weights.latest_version)
        if share is not None:
            self.admission.set_share(share, self.cfg.chunks_per_update)
        if active is not None:
            self.active = max(0, min(active, len(self.envs)))
        if self.parked and min(self.parked) < self.active:  # groups that may step now
            self.start_admitted()

    def step(self) -> bool:
        """Async: one unit of work (wait for admission, or handle one reply); False when
        the lane should end."""
        if self.plan is not None:
            self._apply_plan()
        if self.active == 0 and len(self.parked) == len(self.envs):  # the rank learns now: nothing to sample
            with self.tracer.span("sampling", "throttle"):
                self.stop.wait(self.cfg.poll_s)
            return True
        if len(self.parked) == len(self.envs):  # every group throttled: wait for newer weights
            with self.tracer.span("sampling", "throttle"):
                fresh = self.weights.wait_for(self.admission.needed(), self.stop, timeout=self.cfg.throttle_s)
            if not fresh and not self.stopping():
                # No new version for a while although we produce nothing: the learner is
                # short of data (it dropped a chunk). Sample with the newest weights.
                self.ledger.add("throttle_timeouts")
                g = next(g for g in self.parked if g < max(self.active, 1))
                self.parked.remove(g)
                self.start(g)
            self.start_admitted()
            return True
        reply = self.next_reply()
        if reply is None:
            return False
        if self.on_reply(reply):
            self.parked.append(reply.group)
            self.start_admitted()
        return True

    # -- sync mode (the threaded driver blocks in poll, the serial driver does not) ---------
    def begin(self) -> None:
        """Before the first :meth:`step` or :meth:`poll`: admission and the round start from
        the first published weights version (> 0 after a resume)."""
        c = self.cfg
        self.admission = Admission(self.weights.latest_version, c.chunks_per_update, c.senders, c.max_staleness)
        self.round, self.current = self.weights.latest_version, None
        self.backup: int | None = None  # sync with reissue: the group sampling the round's work again
        self.backups = 0  # groups re-run since the round's own groups finished

    def poll(self, block: bool = False) -> bool:
        """Sync mode: the groups run one after the other, each round on the weights learned
        from the one before. Start the round's next group once the round's weights are
        published, or advance the active group by one reply. ``block``: wait for either
        (until the lane stops). True if it did anything.

        With ``reissue`` (``swimlane.reissue``) a rank that has sent its round's chunks and
        finds no new weights yet samples the round's work again, each group once more on the
        round's weights: the learner takes the first chunks of its version from whoever
        sends them, so its round does not wait for a straggler (what comes too late is
        dropped and counted)."""
        if self.current is None and self.backup is None:
            if self.weights.latest_version < self.round:
                if self.cfg.reissue and self.backups < len(self.envs):
                    self.backup, self.backups = self.backups, self.backups + 1
                    self.ledger.add("chunks_reissued")
                    self.start(self.backup)
                    return True
                if not block:
                    return False
                with self.tracer.span("sampling", "wait"):  # barrier: the weights of this round
                    if not self.weights.wait_for(self.round, self.stop):
                        return False
            self.current, self.backups = 0, 0
            self.start(0)
            return True
        reply = self.next_reply() if block else self.replies.get(0.0)
        if reply is None:
            return False
        if self.on_reply(reply):
            if self.backup is not None:  # a re-issued batch is sent
                self.backup = None
                return True
            self.current += 1
            if self.current == len(self.envs):
                self.current, self.round = None, self.round + 1
            else:
                self.start(self.current)
        return True
