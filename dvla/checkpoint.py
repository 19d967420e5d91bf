"""Checkpoints a long training run can trust.

Two layers:

* ``save_safetensors`` writes one safetensors file atomically (temp file, fsync, rename).
* ``CheckpointManager`` keeps a directory of step checkpoints::

      directory/
        step-00001000/
          tensors.safetensors
          manifest.json        # caller's manifest + format, step, created, sha256/size of files

  A checkpoint is built in a hidden sibling ``.tmp-step-...`` directory, fsynced, and only
  then renamed to its final name, so a crash leaves either the previous state or the
  complete new checkpoint. Readers verify size and sha256 before trusting a checkpoint and
  ``load_latest`` falls back to the newest one that verifies.

``optimizer_state`` / ``load_optimizer_state`` and ``rng_state`` / ``set_rng_state`` turn
optimizer and random-number-generator state into (tensors, json-able metadata) pairs that
fit this format, so resuming is bit-identical to never having stopped.

One writer per checkpoint directory is assumed (e.g. rank 0): a save removes every stale
``.tmp-*`` entry it finds, including one another writer might still be filling.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import os
import random
import re
import secrets
import shutil
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

log = logging.getLogger("dvla.checkpoint")

FORMAT_VERSION = 1
TENSORS_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_RESERVED = ("format", "step", "created", "files")
_HASH_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, or does not fit what it is loaded into."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    manifest: dict
    tensors: dict[str, Tensor] = field(repr=False)


# -- low-level file helpers -----------------------------------------------------------------


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (creations, renames) durable. No-op where unsupported."""
    if os.name == "posix":  # directories cannot be opened on Windows
        _fsync(path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _cpu_tensors(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Detached, contiguous CPU tensors that share no storage (safetensors refuses sharing)."""
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for name, t in state.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        if not isinstance(t, Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr and ptr in seen:
            t = t.clone()
        elif ptr:
            seen.add(ptr)
        out[name] = t
    return out


def _write_safetensors(state: dict[str, Tensor], path: Path, metadata: dict[str, str] | None) -> None:
    save_file(_cpu_tensors(state), str(path), metadata=metadata)
    _fsync(path)


def save_safetensors(state: dict[str, Tensor], path: str | Path, metadata: dict[str, str]) -> None:
    """Write ``state`` (moved to the CPU) to ``path``; a crash mid-write leaves the old file.

    The data go to a uniquely named temp file next to ``path``, which is fsynced and then
    renamed over ``path``; the directory is fsynced so the rename survives a power cut.
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        _write_safetensors(state, tmp, metadata)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns False where the platform or file system cannot do it.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2 exchange failed: {os.strerror(err)}", str(a), None, str(b))


# -- checkpoint directory -------------------------------------------------------------------


class CheckpointManager:
    """Atomic, verified, pruned step checkpoints in one directory.

    ``keep`` is how many valid checkpoints survive pruning after each save. The checkpoint
    a save has just written is never pruned, and corrupt checkpoints newer than the newest
    valid one are left in place for inspection (readers skip them).
    """

    def __init__(self, directory: str | Path, keep: int = 3):
        if int(keep) < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = int(keep)
        self.skipped: list[tuple[Path, str]] = []
        # path -> file signature at the time it fully verified; lets pruning skip re-hashing
        # big files this process wrote or checked itself and that have not changed since.
        self._verified: dict[Path, tuple] = {}

    # -- paths ---------------------------------------------------------------------------

    def path_for(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}"

    def list(self) -> list[Path]:
        """Final-named checkpoint directories, oldest step first (temp dirs excluded)."""
        if not self.directory.is_dir():
            return []
        found = []
        for entry in self.directory.iterdir():
            m = _STEP_DIR.match(entry.name)
            if m and entry.is_dir():
                found.append((int(m.group(1)), entry))
        found.sort(key=lambda se: se[0])
        return [p for _, p in found]

    # -- writing -------------------------------------------------------------------------

    def save(self, step: int, tensors: dict[str, Tensor], manifest: dict) -> Path:
        """Write checkpoint ``step`` atomically and prune old ones; returns its final path.

        Keys ``format``, ``step``, ``created`` and ``files`` of ``manifest`` are reserved and
        overwritten. An existing checkpoint of the same step is replaced atomically.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if not isinstance(manifest, dict):
            raise TypeError(f"manifest must be a dict, got {type(manifest).__name__}")
        overwritten = sorted(k for k in _RESERVED if k in manifest)
        if overwritten:
            log.warning("checkpoint manifest keys %s are reserved and will be overwritten", overwritten)
        data = dict(manifest)
        data.update(format=FORMAT_VERSION, step=step,
                    created=datetime.now(UTC).isoformat(timespec="seconds"))
        json.dumps(data)  # fail on a non-json-able manifest before touching the disk

        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_stale_tmp()
        existing = self.list()
        if existing and _step_of(existing[-1]) > step:
            log.warning("saving checkpoint step %d below the newest existing one (%s)",
                        step, existing[-1].name)

        final = self.path_for(step)
        tmp = self.directory / f"{TMP_PREFIX}{final.name}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            tensor_path = tmp / TENSORS_FILE
            _write_safetensors(tensors, tensor_path, {"format": str(FORMAT_VERSION), "step": str(step)})
            data["files"] = {TENSORS_FILE: {"sha256": _sha256(tensor_path),
                                            "bytes": tensor_path.stat().st_size}}
            manifest_path = tmp / MANIFEST_FILE
            with open(manifest_path, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=2, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            self._publish(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._remember_valid(final)
        self._prune(final)
        return final

    def _publish(self, tmp: Path, final: Path) -> None:
        """Move the finished ``tmp`` to ``final``; replaces an existing ``final`` atomically."""
        if not final.exists():
            os.rename(tmp, final)
            _fsync_dir(self.directory)
            return
        if _exchange(tmp, final):
            # ``final`` is now the new checkpoint and ``tmp`` holds the old one.
            _fsync_dir(self.directory)
            shutil.rmtree(tmp, ignore_errors=True)
            return
        # No atomic swap available: move the old one aside under a temp name first. A crash
        # between the two renames leaves no checkpoint of this step (older ones remain).
        aside = self.directory / f"{TMP_PREFIX}replaced-{final.name}-{secrets.token_hex(4)}"
        os.rename(final, aside)
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(aside, final)
            raise
        _fsync_dir(self.directory)
        shutil.rmtree(aside, ignore_errors=True)

    def _remove_stale_tmp(self) -> None:
        for entry in self.directory.iterdir():
            if entry.name.startswith(TMP_PREFIX):
                log.info("removing stale checkpoint temp entry %s", entry)
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)

    def _prune(self, just_saved: Path) -> None:
        """Keep the newest ``keep`` valid checkpoints (plus ``just_saved`` and corrupt ones
        newer than the newest valid); delete everything else."""
        valid = 0
        for path in reversed(self.list()):
            if path == just_saved:
                valid += 1
                continue
            if valid >= self.keep:
                log.info("pruning checkpoint %s", path)
                self._delete(path)
                continue
            reason = self._check(path)
            if reason is None:
                valid += 1
            elif valid > 0:
                log.warning("pruning corrupt checkpoint %s: %s", path, reason)
                self._delete(path)

    def _delete(self, path: Path) -> None:
        self._verified.pop(path, None)
        # Rename first so a crash mid-delete never leaves a half checkpoint under a final name.
        doomed = self.directory / f"{TMP_PREFIX}deleted-{path.name}-{secrets.token_hex(4)}"
        try:
            os.rename(path, doomed)
        except OSError:
            doomed = path
        shutil.rmtree(doomed, ignore_errors=True)

    # -- reading -------------------------------------------------------------------------

    def verify(self, path: str | Path) -> dict:
        """Check ``path`` completely (manifest, format, sizes, sha256); return its manifest."""
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {path}: directory does not exist")
        manifest_path = path / MANIFEST_FILE
        if not manifest_path.is_file():
            raise CheckpointError(f"checkpoint {path}: missing {MANIFEST_FILE}")
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(
                f"checkpoint {path}: {MANIFEST_FILE} is truncated or not valid JSON ({e})") from None
        if not isinstance(manifest, dict):
            raise CheckpointError(
                f"checkpoint {path}: {MANIFEST_FILE} holds a {type(manifest).__name__}, not an object")
        fmt = manifest.get("format")
        if fmt != FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint {path}: unsupported format version {fmt!r} (this code reads {FORMAT_VERSION})")
        step = manifest.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise CheckpointError(f"checkpoint {path}: manifest has no integer 'step' (got {step!r})")
        m = _STEP_DIR.match(path.name)
        if m and int(m.group(1)) != step:
            raise CheckpointError(
                f"checkpoint {path}: manifest step {step} does not match directory name {path.name}")
        files = manifest.get("files")
        if not isinstance(files, dict) or TENSORS_FILE not in files:
            raise CheckpointError(f"checkpoint {path}: manifest does not list {TENSORS_FILE}")
        for name, info in files.items():
            self._verify_file(path, name, info)
        return manifest

    @staticmethod
    def _verify_file(path: Path, name: str, info: Any) -> None:
        if not isinstance(info, dict) or not isinstance(info.get("sha256"), str) \
                or not isinstance(info.get("bytes"), int):
            raise CheckpointError(f"checkpoint {path}: manifest entry for {name} lacks sha256/bytes")
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: missing {name}")
        size = file.stat().st_size
        if size != info["bytes"]:
            what = "truncated" if size < info["bytes"] else "size mismatch"
            raise CheckpointError(
                f"checkpoint {path}: {name} {what}: expected {info['bytes']} bytes, found {size}")
        actual = _sha256(file)
        if actual != info["sha256"]:
            raise CheckpointError(
                f"checkpoint {path}: {name} checksum mismatch: expected sha256 {info['sha256']}, "
                f"actual {actual}")

    def load(self, path: str | Path, map_location: str | torch.device = "cpu") -> Checkpoint:
        """Verify ``path``, then read its tensors onto ``map_location``."""
        path = Path(path)
        manifest = self.verify(path)
        self._remember_valid(path)
        try:
            tensors = load_file(str(path / TENSORS_FILE), device="cpu")
        except Exception as e:  # verified bytes that still do not parse: not ours / a bug
            raise CheckpointError(f"checkpoint {path}: {TENSORS_FILE} is unparsable ({e})") from e
        if torch.device(map_location) != torch.device("cpu"):
            tensors = {k: v.to(map_location) for k, v in tensors.items()}
        return Checkpoint(path=path, step=manifest["step"], manifest=manifest, tensors=tensors)

    def load_latest(self, map_location: str | torch.device = "cpu") -> Checkpoint | None:
        """The newest checkpoint that verifies; newer broken ones are logged and put in
        ``self.skipped``. None when there is no checkpoint at all."""
        self.skipped = []
        paths = self.list()
        for path in reversed(paths):
            try:
                return self.load(path, map_location)
            except CheckpointError as e:
                log.error("skipping checkpoint %s: %s", path, e)
                self.skipped.append((path, str(e)))
        if not paths:
            return None
        listing = "\n".join(f"  {p}: {reason}" for p, reason in self.skipped)
        raise CheckpointError(f"no valid checkpoint in {self.directory}; all {len(paths)} failed:\n{listing}")

    # -- verification cache (pruning only) ------------------------------------------------

    @staticmethod
    def _signature(path: Path) -> tuple | None:
        try:
            a, b = (path / TENSORS_FILE).stat(), (path / MANIFEST_FILE).stat()
        except OSError:
            return None
        return (a.st_ino, a.st_size, a.st_mtime_ns, b.st_ino, b.st_size, b.st_mtime_ns)

    def _remember_valid(self, path: Path) -> None:
        sig = self._signature(path)
        if sig is not None:
            self._verified[path] = sig

    def _check(self, path: Path) -> str | None:
        """None if ``path`` is valid (cached when unchanged since last verified), else why not."""
        sig = self._signature(path)
        if sig is not None and self._verified.get(path) == sig:
            return None
        try:
            self.verify(path)
        except CheckpointError as e:
            self._verified.pop(path, None)
            return str(e)
        self._remember_valid(path)
        return None


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


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
    if torch.cuda.is_available():
        states = torch.cuda.get_rng_state_all()
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
    checkpoint; CUDA states for devices this process lacks are skipped with a warning."""
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
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < saved_cuda:
            log.warning("rng state: checkpoint has %d CUDA RNG states, this process sees %d devices; "
                        "restoring %d", saved_cuda, have, have)
        for i in range(min(have, saved_cuda)):
            torch.cuda.set_rng_state(tensors[f"rng/cuda/{i}"].to("cpu", torch.uint8), device=i)
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in meta and "rng/numpy" in tensors:
        import numpy as np

        n = meta["numpy"]
        keys = tensors["rng/numpy"].numpy().astype(np.uint32)
        np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    for name, gen in (generators or {}).items():
        gen.set_state(tensors[f"rng/gen/{name}"].to("cpu", torch.uint8))


def save_weights(module: torch.nn.Module, path: str | Path, version: int, **meta: str) -> None:
    """Write a module's weights as safetensors with its version (and a policy's registry
    name) in the metadata, plus any ``meta`` strings."""
    info = {"version": str(version), **meta}
    if getattr(module, "registry_name", None):
        info["policy"] = str(module.registry_name)
    save_safetensors(module.state_dict(), path, info)


def weights_digest(module: torch.nn.Module) -> str:
    """A short hash of every parameter and buffer's bytes, in state-dict order: ranks that
    should hold identical weights (learners averaging gradients) report the same digest."""
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
