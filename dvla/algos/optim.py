"""The learner's optimizer parameter groups and its small collectives (counts, a KL) over
the learner ranks."""

from __future__ import annotations

import functools
import inspect
import sys

import torch
import torch.distributed as dist

from dvla.policy import VLAPolicy
from memory import runtime


def adam(groups, *, lr: float, eps: float, weight_decay: float) -> torch.optim.Optimizer:
    """The learner's optimizer: ``torch.optim.AdamW`` with weight decay, else ``Adam``, as
    :func:`without_dynamo_import` makes it."""
    cls = torch.optim.AdamW if weight_decay else torch.optim.Adam
    return without_dynamo_import(cls)(groups, lr=lr, eps=eps, weight_decay=weight_decay)


_DECORATED = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")


@functools.cache
def without_dynamo_import(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``cls`` (``Adam``, ``AdamW``) unchanged in what it computes, but without importing
    ``torch._dynamo`` before anything compiles.

    torch wraps ``step`` and four other methods of every optimizer so that dynamo never
    traces them (``torch._disable_dynamo``, graph breaks around ``step``), and each wrapper
    imports ``torch._dynamo`` on its first call: about a second of CPU at the start of every
    learner process (40% of a small job's, on two cores), for a compiler dvla's learners do not
    use. Those wrappers only act while dynamo traces, which needs ``torch._dynamo`` imported.
    So while it is not, this class calls the methods themselves, and from the moment it is
    (something compiles) it defers to torch's wrappers, exactly as ``cls`` would. Where
    torch's methods are not wrapped as expected (another version), ``cls`` is returned as it
    is. Same name as ``cls`` (checkpoints record the optimizer's type by name)."""
    raw_step = inspect.unwrap(cls.step)
    if raw_step is cls.step or any(not hasattr(getattr(cls, m), "__wrapped__") for m in _DECORATED):
        return cls

    def plain(name: str, raw):
        wrapped = getattr(cls, name)

        def method(self, *args, **kwargs):
            if "torch._dynamo" in sys.modules:
                return wrapped(self, *args, **kwargs)
            return raw(self, *args, **kwargs)

        return functools.wraps(raw)(method)

    def step(self, closure=None):
        if "torch._dynamo" in sys.modules:
            return cls.step(self, closure)
        with torch.set_grad_enabled(self.defaults["differentiable"]):  # what torch's wrapper sets
            return raw_step(self, closure)

    body = {name: plain(name, inspect.unwrap(getattr(cls, name))) for name in _DECORATED}
    body.update(step=functools.wraps(raw_step)(step), __module__=cls.__module__, __qualname__=cls.__qualname__)
    return type(cls.__name__, (cls,), body)


def collective_device(backend: str, device: torch.device) -> torch.device:
    """Where a small tensor of a collective on a group of ``backend`` (``dist.get_backend``)
    goes: the CPU where the group takes CPU tensors (gloo; ``cpu:gloo,cuda:nccl``, the default
    group's backends on CUDA, sends them over gloo), else ``device``, the learner's (NCCL alone
    takes CUDA tensors only: a CPU tensor fails there with "No backend type associated with
    device type cpu"). A ValueError where the group takes neither."""
    takes = dist.BackendConfig(dist.Backend(backend)).get_device_backend_map()
    if "cpu" in takes:
        return torch.device("cpu")
    if device.type in takes:
        return device
    raise ValueError(f"a process group of backend {backend!r} takes tensors on {', '.join(takes)} only, "
                     f"neither on the CPU nor on the learner's {device}")


def all_reduce_small(values, dtype: torch.dtype, group, device: torch.device,
                     op=dist.ReduceOp.SUM) -> list:
    """``values`` reduced over ``group`` with ``op``, as one small tensor placed where the
    group's backend takes it (:func:`collective_device`; ``device``: the learner's)."""
    where = collective_device(dist.get_backend(group), device)
    t = torch.tensor(values, dtype=dtype, device=where)
    with runtime.current().collective():  # on the communication stream (memory/runtime.py), as every collective
        dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def param_groups(policy: VLAPolicy) -> list[dict]:
    """The optimizer's parameter groups: the policy's ``optim_groups()`` (per-module learning
    rates, weight decay), or one group of every trainable parameter. Frozen parameters
    (``requires_grad=False``) are left out; a trainable one in no group, or in two, is an
    error (it would silently never learn, or learn twice)."""
    declared = policy.optim_groups()
    if declared is None:
        return [{"params": [p for p in policy.parameters() if p.requires_grad]}]
    trainable = {id(p): n for n, p in policy.named_parameters() if p.requires_grad}
    seen: dict[int, int] = {}
    groups = []
    for gi, group in enumerate(declared):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"{type(policy).__qualname__}.optim_groups(): group {gi} must be a dict with 'params'")
        params = [p for p in group["params"] if p.requires_grad]
        for p in params:
            if id(p) in seen:
                raise ValueError(f"{type(policy).__qualname__}.optim_groups(): parameter "
                                 f"{trainable.get(id(p), '?')} is in groups {seen[id(p)]} and {gi}")
            seen[id(p)] = gi
        if params:
            groups.append({**group, "params": params})
    missing = [n for i, n in trainable.items() if i not in seen]
    if missing:
        raise ValueError(f"{type(policy).__qualname__}.optim_groups(): trainable parameter(s) in no group: "
                         f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} (freeze them with "
                         f"requires_grad_(False), or add them)")
    return groups
