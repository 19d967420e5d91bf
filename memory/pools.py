"""The dual-pool memory manager: a sealed persistent pool and a size-classed transient arena.

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

import contextlib
import functools
import operator
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from .budget import PoolBudgetError, format_bytes, parse_budget

__all__ = [
    "MIN_BLOCK_BYTES",
    "Lease",
    "MemoryManager",
    "PersistentPool",
    "PoolStats",
    "TransientPool",
    "size_class",
]

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
        device = torch.device("cuda", torch.cuda.current_device())
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

    def __init__(self, device, budget_bytes: int | None, name: str) -> None:
        self.name = name
        self.device = _normalize_device(device)
        self.budget_bytes = _check_budget(budget_bytes, name)
        self._lock = threading.Lock()
        #: ``torch.cuda.MemPool`` holding this pool's segments on CUDA; None on CPU.
        self.mempool = torch.cuda.MemPool() if self.device.type == "cuda" else None

    def _routed(self):
        """Context under which new device allocations land in this pool's segments."""
        if self.mempool is None:
            return contextlib.nullcontext()
        return torch.cuda.use_mem_pool(self.mempool, self.device)

    def device_segments(self) -> dict[str, int] | None:
        """On CUDA, what the caching allocator holds for this pool's ``MemPool``:
        ``{"segment_bytes", "allocated_bytes", "segments"}``. None on CPU."""
        if self.mempool is None:
            return None
        segments = self.mempool.snapshot(include_traces=False)
        mine = [s for s in segments if s.get("device", self.device.index) == self.device.index]
        return {
            "segment_bytes": sum(int(s["total_size"]) for s in mine),
            "allocated_bytes": sum(int(s["allocated_size"]) for s in mine),
            "segments": len(mine),
        }


# --------------------------------------------------------------------------------------
# Persistent pool
# --------------------------------------------------------------------------------------


def _scalar_dtype(fused: bool) -> torch.dtype:
    """The dtype torch.optim gives the ``step`` counter (mirrors ``_get_scalar_dtype``)."""
    try:
        from torch.optim.optimizer import _get_scalar_dtype
    except ImportError:  # pragma: no cover - older/newer torch without the helper
        if fused:
            return torch.float32
        return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return _get_scalar_dtype(is_fused=fused) if fused else _get_scalar_dtype()


