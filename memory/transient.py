"""The transient pool: an arena of size-classed blocks reused step after step, with leases
(see :mod:`memory.pools` for the design)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from .budget import PoolBudgetError
from .lease import Lease
from .pools import PoolStats, _DevicePool, _layout, size_class

# --------------------------------------------------------------------------------------
# Transient pool
# --------------------------------------------------------------------------------------


class _Block:
    """One arena block: a flat uint8 tensor of a class size, its dtype views, and the event
    recorded at its last release on CUDA."""

    __slots__ = ("data", "event", "size", "views")

    def __init__(self, data: Tensor, size: int) -> None:
        self.data = data
        self.size = size
        self.views: dict[torch.dtype, Tensor] = {}
        self.event = None

    def view(self, dtype: torch.dtype, dims: tuple[int, ...], strides: tuple[int, ...]) -> Tensor:
        flat = self.views.get(dtype)
        if flat is None:  # class sizes are multiples of 64, so every itemsize divides them
            flat = self.views[dtype] = self.data.view(dtype)
        return flat.as_strided(dims, strides)


class _Live:
    """A handed-out tensor: its block, the bytes it asked for, and a weak reference to it."""

    __slots__ = ("block", "nbytes", "ref")

    def __init__(self, block: _Block, nbytes: int, ref: weakref.ref) -> None:
        self.block = block
        self.nbytes = nbytes
        self.ref = ref


class TransientPool(_DevicePool):
    """The size-classed arena for per-step tensors (see the module docstring).

    ``borrow_limit``: when a request's class has no cached block, it may take a cached block
    of a larger class up to ``borrow_limit`` x its class (1.0 disables borrowing).
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        budget_bytes: int | None = None,
        name: str = "transient",
        borrow_limit: float = 2.0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__(device, budget_bytes, name, host=pin_memory)
        if pin_memory and self.device.type != "cpu":
            raise ValueError(f"{name} pool: pin_memory is for a host pool, this one is on {self.device}")
        #: Host blocks are page-locked (on a GPU run), so device copies into and out of them
        #: need not wait; a block goes out again only once its release event has passed.
        self.pin_memory = pin_memory
        if not borrow_limit >= 1.0:
            raise ValueError(f"{name} pool: borrow_limit must be >= 1, got {borrow_limit!r}")
        #: A request may reuse a cached block of a larger class up to this many times its own.
        self.borrow_limit = float(borrow_limit)
        self._free: dict[int, list[_Block]] = {}  # class size -> cached blocks (LIFO)
        self._live: dict[int, _Live] = {}  # data_ptr of the handed-out view -> its block
        self._zero: dict[int, weakref.ref] = {}  # id -> zero-size tensors handed out
        self._reserved = 0
        self._in_use = 0
        self._requested = 0
        self._peak_reserved = 0
        self._peak_in_use = 0
        self._allocations = 0
        self._reuses = 0

    # -- allocation ------------------------------------------------------------------

    def empty(self, shape, dtype: torch.dtype) -> Tensor:
        """An uninitialised tensor backed by a cached block of the request's size class (or of
        a larger class within ``borrow_limit``), or by a new block. Give it back with
        :meth:`release`."""
        dims, strides, numel = _layout(shape)
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return self._empty_zero(dims, dtype)
        size = size_class(nbytes)
        with self._lock:
            block = self._take_cached(size)
            if block is not None:
                self._reuses += 1
                if block.event is not None:
                    if self.pin_memory:  # the host writes it next: copies into it must be done
                        self.runtime.host_wait(block.event)
                    else:  # device work that follows waits for what came before the release
                        self.runtime.wait_event(block.event)
                    block.event = None
                self.runtime.handing_out(block.data)
            else:
                block = self._new_block(size, nbytes, dims, dtype)
            view = block.view(dtype, dims, strides)
            self._live[view.data_ptr()] = _Live(block, nbytes, weakref.ref(view))
            self._in_use += block.size
            self._requested += nbytes
            self._peak_in_use = max(self._peak_in_use, self._in_use)
        return view

    def _take_cached(self, size: int):
        """Pop a cached block of class ``size``, else of the smallest larger class up to
        ``borrow_limit * size`` (lock held); None if there is none."""
        free = self._free.get(size)
        if free:
            return free.pop()
        limit = size * self.borrow_limit
        cls = size_class(size + 1)
        while cls <= limit:
            free = self._free.get(cls)
            if free:
                return free.pop()
            cls = size_class(cls + 1)
        return None

    def _empty_zero(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        # Zero-size tensors own no memory (their data_ptr is 0), so they are tracked by
        # identity and never touch the arena.
        t = torch.empty(shape, dtype=dtype, device=self.device)
        key = id(t)

        def forget(_ref, key=key, zero=self._zero):
            zero.pop(key, None)

        with self._lock:
            self._zero[key] = weakref.ref(t, forget)
        return t

    def _held(self) -> int:
        """Bytes this pool holds against its budget: its arena's blocks, and on a GPU all
        that lives in its ``MemPool`` (the activations routed there too; lock held)."""
        segments = self.device_segments() if self.budget_bytes is not None else None
        return max(self._reserved, segments["allocated_bytes"] if segments else 0)

    def _new_block(self, size: int, nbytes: int, shape, dtype) -> _Block:
        # Called with the lock held.
        if self.budget_bytes is not None and self._held() + size > self.budget_bytes:
            self._evict(self._held() + size - self.budget_bytes)
            if self._held() + size > self.budget_bytes:
                raise PoolBudgetError(
                    self.name,
                    nbytes,
                    self.budget_bytes,
                    reserved_bytes=self._held(),
                    in_use_bytes=self._in_use,
                    shape=shape,
                    dtype=dtype,
                    block_bytes=size,
                )
        try:
            data = self._allocate(size)
        except torch.OutOfMemoryError:
            # The device is full: give back what we cache, and the segments our MemPool
            # would keep for itself, then try once more.
            self._evict(self._reserved)
            self.give_back_segments()
            data = self._allocate(size)
        self._allocations += 1
        self._reserved += size
        self._peak_reserved = max(self._peak_reserved, self._reserved)
        return _Block(data, size)

    def _allocate(self, size: int) -> Tensor:
        if self.pin_memory:
            return self.runtime.pinned_empty(size)
        with self._routed():
            return torch.empty(size, dtype=torch.uint8, device=self.device)

    def _evict(self, want: int) -> int:
        """Drop cached blocks, largest class first, until ``want`` bytes are freed (lock held)."""
        freed = 0
        for size in sorted(self._free, reverse=True):
            blocks = self._free[size]
            while blocks and freed < want:
                block = blocks.pop()
                if block.event is not None:
                    # The caching allocator may hand this memory to another stream at once:
                    # let the work enqueued before its release finish first.
                    self.runtime.host_wait(block.event)
                freed += size
            if not blocks:
                del self._free[size]
            if freed >= want:
                break
        self._reserved -= freed
        return freed

    # -- release ---------------------------------------------------------------------

    def release(self, t: Tensor) -> None:
        """Give ``t``'s block back to its free list. ``t`` must be the tensor object
        :meth:`empty` returned; anything else (a foreign tensor, a view of a pool tensor,
        a second release) raises ``ValueError``."""
        if not isinstance(t, Tensor):
            raise TypeError(f"{self.name} pool: release() expects a tensor, got {type(t).__name__}")
        if t.numel() == 0:
            with self._lock:
                ref = self._zero.get(id(t))
                if ref is None or ref() is not t:
                    raise ValueError(self._foreign(t, None))
                del self._zero[id(t)]
            return
        ptr = t.data_ptr()
        with self._lock:
            live = self._live.get(ptr)
            if live is None or live.ref() is not t:
                raise ValueError(self._foreign(t, live))
            del self._live[ptr]
            block = live.block
            if self.runtime.accelerated:  # device blocks, and pinned ones device copies write
                block.event = self.runtime.record_event()
            free = self._free.get(block.size)
            if free is None:
                free = self._free[block.size] = []
            free.append(block)
            self._in_use -= block.size
            self._requested -= live.nbytes

    def _foreign(self, t: Tensor, live: _Live | None) -> str:
        what = f"tensor of shape {tuple(t.shape)}, {t.dtype} on {t.device}"
        if live is None:
            return (
                f"{self.name} pool: cannot release a {what}: it was not handed out by this pool "
                "or it was already released"
            )
        return (
            f"{self.name} pool: cannot release a {what}: it shares memory with a live pool "
            "tensor but is not the tensor empty() returned (a view or reshape of it, or a "
            "stale reference released twice after its block was reused); release the "
            "original tensor"
        )

    def lease(self) -> Lease:
        """A :class:`Lease` on this pool."""
        return Lease(self)

    # -- helpers that write into pool memory -----------------------------------------

    def _fill(self, tensors, lease: Lease | None, out_shape, fill) -> Tensor:
        dtype = tensors[0].dtype
        where = -1 if self.device.type == "cpu" else self.device.index  # as Tensor.get_device()
        same_device = True
        for t in tensors:
            if t.dtype is not dtype:
                dtype = torch.promote_types(dtype, t.dtype)
            if same_device and t.get_device() != where:
                same_device = False
        owner = lease if lease is not None else self
        out = owner.empty(out_shape, dtype)
        try:
            if torch.is_grad_enabled():
                with torch.no_grad():
                    fill(out, same_device)
            else:
                fill(out, same_device)
        except BaseException:
            if lease is not None:
                lease._discard(out)
            else:
                self.release(out)
            raise
        return out

    def stack(self, tensors: Sequence[Tensor], dim: int = 0, lease: Lease | None = None) -> Tensor:
        """``torch.stack(tensors, dim)`` written into pool memory (allocated through ``lease``
        if given). Inputs may live on another device (they are copied slice by slice). The
        result is data, not part of autograd."""
        tensors = list(tensors)
        if not tensors:
            raise ValueError("stack() needs at least one tensor")
        first = tensors[0].shape
        for t in tensors:
            if t.shape != first:
                raise ValueError(
                    f"stack() needs tensors of equal shape, got {tuple(first)} and {tuple(t.shape)}"
                )
        shape = tuple(first)
        nd = len(shape) + 1
        d = dim + nd if dim < 0 else dim
        if not 0 <= d < nd:
            raise IndexError(f"stack() dim {dim} out of range for {nd - 1}-d tensors")
        out_shape = shape[:d] + (len(tensors),) + shape[d:]

        def fill(out: Tensor, same_device: bool) -> None:
            if same_device:
                torch.stack(tensors, dim=d, out=out)
            else:
                for i, t in enumerate(tensors):
                    out.select(d, i).copy_(t, non_blocking=True)

        return self._fill(tensors, lease, out_shape, fill)

    def cat(self, tensors: Sequence[Tensor], dim: int = 0, lease: Lease | None = None) -> Tensor:
        """``torch.cat(tensors, dim)`` written into pool memory (allocated through ``lease``
        if given); same conventions as :meth:`stack`."""
        tensors = list(tensors)
        if not tensors:
            raise ValueError("cat() needs at least one tensor")
        shape = tuple(tensors[0].shape)
        nd = len(shape)
        if nd == 0:
            raise ValueError("cat() cannot concatenate zero-dimensional tensors")
        d = dim + nd if dim < 0 else dim
        if not 0 <= d < nd:
            raise IndexError(f"cat() dim {dim} out of range for {nd}-d tensors")
        for t in tensors[1:]:
            other = tuple(t.shape)
            if len(other) != nd or other[:d] + other[d + 1 :] != shape[:d] + shape[d + 1 :]:
                raise ValueError(f"cat() along dim {d}: shapes {shape} and {other} do not match")
        out_shape = shape[:d] + (sum(t.shape[d] for t in tensors),) + shape[d + 1 :]

        def fill(out: Tensor, same_device: bool) -> None:
            if same_device:
                torch.cat(tensors, dim=d, out=out)
            else:
                start = 0
                for t in tensors:
                    out.narrow(d, start, t.shape[d]).copy_(t, non_blocking=True)
                    start += t.shape[d]

        return self._fill(tensors, lease, out_shape, fill)

    @contextlib.contextmanager
    def activations(self) -> Iterator[None]:
        """Route the enclosed code's device allocations (e.g. the activations autograd saves
        during a forward pass) into this pool's segments.

        On CUDA this is ``torch.cuda.use_mem_pool(self.mempool)``; it only affects the calling
        thread (the backward pass runs in autograd's own threads and allocates normally), and
        the memory is managed by PyTorch's caching allocator, not by the arena's counters (see
        :meth:`device_segments`). On CPU it is a no-op: CPU autograd allocations always go to
        the system allocator. The first thread to route a pass here owns the pool for passes
        (memory/runtime.py).
        """
        with self._routed(held=True):
            yield

    # -- maintenance and reports -----------------------------------------------------

    def trim(self) -> int:
        """Drop all cached (unused) blocks; return the bytes freed. On CUDA the memory goes
        back to this pool's segments in PyTorch's caching allocator
        (``torch.cuda.empty_cache()`` returns unused segments to the driver)."""
        with self._lock:
            return self._evict(self._reserved)

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                name=self.name,
                reserved_bytes=self._reserved,
                in_use_bytes=self._in_use,
                requested_bytes=self._requested,
                peak_reserved_bytes=self._peak_reserved,
                peak_in_use_bytes=self._peak_in_use,
                allocations=self._allocations,
                reuses=self._reuses,
                budget_bytes=self.budget_bytes,
            )

    def reset_peaks(self) -> None:
        """Set the peak counters to the current values."""
        with self._lock:
            self._peak_reserved = self._reserved
            self._peak_in_use = self._in_use
