"""The memory manager: one persistent pool and the transient pools on a device, with budgets."""

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
    """The pools of one device: the persistent pool (filled at start-up, then sealed), the
    transient pool of the gradient lane (its activations and per-update tensors) and the
    transient pool of the inference lane (its batches). Each lane that allocates has a pool
    of its own: a pass routed into a pool (activations) makes that thread its owner (memory/runtime.py).

    Budgets are bytes or ``None``; any form :func:`memory.parse_budget` accepts (``"8GiB"``,
    ``0.5``) works too. The transient budget holds for each transient pool.
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
        budget = parse_budget(transient_budget, self.device, "memory.transient_budget")
        self.transient = TransientPool(self.device, budget)
        self.inference = TransientPool(self.device, budget, name="transient_inference")

    def metrics(self) -> dict[str, float]:
        """Every pool's :meth:`PoolStats.as_metrics` merged."""
        return {**self.persistent.stats().as_metrics(), **self.transient.stats().as_metrics(),
                **self.inference.stats().as_metrics()}

    def summary(self) -> dict:
        """JSON-able report: both pools' stats (with fragmentation) and persistent tags."""
        out: dict = {
            "device": str(self.device),
            "persistent": self.persistent.stats().as_dict(),
            "transient": self.transient.stats().as_dict(),
            "transient_inference": self.inference.stats().as_dict(),
            "persistent_tensors": self.persistent.tensors(),
        }
        if self.persistent.mempool is not None:
            out["device_segments"] = {
                "persistent": self.persistent.device_segments(),
                "transient": self.transient.device_segments(),
                "transient_inference": self.inference.device_segments(),
            }
        return out
