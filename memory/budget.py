"""Memory budgets: parsing budget specs, formatting byte counts, the budget error.

A budget is given in configs as ``None``/``0``/``"unlimited"`` (no budget), a byte count
(``4096``, ``"512MiB"``, ``"2GB"``, ``"1.5GiB"``) or a fraction of the device's memory
(``0.8``, or the string ``"80%"``). :func:`parse_budget` turns any of these into a number of
bytes (or ``None``) and reports anything else as a :class:`BudgetError`.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import torch

__all__ = ["BudgetError", "PoolBudgetError", "device_total_memory", "format_bytes", "parse_budget"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_PERCENT_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*$")
_NO_BUDGET = {"unlimited", "none", "null", "0"}

_ALLOWED = (
    "allowed: null, 0 or 'unlimited' (no budget); a positive integer number of bytes; "
    "a size string such as '512MiB', '2GB', '1.5GiB' or '4096'; "
    "or a fraction of the device memory in (0, 1] such as 0.8 (or '80%')"
)


def format_bytes(n: float) -> str:
    """``12582912`` -> ``"12.0 MiB"`` (binary units, one decimal; plain bytes below 1 KiB)."""
    n = float(n)
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024.0
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


class PoolBudgetError(MemoryError):
    """A pool was asked for more memory than its budget allows.

    Attributes: ``pool`` (the pool's name), ``request_bytes`` (the bytes asked for),
    ``budget_bytes`` (the pool's budget); also ``reserved_bytes`` / ``in_use_bytes`` at the
    time of the request.
    """

    def __init__(
        self,
        pool: str,
        request_bytes: int,
        budget_bytes: int,
        *,
        reserved_bytes: int = 0,
        in_use_bytes: int = 0,
        shape: tuple[int, ...] | None = None,
        dtype: torch.dtype | None = None,
        block_bytes: int | None = None,
        tag: str = "",
    ) -> None:
        self.pool = pool
        self.request_bytes = int(request_bytes)
        self.budget_bytes = int(budget_bytes)
        self.reserved_bytes = int(reserved_bytes)
        self.in_use_bytes = int(in_use_bytes)
        details = []
        if tag:
            details.append(f"tag {tag!r}")
        if shape is not None:
            details.append(f"shape {tuple(shape)}")
        if dtype is not None:
            details.append(str(dtype))
        if block_bytes is not None and block_bytes != request_bytes:
            details.append(f"size-class block {format_bytes(block_bytes)}")
        what = f"a request of {format_bytes(request_bytes)}"
        if details:
            what += f" ({', '.join(details)})"
        super().__init__(
            f"{pool} pool: {what} would exceed its budget of {format_bytes(budget_bytes)} "
            f"(reserved {format_bytes(reserved_bytes)}, in use {format_bytes(in_use_bytes)})"
        )


def _cgroup_memory_limit(
    cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
    proc_cgroup: str | os.PathLike = "/proc/self/cgroup",
) -> int | None:
    """The tightest cgroup memory limit that applies to this process, or None.

    cgroup v2: ``memory.max`` of the process's own cgroup and of every ancestor (a value of
    ``max`` means no limit). cgroup v1 (hybrid hosts): ``memory/memory.limit_in_bytes``, where
    "no limit" shows up as a huge number that exceeds physical RAM and so never wins the min.
    """
    root = Path(cgroup_root)
    limits: list[int] = []
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, rel = parts
        rel = rel.strip().lstrip("/")
        if hier == "0" and controllers == "":  # cgroup v2 (unified) entry
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
            name = "memory.max"
        elif "memory" in controllers.split(","):  # cgroup v1 memory controller
            base = root / "memory"
            name = "memory.limit_in_bytes"
        else:
            continue
        # The process's own cgroup and all its ancestors up to the root of the hierarchy.
        for directory in [base / rel, *(base / p for p in Path(rel).parents)]:
            try:
                text = (directory / name).read_text().strip()
            except OSError:
                continue
            if text.isdigit():
                limits.append(int(text))
    return min(limits) if limits else None


def device_total_memory(device: torch.device | str) -> int:
    """Total memory of ``device`` in bytes: the GPU's memory on CUDA; on CPU the physical RAM,
    or the process's cgroup memory limit when that is smaller."""
    device = torch.device(device)
    if device.type == "cuda":
        from .runtime import current

        return current().total_memory(device.index)
    if device.type != "cpu":
        raise ValueError(f"cannot tell the total memory of a {device.type!r} device")
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_memory_limit()
    return int(min(physical, limit) if limit else physical)


class BudgetError(ValueError):
    """A memory budget that is not one of the accepted forms (the message names the field)."""


def _fail(field: str, spec, why: str = "") -> BudgetError:
    reason = f" ({why})" if why else ""
    return BudgetError(f"{field}: invalid memory budget {spec!r}{reason}; {_ALLOWED}")


def parse_budget(spec, device: torch.device | str, field: str = "memory.budget") -> int | None:
    """Turn a budget spec into bytes, or ``None`` for "no budget".

    * ``None``, ``0``, ``"0"``, ``"unlimited"`` -> ``None``
    * ``int >= 1`` -> that many bytes
    * ``"512MiB"``, ``"2GB"``, ``"1.5GiB"``, ``"4096"`` -> bytes (``K/M/G/T[B]`` are decimal,
      ``KiB/MiB/GiB/TiB`` binary; a size of zero in any unit means no budget)
    * ``float`` in ``(0, 1]`` (or ``"80%"``) -> that fraction of :func:`device_total_memory`

    Anything else raises :class:`BudgetError` whose message starts with ``field``.
    """
    if spec is None:
        return None
    if isinstance(spec, bool):
        raise _fail(field, spec, "a boolean is not a size")
    if isinstance(spec, int):
        if spec == 0:
            return None
        if spec < 0:
            raise _fail(field, spec, "negative")
        return spec
    if isinstance(spec, float):
        if spec == 0.0:
            return None
        if not math.isfinite(spec) or not 0.0 < spec <= 1.0:
            raise _fail(field, spec, "a float is a fraction of device memory and must be in (0, 1]")
        return max(1, int(spec * device_total_memory(device)))
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text in _NO_BUDGET:
            return None
        m = _PERCENT_RE.match(text)
        if m:
            frac = float(m.group(1)) / 100.0
            if frac == 0.0:
                return None
            if frac > 1.0:
                raise _fail(field, spec, "more than 100%")
            return max(1, int(frac * device_total_memory(device)))
        m = _SIZE_RE.match(text)
        if m and m.group(2) in _UNITS:
            number, unit = m.group(1), m.group(2)
            if unit == "" and not number.isdigit():
                raise _fail(field, spec, "a plain number must be a whole number of bytes")
            value = float(number) * _UNITS[unit] if "." in number else int(number) * _UNITS[unit]
            if value == 0:
                return None
            nbytes = int(value)
            if nbytes < 1:
                raise _fail(field, spec, "less than one byte")
            return nbytes
        raise _fail(field, spec)
    raise _fail(field, spec, f"unsupported type {type(spec).__name__}")
