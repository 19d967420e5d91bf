"""The broadcast lane, both ends: rank 0 publishes every snapshot of the learner's
weights (locally into the standby inference replica, and over the control plane); every
other rank receives each version into its standby replica.

The gradient lane hands snapshots over through a :class:`SnapshotSlot`: one slot, so a
version the broadcast lane is too busy to take is skipped and a newer one goes out.
"""

from __future__ import annotations

import threading
from typing import Callable

from swimlane.agreement.ordering import CollectiveOrder
from swimlane.observation.trace import Tracer


class SnapshotSlot:
    """One snapshot of the weights between the gradient lane (writer) and the broadcast lane
    (reader). The writer copies into it only while the reader is not sending from it."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._free = threading.Event()
        self._free.set()
        self.version = -1
        self.pending = False  # the writer skipped a version while the slot was busy

    @property
    def free(self) -> bool:
        return self._free.is_set()

    def offer(self, version: int, copy: Callable[[], None], wait: bool, stop: threading.Event,
              poll_s: float = 0.05) -> bool:
        """Copy the weights in (``copy``) and hand them over as ``version``. When the reader
        is still sending the previous snapshot: wait for it if ``wait``, else mark the
        version pending (a later offer goes out instead) and return False."""
        while wait and not self._free.wait(poll_s):
            if stop.is_set():
                return False
        if not self._free.is_set():
            self.pending = True
            return False
        self.pending = False
        self._free.clear()
        copy()
        self.version = version
        self._ready.set()
        return True

    def take(self, timeout: float) -> int | None:
        """Reader: the version handed over, or None after ``timeout``. Call :meth:`done`
        when it is sent."""
        if not self._ready.wait(timeout):
            return None
        self._ready.clear()
        return self.version

    def done(self) -> None:
        self._free.set()


class BroadcastSource:
    """Rank 0: publish the starting weights, then every snapshot handed over, until the
    last version (or the learner ended without handing more)."""

    def __init__(self, *, slot: SnapshotSlot, publish: Callable[[int], None], snapshot: Callable[[], None],
                 last_version: int, learner_done: threading.Event, poll_s: float = 0.05):
        self.slot, self.publish, self.snapshot = slot, publish, snapshot
        self.last_version, self.learner_done, self.poll_s = last_version, learner_done, poll_s
        self.finished = False  # the last version is out

    def begin(self, start_version: int) -> None:
        """Publish the starting weights: version 0, or the version a resumed run starts from."""
        self.snapshot()
        self.publish(start_version)

    def poll(self, timeout: float = 0.0) -> bool:
        """Publish a snapshot if one is handed over within ``timeout`` (0: the serial
        driver's non-blocking step)."""
        version = self.slot.take(timeout)
        if version is None:
            return False
        self.publish(version)
        self.slot.done()
        self.finished = version >= self.last_version
        return True

    def run(self, start_version: int, stop: threading.Event) -> None:
        self.begin(start_version)
        while not stop.is_set():
            if self.poll(self.poll_s):
                if self.finished:
                    break
            elif self.learner_done.is_set() and self.slot.free:
                break  # the learner ended and nothing is waiting to go out


class BroadcastReceiver:
    """Every other rank: receive each published version into the standby replica (or, on a
    rank without replicas, ``weights`` None, relay it). On a learner, each receive waits for
    its turn in the rank's order of collectives (:class:`swimlane.agreement.ordering.CollectiveOrder`)."""

    def __init__(self, *, broadcaster, weights, tracer: Tracer, shutdown_marker: int,
                 order: CollectiveOrder | None = None, stop: threading.Event | None = None,
                 on_header: Callable[[list[int]], None] | None = None):
        """``on_header(words)``: handed each version's header (a rebalancing plan) as soon as
        the version is announced."""
        self.bc, self.weights, self.tracer, self.shutdown_marker = broadcaster, weights, tracer, shutdown_marker
        self.order, self.stop, self.on_header = order, stop or threading.Event(), on_header
        self.last = -1  # newest version received
        self.with_frozen: set[int] = set()  # replicas that hold the frozen buckets

    def step(self) -> bool:
        """Receive one version (blocks until the learner publishes); False at shutdown (or
        a stop while waiting for its turn)."""
        if self.order is not None and not self.order.before_broadcast(self.order.next_published(self.last), self.stop):
            return False
        version = self.bc.receive_version(self.stop)  # on the store: no collective waits for it
        if version is None or version == self.shutdown_marker:
            return False
        if self.on_header is not None:
            self.on_header(self.bc.header)
        if self.weights is None:  # a learner that does not roll out: pass the version on, keep nothing
            with self.tracer.span("broadcast", "relay"):
                self.bc.relay_buckets(version)
            return self._received(version)
        # Pick the standby replica only now: until the data arrives, a version that is
        # ready but not yet picked up by the inference lane stays available to it.
        idx = self.weights.begin_write()
        with self.tracer.span("broadcast", "receive"):
            carries_frozen = not self.bc.frozen_sent  # only the first version carries them
            self.bc.receive_buckets(version, into=self.weights.flats[idx])
            if not carries_frozen and idx not in self.with_frozen:
                # This replica never got the frozen weights: take them from the other one
                # (the active replica, read here, never written while it is active).
                mine, other = self.weights.flats[idx], self.weights.flats[1 - idx]
                for i in self.bc.frozen_buckets:
                    mine[i].copy_(other[i])
            self.with_frozen.add(idx)
        self.weights.commit(idx, version)
        return self._received(version)

    def _received(self, version: int) -> bool:
        self.last = version
        if self.order is not None:
            self.order.broadcast_done(version)
        return True

    def run(self) -> None:
        while self.step():
            pass
