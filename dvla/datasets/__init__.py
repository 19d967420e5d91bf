"""Demonstration datasets: LeRobot's format (written by ``dvla record``, read in v2.0 to
v3.0) and LIBERO's HDF5 demonstrations, read into one in-memory form (:class:`Episode`)
with one set of conventions (upright images, LIBERO's gripper sign), plus the statistics
``dvla sft`` normalises with.

    from dvla.datasets import open_dataset
    data = open_dataset("path/to/dataset", spec=env_spec(cfg.env))   # checks it fits the env
    stats = data.stats()                                             # {"action": {...}, "proprio": {...}}
    for ep in data:
        obs = ep.observations()                   # Observation, one row per frame
        chunks, valid = ep.action_chunks(k)       # (T, K, D) and (T, K)
"""

from __future__ import annotations

from pathlib import Path

from dvla.datasets.core import DatasetError, Episode, check_against_spec


def open_dataset(path: str | Path, spec=None, **kwargs):
    """A reader for the dataset at ``path``: a LeRobot dataset (a directory with
    meta/info.json) or LIBERO HDF5 demonstrations (a ``.hdf5`` file, or a directory of them).
    ``spec`` (an :class:`~dvla.envs.EnvSpec`): check the data fits that env (DatasetError)."""
    path = Path(path)
    if (path / "meta/info.json").is_file():
        from dvla.datasets.lerobot_reader import LeRobotReader

        return LeRobotReader(path, spec=spec, **kwargs)
    if path.suffix in (".hdf5", ".h5") or (path.is_dir() and any(path.glob("*.hdf5"))):
        from dvla.datasets.libero_hdf5 import LiberoHDF5Reader

        return LiberoHDF5Reader(path, spec=spec, **kwargs)
    raise DatasetError(f"{path}: neither a LeRobot dataset (meta/info.json) nor LIBERO HDF5 demonstrations (*.hdf5)")


__all__ = ["DatasetError", "Episode", "check_against_spec", "open_dataset"]
