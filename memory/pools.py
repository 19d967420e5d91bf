"""The dual-pool memory manager: a sealed persistent pool and a size-classed transient arena.

This module holds what both pools share (size classes, layouts, stats); the pools are in
:mod:`memory.persistent` and :mod:`memory.transient`, both behind :class:`memory.manager.MemoryManager`.

Why two pools
-------------
Training memory falls into two kinds with opposite lifetimes. *Persistent* tensors (weights,
optimizer state, the two weight versions the inference lane swaps between, communication
buckets) are created once at start-up and live for the whole run. *Transient* tensors (rollout
buffers, observation batches, activations) are created and dropped every step, in sizes that
vary with the episode length. Mixing both in one heap lets a long-lived tensor land between
short-lived ones and pin the memory around it, which is how fragmentation creeps in over a long
run. Keeping them apart, each with its own budget, makes the persistent footprint a fixed number
known after start-up and the transient footprint a bounded, reused working set.

:class:`PersistentPool` hands out plain tensors, counts them against its budget and is then
sealed: any allocation after :meth:`PersistentPool.seal` is a bug (a per-step allocation that
should have gone to the transient pool) and raises.

:class:`TransientPool` is an arena of size-classed blocks:

* **Size classes.** A request of ``n`` bytes is rounded up to a class. With
  ``2**k <= n < 2**(k+1)``, the classes of that octave are ``2**k * {1, 1.25, 1.5, 1.75}``
  (and ``2**(k+1)`` closes it), i.e. four evenly spaced classes per power of two. The spacing
  ``2**k / 4`` is at most ``n / 4``, so for any request above 256 bytes the class is **less
  than 1.25x the request**: rounding wastes under 20% of a block (under 25% of the request).
  Requests of up to 256 bytes share the smallest class, 256 bytes (so they waste under 256
  bytes each). Every class is a multiple of 64 bytes, so each block starts on the allocator's
  alignment and any dtype viewed at offset 0 is aligned.
* **Blocks and views.** A block is a flat ``uint8`` tensor of its class size. ``empty`` returns
  a contiguous view of its first ``n`` bytes in the requested dtype and shape (an
  ``as_strided`` of the block viewed as that dtype; the dtype views are cached per block, as
  building the view chain each time costs more than the rest of ``empty``). The pool keeps the
  block in a dict keyed by the view's ``data_ptr`` and gives it back to its class's free list
  on :meth:`TransientPool.release`.
* **Reuse.** ``empty`` first pops a cached block of the request's class (LIFO, so the most
  recently touched memory is reused). If that list is empty it *borrows* the smallest cached
  block of a larger class up to ``borrow_limit`` times its own (default 2, one octave), and
  only creates a new block when neither exists. Without borrowing, a workload whose sizes
  wander (rollouts of varying length) keeps idle blocks in every class it has visited; with it,
  bigger idle blocks serve smaller requests. The price is bounded too: a borrowed block is at
  most ``borrow_limit`` x the class, i.e. under 2.5x the request by default
  (``borrow_limit=1`` turns borrowing off and keeps every block under 1.25x). Once a workload
  has seen its largest working set, it runs at **zero new allocations**: every request is a
  free-list pop and every release a push. ``stats()`` counts both (``allocations`` = blocks
  created, ``reuses`` = requests served from the free lists).
* **Trim.** Cached blocks stay reserved until :meth:`TransientPool.trim` drops them (it returns
  the bytes freed). Under a budget the pool trims by itself: when a new block would push
  ``reserved`` over the budget, cached blocks of other classes are dropped (largest first)
  until it fits; if it still does not fit, :class:`PoolBudgetError` is raised.
* **Threads.** One lock guards the free lists and counters, so one thread may allocate while
  another releases (an actor filling rollout chunks, a learner returning them).
* **Release is strict.** ``release`` must get the very tensor object ``empty`` returned. A
  foreign tensor, a view/slice of a pool tensor, or a second release raises ``ValueError``
  (the pool checks object identity, so a stale second release cannot free a block that was
  handed out again in the meantime). A tensor that is dropped without being released stays
  counted as in use: that is a leak the stats will show.

On CUDA each pool owns a ``torch.cuda.MemPool`` and allocates its blocks inside
``torch.cuda.use_mem_pool(pool)``, so PyTorch's caching allocator keeps each pool's memory in
its own segments; the arena above only decides which blocks to keep and reuse. Reusing a
block on the device is stream-ordered: ``release`` records an event on the current stream and
the next ``empty`` that reuses the block makes its current stream wait on that event.
:meth:`TransientPool.activations` routes autograd activations of the enclosed forward pass
to the transient pool's segments as well (those are managed by PyTorch, not by the arena).
On CPU the same arena logic runs on ordinary CPU tensors (the CPU allocator has no pools), which
is how it is tested without a GPU.
"""

from __future__ import annotations

import functools
import operator
import threading
from dataclasses import asdict, dataclass

import torch

from .runtime import for_device

#: The smallest block of the transient arena; smaller requests share it.
MIN_BLOCK_BYTES = 256

_MIB = float(1 << 20)


def size_class(nbytes: int) -> int:
    """Block size for a request of ``nbytes``: the next of ``2**k * {1, 1.25, 1.5, 1.75, 2}``.

    Always ``nbytes <= size_class(nbytes) < 1.25 * nbytes`` for ``nbytes > MIN_BLOCK_BYTES``.
    """
    if nbytes <= MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    k = nbytes.bit_length() - 1  # 2**k <= nbytes < 2**(k+1)
    quarter = 1 << (k - 2)  # >= 64 since k >= 8
    return -(-nbytes // quarter) * quarter


def _normalize_device(device: torch.device | str | int) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)  # a rank sees its own GPU alone (memory/runtime.py)
    return device


