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

``dvla.state.train_state`` turns optimizer and random-number-generator state into (tensors,
json-able metadata) pairs that fit this format, so resuming is bit-identical to never
having stopped; ``dvla.state.atomic_io`` holds the file-level helpers.

One writer per checkpoint directory is assumed (e.g. rank 0): a save removes every stale
``.tmp-*`` entry it finds, including one another writer might still be filling.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from dvla.state.atomic_io import exchange_paths, fsync_dir, save_safetensors, sha256_file, write_safetensors
from dvla.distributed.sharding import full_state_dict

log = logging.getLogger("dvla.state.checkpoint")

FORMAT_VERSION = 1
TENSORS_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_RESERVED = ("format", "step", "created", "files")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, or does not fit what it is loaded into."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    manifest: dict
    tensors: dict[str, Tensor] = field(repr=False)


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
            write_safetensors(tensors, tensor_path, {"format": str(FORMAT_VERSION), "step": str(step)})
            data["files"] = {TENSORS_FILE: {"sha256": sha256_file(tensor_path),
                                            "bytes": tensor_path.stat().st_size}}
            manifest_path = tmp / MANIFEST_FILE
            with open(manifest_path, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=2, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
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
            fsync_dir(self.directory)
            return
        if exchange_paths(tmp, final):
            # ``final`` is now the new checkpoint and ``tmp`` holds the old one.
            fsync_dir(self.directory)
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
        fsync_dir(self.directory)
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
        actual = sha256_file(file)
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
        ``self.skipped``. None when there is no checkpoint at all; a CheckpointError listing
        every one when none verifies."""
        self.skipped = []
        paths = self.list()
        for path in reversed(paths):
            try:
                ck = self.load(path, map_location)
            except CheckpointError as e:
                self.skipped.append((path, str(e)))
                continue
            for skipped, why in self.skipped:  # (when none is valid, the error lists them instead)
                log.error("skipping checkpoint %s: %s", skipped, why)
            return ck
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


def section(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint holds under ``prefix`` (``"policy/"``, ``"reference/"``),
    named as the module's state dict names them."""
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def save_weights(module: torch.nn.Module, path: str | Path, version: int, state: dict | None = None,
                 **meta: str) -> None:
    """Write a module's weights (or ``state``, its whole state dict when the module is
    sharded) as safetensors with its version (and a policy's registry name) in the
    metadata, plus any ``meta`` strings."""
    info = {"version": str(version), **meta}
    if getattr(module, "registry_name", None):
        info["policy"] = str(module.registry_name)
    save_safetensors(full_state_dict(module) if state is None else state, path, info)


def all_finite(state: dict[str, Tensor]) -> bool:
    """Whether every floating-point tensor of ``state`` is finite (no NaN or inf): weights
    that are not are never written (``weights.safetensors``, checkpoints)."""
    return all(bool(torch.isfinite(t).all()) for t in state.values() if t.is_floating_point())


def weights_digest(module: torch.nn.Module, state: dict | None = None) -> str:
    """A short hash of every parameter and buffer's bytes (of ``module``, or of ``state``, its
    whole state dict), in state-dict order: ranks that should hold identical weights
    (learners averaging gradients) report the same digest. A sharded module's tensors are
    gathered (a collective: every rank of its mesh calls this)."""
    h = hashlib.sha256()
    for name, t in (full_state_dict(module) if state is None else state).items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
