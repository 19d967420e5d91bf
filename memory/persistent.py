"""The persistent pool: tensors made once at start-up, counted against a budget, then sealed
(see :mod:`memory.pools` for the design)."""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from .budget import PoolBudgetError, format_bytes

from .pools import PoolStats, _DevicePool, _layout, _shape

# --------------------------------------------------------------------------------------
# Persistent pool
# --------------------------------------------------------------------------------------


def is_dtensor(t) -> bool:
    """Whether ``t`` is a sharded tensor (a DTensor), without importing DTensor where nothing
    did: a process that shards has imported it (0.55 s of every process's start otherwise)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def local_part(t: Tensor) -> Tensor:
    """What this process holds of ``t``: a sharded tensor's (DTensor's) local shard."""
    return t.to_local() if is_dtensor(t) else t


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
        nbytes = local_part(t).untyped_storage().nbytes()
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
        capturable, amsgrad), over plain or sharded (DTensor) parameters: a sharded parameter's
        state is sharded like it, and only the local shard counts. For every parameter that
        requires grad, this creates exactly the
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
                need += sum(local_part(p).numel() * p.element_size() for _ in keys)
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
