"""The learner's side of publishing: copying its weights into the snapshot the broadcast lane
sends from (rank 0), whole or gathered from the shards of a sharded learner."""

from __future__ import annotations

import torch

from dvla.distributed.sharding import gathered_weights, is_sharded
from planes.buckets import module_weights, named_weights


@torch.no_grad()
def copy_into_snapshot(policy: torch.nn.Module, snapshot: torch.nn.Module | None,
                       dtype: torch.dtype | None = None) -> None:
    """Copy ``policy``'s weights into ``snapshot``. A sharded policy's are gathered tensor by
    tensor, each cast to ``dtype`` first (the same on every learner; None: its own): every
    learner calls this at the same version (a collective), those without a snapshot
    (``None``) only to take part."""
    if not is_sharded(policy):
        torch._foreach_copy_(module_weights(snapshot), module_weights(policy))
        return
    dst = dict(named_weights(snapshot)) if snapshot is not None else {}
    for name, t in gathered_weights(policy, dtype):
        if name in dst:
            dst[name].copy_(t)


def check_finite(flats: list[torch.Tensor], version: int, counters, last_good: int | None = None) -> None:
    """Weights that are not finite are never published: the run stops instead, naming the
    last version whose weights were finite (``last_good``)."""
    if not bool(torch.stack([torch.isfinite(f).all() for f in flats]).all()):
        good = f"; the last good version is {last_good}" if last_good is not None else ""
        raise RuntimeError(f"the weights of version {version} hold NaN or inf: not published, stopping{good} "
                           f"(counters: {counters})")