class PersistentPool(_DevicePool):
    """Tensors that live for the whole run, allocated at start-up, then :meth:`seal` -ed.

    Every byte handed out is counted against ``budget_bytes`` (reserved == in use ==
    requested: nothing is cached or rounded here). Tensors are assumed to live until the end;
    dropping one does not give its bytes back to the budget.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        budget_bytes: int | None = None,
        name: str = "persistent",
    ) -> None:
        super().__init__(device, budget_bytes, name)
        self._sealed = False
        self._bytes = 0
        self._count = 0
        self._tags: dict[str, int] = {}

    # -- allocation ------------------------------------------------------------------

    def _sealed_error(self, tag: str, what: str) -> RuntimeError:
        return RuntimeError(
            f"{self.name} pool is sealed: cannot allocate {what} for tag {tag or 'untagged'!r} "
            "after start-up; allocate persistent tensors at start-up, before seal(), and use "
            "the transient pool for per-step memory"
        )

    def _budget_error(self, nbytes: int, shape=None, dtype=None, tag: str = "") -> PoolBudgetError:
        return PoolBudgetError(
            self.name,
            nbytes,
            self.budget_bytes or 0,
            reserved_bytes=self._bytes,
            in_use_bytes=self._bytes,
            shape=shape,
            dtype=dtype,
            tag=tag,
        )

    def _allocate(self, make, shape: tuple[int, ...], dtype: torch.dtype, tag: str) -> Tensor:
        nbytes = _layout(shape)[2] * dtype.itemsize
        with self._lock:
            if self._sealed:
                raise self._sealed_error(tag, f"{format_bytes(nbytes)} (shape {shape}, {dtype})")
            if self.budget_bytes is not None and self._bytes + nbytes > self.budget_bytes:
                raise self._budget_error(nbytes, shape, dtype, tag)
            with self._routed():
                t = make()
            self._account(t, tag)
        return t

    def _account(self, t: Tensor, tag: str) -> None:
        nbytes = t.untyped_storage().nbytes()
        self._bytes += nbytes
        self._count += 1
        key = tag or "untagged"
        self._tags[key] = self._tags.get(key, 0) + nbytes

    def empty(self, shape, dtype: torch.dtype, *, tag: str = "") -> Tensor:
        """A new uninitialised tensor, counted against the budget."""
        shape = _shape(shape)
        return self._allocate(
            lambda: torch.empty(shape, dtype=dtype, device=self.device), shape, dtype, tag
        )

    def zeros(self, shape, dtype: torch.dtype, *, tag: str = "") -> Tensor:
        """A new zero-filled tensor, counted against the budget."""
        shape = _shape(shape)
        return self._allocate(
            lambda: torch.zeros(shape, dtype=dtype, device=self.device), shape, dtype, tag
        )

    def clone(self, src: Tensor, *, tag: str = "") -> Tensor:
        """A copy of ``src`` (same shape, dtype and strides where dense) in this pool, e.g. the
        second weight version of a double buffer."""
        with torch.no_grad():
            out = self._allocate(
                lambda: torch.empty_like(
                    src, device=self.device, memory_format=torch.preserve_format
                ),
                tuple(src.shape),
                src.dtype,
                tag,
            )
            out.copy_(src)
        return out

    # -- optimizer state -------------------------------------------------------------

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Create ``optimizer``'s state in this pool at start-up, before the first step.

        Supported: ``torch.optim.Adam`` and ``torch.optim.AdamW`` (foreach or not, fused,
        capturable, amsgrad). For every parameter that requires grad, this creates exactly the
        state Adam creates lazily on its first step (a ``step`` scalar on the CPU, or on the
        device when capturable/fused, and zero-filled ``exp_avg``, ``exp_avg_sq`` and with
        amsgrad ``max_exp_avg_sq`` shaped like the parameter), with the big tensors from this
        pool. Adam then finds the state present and skips its lazy init, so training is
        bit-identical to an optimizer that was never adopted. A parameter that gets no grad on
        the first step simply keeps its zero state (Adam only touches parameters with grads).

        State that already exists (e.g. loaded from a checkpoint) is copied into the pool
        bit for bit; its ``step`` counters are left where they are.
        """
        adam = torch.optim.Adam
        if not isinstance(optimizer, adam) or type(optimizer)._init_group is not adam._init_group:
            raise TypeError(
                f"adopt_optimizer: {type(optimizer).__name__} is not supported; only "
                "torch.optim.Adam and torch.optim.AdamW are (their state layout is mirrored "
                "exactly)"
            )
        try:
            from torch.optim.optimizer import _device_dtype_check_for_fused
        except ImportError:  # pragma: no cover
            _device_dtype_check_for_fused = None

        plan: list[tuple[dict, Tensor, bool]] = []  # (group, param, has state already)
        need = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                if p.device != self.device:
                    raise ValueError(
                        f"adopt_optimizer: a parameter lives on {p.device} but the "
                        f"{self.name} pool is on {self.device}"
                    )
                state = optimizer.state.get(p) or {}  # .get: do not create entries yet
                keys = [k for k, v in state.items() if isinstance(v, Tensor) and k != "step"]
                if not state:
                    keys = ["exp_avg", "exp_avg_sq"] + (
                        ["max_exp_avg_sq"] if group["amsgrad"] else []
                    )
                    fused = bool(group.get("fused"))
                    if fused and _device_dtype_check_for_fused is not None:
                        _device_dtype_check_for_fused(p)  # the error torch would raise later
                    if group.get("capturable") or fused:
                        need += _scalar_dtype(fused).itemsize  # the on-device step counter
                need += sum(p.numel() * p.element_size() for _ in keys)
                plan.append((group, p, bool(state)))

        with self._lock:
            if self._sealed:
                raise self._sealed_error("optimizer", f"{type(optimizer).__name__} state")
            if self.budget_bytes is not None and self._bytes + need > self.budget_bytes:
                raise self._budget_error(need, tag=f"{type(optimizer).__name__} state")
            with self._routed(), torch.no_grad():
                for group, p, existing in plan:
                    state = optimizer.state[p]
                    if existing:
                        for key, value in list(state.items()):
                            if key == "step" or not isinstance(value, Tensor):
                                continue
                            moved = torch.empty_like(value, memory_format=torch.preserve_format)
                            moved.copy_(value)
                            self._account(moved, f"optimizer/{key}")
                            state[key] = moved
                        continue
                    fused = bool(group.get("fused"))
                    if group.get("capturable") or fused:
                        step = torch.zeros((), dtype=_scalar_dtype(fused), device=p.device)
                        self._account(step, "optimizer/step")
                    else:
                        # Deliberately a CPU scalar, exactly like torch.optim.Adam.
                        step = torch.tensor(0.0, dtype=_scalar_dtype(False), device="cpu")
                    state["step"] = step
                    for key in ("exp_avg", "exp_avg_sq") + (
                        ("max_exp_avg_sq",) if group["amsgrad"] else ()
                    ):
                        buf = torch.zeros_like(p, memory_format=torch.preserve_format)
                        self._account(buf, f"optimizer/{key}")
                        state[key] = buf

    # -- lifecycle and reports -------------------------------------------------------

    def seal(self) -> None:
        """End of start-up: any later allocation raises ``RuntimeError``."""
        with self._lock:
            self._sealed = True

    @property
    def sealed(self) -> bool:
        return self._sealed

    def tensors(self) -> dict[str, int]:
        """Bytes allocated per tag (tensors with the same tag are summed)."""
        with self._lock:
            return dict(self._tags)

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                name=self.name,
                reserved_bytes=self._bytes,
                in_use_bytes=self._bytes,
                requested_bytes=self._bytes,
                peak_reserved_bytes=self._bytes,
                peak_in_use_bytes=self._bytes,
                allocations=self._count,
                reuses=0,
                budget_bytes=self.budget_bytes,
            )


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


