"""FSDP2-sharded learners (``algo.shard=fsdp``).

Each learner rank keeps ``1/N`` of every parameter, of its gradient and of the optimizer's
moments (``torch.distributed.fsdp.fully_shard``, gloo on the CPU, NCCL on CUDA). A forward
pass gathers the parameters of one unit at a time; the backward pass reduce-scatters the
gradients, averaged over the learners in fp32, which is the mean the unsharded learners'
all-reduce takes, so a sharded update equals the unsharded one on the same data.

Units: the modules a policy's :meth:`dvla.policy.VLAPolicy.shard_units` names (a large
model's transformer blocks, say) are sharded one by one, then the policy itself (whatever
is left). A unit's parameters must only be used inside its own ``forward``: FSDP gathers
them there and frees them after.

A learner is sharded after it has agreed on its starting state with the others (and
resumed from a checkpoint): the full weights and optimizer state are cut into each rank's
shard, and the optimizer is rebuilt on the sharded parameters (:func:`shard_learner`).

The same units can recompute their activations in the backward pass instead of keeping
them (:func:`checkpoint_activations`, ``algo.activation_checkpointing``).

Every sharded collective is issued by all learners in the same order, so the number of
forward and backward passes of an update must not depend on a rank's data: the algorithm
pads with passes that contribute nothing (:class:`dvla.algos.base.Algorithm`).
"""

from __future__ import annotations

import sys
import warnings
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from memory import runtime
from memory.persistent import is_dtensor, local_part

# FSDP, DTensor and activation checkpointing are imported where a rank shards: they cost 0.6 s
# of every process's start (sympy, the DTensor op tables), and a tensor can only be a DTensor
# in a process that imported them (``is_dtensor``).

__all__ = ["checkpoint_activations", "full_state_dict", "full_tensor", "gathered_weights", "is_sharded",
           "learner_bytes", "local_bytes", "reshard", "shard_learner", "shard_module"]


def is_sharded(module: nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")  # (not imported: nothing is sharded)
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def mixed_precision(precision: str):
    """``bf16``: parameters gathered and computed in bfloat16, gradients reduced in fp32 and
    the master weights and optimizer state kept in fp32; ``fp32``: everything fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _anchor_distribution(module: nn.Module, args, output):
    """A policy's forward returns its action distribution, whose tensors FSDP cannot see (it
    looks into dataclasses, lists and dicts only): expose them as ``backward_anchors``, so
    that the backward pass through them reduce-scatters the policy's gradients."""
    dist_ = getattr(output, "dist", None)
    if dist_ is not None and hasattr(output, "backward_anchors") and torch.is_grad_enabled():
        found = []
        for v in vars(dist_).values():
            for t in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(t, Tensor) and t.requires_grad:
                    found.append(t)
        output.backward_anchors = tuple(found)
    return output


def shard_module(module: nn.Module, group: dist.ProcessGroup, precision: str = "fp32",
                 units: list[nn.Module] | None = None):
    """Shard ``module`` over ``group``: each of ``units`` (its own submodules) first, then the
    rest. Returns the mesh (a ``DeviceMesh``)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    device = next(module.parameters()).device
    mesh = DeviceMesh.from_group(group, device.type)
    mp = mixed_precision(precision)
    for unit in units or []:
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    module.register_forward_hook(_anchor_distribution)  # runs before FSDP's own (registered next)
    fully_shard(module, mesh=mesh, mp_policy=mp)
    # The anchors may be views (an expanded log-std, say): FSDP warns about in-place ops on
    # them, which nothing here does.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    return mesh


def reshard(module: nn.Module) -> None:
    """Free the whole parameters a forward pass without a backward one leaves gathered: FSDP
    keeps the root module's after its forward, for the backward that usually follows (no-op
    on a module that is not sharded)."""
    if is_sharded(module):
        module.reshard()


def full_tensor(t: Tensor) -> Tensor:
    """The whole of ``t``: gathered from every shard when it is a DTensor (a collective: every
    rank of its mesh must call it; on the communication stream, :meth:`memory.runtime.Runtime.collective`),
    else ``t``."""
    if not is_dtensor(t):
        return t
    with runtime.current().collective():
        return t.full_tensor()


def full_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """``module.state_dict()`` with every sharded tensor gathered whole, one at a time, into
    host memory (a collective); the others as they are."""
    return {k: full_tensor(v).cpu() if is_dtensor(v) else v for k, v in module.state_dict().items()}


def local_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor counts its local shard)."""
    total = 0
    for t in tensors:
        local = local_part(t)
        total += local.numel() * local.element_size()
    return total


def learner_bytes(algo) -> int:
    """Bytes of the learner's persistent state on this rank: its policy's weights and the
    optimizer's state (a sharded learner's shards of them)."""
    state = [t for entries in algo.optimizer.state.values() for t in entries.values() if isinstance(t, Tensor)]
    return local_bytes([*algo.policy.parameters(), *algo.policy.buffers(), *state])


@torch.no_grad()
def gathered_weights(module: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` for every parameter and buffer of ``module``, gathered one at a time,
    each cast to ``dtype`` (default: its own) *before* the gather, so that no rank ever holds
    more than one whole tensor, and that one in ``dtype``. A collective per sharded tensor:
    every rank of the mesh must iterate to the end."""
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        yield name, full_tensor(t)


def _shard_like(value: Tensor, param: Tensor) -> Tensor:
    """``value`` (a whole tensor shaped like ``param``) cut to ``param``'s placement, locally."""
    if is_dtensor(param) and not is_dtensor(value) and value.shape == param.shape:
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(value.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return value


def checkpoint_activations(policy: nn.Module) -> int:
    """Recompute the activations of each of ``policy.shard_units()`` in the backward pass
    instead of keeping them (``algo.activation_checkpointing``; composable
    ``torch.distributed._composable.checkpoint``: names and weights are unchanged). Apply it
    before sharding. Returns the number of units; a ValueError when the policy names none."""
    units = list(policy.shard_units())
    if not units:
        raise ValueError(f"algo.activation_checkpointing: {type(policy).__qualname__} names no shard_units() "
                         "(the blocks whose activations would be recomputed)")
    from torch.distributed._composable import checkpoint

    for unit in units:
        checkpoint(unit)
    return len(units)


def shard_learner(algo, group: dist.ProcessGroup) -> None:
    """Shard an unsharded learner in place: its policy (``algo.policy``, units from
    ``shard_units()``), the KL reference if it has one, and the optimizer's state, which is
    rebuilt on the sharded parameters with each rank's shard of the existing moments (after a
    resume they carry on where the checkpoint left them)."""
    state = algo.optimizer.state_dict()
    shard_module(algo.policy, group, algo.cfg.precision, list(algo.policy.shard_units()))
    if getattr(algo, "reference", None) is not None:
        shard_module(algo.reference, group, algo.cfg.precision, list(algo.reference.shard_units()))
    algo.build_optimizer()
    params = algo.params
    for idx, entries in state["state"].items():
        state["state"][idx] = {k: _shard_like(v, params[idx]) if isinstance(v, Tensor) else v
                               for k, v in entries.items()}
    algo.optimizer.load_state_dict(state)
    algo.grad_sync = None
    algo.shard_group = group
