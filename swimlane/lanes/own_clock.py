"""The sampling lane's env groups with every env on its own clock (``swimlane.independent_envs``).

A group is reset once; from then on its env restarts each episode (each GRPO group of
episodes) as soon as it ends, and a :class:`dvla.rollout.episodes.StreamRecorder` fills chunks with
ended episodes. In sync mode a group's turn in a round lasts until it has sent one chunk;
the episodes it runs then wait for its next turn.

In async mode admission (weights version against the chunks sent, :mod:`swimlane.lanes.admission`)
is asked when a new episode would open a chunk: while that chunk would reach the learner
more than ``max_staleness`` versions after these weights, the env holds its restarts (ended
envs wait) and the episodes that run go on, so what the group holds does not grow stale
while it waits. A chunk being filled always takes new episodes (it was admitted when it
opened), so chunks leave full. Once no episode runs, the group parks until admitted, then
every env starts anew. A group fills a bounded number of chunks at once (:attr:`OwnClock.max_open`).

With PPO segments (``swimlane.segment_len``, a :class:`dvla.rollout.segments.SegmentRecorder`) no
restart is held: every env steps until its group's chunk is full. Then the group opens the
next chunk by acting (the reply's values also complete the full chunk) if it may; if not
(sync mode: the round's chunk is sent; async: admission refuses), it asks for the values the
full chunk still needs, sends it, and parks until admitted.
"""

from __future__ import annotations

from dvla.rollout.episodes import ChunkRecorder, StreamRecorder
from dvla.rollout.segments import SegmentRecorder
from swimlane.lanes.messages import Reply, Request


