"""Writing tensors to disk safely: safetensors, atomically (temp file + rename)."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file
from torch import Tensor


def save_safetensors(state: dict[str, Tensor], path: str | Path, metadata: dict[str, str]) -> None:
    """Write ``state`` (moved to the CPU) to ``path``; a crash mid-write leaves the old file."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(tmp), metadata=metadata)
    tmp.replace(path)
