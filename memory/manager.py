"""The memory manager: one persistent and one transient pool on a device, with budgets."""

from __future__ import annotations

import torch

from .budget import parse_budget

from .persistent import PersistentPool
from .pools import _normalize_device
from .transient import TransientPool

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
