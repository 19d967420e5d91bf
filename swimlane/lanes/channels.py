"""Channels between lanes: one small protocol, in-process or over the data plane.

A channel carries messages from one lane to another: ``put(item, stop)`` (False when the
run stopped before a bounded channel had room), ``get(timeout)`` (the next item, or None
after ``timeout`` seconds; 0 does not wait), ``depth()`` and ``close()``. The messages are
small types: :class:`swimlane.lanes.messages.Request` and ``Reply`` between sampling and
inference, :class:`Chunk` from sampling to the learner. Chunks travel in-process through
:class:`swimlane.lanes.chunks.LocalChunks` or across processes through the data plane
(``RemoteChunkSink``/``RemoteChunkSource``): the same protocol, and a sink also has
``end(meta)`` (this sender is done). Snapshots of the weights go
through :class:`swimlane.lanes.broadcast.SnapshotSlot`, a one-item channel whose newest item
wins.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Generic, NamedTuple, Protocol, TypeVar

T = TypeVar("T")


class Channel(Protocol[T]):
    def put(self, item: T, stop: threading.Event | None = None) -> bool: ...

    def get(self, timeout: float = 0.0) -> T | None: ...

    def depth(self) -> int: ...

    def close(self) -> None: ...


class Chunk(NamedTuple):
    """One env group's batch of episodes on its way to the learner."""

    batch: Any  # RolloutBatch
    meta: dict[str, Any]
    on_done: Callable[[], None] | None  # gives the rollout buffers back once used


class LocalChannel(Generic[T]):
    """In-process; with ``capacity`` > 0, ``put`` waits while the channel is full. Once
    ``stop`` is set, ``put`` sends nothing more and returns False."""

    def __init__(self, capacity: int = 0, poll_s: float = 0.05):
        self._q: queue.Queue = queue.Queue(maxsize=capacity)
        self.poll_s = poll_s

    def put(self, item: T, stop: threading.Event | None = None) -> bool:
        while stop is None or not stop.is_set():
            try:
                self._q.put(item, timeout=self.poll_s)
                return True
            except queue.Full:
                continue
        return False

    def get(self, timeout: float = 0.0) -> T | None:
        try:
            return self._q.get(timeout=timeout) if timeout > 0 else self._q.get_nowait()
        except queue.Empty:
            return None

    def depth(self) -> int:
        return self._q.qsize()

    def close(self) -> None:
        pass
