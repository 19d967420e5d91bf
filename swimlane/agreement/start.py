"""Learners of one run start from one state.

Several learner ranks average gradients, which keeps them identical only if they start
identical. Seeds alone do not guarantee it (a custom model may draw its init from
anywhere), and on a resume each learner reads the checkpoint directory as its own host
sees it: one that cannot see rank 0's checkpoints would start at version 0 while rank 0
resumes at ``V``. So, once at start-up, over the learners' group:

1. every learner says which checkpoint version it loaded (-1: none);
2. a learner that loaded a *different* version than rank 0 stops the run, on every
   learner, with an error naming both (stale or unshared checkpoint directories);
3. rank 0 sends its state to every learner: the policy's and the KL reference's weights,
   and after a resume also the optimizer state, the generators, the version and the
   counters, so a learner without the checkpoint receives it from rank 0.

Tensors travel as collectives on their own device (NCCL for CUDA tensors, gloo for CPU
ones); names, shapes and the manifest as JSON bytes (no pickle).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dvla.config import ConfigError
from dvla.distributed import all_gather_json, broadcast_json, broadcast_tensors, tensor_layout
from swimlane.agreement.checkpoints import Resumed, RunCheckpoints

log = logging.getLogger("dvla.swimlane")


def agree(checkpoints: RunCheckpoints, resumed: Resumed | None, *, group, learners: list[int], rank: int,
          device: torch.device, error: str | None = None) -> Resumed | None:
    """Run on every learner. ``resumed``: what this learner loaded itself; ``error``: why
    it could not (raised on every learner, so none waits for the others forever).
    Returns what this learner now resumes from (None: a fresh start)."""
    said = all_gather_json([resumed.version if resumed is not None else -1, error], group=group)
    errors = [e for _, e in said if e]
    if errors:
        raise ConfigError(errors[0])
    versions = [v for v, _ in said]
    source = versions[learners.index(0)]
    odd = [(r, v) for r, v in zip(learners, versions) if v not in (-1, source)]
    if odd:
        raise ConfigError(
            "learners disagree on the checkpoint to resume from: rank 0 has version "
            f"{source if source >= 0 else 'none'}, " + ", ".join(f"rank {r} has version {v}" for r, v in odd)
            + "; give all learners the same run directory (shared storage) or remove the stale checkpoints")
    full = source >= 0  # rank 0 resumed: the whole state, else the starting weights
    obj = None
    if rank == 0:
        manifest = {"env_steps": resumed.env_steps, "counters": resumed.counters} if full else {}
        tensors, meta = checkpoints.state(source, manifest) if full else (checkpoints.weights(), {})
        obj = [tensor_layout(tensors), meta, str(resumed.path) if resumed is not None else ""]
    layout, meta, path = broadcast_json(obj, src=0, group=group)
    tensors = broadcast_tensors(tensors if rank == 0 else None, layout, src=0, group=group, device=device)
    if rank == 0:
        return resumed
    if not full:
        checkpoints.load_weights(tensors)
        return None
    got = checkpoints.restore(tensors, meta, Path(path))
    if resumed is None:
        log.warning("rank %d: no checkpoint visible here; resuming from rank 0's version %d (%s)", rank,
                    got.version, path)
    return got
