"""LIBERO's own demonstrations (``<task>_demo.hdf5``, robomimic's layout) as :class:`Episode`\\ s,
with dvla's conventions applied so that they agree with what ``env.name=libero`` gives a
policy and with openpi's LeRobot conversion of the same demonstrations::

    data/demo_N/actions              (T, 7)  OSC_POSE deltas in [-1, 1], gripper -1 open / +1 close
    data/demo_N/obs/agentview_rgb    (T, H, W, 3) uint8   -> camera "image"
    data/demo_N/obs/eye_in_hand_rgb  (T, H, W, 3) uint8   -> camera "wrist"
    data/demo_N/obs/ee_states        (T, 6)  effector position and axis-angle
    data/demo_N/obs/gripper_states   (T, 2)  finger positions
    data/demo_N/dones, rewards       (T,)    (the last step 1)

* Images: robosuite renders them upside down (OpenGL's convention, the file's
  ``data.attrs["macros_image_convention"]``, ``opengl`` where absent); dvla's LiberoEnv and
  openpi turn them upright by rotating 180 degrees (``[::-1, ::-1]``), and so does this reader.
  A file written under robosuite's ``opencv`` convention is already flipped vertically: it
  gets the horizontal flip only, which lands on the same upright image.
* Proprio: ``ee_states`` then ``gripper_states`` (8 values: position, axis-angle, fingers),
  which is dvla's LiberoEnv proprio and openpi's ``state``.
* Actions pass through: LIBERO's gripper sign is dvla's (``flip_gripper=True`` negates it for
  files stored the other way round).
* The instruction is the task's as LIBERO's benchmark (and so dvla's env) words it: the
  file's name in words (``LIVING_ROOM_SCENE2_put_the_x_in_the_y_demo.hdf5`` -> "put the x in
  the y"), not ``problem_info``'s language, which words some tasks differently.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dvla.datasets.core import DatasetError, Episode, check_against_spec
from dvla.datasets.stats import dvla_stats
from dvla.types import MAIN_CAMERA

CAMERAS = {"agentview_rgb": MAIN_CAMERA, "eye_in_hand_rgb": "wrist"}


def libero_instruction(name: str) -> str:
    """The task's instruction from a BDDL or demo file name, as LIBERO's benchmark makes it."""
    base = Path(name).name
    for suffix in (".hdf5", ".bddl"):
        base = base[: -len(suffix)] if base.endswith(suffix) else base
    base = base[: -len("_demo")] if base.endswith("_demo") else base
    if base[:1].isupper() and "SCENE" in base:  # LIBERO-90 / LIBERO-10: KITCHEN_SCENE3_turn_on ...
        rest = base[base.find("SCENE") + len("SCENE"):]
        base = rest[rest.find("_") + 1:]
    return " ".join(base.split("_"))


def _upright(images: np.ndarray, convention: str) -> np.ndarray:
    return images[:, :, ::-1] if convention == "opencv" else images[:, ::-1, ::-1]


class LiberoHDF5Reader:
    """The demonstrations of one LIBERO HDF5 file, or of every ``*.hdf5`` under a directory.
    Opening validates every demo's layout and shapes (a one-line :class:`DatasetError` for a
    truncated or corrupt file, a missing camera or key, frame counts that differ, dimensions
    other than the env ``spec``'s); frames are read per episode."""

    def __init__(self, path: str | Path, spec=None, cameras: dict[str, str] | None = None,
                 instruction: str | None = None, flip_gripper: bool = False):
        import h5py

        self._h5py = h5py
        path = Path(path)
        files = sorted(path.glob("*.hdf5")) if path.is_dir() else [path]
        if not files or not files[0].exists():
            raise DatasetError(f"{path}: no LIBERO HDF5 file there")
        self.cameras_map = dict(cameras or CAMERAS)
        self.flip_gripper, self.instruction = flip_gripper, instruction
        self.demos: list[tuple[Path, str]] = []
        self.conventions: dict[Path, str] = {}
        shapes: dict[str, tuple] | None = None
        for f in files:
            with self._open(f) as h:
                data = h.get("data")
                if data is None:
                    raise DatasetError(f"{f}: no 'data' group (not a LIBERO/robomimic demonstration file)")
                conv = data.attrs.get("macros_image_convention", "opengl")
                self.conventions[f] = conv.decode() if isinstance(conv, bytes) else str(conv)
                keys = sorted(data.keys(), key=lambda k: (len(k), k))
                if not keys:
                    raise DatasetError(f"{f}: no demonstrations under data/")
                for k in keys:
                    s = self._check_demo(f, k, data[k])
                    if shapes is None:
                        shapes = s
                    elif s != shapes:
                        raise DatasetError(f"{f}: data/{k}: shapes {s} differ from the first demo's {shapes}")
                    self.demos.append((f, k))
        self.image_shapes, self.proprio_dim, self.action_dim = shapes["cameras"], shapes["proprio"], shapes["action"]
        if spec is not None:
            check_against_spec(self.image_shapes, self.proprio_dim, self.action_dim, spec, str(path))

    def _open(self, f: Path):
        try:
            return self._h5py.File(f, "r")
        except OSError as exc:
            raise DatasetError(f"{f}: truncated or corrupt HDF5 file ({' '.join(str(exc).split())})") from None

    def _check_demo(self, f: Path, k: str, g) -> dict:
        where = f"{f}: data/{k}"
        need = ["actions", "obs/ee_states", "obs/gripper_states", *(f"obs/{c}" for c in self.cameras_map)]
        missing = [n for n in need if n not in g]
        if missing:
            have = sorted(g["obs"]) if "obs" in g else []
            raise DatasetError(f"{where}: missing {', '.join(missing)} (its obs/ has {have})")
        try:
            a, ee, gr = g["actions"], g["obs/ee_states"], g["obs/gripper_states"]
            cams = {self.cameras_map[c]: g[f"obs/{c}"] for c in self.cameras_map}
            lengths = {"actions": a.shape[0], "ee_states": ee.shape[0], "gripper_states": gr.shape[0],
                       **{c: v.shape[0] for c, v in cams.items()}}
        except (OSError, KeyError, RuntimeError) as exc:
            raise DatasetError(f"{where}: unreadable ({' '.join(str(exc).split())})") from None
        if len(set(lengths.values())) != 1:
            raise DatasetError(f"{where}: frame counts differ: {lengths}")
        for c, v in cams.items():
            if v.ndim != 4 or v.shape[-1] != 3 or v.dtype != np.uint8:
                raise DatasetError(f"{where}: camera {c!r} is {v.shape} {v.dtype}, not (T, H, W, 3) uint8")
        if a.ndim != 2 or ee.ndim != 2 or gr.ndim != 2 or ee.shape[1] < 6:
            raise DatasetError(f"{where}: actions {a.shape}, ee_states {ee.shape}, gripper_states {gr.shape}: "
                               f"expected (T, 7), (T, 6), (T, 2)")
        return {"cameras": {c: tuple(v.shape[1:]) for c, v in cams.items()}, "proprio": 6 + gr.shape[1],
                "action": a.shape[1]}

    def __len__(self) -> int:
        return len(self.demos)

    def __iter__(self):
        return (self.episode(i) for i in range(len(self)))

    def episode(self, i: int) -> Episode:
        f, k = self.demos[i]
        with self._open(f) as h:
            g = h["data"][k]
            try:
                images = {self.cameras_map[c]: _upright(g[f"obs/{c}"][()], self.conventions[f])
                          for c in self.cameras_map}
                proprio = np.concatenate([g["obs/ee_states"][()][:, :6], g["obs/gripper_states"][()]], 1)
                actions = g["actions"][()].astype(np.float32)
                dones = g["dones"][()] if "dones" in g else None
                rewards = g["rewards"][()].astype(np.float32) if "rewards" in g else None
            except (OSError, RuntimeError) as exc:  # a chunk cut off by truncation reads as an error here
                raise DatasetError(f"{f}: data/{k}: unreadable ({' '.join(str(exc).split())})") from None
        if self.flip_gripper:
            actions[:, -1] = -actions[:, -1]
        ep = Episode(images={c: np.ascontiguousarray(v) for c, v in images.items()},
                     proprio=proprio.astype(np.float32), actions=actions,
                     instruction=self.instruction or libero_instruction(f.name),
                     success=None if dones is None else bool(dones[-1]), rewards=rewards,
                     meta={"file": str(f), "demo": k})
        return ep.check(f"{f}: data/{k}")

    def problem_info(self, i: int = 0) -> dict:
        """The file's ``problem_info`` attribute (LIBERO's own language, problem name)."""
        with self._open(self.demos[i][0]) as h:
            return json.loads(h["data"].attrs.get("problem_info", "{}"))

    def stats(self) -> dict:
        """``{"action": ..., "proprio": ...}`` over every frame (no image read)."""
        acts, props = [], []
        for f, k in self.demos:
            with self._open(f) as h:
                g = h["data"][k]
                acts.append(g["actions"][()].astype(np.float32))
                props.append(np.concatenate([g["obs/ee_states"][()][:, :6], g["obs/gripper_states"][()]], 1))
        a = np.concatenate(acts)
        if self.flip_gripper:
            a[:, -1] = -a[:, -1]
        return dvla_stats(a, np.concatenate(props))
