"""Flat weight buckets: a model's parameters and buffers laid out in a few contiguous
tensors (the module's own tensors become views into them), so that a weights version moves
as one collective per bucket (:mod:`planes.control`)."""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

DEFAULT_BUCKET_BYTES = 32 << 20


class LayoutMismatchError(RuntimeError):
    """Ranks of the control group hold models with different parameter layouts."""


@dataclass
class Bucket:
    flat: Tensor
    names: list[str]
    frozen: bool = False  # holds only frozen parameters: a broadcast sends it once


def named_weights(module: nn.Module) -> list[tuple[str, Tensor]]:
    """Parameters and floating-point buffers, in a deterministic order."""
    out = [(n, p.data) for n, p in module.named_parameters()]
    out += [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
    return out


def module_weights(module: nn.Module) -> list[Tensor]:
    """The tensors a broadcast carries (parameters, floating buffers), in layout order."""
    return [t for _, t in named_weights(module)]


def _rebind(module: nn.Module, name: str, view: Tensor) -> None:
    """Make parameter/buffer ``name`` of ``module`` live in ``view`` (values copied)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if leaf in owner._parameters:
        param = owner._parameters[leaf]
        view.copy_(param.data)
        param.data = view
    else:
        view.copy_(owner._buffers[leaf])
        owner._buffers[leaf] = view


Alloc = Callable[[int, torch.dtype, torch.device, str], Tensor]
"""``alloc(numel, dtype, device, tag)`` -> a 1-D tensor: where flat buckets come from
(e.g. :meth:`memory.PersistentPool.empty`); ``torch.empty`` by default."""


def _default_alloc(numel: int, dtype: torch.dtype, device: torch.device, tag: str) -> Tensor:
    return torch.empty(numel, dtype=dtype, device=device)


@torch.no_grad()
def layout_buckets(module: nn.Module, entries: list[tuple[str, Tensor]], bucket_bytes: int,
                    device: torch.device, alloc: Alloc | None = None, tag: str = "weights",
                    frozen: frozenset[str] = frozenset()) -> list[Bucket]:
    """Allocate flat buckets (at most ``bucket_bytes``, one dtype each, the ``frozen``
    entries in buckets of their own) and rebind every entry of ``module`` to its view in
    them."""
    alloc = alloc or _default_alloc
    buckets: list[Bucket] = []
    by_kind: dict[tuple[bool, torch.dtype], list[tuple[str, Tensor]]] = {}
    for name, t in entries:
        by_kind.setdefault((name in frozen, t.dtype), []).append((name, t))
    for (is_frozen, dtype), items in by_kind.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        cap = max(1, bucket_bytes // itemsize)
        group: list[tuple[str, Tensor]] = []
        size = 0
        for item in items + [None]:
            if item is None or (group and size + item[1].numel() > cap):
                flat = alloc(size, dtype, device, f"{tag}/bucket{len(buckets)}")
                off = 0
                for name, t in group:
                    _rebind(module, name, flat[off : off + t.numel()].view_as(t))
                    off += t.numel()
                buckets.append(Bucket(flat, [n for n, _ in group], is_frozen))
                group, size = [], 0
            if item is not None:
                group.append(item)
                size += item[1].numel()
    return buckets


def layout_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` on the meta device, floating tensors in ``dtype``: its weights'
    names, shapes and dtypes, no storage (the model's own tensors are never copied)."""
    memo = {}
    for t in [*model.parameters(), *model.buffers()]:
        meta = torch.empty_like(t, device="meta", dtype=dtype if t.is_floating_point() else t.dtype)
        memo[id(t)] = nn.Parameter(meta, requires_grad=False) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def meta_alloc(numel: int, dtype: torch.dtype, device: torch.device, tag: str) -> Tensor:
    """An :data:`Alloc` of buckets without storage, for a :func:`layout_copy`."""
    return torch.empty(numel, dtype=dtype, device="meta")


def flat_buckets(module: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES, alloc: Alloc | None = None,
                 tag: str = "weights") -> list[Tensor]:
    """Lay ``module`` out in flat buckets (see :class:`WeightBroadcaster`) without any
    collective; returns the flat tensors, e.g. for copying whole versions in one pass."""
    entries = named_weights(module)
    return [b.flat for b in layout_buckets(module, entries, bucket_bytes, entries[0][1].device, alloc, tag)]


def frozen_names(module: nn.Module) -> frozenset[str]:
    """The parameters that do not train (``requires_grad=False``: a frozen backbone, the
    base weights under LoRA adapters)."""
    return frozenset(n for n, p in module.named_parameters() if not p.requires_grad)


def layout_checksum(entries: list[tuple[str, Tensor]], bucket_bytes: int, frozen: frozenset[str] = frozenset()) -> int:
    h = hashlib.sha256(str(bucket_bytes).encode())
    for name, t in entries:
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|{name in frozen};".encode())
    return int.from_bytes(h.digest()[:8], "little") & ((1 << 63) - 1)
