"""The receiving side of the control plane in a background thread: a consumer (the
inference lane, a tool) ``poll()`` s without blocking and gets the newest complete
version, or ``None`` when nothing new has arrived."""

from __future__ import annotations

import threading

from planes.control import SHUTDOWN, WeightBroadcaster


class WeightSubscriber:
    """Receives versions in a background thread; ``poll()`` applies the newest one.

    Two staging buffers: the thread always receives into the one that is not the
    latest complete version, so ``poll`` copies a whole version, never a torn one. On a GPU
    ``poll``'s copies run after it returns: the thread receives into a buffer again only
    after the event that follows them (its collective's stream waits for it).
    """

    def __init__(self, broadcaster: WeightBroadcaster):
        self.bc = broadcaster
        self._bufs = [broadcaster.staging_buffers(), broadcaster.staging_buffers()]
        self._locks = [threading.Lock(), threading.Lock()]
        self._copied: list = [None, None]  # per buffer: the event after poll's copies out of it
        self._ready: tuple[int, int] | None = None  # (version, buffer index)
        self._ready_cv = threading.Condition()
        self.error: BaseException | None = None
        self.closed = False
        self._thread = threading.Thread(target=self._run, name="dvla-weights-recv", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.bc.rt.bind_thread()  # a new thread starts on device 0: bind the rank's
            while True:
                idx = 0 if self._ready is None else 1 - self._ready[1]
                with self._locks[idx]:
                    version = self.bc.receive(into=self._bufs[idx], after=self._copied[idx])
                if version == SHUTDOWN:
                    break
                with self._ready_cv:
                    self._ready = (version, idx)
                    self._ready_cv.notify_all()
        except BaseException as exc:
            self.error = exc
        finally:
            with self._ready_cv:
                self.closed = True
                self._ready_cv.notify_all()

    @property
    def latest_version(self) -> int:
        r = self._ready
        return -1 if r is None else r[0]

    def poll(self) -> int | None:
        """Apply the newest received version to the module if it is newer than the one
        applied; return it, or ``None`` when there is nothing new. Never waits for the
        network."""
        if self.error is not None:
            raise RuntimeError("weight receiver thread failed") from self.error
        for _ in range(3):
            r = self._ready
            if r is None or r[0] <= self.bc.version:
                return None
            version, idx = r
            # The receiving thread only ever writes the buffer that is *not* ready; if this
            # lock is taken, a newer version has just become ready: look again.
            if not self._locks[idx].acquire(blocking=False):
                continue
            try:
                if self._ready != r:
                    continue
                self._copied[idx] = self.bc.load_flat(self._bufs[idx], version)
                return version
            finally:
                self._locks[idx].release()
        return None

    def wait_for(self, version: int, timeout: float | None = None) -> bool:
        """Block until ``version`` (or newer) has arrived or the stream ended."""
        with self._ready_cv:
            return self._ready_cv.wait_for(lambda: self.latest_version >= version or self.closed, timeout)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
