"""Optimizer and random-number-generator state as (tensors, json-able metadata) pairs that
fit a checkpoint (:mod:`dvla.state.checkpoint`), so that resuming is bit-identical to never
having stopped."""

from __future__ import annotations

import hashlib
import json
import logging
import random
from typing import Any

import torch
from torch import Tensor

from dvla.state.checkpoint import FORMAT_VERSION, CheckpointError
from memory import runtime

log = logging.getLogger("dvla.state.checkpoint")


# -- optimizer state ------------------------------------------------------------------------

# Switches that pick an implementation, not the maths: the running optimizer keeps its own.
_IMPL_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable"})


def _check_meta(meta: Any, what: str) -> None:
    if not isinstance(meta, dict):
        raise CheckpointError(f"{what}: metadata is a {type(meta).__name__}, not a dict")
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{what}: unsupported format version {meta.get('format')!r} (this code reads {FORMAT_VERSION})")


def _jsonable(value: Any, where: str) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{where} = {value!r} cannot be stored in a json manifest ({e})") from None
    return value


def optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict]:
    """Split ``optimizer.state_dict()`` into tensors and a json-able dict.

    Tensors: per-parameter state as ``optim/{param_index}/{key}`` (``step`` included) and
    tensor-valued hyper-parameters as ``optim/group/{group_index}/{key}``. The dict holds the
    param groups (hyper-parameters and parameter indices), non-tensor state values, and the
    parameter shapes for checking on load. Tensors are references, not copies.
    """
    sd = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    groups = []
    for gi, group in enumerate(sd["param_groups"]):
        g = {}
        for key, value in group.items():
            if isinstance(value, Tensor):
                tensors[f"optim/group/{gi}/{key}"] = value
            else:
                g[key] = _jsonable(list(value) if isinstance(value, tuple) else value,
                                   f"param_groups[{gi}][{key!r}]")
        groups.append(g)
    state: dict[str, dict] = {}
    for idx, entries in sd["state"].items():
        plain = {}
        for key, value in entries.items():
            if isinstance(value, Tensor):
                tensors[f"optim/{idx}/{key}"] = value
            else:
                plain[key] = _jsonable(value, f"state[{idx}][{key!r}]")
        state[str(idx)] = plain
    params = [p for group in optimizer.param_groups for p in group["params"]]
    meta = {
        "format": FORMAT_VERSION,
        "type": type(optimizer).__name__,
        "param_groups": groups,
        "state": state,
        "param_shapes": [list(p.shape) for p in params],
    }
    return tensors, meta


def _place_state(value: Tensor, param: Tensor, key: str, group: dict) -> Tensor:
    """Where torch's own ``load_state_dict`` would put a state tensor."""
    if key == "step":
        if group.get("capturable") or group.get("fused"):
            return value.to(dtype=torch.float32, device=param.device)
        return value.clone()
    if param.is_floating_point() and value.is_floating_point():
        return value.to(dtype=param.dtype, device=param.device, copy=True)
    return value.to(device=param.device, copy=True)


def load_optimizer_state(optimizer: torch.optim.Optimizer, tensors: dict[str, Tensor], meta: dict) -> None:
    """Restore what ``optimizer_state`` produced, in place.

    A state tensor that already exists with the same shape and dtype is overwritten with
    ``copy_`` (so state living in pre-allocated memory stays there); anything else is set.
    State keys the checkpoint does not have are removed, so the result matches the saved
    optimizer exactly. Param-group hyper-parameters are restored; implementation switches
    (foreach, fused, capturable, differentiable) keep the running optimizer's values.
    """
    _check_meta(meta, "optimizer state")
    saved_groups = meta["param_groups"]
    groups = optimizer.param_groups
    if len(saved_groups) != len(groups):
        raise CheckpointError(
            f"optimizer state: checkpoint has {len(saved_groups)} param groups, optimizer has {len(groups)}")
    params = [p for group in groups for p in group["params"]]
    shapes = meta["param_shapes"]
    if len(shapes) != len(params):
        raise CheckpointError(
            f"optimizer state: checkpoint has {len(shapes)} parameters, optimizer has {len(params)}")
    for gi, (saved, group) in enumerate(zip(saved_groups, groups)):
        if len(saved["params"]) != len(group["params"]):
            raise CheckpointError(
                f"optimizer state: param group {gi} has {len(saved['params'])} parameters in the "
                f"checkpoint, {len(group['params'])} in the optimizer")
    for i, (shape, p) in enumerate(zip(shapes, params)):
        if list(p.shape) != list(shape):
            raise CheckpointError(
                f"optimizer state: parameter {i} has shape {tuple(shape)} in the checkpoint, "
                f"{tuple(p.shape)} in the optimizer")

    # The checkpoint's parameter indices (state_dict ids), in optimizer order.
    index_of = {idx: params_pos for params_pos, idx in
                enumerate(i for g in saved_groups for i in g["params"])}
    group_of = [group for group in groups for _ in group["params"]]
    per_param: dict[int, dict[str, Any]] = {}
    for name, t in tensors.items():
        parts = name.split("/", 2)
        if len(parts) != 3 or parts[0] != "optim" or parts[1] == "group":
            continue
        per_param.setdefault(int(parts[1]), {})[parts[2]] = t
    for idx, plain in meta["state"].items():
        per_param.setdefault(int(idx), {}).update(plain)
    unknown = sorted(set(per_param) - set(index_of))
    if unknown:
        raise CheckpointError(f"optimizer state: state for unknown parameter indices {unknown}")

    for idx, pos in index_of.items():
        p = params[pos]
        saved = per_param.get(idx, {})
        if not saved:
            optimizer.state.pop(p, None)
            continue
        state = optimizer.state[p]
        for key in [k for k in state if k not in saved]:
            del state[key]
        for key, value in saved.items():
            if not isinstance(value, Tensor):
                state[key] = value
                continue
            current = state.get(key)
            if isinstance(current, Tensor) and current.shape == value.shape and current.dtype == value.dtype:
                with torch.no_grad():
                    current.copy_(value)
            else:
                state[key] = _place_state(value, p, key, group_of[pos])

    for gi, (saved, group) in enumerate(zip(saved_groups, groups)):
        for key, value in saved.items():
            if key == "params" or key in _IMPL_KEYS:
                continue
            if key == "param_names" and "param_names" in group and list(group["param_names"]) != list(value):
                raise CheckpointError(
                    f"optimizer state: param group {gi} names differ: checkpoint {value}, "
                    f"optimizer {group['param_names']}")
            if isinstance(group.get(key), tuple) and isinstance(value, list):
                value = tuple(value)
            group[key] = value
        prefix = f"optim/group/{gi}/"
        for name, t in tensors.items():
            if not name.startswith(prefix):
                continue
            key = name[len(prefix):]
            current = group.get(key)
            if isinstance(current, Tensor) and current.shape == t.shape and current.dtype == t.dtype:
                with torch.no_grad():
                    current.copy_(t)
            else:
                group[key] = t.clone()


