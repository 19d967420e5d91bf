"""A recording fake of the rank's device runtime (memory/runtime.py) for CPU tests.

It runs the GPU code paths (streams, memory pools with MemPools, pinned host buffers and
asynchronous copies, collectives on a communication stream) with tensors on the CPU, and
records every break of the discipline as a violation:

* a thread that calls the runtime without having bound the device first;
* a collective (``torch.distributed``'s, and a DTensor's gather, ``full_tensor``: patched while
  the fake is installed) issued outside :meth:`Runtime.collective`, i.e. on the thread's
  compute stream;
* two threads routing allocations into one memory pool at once, or a thread other than the
  owner of a pool held for whole passes (the base runtime refuses both with
  :class:`memory.runtime.DisciplineError`; the fake records them too, and which threads
  routed into each pool, :attr:`FakeRuntime.routed`);
* a pinned block handed out again while an asynchronous copy into it may still be in flight
  (no event recorded after the copy and waited for by the host).

A fake cannot see CUDA work torch does on its own; it guards the discipline, it does not
prove a GPU run correct.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.distributed as dist

from memory import runtime
from memory.runtime import DisciplineError, Runtime

COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "all_gather_object", "reduce_scatter_tensor", "barrier",
               "all_gather_into_tensor", "broadcast_object_list")


class FakeStream:
    def __init__(self, name: str, kind: str):
        self.name, self.kind = name, kind  # kind: "compute" (default and lane streams) or "comm"

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self, storages: set[int], copies: list | None = None):
        self.storages = storages  # pinned storages with copies queued before the event
        self.copies = copies or []  # with deferred copies: those queued before the event


class FakePool:
    """Stands in for a ``torch.cuda.MemPool``."""


class FakeRuntime(Runtime):
    accelerated = True
    fake = True

    def __init__(self, defer_copies: bool = False):
        """``defer_copies``: :meth:`copy_async` runs a copy only once something waits for it
        (the stream's :meth:`synchronize`, or an event after it that a stream or the host
        waits for), as a GPU may: a buffer written again before then gives the copy the
        newer contents, the race a missing event lets through."""
        super().__init__("cpu")
        self.defer_copies = defer_copies
        self._deferred: dict[int, list] = {}  # id(stream) -> [(dst, src)] not yet run
        self.violations: list[str] = []
        self._local = threading.local()
        self._default = FakeStream("default", "compute")
        self._pinned: set[int] = set()  # storages of pinned host buffers
        self._pending: dict[int, set[int]] = {}  # id(stream) -> pinned storages with copies in flight
        self._vlock = threading.Lock()
        self.collectives = 0
        self.emptied = 0  # empty_cache calls
        self.routed: dict[str, set[str]] = {}  # pool name -> the threads that routed allocations into it

    # -- recording -------------------------------------------------------------------------
    def _violate(self, what: str) -> None:
        with self._vlock:
            self.violations.append(f"{threading.current_thread().name}: {what}")

    def _check(self, call: str) -> None:
        if not getattr(self._local, "bound", False):
            self._violate(f"{call} before the thread bound the rank's device")

    def _stream(self) -> FakeStream:
        return getattr(self._local, "stream", None) or self._default

    # -- the runtime -------------------------------------------------------------------------
    def bind_thread(self) -> None:
        self._local.bound = True

    def new_stream(self, priority: int = 0):
        self._check("new_stream")
        return FakeStream(f"lane{priority}", "compute")

    def priority_range(self) -> tuple[int, int]:
        return 0, -1

    def current_stream(self):
        self._check("current_stream")
        return self._stream()

    def default_stream(self):
        return self._default

    @contextlib.contextmanager
    def use_stream(self, stream):
        self._check("use_stream")
        before, self._local.stream = getattr(self._local, "stream", None), stream
        try:
            yield
        finally:
            self._local.stream = before

    def synchronize(self, stream=None) -> None:
        self._check("synchronize")
        with self._vlock:
            self._pending.pop(id(stream or self._stream()), None)
            self._run_copies(list(self._deferred.get(id(stream or self._stream()), ())))

    def _run_copies(self, copies: list) -> None:
        """Run the deferred copies named that have not run yet (lock held)."""
        for queue in self._deferred.values():
            for copy in [c for c in queue if any(c is d for d in copies)]:
                queue.remove(copy)
                copy[0].copy_(copy[1])

    def record_stream(self, tensor, stream) -> None:
        self._check("record_stream")

    def record_event(self, stream=None):
        self._check("record_event")
        with self._vlock:
            key = id(stream or self._stream())
            return FakeEvent(set(self._pending.get(key, ())), list(self._deferred.get(key, ())))

    def wait_event(self, event) -> None:
        self._check("wait_event")
        if event is not None:
            with self._vlock:
                self._run_copies(event.copies)

    def host_wait(self, event) -> None:
        self._check("host_wait")
        if event is not None:
            with self._vlock:
                for pending in self._pending.values():
                    pending -= event.storages
                self._run_copies(event.copies)

    def event_done(self, event) -> bool:
        return True

    def new_mempool(self, device=None):
        return FakePool()

    def empty_cache(self) -> None:
        self.emptied += 1

    def _enter(self, pool, name: str, held: bool) -> None:
        self._check("allocate_in")
        try:
            super()._enter(pool, name, held)
        except DisciplineError as exc:
            self._violate(str(exc))
            raise
        with self._vlock:
            self.routed.setdefault(name, set()).add(threading.current_thread().name)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        self._check("pinned_empty")
        t = torch.empty(nbytes, dtype=torch.uint8)
        with self._vlock:
            self._pinned.add(t.untyped_storage().data_ptr())
        return t

    def handing_out(self, block: torch.Tensor) -> None:
        ptr = block.untyped_storage().data_ptr()
        with self._vlock:
            busy = any(ptr in pending for pending in self._pending.values())
        if busy:
            self._violate("a pinned block is handed out again before the event after its copies was waited for")

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._check("copy_async")
        if self.defer_copies:
            with self._vlock:
                self._deferred.setdefault(id(self._stream()), []).append((dst, src))
            return
        dst.copy_(src)
        ptr = dst.untyped_storage().data_ptr()
        with self._vlock:
            if ptr in self._pinned:
                self._pending.setdefault(id(self._stream()), set()).add(ptr)

    @contextlib.contextmanager
    def collective(self):
        self._check("collective")
        if self.defer_copies:  # the communication stream follows the thread's current one
            with self._vlock:
                self._run_copies(list(self._deferred.get(id(self._stream()), ())))
        comm = getattr(self._local, "comm", None) or FakeStream("comm", "comm")
        self._local.comm = comm
        before = getattr(self._local, "stream", None), getattr(self._local, "in_collective", False)
        self._local.stream, self._local.in_collective = comm, True
        try:
            yield
        finally:  # (a block inside another leaves the outer one on the communication stream)
            self._local.stream, self._local.in_collective = before

    def available(self) -> bool:
        return False  # torch itself has no CUDA here: process groups stay gloo

    # -- torch.distributed, watched ----------------------------------------------------------
    def watching(self):
        """Patch torch.distributed's collectives so that one issued outside
        :meth:`collective` (on a compute stream) is recorded."""
        stack = contextlib.ExitStack()
        for name in COLLECTIVES:
            original = getattr(dist, name)

            def watched(*args, __original=original, __name=name, **kwargs):
                self.collectives += 1
                if not getattr(self._local, "in_collective", False):
                    self._violate(f"torch.distributed.{__name} on the compute stream {self._stream().name!r} "
                                  "(outside Runtime.collective)")
                return __original(*args, **kwargs)

            stack.enter_context(_patched(dist, name, watched))
        from torch.distributed.tensor import DTensor

        gather = DTensor.full_tensor

        def watched_gather(t, *args, **kwargs):  # (its all-gather is a functional collective, unpatched above)
            self.collectives += 1
            if not getattr(self._local, "in_collective", False):
                self._violate(f"DTensor.full_tensor on the compute stream {self._stream().name!r} "
                              "(outside Runtime.collective)")
            return gather(t, *args, **kwargs)

        stack.enter_context(_patched(DTensor, "full_tensor", watched_gather))
        return stack


@contextlib.contextmanager
def _patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


@contextlib.contextmanager
def installed(fake: FakeRuntime | None = None):
    """Install a fake (the process's runtime) for the block, watching collectives."""
    fake = fake or FakeRuntime()
    previous = runtime.install(fake)
    try:
        with fake.watching():
            yield fake
    finally:
        runtime.install(previous)
