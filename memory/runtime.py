"""The rank's device runtime: every CUDA call of dvla goes through this module.

One place to read what a rank asks of its GPU, and one place to substitute: tests install a
recording fake (:func:`install`) that runs the GPU code paths with tensors on the CPU and
fails on a broken discipline. The discipline:

* **One device per rank, bound in every thread.** A rank sees only its own GPU (the launcher
  sets ``CUDA_VISIBLE_DEVICES`` before CUDA starts: :func:`visible_device_env`), so simulators
  and torch agree on it, and every thread the rank starts calls :meth:`Runtime.bind_thread`
  first (the current device is per thread; a new thread starts on device 0).
* **No collective on a compute stream.** A collective is issued inside
  :meth:`Runtime.collective`, on a communication stream of the calling thread's own, and the
  thread waits for that stream there. A receive that waits for its peer then never holds up
  the default stream, which the lanes' streams and the pools' events wait on.
* **One thread per memory pool at a time.** PyTorch refuses a second thread recording to a
  ``MemPool`` while one does. A pool whose routing spans a whole pass (the gradient lane's
  activations: :meth:`Runtime.allocate_in` with ``held=True``) has one owning thread, named at
  its first such use; any other thread is refused. A brief routing (one arena block, made
  under the pool's own lock) may come from any thread, one at a time: the sampling lane then
  answers inference requests in the inference lane's pool while the lanes take turns.
* **A pinned block is reused only after its event.** A pinned host block written by
  asynchronous device copies gets an event when released (:meth:`Runtime.record_event`) and
  the host waits for it before handing the block out again (:meth:`Runtime.host_wait`).

:class:`Runtime` is the CPU's (every call a no-op); :class:`CudaRuntime` the GPU's.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator

import torch


TORCH_FLOOR = (2, 11)
"""The oldest torch dvla is tested on (setup.py's floor): ``MemPool.snapshot(include_traces=...)``
and ``use_mem_pool`` routing only the calling thread's allocations (each pool has one owning
thread, :meth:`Runtime.allocate_in`) are not in older ones."""


class DisciplineError(RuntimeError):
    """A device call that breaks the rank's discipline (wrong thread, pool or stream)."""


