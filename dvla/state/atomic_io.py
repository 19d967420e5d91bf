"""Files written so that a crash leaves the old file or the complete new one: safetensors
written through a temporary file, fsynced and renamed; hashing; an atomic exchange of two
paths (Linux)."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import secrets
import sys
from pathlib import Path

from safetensors.torch import save_file
from torch import Tensor


_HASH_CHUNK = 8 << 20


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (creations, renames) durable. No-op where unsupported."""
    if os.name == "posix":  # directories cannot be opened on Windows
        fsync_file(path)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def cpu_tensors(state: dict[str, Tensor]) -> dict[str, Tensor]:
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


def write_safetensors(state: dict[str, Tensor], path: Path, metadata: dict[str, str] | None) -> None:
    save_file(cpu_tensors(state), str(path), metadata=metadata)
    fsync_file(path)


def _replace(path: str | Path, write) -> None:
    """``write(tmp)`` (which writes and fsyncs) into a uniquely named temp file next to
    ``path``, then renamed over ``path``; the directory is fsynced so the rename survives a
    power cut. A crash mid-write leaves the old file."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def save_safetensors(state: dict[str, Tensor], path: str | Path, metadata: dict[str, str]) -> None:
    """Write ``state`` (moved to the CPU) to ``path`` atomically (:func:`_replace`)."""
    _replace(path, lambda tmp: write_safetensors(state, tmp, metadata))


def save_text(text: str, path: str | Path) -> None:
    """Write ``text`` to ``path`` atomically (:func:`_replace`)."""
    def write(tmp: Path) -> None:
        tmp.write_text(text)
        fsync_file(tmp)

    _replace(path, write)


def exchange_paths(a: Path, b: Path) -> bool:
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
