"""Dual-pool memory manager: a sealed persistent pool for start-up tensors and a size-classed,
reusing transient arena for per-step tensors. See :mod:`memory.pools` for the design."""

from .budget import (
    BudgetError,
    PoolBudgetError,
    device_total_memory,
    format_bytes,
    parse_budget,
)
from .config import MemoryConfig
from .manager import MemoryManager
from .persistent import PersistentPool
from .pools import MIN_BLOCK_BYTES, PoolStats, size_class
from .lease import Lease
from .transient import TransientPool

__all__ = [
    "MIN_BLOCK_BYTES",
    "Lease",
    "MemoryManager",
    "PersistentPool",
    "PoolBudgetError",
    "PoolStats",
    "TransientPool",
    "device_total_memory",
    "format_bytes",
    "parse_budget",
    "BudgetError",
    "MemoryConfig",
    "size_class",
]