# -- random number generators ---------------------------------------------------------------


def rng_state(generators: dict[str, torch.Generator] | None = None) -> tuple[dict[str, Tensor], dict]:
    """Capture torch (CPU and every CUDA device), python ``random``, numpy's global RNG and
    the named ``generators``: tensors ``rng/torch``, ``rng/cuda/{i}``, ``rng/numpy``,
    ``rng/gen/{name}`` plus a json-able dict with the rest."""
    tensors: dict[str, Tensor] = {"rng/torch": torch.get_rng_state()}
    meta: dict[str, Any] = {"format": FORMAT_VERSION, "cuda_devices": 0}
    states = runtime.current().rng_states()
    if states:
        meta["cuda_devices"] = len(states)
        for i, s in enumerate(states):
            tensors[f"rng/cuda/{i}"] = s
    version, internal, gauss = random.getstate()
    meta["python"] = [version, list(internal), gauss]
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        np = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        tensors["rng/numpy"] = torch.from_numpy(keys.astype(np.int64))
        meta["numpy"] = {"kind": str(kind), "pos": int(pos), "has_gauss": int(has_gauss),
                         "cached_gaussian": float(cached)}
    meta["generators"] = {}
    for name, gen in (generators or {}).items():
        tensors[f"rng/gen/{name}"] = gen.get_state()
        meta["generators"][name] = str(gen.device)
    return tensors, meta


def set_rng_state(tensors: dict[str, Tensor], meta: dict,
                  generators: dict[str, torch.Generator] | None = None) -> None:
    """Restore everything ``rng_state`` captured. Every generator passed must be in the
    checkpoint; CUDA states for devices this process lacks are skipped with a warning, and a
    generator saved on another kind of device (a CPU run resumed on a GPU) is reseeded from
    its saved state, with a warning."""
    _check_meta(meta, "rng state")
    missing = sorted(n for n in (generators or {}) if f"rng/gen/{n}" not in tensors)
    if missing:
        raise CheckpointError(f"rng state: no state for generator(s) {missing} in the checkpoint "
                              f"(it has {sorted(meta.get('generators', {}))})")
    if "rng/torch" not in tensors:
        raise CheckpointError("rng state: tensor 'rng/torch' is missing")

    torch.set_rng_state(tensors["rng/torch"].to("cpu", torch.uint8))
    saved_cuda = int(meta.get("cuda_devices", 0))
    if saved_cuda:
        have = runtime.current().device_count()
        if have < saved_cuda:
            log.warning("rng state: checkpoint has %d CUDA RNG states, this process sees %d devices; "
                        "restoring %d", saved_cuda, have, have)
        for i in range(min(have, saved_cuda)):
            runtime.current().set_rng_state(tensors[f"rng/cuda/{i}"].to("cpu", torch.uint8), i)
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in meta and "rng/numpy" in tensors:
        import numpy as np

        n = meta["numpy"]
        keys = tensors["rng/numpy"].numpy().astype(np.uint32)
        np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    saved_on = meta.get("generators", {})
    for name, gen in (generators or {}).items():
        state = tensors[f"rng/gen/{name}"].to("cpu", torch.uint8)
        was = torch.device(saved_on.get(name, str(gen.device))).type
        if was == gen.device.type:
            gen.set_state(state)
            continue
        # A CPU generator's state (Mersenne Twister, 5056 bytes) means nothing to a CUDA one
        # (Philox, 16 bytes) and the other way round: the run resumed on another device. Its
        # stream cannot continue; it goes on from a seed the saved state decides.
        seed = int.from_bytes(hashlib.sha256(state.numpy().tobytes()).digest()[:8], "little")
        gen.manual_seed(seed)
        log.warning("rng state: generator %r was saved on %s and resumes on %s: its stream restarts from a "
                    "seed the saved state decides (the same on every resume of this checkpoint)", name, was,
                    gen.device.type)
