"""Demonstration episodes in memory, as every reader yields them and the writer takes them.

An :class:`Episode` holds one episode in storage form (numpy, images ``(T, H, W, 3)`` uint8
as LeRobot and LIBERO keep them): frame ``t`` is the observation the action ``t`` was
chosen on. :meth:`Episode.observations` turns frames into dvla's :class:`Observation`
(``(B, 3, H, W)`` images, the main camera as ``image``, the others in ``cameras``) and
:meth:`Episode.action_chunks` the actions into the ``(T, K, D)`` chunks a policy predicts.

Conventions (the same for data recorded by ``dvla record``, LIBERO's HDF5 and openpi's
LeRobot conversion): images upright as dvla's envs render them (LIBERO: rotated by 180
degrees from robosuite's OpenGL render); LIBERO's gripper action -1 opens, +1 closes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dvla.types import MAIN_CAMERA, Observation


class DatasetError(ValueError):
    """Bad or mismatched data, said in one line (path first)."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


@dataclass
class Episode:
    images: dict[str, np.ndarray]
    """Camera name -> ``(T, H, W, 3)`` uint8; ``image`` is the main camera."""
    proprio: np.ndarray  # (T, P) float32
    actions: np.ndarray  # (T, D) float32: the action taken at each frame
    instruction: str
    success: bool | None = None  # None: not known (LIBERO's demonstrations all succeed)
    rewards: np.ndarray | None = None  # (T,) float32, the reward after each action, where known
    meta: dict = field(default_factory=dict)  # where it came from (file, demo key, episode index)

    def __len__(self) -> int:
        return int(self.actions.shape[0])

    def check(self, where: str = "episode") -> "Episode":
        """Shapes and dtypes agree (a DatasetError otherwise); returns itself."""
        t = len(self)
        if t < 1:
            raise DatasetError(f"{where}: no frames")
        if self.actions.ndim != 2 or self.proprio.ndim != 2:
            raise DatasetError(f"{where}: actions {self.actions.shape} and proprio {self.proprio.shape} must be (T, D)")
        if MAIN_CAMERA not in self.images:
            raise DatasetError(f"{where}: no main camera {MAIN_CAMERA!r} (cameras: {sorted(self.images)})")
        for name, img in self.images.items():
            if img.dtype != np.uint8 or img.ndim != 4 or img.shape[-1] != 3:
                raise DatasetError(f"{where}: camera {name!r} must be (T, H, W, 3) uint8, got {img.shape} {img.dtype}")
        lengths = {"actions": t, "proprio": len(self.proprio),
                   **{f"camera {k!r}": len(v) for k, v in self.images.items()}}
        if len(set(lengths.values())) != 1:
            raise DatasetError(f"{where}: frame counts differ: {lengths}")
        if not (np.isfinite(self.actions).all() and np.isfinite(self.proprio).all()):
            raise DatasetError(f"{where}: actions or proprio hold NaN or inf")
        return self

    def observations(self, frames: slice | np.ndarray | None = None) -> Observation:
        """Frames ``frames`` (default all) as one Observation batch (a row per frame)."""
        sel = slice(None) if frames is None else frames

        def chw(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a[sel])).permute(0, 3, 1, 2).contiguous()

        proprio = torch.from_numpy(np.ascontiguousarray(self.proprio[sel], dtype=np.float32))
        return Observation(image=chw(self.images[MAIN_CAMERA]), proprio=proprio,
                           instruction=[self.instruction] * proprio.shape[0],
                           cameras={k: chw(v) for k, v in self.images.items() if k != MAIN_CAMERA})

    def action_chunks(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(T, K, D)`` chunks (frame t: actions t .. t+K-1) and ``(T, K)`` bool, true on real
        actions: past the episode's end the last action is repeated and marked false."""
        t = len(self)
        idx = np.arange(t)[:, None] + np.arange(k)[None, :]
        valid = idx < t
        chunks = self.actions[np.minimum(idx, t - 1)].astype(np.float32)
        return torch.from_numpy(chunks), torch.from_numpy(valid)


def check_against_spec(cameras: dict[str, tuple[int, int, int]], proprio_dim: int, action_dim: int, spec,
                       where: str) -> None:
    """A DatasetError unless data with ``cameras`` (name -> (H, W, 3)), ``proprio_dim`` and
    ``action_dim`` fits the env spec ``spec`` (:class:`dvla.envs.EnvSpec`): every camera the
    env has, at its size, and the env's proprio and action dimensions."""
    if action_dim != spec.action_dim:
        raise DatasetError(f"{where}: actions have {action_dim} dimensions, the env's have {spec.action_dim}")
    if proprio_dim != spec.proprio_dim:
        raise DatasetError(f"{where}: proprio (observation.state) has {proprio_dim} dimensions, the env's has "
                           f"{spec.proprio_dim}")
    for name, (c, h, w) in ((MAIN_CAMERA, spec.image_shape), *spec.cameras):
        if name not in cameras:
            raise DatasetError(f"{where}: no camera {name!r}, which the env has (the data has {sorted(cameras)})")
        if tuple(cameras[name]) != (h, w, c):
            raise DatasetError(f"{where}: camera {name!r} is {cameras[name][0]}x{cameras[name][1]}, the env's "
                               f"{h}x{w} (set env.image_size / the camera's size to the data's)")