class OwnClock:
    def __init__(self, lane):
        """``lane``: the :class:`swimlane.lanes.sampling.SamplingLane` whose groups it steps."""
        self.lane = lane
        c = lane.cfg
        self.max_open = 2 if c.mode == "sync" else 1 + c.max_staleness
        """Chunks a group fills at once. Sync: the oldest (waiting for its slowest episodes)
        and the next, so that a chunk leaves in its round or the next. Async: one more per
        version of staleness allowed (admission bounds what they hold); a bound on memory."""

    def resume(self, g: int) -> None:
        """Ask for the group's next actions: after a reset the first time (or after a
        failure), after restarting every env when it parked drained."""
        lane, c = self.lane, self.lane.cfg
        state, env = lane.groups[g], lane.envs[g]
        if state.recorder is None:
            with lane.tracer.span("sampling", "reset"):
                while True:
                    try:
                        raw = env.reset(c.group_size, independent=True, final_obs=c.has_value)
                        break
                    except Exception as exc:
                        lane.recover(g, exc)
                state.recorder = self._recorder(g)
                state.recorder.begin(lane.prepare(raw))
        elif isinstance(state.recorder, SegmentRecorder):
            pass  # admitted: its next decision opens a chunk
        elif env.restart_limit == 0 and state.recorder.drained:
            env.restart_limit = None
            state.recorder.restart(*env.restart_ended())
        self.ask(g)

    def _recorder(self, g: int) -> StreamRecorder | SegmentRecorder:
        lane, c = self.lane, self.lane.cfg
        lease = None
        if lane.host_pool is not None:  # each chunk's tensors from the transient pool
            def lease():
                held = lane.host_pool.lease()
                return held.empty, held.release
        n_sets = len(lane.envs) * c.rollout_ranks  # episode group ids unique across the run

        def group_id(k: int) -> int:
            return k * n_sets + c.rollout_index * len(lane.envs) + g

        if c.segment_len:
            return SegmentRecorder(lane.envs[g].spec, c.n_envs, c.action_chunk, c.segment_len, prepare=lane.prepare,
                                   lease=lease, extras=c.extras, cameras=c.cameras, group_id=group_id)
        return StreamRecorder(lane.envs[g].spec, c.n_envs, c.action_chunk, c.episode_len, prepare=lane.prepare,
                              group_size=c.group_size, has_value=c.has_value, lease=lease, extras=c.extras,
                              cameras=c.cameras, group_id=group_id)

    def ask(self, g: int) -> None:
        """The group's next request: values only when no episode runs and bootstrap values
        are owed (or the oldest chunk waits for them). Segments ask here only when resumed:
        for actions, which open the next chunk."""
        rec = self.lane.groups[g].recorder
        owed = not isinstance(rec, SegmentRecorder) and (rec.waiting_for_values or not bool(rec.live.any()))
        kind = "value" if owed else "act"
        self.lane.requests.put(Request(g, kind, rec.request_obs()))

    def gate(self, g: int) -> None:
        """Before each step: how many envs whose episode has ended may start another? As many
        as the chunk being filled has columns left (admitted when it opened), and a chunk
        more if the group may open one: it is active (``lane.active``), has fewer than
        :attr:`max_open` open and, in async mode, admission for a chunk that leaves after
        every chunk open now. An inactive group fills its chunk, then drains and parks."""
        rec, env = self.lane.groups[g].recorder, self.lane.envs[g]
        env.restart_limit = rec.room + (rec.b if self.may_open(g) else 0)

    def may_open(self, g: int) -> bool:
        """Whether group ``g`` may open another chunk (see :meth:`gate`)."""
        lane, rec = self.lane, self.lane.groups[g].recorder
        return g < lane.active and len(rec.chunks) < self.max_open and (
            lane.cfg.mode != "async" or lane.admission.admits(lane.weights.latest_version, ahead=self.open_chunks()))

    def open_chunks(self) -> int:
        """Chunks being filled in every group: about as many leave before a new one."""
        return sum(len(s.recorder.chunks) for s in self.lane.groups
                   if isinstance(s.recorder, ChunkRecorder))

    def on_reply(self, reply: Reply) -> bool:
        """Advance the reply's group; True when it stops for now (sync: it sent its chunk of
        the round; async: it sent everything and parks until admitted)."""
        g, rec, env = reply.group, self.lane.groups[reply.group].recorder, self.lane.envs[reply.group]
        segments = isinstance(rec, SegmentRecorder)
        if reply.kind != "value" and not segments:
            self.gate(g)
        stop = self._advance(reply, rec)
        if stop is not None:
            return stop
        if segments:
            return self._next_segment(g, rec)
        if env.restart_limit == 0 and rec.drained:  # nothing runs: send what it holds, then wait
            rec.flush()
            while rec.ready:
                self.lane.emit(g, None)
            return True
        self.ask(g)
        return False

    def _advance(self, reply: Reply, rec) -> bool | None:
        """Take the reply in (values, or a step simulated and recorded) and send every chunk it
        completed. A bool when that settles :meth:`on_reply`'s answer: False after a failed
        step (the group starts anew), True once sync mode sent the round's chunk."""
        lane = self.lane
        if reply.kind == "value":
            rec.fill(reply.out)
        else:
            res = lane.simulate(reply.group, reply.out.actions[:rec.b])
            if res is None:
                return False
            live, idle = rec.record(reply.out, res, reply.version)
            lane.ledger.add("env_steps_live", live)
            lane.ledger.add("env_steps_idle", idle)
        while rec.ready:
            lane.emit(reply.group, None)
            if lane.cfg.mode == "sync":
                return True
        return None

    def _next_segment(self, g: int, rec: SegmentRecorder) -> bool:
        """PPO segments, after a reply: act on; once the chunk is full and the group may not
        open another, ask for the values it still needs, then park (see the module's
        docstring)."""
        if rec.full and (self.lane.cfg.mode == "sync" or not self.may_open(g)):
            if not rec.owes_values:
                return True  # its chunks are sent: parked until admitted (sync: the next round)
            kind = "value"
        else:
            kind = "act"
        self.lane.requests.put(Request(g, kind, rec.request_obs()))
        return False
