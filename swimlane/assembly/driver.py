"""The threaded driver: every lane in a thread of its own, supervised.

A lane that raises ends the run: its error is kept as a :class:`LaneError` carrying the
lane's name and traceback, and the stop events are set so the other lanes wind down.
After a stop, lanes get ``grace_s`` to end; one blocked in a collective whose peer died
never does, so the driver leaves it behind (its thread is a daemon) and reports it, so
that the run's summary is still written before torchrun's SIGKILL follows its SIGTERM.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from typing import Callable

from memory import runtime

log = logging.getLogger("dvla.swimlane")


def lower_thread_priority(nice: int) -> None:
    """Add ``nice`` to the calling thread's niceness (Linux: a thread id is a process id
    to ``setpriority``); warn and go on where that is not possible."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + nice, 19))
    except (AttributeError, OSError) as exc:
        log.warning("swimlane.gradient_nice=%d not applied to the gradient lane: %r", nice, exc)


class LaneError(RuntimeError):
    """A lane raised; the message carries the lane's name and traceback."""

    def __init__(self, lane: str, exc: BaseException, tb: str):
        super().__init__(f"swimlane lane '{lane}' failed: {type(exc).__name__}: {exc}\n{tb}")
        self.lane = lane
        self.original = exc


class ThreadedDriver:
    def __init__(self, *, stop: threading.Event, on_error: Callable[[], None], poll_s: float = 0.05,
                 grace_s: float = 10.0, join_s: float = 5.0):
        """``stop``: the run is stopping (the grace period counts from it); ``on_error()``
        makes every lane stop after one failed."""
        self.stop, self.on_error = stop, on_error
        self.poll_s, self.grace_s, self.join_s = poll_s, grace_s, join_s
        self.errors: list[LaneError] = []
        self.threads: dict[str, threading.Thread] = {}

    def start(self, name: str, fn: Callable[[], None]) -> threading.Thread:
        """Run lane ``fn`` in a thread of its own, bound to the rank's device first (the
        current device is per thread: memory/runtime.py)."""
        rt = runtime.current()

        def body() -> None:
            try:
                rt.bind_thread()
                fn()
            except BaseException as exc:  # any failure ends the run with this lane's traceback
                self.errors.append(LaneError(name, exc, traceback.format_exc()))
                self.on_error()

        t = threading.Thread(target=body, name=f"dvla-{name}", daemon=True)
        self.threads[name] = t
        t.start()
        return t

    def supervise(self, tick: Callable[[], None] = lambda: None) -> None:
        """Wait while any lane runs and none failed, calling ``tick()`` between checks;
        after a stop, wait at most ``grace_s``."""
        stopped_at = None
        while any(t.is_alive() for t in self.threads.values()) and not self.errors:
            tick()
            if self.stop.is_set():
                stopped_at = stopped_at or time.monotonic()
                if time.monotonic() - stopped_at > self.grace_s:
                    break
            for t in self.threads.values():
                t.join(timeout=self.poll_s)

    def join(self) -> list[str]:
        """Give all lanes together ``join_s`` more; return the names of those still running."""
        deadline = time.monotonic() + self.join_s
        for t in self.threads.values():
            t.join(timeout=max(deadline - time.monotonic(), 0.0))
        left = [name for name, t in self.threads.items() if t.is_alive()]
        if left:
            log.warning("lane(s) %s still running after the stop (blocked in a collective whose peer is "
                        "gone?); leaving them", ", ".join(left))
        return left


class SerialDriver:
    """Every lane in the calling thread: round-robin over the lanes' non-blocking
    ``poll()`` until ``done()``. Deterministic by construction, no threads to reason
    about: the reference the threaded driver's sync mode must match bit for bit. A full
    round in which no lane can do anything is a deadlock, reported, not waited on."""

    def __init__(self, polls: dict[str, Callable[[], bool]]):
        self.polls = polls

    def run(self, done: Callable[[], bool], stop: threading.Event) -> None:
        while not done() and not stop.is_set():
            progressed = False
            for name, poll in self.polls.items():
                try:
                    progressed |= poll()
                except BaseException as exc:
                    raise LaneError(name, exc, traceback.format_exc()) from exc
                if done():
                    return
            if not progressed:
                raise RuntimeError(f"serial driver: no lane can go on (lanes: {', '.join(self.polls)})")
