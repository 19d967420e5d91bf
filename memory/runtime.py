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
* **One thread per memory pool.** Only one thread may route allocations into a ``MemPool``
  (PyTorch refuses a second thread recording to a pool): :meth:`Runtime.allocate_in` names
  the pool's owner at its first use and refuses any other thread.
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
        self._owners: dict[int, tuple[int, str]] = {}  # id(pool) -> (thread id, thread name)
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
    def new_mempool(self) -> Any:
        return None

    @contextlib.contextmanager
    def allocate_in(self, pool: Any, name: str = "pool") -> Iterator[None]:
        """Route the calling thread's device allocations into ``pool``; the first thread to
        do so owns it, and any other thread is refused (:class:`DisciplineError`)."""
        if pool is None:
            yield
            return
        self._claim(pool, name)
        with self._route(pool):
            yield

    def _claim(self, pool: Any, name: str) -> None:
        me = threading.get_ident()
        with self._lock:
            owner = self._owners.setdefault(id(pool), (me, threading.current_thread().name))
        if owner[0] != me:
            raise DisciplineError(f"{name}: thread {threading.current_thread().name!r} allocates into a memory pool "
                                  f"that thread {owner[1]!r} owns; each lane needs a pool of its own")

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

    def new_mempool(self) -> Any:
        return torch.cuda.MemPool()

    def _route(self, pool: Any):
        return torch.cuda.use_mem_pool(pool, self.device)

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
    """The runtime for work on ``device``: on a CUDA device CUDA's (installed if the CPU's is
    current), else the current one (host memory of a GPU run, or a test's fake)."""
    device = torch.device(device)
    if device.type == "cuda" and not _current.accelerated:
        install(CudaRuntime(device))
    return _current


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