class Lease:
    """A bag of transient tensors released together.

    ``lease.empty(shape, dtype)`` allocates from the pool and remembers the tensor;
    ``lease.release()`` (or leaving a ``with lease:`` block) releases everything it holds.
    Releasing again is a no-op; the lease can be reused afterwards.
    """

    def __init__(self, pool: TransientPool) -> None:
        self.pool = pool
        self._tensors: list[Tensor] = []
        self._lock = threading.Lock()

    def empty(self, shape, dtype: torch.dtype) -> Tensor:
        t = self.pool.empty(shape, dtype)
        with self._lock:
            self._tensors.append(t)
        return t

    def stack(self, tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
        return self.pool.stack(tensors, dim, lease=self)

    def cat(self, tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
        return self.pool.cat(tensors, dim, lease=self)

    def _discard(self, t: Tensor) -> None:
        with self._lock:
            self._tensors = [x for x in self._tensors if x is not t]
        self.pool.release(t)

    def release(self) -> None:
        """Release every tensor this lease allocated (all are attempted; the first error,
        e.g. one of them was already released through the pool, is raised afterwards)."""
        with self._lock:
            tensors, self._tensors = self._tensors, []
        first_error: ValueError | None = None
        for t in tensors:
            try:
                self.pool.release(t)
            except ValueError as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        """Bytes requested by the tensors currently held."""
        with self._lock:
            return sum(t.numel() * t.element_size() for t in self._tensors)

    def __enter__(self) -> Lease:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.release()


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
    ) -> None:
        super().__init__(device, budget_bytes, name)
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
                    torch.cuda.current_stream(self.device).wait_event(block.event)
                    block.event = None
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

    def _new_block(self, size: int, nbytes: int, shape, dtype) -> _Block:
        # Called with the lock held.
        if self.budget_bytes is not None and self._reserved + size > self.budget_bytes:
            self._evict(self._reserved + size - self.budget_bytes)
            if self._reserved + size > self.budget_bytes:
                raise PoolBudgetError(
                    self.name,
                    nbytes,
                    self.budget_bytes,
                    reserved_bytes=self._reserved,
                    in_use_bytes=self._in_use,
                    shape=shape,
                    dtype=dtype,
                    block_bytes=size,
                )
        try:
            with self._routed():
                data = torch.empty(size, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError:
            # The device is full: give back what we cache and try once more.
            self._evict(self._reserved)
            with self._routed():
                data = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._allocations += 1
        self._reserved += size
        self._peak_reserved = max(self._peak_reserved, self._reserved)
        return _Block(data, size)

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
                    block.event.synchronize()
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
            if self.device.type == "cuda":
                block.event = torch.cuda.Event()
                block.event.record(torch.cuda.current_stream(self.device))
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
        the system allocator.
        """
        with self._routed():
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


# --------------------------------------------------------------------------------------
# Manager
# --------------------------------------------------------------------------------------


class MemoryManager:
    """Both pools for one device.

    Budgets are bytes or ``None``; any form :func:`memory.parse_budget` accepts (``"8GiB"``,
    ``0.5``) works too.
    """

    def __init__(
        self,
        device: torch.device | str,
        persistent_budget: str | float | None = None,
        transient_budget: str | float | None = None,
    ) -> None:
        self.device = _normalize_device(device)
        self.persistent = PersistentPool(
            self.device, parse_budget(persistent_budget, self.device, "memory.persistent_budget")
        )
        self.transient = TransientPool(
            self.device, parse_budget(transient_budget, self.device, "memory.transient_budget")
        )

    def metrics(self) -> dict[str, float]:
        """Both pools' :meth:`PoolStats.as_metrics` merged."""
        return {**self.persistent.stats().as_metrics(), **self.transient.stats().as_metrics()}

    def summary(self) -> dict:
        """JSON-able report: both pools' stats (with fragmentation) and persistent tags."""
        out: dict = {
            "device": str(self.device),
            "persistent": self.persistent.stats().as_dict(),
            "transient": self.transient.stats().as_dict(),
            "persistent_tensors": self.persistent.tensors(),
        }
        if self.device.type == "cuda":
            out["device_segments"] = {
                "persistent": self.persistent.device_segments(),
                "transient": self.transient.device_segments(),
            }
        return out
