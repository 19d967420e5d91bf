"""Lanes of one rank taking turns on the CPU, a ``swimlane.autotune`` knob.

Overlapping the lanes pays when they run on separate cores without contending. With
GIL-holding simulators, a cheap policy or too few cores, threads that simulate and learn
at once slow each other down more than the overlap gains. With turns on, the sampling
lane's simulator and inline inference steps and the gradient lane's updates each hold one
lock: the rank then runs like the synchronous loop (sample until admission stops it,
learn, publish) with its lanes and channels unchanged, and the controller can switch back
at the next window. Blocking hand-offs (a full chunk queue, waiting for weights or
replies) never hold the turn, so taking turns cannot deadlock the lanes.
"""

from __future__ import annotations

import contextlib
import threading
from typing import ContextManager

_NO_TURN = contextlib.nullcontext()


class Turns:
    """The switch (:attr:`on`, :meth:`set`) and the lock. While on, the inference lane's
    thread idles and the sampling lane answers its own requests (inline)."""

    def __init__(self, on: bool = False) -> None:
        self._lock = threading.Lock()
        self.threads_free = threading.Event()  # set while the lanes overlap (turns off)
        self.set(on)

    def set(self, on: bool) -> None:
        self.on = on
        if on:
            self.threads_free.clear()
        else:
            self.threads_free.set()

    def __call__(self) -> ContextManager:
        """The context a unit of CPU work runs in: the shared lock while turns are on (the
        lock itself, so a switch in between cannot unbalance it)."""
        return self._lock if self.on else _NO_TURN