def _shape(shape) -> tuple[int, ...]:
    return _layout(shape)[0]


def _layout(shape) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """``(dims, contiguous strides, numel)`` for a shape given as an int or a sequence."""
    if isinstance(shape, int):
        shape = (shape,)
    elif not isinstance(shape, tuple):
        shape = tuple(shape)
    return _layout_of(shape)


@functools.lru_cache(maxsize=4096)
def _layout_of(shape: tuple) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    dims = tuple(operator.index(s) for s in shape)
    if any(s < 0 for s in dims):
        raise ValueError(f"negative dimension in shape {dims}")
    strides = []
    numel = 1
    for s in reversed(dims):
        strides.append(numel)
        numel *= s
    return dims, tuple(reversed(strides)), numel


def _check_budget(budget_bytes: int | None, name: str) -> int | None:
    if budget_bytes is None:
        return None
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
        raise ValueError(
            f"{name} pool: budget_bytes must be None or a positive int, got {budget_bytes!r} "
            "(use memory.parse_budget() for strings and fractions)"
        )
    return budget_bytes


@dataclass
class PoolStats:
    """A snapshot of one pool's counters (bytes unless noted)."""

    name: str
    reserved_bytes: int  # held by the pool: blocks in use + cached free blocks
    in_use_bytes: int  # blocks currently handed out (class-rounded sizes)
    requested_bytes: int  # bytes the live tensors asked for
    peak_reserved_bytes: int
    peak_in_use_bytes: int
    allocations: int  # new blocks created
    reuses: int  # requests served from the free lists
    budget_bytes: int | None

    @property
    def cached_bytes(self) -> int:
        """Reserved but not handed out (free-list blocks)."""
        return self.reserved_bytes - self.in_use_bytes

    @property
    def fragmentation(self) -> float:
        """Share of reserved bytes no live tensor asked for (size-class rounding plus cached
        free blocks): ``1 - requested / reserved``, 0.0 when nothing is reserved."""
        if self.reserved_bytes <= 0:
            return 0.0
        return 1.0 - self.requested_bytes / self.reserved_bytes

    def as_metrics(self) -> dict[str, float]:
        """Flat floats for the metrics log (``*_mb`` values are MiB)."""
        p = f"mem/{self.name}/"
        out = {
            p + "reserved_mb": self.reserved_bytes / _MIB,
            p + "in_use_mb": self.in_use_bytes / _MIB,
            p + "requested_mb": self.requested_bytes / _MIB,
            p + "cached_mb": self.cached_bytes / _MIB,
            p + "peak_reserved_mb": self.peak_reserved_bytes / _MIB,
            p + "peak_in_use_mb": self.peak_in_use_bytes / _MIB,
            p + "fragmentation": float(self.fragmentation),
            p + "allocations": float(self.allocations),
            p + "reuses": float(self.reuses),
        }
        if self.budget_bytes is not None:
            out[p + "budget_mb"] = self.budget_bytes / _MIB
        return out

    def as_dict(self) -> dict:
        """JSON-able dict of all fields plus ``cached_bytes`` and ``fragmentation``."""
        out = asdict(self)
        out["cached_bytes"] = self.cached_bytes
        out["fragmentation"] = self.fragmentation
        return out


class _DevicePool:
    """What both pools share: the device, the budget and (on CUDA) a ``MemPool``."""

    def __init__(self, device, budget_bytes: int | None, name: str, host: bool = False) -> None:
        self.name = name
        self.device = _normalize_device(device)
        self.budget_bytes = _check_budget(budget_bytes, name)
        self._lock = threading.Lock()
        self.runtime = for_device(self.device)
        #: ``torch.cuda.MemPool`` holding this pool's segments on a GPU (the runtime's); None
        #: on the CPU and for a host pool. One thread only routes allocations into it.
        self.mempool = self.runtime.new_mempool(self.device) if self.runtime.accelerated and not host else None
        self.mempools_retired = 0  # MemPools given back near capacity (give_back_segments)

    def _routed(self, held: bool = False):
        """Context under which the calling thread's new device allocations land in this
        pool's segments: briefly, under the pool's lock (any thread), or ``held`` for a whole
        pass (only the pool's owning thread: memory/runtime.py)."""
        return self.runtime.allocate_in(self.mempool, f"{self.name} pool", held=held)

    def give_back_segments(self) -> bool:
        """Near the device's capacity: what this pool's ``MemPool`` holds unused goes back to
        the device, for allocations outside the pool (a backward pass's, from the default
        pool). A live MemPool keeps its free segments (``empty_cache`` leaves them), so the
        pool takes a fresh MemPool for what it allocates next and drops the old one: the
        device gets its segments back as their blocks are freed. Not while a thread routes
        into it (False then)."""
        old = self.mempool
        if old is None or not self.runtime.retire(old):
            return False
        self.mempool = self.runtime.new_mempool(self.device)
        self.mempools_retired += 1
        del old
        self.runtime.empty_cache()
        return True

    def device_segments(self) -> dict[str, int] | None:
        """On CUDA, what the caching allocator holds for this pool's ``MemPool``:
        ``{"segment_bytes", "allocated_bytes", "segments"}``. None on CPU."""
        if self.mempool is None or not hasattr(self.mempool, "snapshot"):
            return None
        segments = self.mempool.snapshot(include_traces=False)
        mine = [s for s in segments if s.get("device", self.device.index) == self.device.index]
        return {
            "segment_bytes": sum(int(s["total_size"]) for s in mine),
            "allocated_bytes": sum(int(s["allocated_size"]) for s in mine),
            "segments": len(mine),
        }