class Runtime:
    """The CPU runtime: no streams, events or memory pools."""

    accelerated = False  # the GPU code paths run (streams, pools' MemPools, pinned buffers)

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._owners: dict[int, tuple[int, str]] = {}  # id(pool) -> (thread id, name) holding it for passes
        self._routing: dict[int, tuple[int, str, int]] = {}  # id(pool) -> (thread id, name, depth) routing now
        self._lock = threading.Lock()

    # -- threads ---------------------------------------------------------------------------
    def bind_thread(self) -> None:
        """Make this rank's device the calling thread's current one (first thing a thread does)."""

    # -- streams ---------------------------------------------------------------------------
    def new_stream(self, priority: int = 0) -> Any:
        return None

    def priority_range(self) -> tuple[int, int]:
        """``(lowest, highest)`` stream priority (lower numbers run first)."""
        return 0, 0

    def current_stream(self) -> Any:
        return None

    def default_stream(self) -> Any:
        return None

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        """Run the block's device work on ``stream`` (after what the thread queued before)."""
        yield

    def synchronize(self, stream: Any = None) -> None:
        """Wait until ``stream`` (default: the thread's current one) has done its work."""

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Mark ``tensor`` as used by ``stream`` (for the caching allocator)."""

    # -- events ------------------------------------------------------------------------------
    def record_event(self, stream: Any = None) -> Any:
        """An event recorded on ``stream`` (default: the current one); None on the CPU."""
        return None

    def wait_event(self, event: Any) -> None:
        """The thread's current stream waits for ``event`` (the host does not)."""

    def host_wait(self, event: Any) -> None:
        """The host waits for ``event``."""

    def event_done(self, event: Any) -> bool:
        return True

    # -- memory ----------------------------------------------------------------------------
    def new_mempool(self, device: torch.device | str | None = None) -> Any:
        """A memory pool for device allocations on ``device`` (the runtime's): None where
        there is none to route into (the CPU's allocator, a GPU run's host memory)."""
        return None

    @contextlib.contextmanager
    def allocate_in(self, pool: Any, name: str = "pool", held: bool = False) -> Iterator[None]:
        """Route the calling thread's device allocations into ``pool``. ``held``: for a
        whole pass (activations); the first thread to hold a pool owns it, and any other
        thread is refused (:class:`DisciplineError`), briefly too. Else a brief routing,
        made under the pool's lock: any thread, but never two at once."""
        if pool is None:
            yield
            return
        self._enter(pool, name, held)
        try:
            with self._route(pool):
                yield
        finally:
            self._leave(pool)

    def _enter(self, pool: Any, name: str, held: bool) -> None:
        me, my_name = threading.get_ident(), threading.current_thread().name
        with self._lock:
            owner = self._owners.get(id(pool))
            if owner is None and held:
                owner = self._owners[id(pool)] = (me, my_name)
            if owner is not None and owner[0] != me:
                raise DisciplineError(f"{name}: thread {my_name!r} allocates into a memory pool that thread "
                                      f"{owner[1]!r} owns; each lane needs a pool of its own")
            routing = self._routing.get(id(pool))
            if routing is not None and routing[0] != me:
                raise DisciplineError(f"{name}: thread {my_name!r} allocates into a memory pool while thread "
                                      f"{routing[1]!r} does; a brief routing takes the pool's lock")
            self._routing[id(pool)] = (me, my_name, (routing or (0, "", 0))[2] + 1)

    def retire(self, pool: Any) -> bool:
        """Forget ``pool`` (its owner) before it is dropped, unless a thread routes into it
        now (False then: it must stay)."""
        with self._lock:
            if id(pool) in self._routing:
                return False
            self._owners.pop(id(pool), None)
            return True

    def empty_cache(self) -> None:
        """Give the device back the caching allocator's unused segments (those of pools no
        longer alive too)."""

    def _leave(self, pool: Any) -> None:
        with self._lock:
            me, name, depth = self._routing[id(pool)]
            if depth > 1:
                self._routing[id(pool)] = (me, name, depth - 1)
            else:
                del self._routing[id(pool)]

    def _route(self, pool: Any):
        return contextlib.nullcontext()

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """Host memory device copies can use without waiting (page-locked on a GPU)."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def handing_out(self, block: torch.Tensor) -> None:
        """A pool hands ``block`` out again (a fake checks it is free of pending copies)."""

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``, without waiting where the runtime can (pinned host buffers)."""
        dst.copy_(src, non_blocking=self.accelerated)

    # -- collectives -------------------------------------------------------------------------
    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Issue the block's collectives on this thread's communication stream, and wait for
        them there (never on the default stream or a lane's)."""
        yield

    # -- facts -------------------------------------------------------------------------------
    def available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def device_name(self, index: int) -> str:
        return torch.cuda.get_device_name(index)

    def total_memory(self, index: int | None = None) -> int:
        return int(torch.cuda.get_device_properties(index if index is not None else 0).total_memory)

    def pci_bus_id(self, index: int = 0) -> str | None:
        """``DDDD:BB:DD.F`` of CUDA device ``index`` (None without CUDA)."""
        if not torch.cuda.is_available():
            return None
        p = torch.cuda.get_device_properties(index)
        return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"

    def rng_states(self) -> list[torch.Tensor]:
        return torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []

    def set_rng_state(self, state: torch.Tensor, index: int) -> None:
        torch.cuda.set_rng_state(state, device=index)


class CudaRuntime(Runtime):
    """One CUDA device, the rank's (``cuda:0`` once ``CUDA_VISIBLE_DEVICES`` shows it alone)."""

    accelerated = True

    def __init__(self, device: torch.device | str = "cuda"):
        device = torch.device(device)
        super().__init__(torch.device("cuda", device.index if device.index is not None else 0))
        self._local = threading.local()

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def new_stream(self, priority: int = 0) -> Any:
        lo, hi = self.priority_range()
        return torch.cuda.Stream(self.device, priority=max(min(priority, lo), hi))

    def priority_range(self) -> tuple[int, int]:
        return torch.cuda.Stream.priority_range()

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def default_stream(self) -> Any:
        return torch.cuda.default_stream(self.device)

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield

    def synchronize(self, stream: Any = None) -> None:
        (stream or torch.cuda.current_stream(self.device)).synchronize()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        if tensor.is_cuda:
            tensor.record_stream(stream)

    def record_event(self, stream: Any = None) -> Any:
        event = torch.cuda.Event()
        event.record(stream or torch.cuda.current_stream(self.device))
        return event

    def wait_event(self, event: Any) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def host_wait(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def event_done(self, event: Any) -> bool:
        return event is None or event.query()

    def new_mempool(self, device: torch.device | str | None = None) -> Any:
        device = torch.device(device) if device is not None else self.device
        return torch.cuda.MemPool() if device.type == "cuda" else None

    def _route(self, pool: Any):
        return torch.cuda.use_mem_pool(pool, self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        if getattr(self._local, "in_collective", False):  # inside another block: already there
            yield
            return
        comm = getattr(self._local, "comm", None)
        if comm is None:
            comm = self._local.comm = torch.cuda.Stream(self.device)
        # The collective reads what this thread queued before it; the thread's current
        # stream never waits for the collective (only the host does, below).
        comm.wait_stream(torch.cuda.current_stream(self.device))
        self._local.in_collective = True
        try:
            with torch.cuda.stream(comm):
                yield
        finally:
            self._local.in_collective = False
        comm.synchronize()


_current: Runtime = Runtime()


def current() -> Runtime:
    """The process's device runtime (the CPU's until :func:`install` sets another)."""
    return _current


def install(runtime: Runtime) -> Runtime:
    """Make ``runtime`` the process's device runtime; returns the one it replaces."""
    global _current
    previous, _current = _current, runtime
    return previous


def for_device(device: torch.device | str) -> Runtime:
    """The runtime for work on ``device``: the current one where it runs the GPU code paths
    (a rank's CUDA runtime, :func:`serving`, or a test's fake); on a CUDA device otherwise
    CUDA's, made once per device and not installed (a caller that only allocates, such as a
    memory pool, leaves the process's runtime as it found it); else the current one."""
    device = torch.device(device)
    if _current.accelerated or device.type != "cuda":
        return _current
    index = device.index if device.index is not None else 0
    with _made_lock:
        if index not in _made:
            _made[index] = CudaRuntime(torch.device("cuda", index))
        return _made[index]


_made: dict[int, "CudaRuntime"] = {}
_made_lock = threading.Lock()


@contextlib.contextmanager
def serving(device: torch.device | str) -> Iterator[Runtime]:
    """The process's runtime is :func:`for_device`'s for ``device`` during the block (a
    rank's life: its collectives, threads and pools all go through it) and the one it found
    afterwards: a test that ran a rank on a GPU leaves no CUDA runtime to the next."""
    mine = for_device(device)
    previous = install(mine)
    try:
        yield mine
    finally:
        if _current is mine:  # (not where a later install replaced it, or a never-run rank is collected)
            install(previous)


def visible_device_env(local_rank: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a rank of local rank ``local_rank`` runs in: ``CUDA_VISIBLE_DEVICES``
    narrowed to its own GPU (from the list already set, else the ordinal), so that it sees
    exactly one and it is ``cuda:0`` to torch and to any simulator. A list shorter than the
    host's ranks is shared round-robin (ranks that share a GPU need
    ``swimlane.collective_backend=gloo``). Must be applied before CUDA starts in the process."""
    env = dict(os.environ if env is None else env)
    visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if "CUDA_VISIBLE_DEVICES" in env and not visible:
        return env  # no GPU visible: nothing to narrow
    if visible:
        env["CUDA_VISIBLE_DEVICES"] = visible[local_rank % len(visible)]
        env["DVLA_VISIBLE_DEVICES_ALL"] = ",".join(visible)  # the host's list (ranks_sharing_gpu)
    else:
        env["CUDA_VISIBLE_DEVICES"] = str(local_rank)
    env["DVLA_VISIBLE_DEVICE_SET"] = "1"
    return env


def host_gpus(env: dict[str, str]) -> list[str]:
    """The host's ``CUDA_VISIBLE_DEVICES`` list as the ranks share it out (before
    :func:`visible_device_env` narrowed it); empty where it names none (each rank then takes
    its own ordinal)."""
    if "DVLA_VISIBLE_DEVICES_ALL" in env:
        listed = env["DVLA_VISIBLE_DEVICES_ALL"]
    else:  # narrowed from no list, or not narrowed yet
        listed = "" if env.get("DVLA_VISIBLE_DEVICE_SET") else env.get("CUDA_VISIBLE_DEVICES", "")
    return [d.strip() for d in listed.split(",") if d.strip()]


def ranks_sharing_gpu(local_rank: int, local_world: int, env: dict[str, str] | None = None) -> list[int]:
    """The local ranks, this one among them, that :func:`visible_device_env` gives this
    rank's GPU: more than one where ``CUDA_VISIBLE_DEVICES`` lists fewer GPUs than the host
    has ranks (NCCL refuses two ranks on one GPU)."""
    visible = host_gpus(os.environ if env is None else env)
    if not visible:
        return [local_rank]
    mine = visible[local_rank % len(visible)]
    return [r for r in range(max(local_world, local_rank + 1)) if visible[r % len(visible)] == mine]
