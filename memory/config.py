"""The memory manager's configuration, owned here so that :mod:`memory` imports nothing from
the packages above it (``dvla.config`` composes it into a job's configuration)."""

from __future__ import annotations

from dataclasses import dataclass

from memory.budget import BudgetError, parse_budget


@dataclass(kw_only=True)
class MemoryConfig:
    """The dual-pool memory manager (:mod:`memory`). Budgets are bytes (``1073741824``),
    sizes with units (``512MiB``, ``2GB``), a fraction of the device's memory (``0.25``)
    or ``0`` for none."""

    enabled: bool = True
    """Weights, optimizer state and weight buffers in the persistent pool; rollout buffers
    and observation batches in the transient pool. False: plain allocation."""
    persistent_budget: int | float | str = 0
    """Budget of the persistent pool (allocated once at start-up, then sealed): bytes,
    ``512MiB``-style sizes, a fraction of device memory (``0.25``), or 0 for none."""
    transient_budget: int | float | str = 0
    """Budget of the transient pool (size-classed blocks reused step after step); same
    forms as ``persistent_budget``."""

    def _validate(self) -> list[tuple[str, str]]:
        errs = []
        for name in ("persistent_budget", "transient_budget"):
            try:
                parse_budget(getattr(self, name), "cpu", field=f"memory.{name}")
            except BudgetError as exc:
                errs.append((name, str(exc).split(": ", 1)[-1]))
        return errs
