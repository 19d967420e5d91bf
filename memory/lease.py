"""A lease: a bag of transient tensors released together (see :mod:`memory.transient`)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor


class TransientPool(Protocol):
    """What a lease needs of :class:`memory.transient.TransientPool`."""

    def empty(self, shape, dtype: torch.dtype) -> Tensor: ...

    def stack(self, tensors: Sequence[Tensor], dim: int = 0, lease=None) -> Tensor: ...

    def cat(self, tensors: Sequence[Tensor], dim: int = 0, lease=None) -> Tensor: ...

    def release(self, t: Tensor) -> None: ...


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
