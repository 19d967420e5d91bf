"""Double-buffered inference weights: a writer fills the standby replica, the reader flips.

The inference lane holds two replicas of the policy. New weights (from the local
broadcast lane or from the control plane) are always written into the replica that
is *not* active; once complete, the version is marked ready, and the inference lane
switches to it between two batches by swapping a reference under a lock held for a
few instructions. No copy happens under the lock and a forward pass never sees a
half-written version.
"""

from __future__ import annotations

import threading
import time

import torch
from torch import Tensor

from dvla.policy import VLAPolicy
from memory import runtime


class DoubleBufferedWeights:
    def __init__(self, replicas: list[VLAPolicy], flats: list[list[Tensor]]):
        if len(replicas) != 2 or len(flats) != 2:
            raise ValueError("DoubleBufferedWeights needs exactly two replicas and their flat buckets")
        self.replicas = replicas
        self.flats = flats
        self.versions = [-1, -1]
        self._active = 0
        self._ready: int | None = None  # index of a complete, newer, not yet active replica
        self._writing: int | None = None
        self._cv = threading.Condition()
        self.swaps = 0

    # -- writer side (one writer thread) ---------------------------------------------------
    def begin_write(self) -> int:
        """Index of the replica to write the next version into (never the active one)."""
        with self._cv:
            idx = 1 - self._active
            if self._ready == idx:
                self._ready = None  # about to be overwritten by something newer
            self._writing = idx
            return idx

    def commit(self, idx: int, version: int) -> None:
        """Mark replica ``idx`` complete as ``version``. The writer's device work (copies,
        broadcasts into it) is finished first: the inference lane may read it from a stream
        of its own (swimlane/lanes/streams.py)."""
        runtime.current().synchronize()  # this thread's device work (a no-op on the CPU)
        with self._cv:
            self._writing = None
            self.versions[idx] = version
            if version > self.versions[self._active]:
                self._ready = idx
            self._cv.notify_all()

    @torch.no_grad()
    def write(self, version: int, src: list[Tensor]) -> None:
        """Copy a complete set of flat buckets in as ``version`` (local publishing)."""
        idx = self.begin_write()
        for dst, s in zip(self.flats[idx], src):
            dst.copy_(s, non_blocking=True)
        self.commit(idx, version)

    # -- reader side (the inference lane) --------------------------------------------------
    def acquire(self) -> tuple[VLAPolicy, int]:
        """The newest complete replica and its version; flips to a ready one if any."""
        with self._cv:
            if self._ready is not None:
                self._active = self._ready
                self._ready = None
                self.swaps += 1
            return self.replicas[self._active], self.versions[self._active]

    @property
    def latest_version(self) -> int:
        """Newest complete version, whether or not the reader has switched to it yet."""
        with self._cv:
            return max(self.versions[self._active],
                       self.versions[self._ready] if self._ready is not None else -1)

    def wait_for(self, version: int, stop: threading.Event, poll_s: float = 0.05,
                 timeout: float | None = None) -> bool:
        """Block until ``version`` (or newer) is available; False if ``stop`` was set or
        ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
                newest = max(self.versions[self._active],
                             self.versions[self._ready] if self._ready is not None else -1)
                if newest >= version:
                    return True
                self._cv.wait(poll_s)
        return False
