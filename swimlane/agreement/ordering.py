"""One order of collectives on a rank that issues them from two lanes.

A learner of several (``swimlane.learner_ranks > 1``) all-reduces gradients and metrics in
its gradient lane, and takes part in every weight broadcast in its broadcast lane (rank 0
sends, the others receive). NCCL needs every rank to issue collectives of different
communicators in the same order: kernels of two communicators that wait on each other
across ranks can deadlock the GPUs. Gloo tolerates any order, but the same rule keeps the
CPU path the one that is tested.

The order, on every learner rank: the collectives of update ``v`` (gradient all-reduces,
then the metrics all-reduce), then the broadcast of ``v`` when ``v`` is published, then
those of update ``v + 1``. Published versions are known to all ranks in advance: the
starting version, every multiple of ``swimlane.broadcast_every`` and the last one (no
version is skipped while this order holds; :meth:`CollectiveOrder.published` lists them).
Two gates keep it:

- the gradient lane calls :meth:`before_update` before the collectives of update ``v + 1``:
  it waits until the broadcast of the newest published version ``<= v`` is done here;
- the broadcast lane calls :meth:`before_broadcast` before the collective of version
  ``v``: it waits until update ``v`` is done here (or the learner has ended).

Rank 0 needs only the first: its broadcast of ``v`` starts after update ``v`` anyway (the
snapshot is handed over then). :attr:`sequence` records what each gate let through, in
order, for tests and the run summary.
"""

from __future__ import annotations

import threading


class CollectiveOrder:
    def __init__(self, *, enabled: bool, start: int, every: int, last: int, poll_s: float = 0.05):
        """``start``: the first published version (0, or the version a resumed run starts
        from); ``every``: ``swimlane.broadcast_every``; ``last``: ``run.iterations``."""
        self.enabled, self.start, self.every, self.last, self.poll_s = enabled, start, every, last, poll_s
        self._cv = threading.Condition()
        self._updated = start  # newest update whose collectives are done here
        self._broadcast = start - 1  # newest version whose broadcast is done here
        self._ended = False
        self.sequence: list[tuple[str, int]] = []

    def published(self, version: int) -> bool:
        return version == self.start or version == self.last or (version > self.start and version % self.every == 0)

    def next_published(self, after: int) -> int:
        """The first version published after ``after`` (``start`` for ``after < start``)."""
        if after < self.start:
            return self.start
        v = (after // self.every + 1) * self.every
        return min(v, self.last) if after < self.last else after + self.every

    def _newest_published(self, upto: int) -> int:
        v = upto - upto % self.every
        return max(v, self.start) if upto < self.last else upto

    def _wait(self, ready, stop: threading.Event) -> bool:
        with self._cv:
            while not ready():
                if stop.is_set():
                    return False
                self._cv.wait(self.poll_s)
            return True

    # -- the gradient lane ---------------------------------------------------------------
    def before_update(self, current: int, stop: threading.Event) -> bool:
        """Before the collectives of update ``current + 1``; False if the run stopped."""
        if not self.enabled:
            return True
        need = self._newest_published(current)
        if not self._wait(lambda: self._broadcast >= need, stop):
            return False
        with self._cv:
            self.sequence.append(("update", current + 1))
        return True

    def updated(self, version: int) -> None:
        """Update ``version``'s collectives are done (after its metrics all-reduce)."""
        with self._cv:
            self._updated = max(self._updated, version)
            self._cv.notify_all()

    def ended(self) -> None:
        """The gradient lane has ended: no more updates; broadcasts need not wait for one."""
        with self._cv:
            self._ended = True
            self._cv.notify_all()

    # -- the broadcast lane --------------------------------------------------------------
    def before_broadcast(self, version: int, stop: threading.Event) -> bool:
        """Before the collective that carries ``version``; False if the run stopped."""
        if not self.enabled:
            return True
        return self._wait(lambda: self._updated >= version or self._ended, stop)

    def broadcast_done(self, version: int) -> None:
        with self._cv:
            self._broadcast = max(self._broadcast, version)
            if self.enabled:
                self.sequence.append(("broadcast", version))
            self._cv.notify_all()
