"""Reading LeRobot datasets (v3.0, as ``dvla record`` and lerobot 0.4 write them; v2.0 and
v2.1, as openpi's ``physical-intelligence/libero`` is) into :class:`Episode`\\ s.

Keys: cameras are the ``image``/``video`` features, named without ``observation.images.``
(openpi's ``wrist_image`` is dvla's ``wrist``); proprio is ``observation.state`` (or
``state``), actions ``action`` (or ``actions``); ``keys`` maps others. Nothing is flipped:
LeRobot data of LIBERO (openpi's conversion of OpenVLA's regenerated demonstrations, and
``dvla record``) already has upright images and LIBERO's gripper sign (-1 open, +1 close);
``flip_gripper=True`` negates the last action dimension of data stored the other way round.

Opening checks what can be checked without decoding a frame, each failure a one-line
:class:`DatasetError`: meta/info.json readable, a known ``codebase_version``, the features
present, the episodes' data files there with intact parquet footers and as many rows as the
metadata says (a truncated file), and, given an env ``spec``, its cameras, proprio and
action dimensions.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from PIL import Image

from dvla.datasets.core import DatasetError, Episode, check_against_spec
from dvla.datasets.stats import dvla_stats
from dvla.types import MAIN_CAMERA

VERSIONS = ("v2.0", "v2.1", "v3.0")
CAMERA_ALIASES = {"wrist_image": "wrist", "observation.image": MAIN_CAMERA, "top": MAIN_CAMERA}


def _camera_name(key: str) -> str:
    name = key[len("observation.images."):] if key.startswith("observation.images.") else key
    return CAMERA_ALIASES.get(name, name)


def _hwc(ft: dict) -> tuple[int, int, int]:
    shape, names = list(ft["shape"]), ft.get("names") or []
    if len(shape) == 3 and names and str(names[0]).startswith("channel"):
        return shape[1], shape[2], shape[0]
    return tuple(shape)


class LeRobotReader:
    """A LeRobot dataset at ``root``: ``len()`` episodes, :meth:`episode`, iteration, and
    :meth:`stats`. ``keys`` maps dvla names (``image``, ``wrist``, ``proprio``, ``action``) to
    the dataset's feature keys where the defaults do not find them."""

    def __init__(self, root: str | Path, spec=None, keys: dict[str, str] | None = None, flip_gripper: bool = False):
        self.root, self.flip_gripper = Path(root), flip_gripper
        info_path = self.root / "meta/info.json"
        if not info_path.is_file():
            raise DatasetError(f"{self.root}: not a LeRobot dataset (no meta/info.json)")
        try:
            self.info = json.loads(info_path.read_text())
            self.version, self.fps, feats = self.info["codebase_version"], self.info["fps"], self.info["features"]
        except (ValueError, KeyError, TypeError) as exc:
            raise DatasetError(f"{info_path}: unreadable ({type(exc).__name__}: {exc})") from None
        if self.version not in VERSIONS:
            raise DatasetError(f"{info_path}: codebase_version {self.version!r} is not one dvla reads "
                               f"({', '.join(VERSIONS)})")
        keys = dict(keys or {})
        visual = [k for k, f in feats.items() if f.get("dtype") in ("image", "video")]
        self.camera_keys = {_camera_name(k): k for k in visual}
        self.camera_keys.update({n: k for n, k in keys.items() if n not in ("proprio", "action")})

        def pick(name: str, options: tuple[str, ...]) -> str:
            found = [keys[name]] if name in keys else [k for k in options if k in feats]
            if not found or found[0] not in feats:
                raise DatasetError(f"{info_path}: no {name} feature ({' or '.join(options)}; it has {sorted(feats)})")
            return found[0]

        self.state_key, self.action_key = pick("proprio", ("observation.state", "state")), pick("action", ("action",
                                                                                                           "actions"))
        for name, k in self.camera_keys.items():
            if k not in feats:
                raise DatasetError(f"{info_path}: camera {name!r}: no feature {k!r}")
        if MAIN_CAMERA not in self.camera_keys:
            raise DatasetError(f"{info_path}: no main camera {MAIN_CAMERA!r} among {sorted(self.camera_keys)}; "
                               f"name it with keys={{'image': KEY}}")
        self.features = feats
        self.cameras = {n: _hwc(feats[k]) for n, k in self.camera_keys.items()}
        self.proprio_dim = int(feats[self.state_key]["shape"][0])
        self.action_dim = int(feats[self.action_key]["shape"][0])
        self.tasks = self._tasks()
        self.episodes = self._episodes()
        self._check_files()
        if spec is not None:
            check_against_spec(self.cameras, self.proprio_dim, self.action_dim, spec, str(self.root))
        self._cache: tuple[Path, pa.Table] | None = None

    # -- metadata ------------------------------------------------------------------------------
    def _read_parquet(self, path: Path, columns=None) -> pa.Table:
        try:
            return pq.read_table(path, columns=columns)
        except (pa.ArrowException, OSError) as exc:
            raise DatasetError(f"{path}: truncated or corrupt parquet file ({exc})") from None

    def _jsonl(self, rel: str) -> list[dict]:
        path = self.root / rel
        try:
            return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except (OSError, ValueError) as exc:
            raise DatasetError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None

    def _tasks(self) -> dict[int, str]:
        if self.version != "v3.0":
            return {int(t["task_index"]): t["task"] for t in self._jsonl("meta/tasks.jsonl")}
        t = self._read_parquet(self.root / "meta/tasks.parquet").to_pydict()
        text = t.get("task") or t.get("__index_level_0__")
        if text is None or "task_index" not in t:
            raise DatasetError(f"{self.root / 'meta/tasks.parquet'}: no task and task_index columns")
        return dict(zip(map(int, t["task_index"]), text))

    def _episodes(self) -> list[dict]:
        if self.version != "v3.0":
            eps, size = self._jsonl("meta/episodes.jsonl"), int(self.info.get("chunks_size", 1000))
            start = 0
            for e in sorted(eps, key=lambda e: e["episode_index"]):
                i = int(e["episode_index"])
                e["file"] = self.root / self.info["data_path"].format(episode_chunk=i // size, episode_index=i)
                e["dataset_from_index"], start = start, start + int(e["length"])
            return sorted(eps, key=lambda e: e["episode_index"])
        files = sorted((self.root / "meta/episodes").glob("*/*.parquet"))
        if not files:
            raise DatasetError(f"{self.root}: no meta/episodes/*/*.parquet")
        rows = [r for f in files for r in self._read_parquet(f).to_pylist()]
        for r in rows:
            r["file"] = self.root / self.info["data_path"].format(chunk_index=r["data/chunk_index"],
                                                                  file_index=r["data/file_index"])
        return sorted(rows, key=lambda r: r["episode_index"])

    def _check_files(self) -> None:
        expected: dict[Path, int] = {}
        for e in self.episodes:
            expected[e["file"]] = expected.get(e["file"], 0) + int(e["length"])
        for path, rows in expected.items():
            if not path.is_file():
                raise DatasetError(f"{path}: missing (meta/episodes names it)")
            try:
                have = pq.read_metadata(path).num_rows
            except (pa.ArrowException, OSError) as exc:
                raise DatasetError(f"{path}: truncated or corrupt parquet file ({exc})") from None
            if have != rows:
                raise DatasetError(f"{path}: {have} frames, the episodes' metadata says {rows} (truncated?)")

    # -- episodes ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.episodes)

    def __iter__(self):
        return (self.episode(i) for i in range(len(self)))

    def _rows(self, e: dict, columns: list[str]) -> pa.Table:
        if self._cache is None or self._cache[0] != e["file"]:
            self._cache = (e["file"], self._read_parquet(e["file"]))
        table = self._cache[1]
        missing = [c for c in columns + ["episode_index"] if c not in table.column_names]
        if missing:
            raise DatasetError(f"{e['file']}: no column(s) {missing}, which meta/info.json declares")
        rows = table.filter(pc.equal(table["episode_index"], e["episode_index"]))
        if "frame_index" in rows.column_names:
            rows = rows.take(pc.sort_indices(rows["frame_index"]))
        if rows.num_rows != int(e["length"]):
            raise DatasetError(f"{e['file']}: episode {e['episode_index']} has {rows.num_rows} frames, the "
                               f"metadata says {e['length']}")
        return rows.select(columns)

    def _decode(self, e: dict, name: str, key: str, column) -> np.ndarray:
        if self.features[key]["dtype"] == "video":
            return self._video(e, key)
        frames = []
        for cell in column.to_pylist():
            data = cell.get("bytes") if isinstance(cell, dict) else cell
            if data is None and isinstance(cell, dict) and cell.get("path"):
                data = (self.root / cell["path"]).read_bytes()
            try:
                frames.append(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
            except Exception as exc:  # noqa: BLE001 - PIL raises many kinds
                raise DatasetError(f"{e['file']}: episode {e['episode_index']}, camera {name!r}: undecodable image "
                                   f"({type(exc).__name__})") from None
        return np.stack(frames)

    def _video(self, e: dict, key: str) -> np.ndarray:
        import av

        i = int(e["episode_index"])
        if self.version == "v3.0":
            path = self.root / self.info["video_path"].format(video_key=key, chunk_index=e[f"videos/{key}/chunk_index"],
                                                              file_index=e[f"videos/{key}/file_index"])
            lo = float(e.get(f"videos/{key}/from_timestamp", 0.0))
        else:
            size = int(self.info.get("chunks_size", 1000))
            path = self.root / self.info["video_path"].format(episode_chunk=i // size, video_key=key, episode_index=i)
            lo = 0.0
        n, frames = int(e["length"]), []
        try:
            with av.open(str(path)) as f:
                for fr in f.decode(video=0):
                    if fr.time is not None and fr.time < lo - 0.5 / self.fps:
                        continue
                    frames.append(fr.to_ndarray(format="rgb24"))
                    if len(frames) == n:
                        break
        except (OSError, av.FFmpegError) as exc:
            raise DatasetError(f"{path}: unreadable video ({exc})") from None
        if len(frames) != n:
            raise DatasetError(f"{path}: {len(frames)} frames for episode {i}, the metadata says {n} (truncated?)")
        return np.stack(frames)

    def episode(self, i: int) -> Episode:
        e = self.episodes[i]
        cols = [k for k in self.camera_keys.values() if self.features[k]["dtype"] == "image"]
        cols += [self.state_key, self.action_key, "task_index"]
        extra = [c for c in ("next.reward", "next.success") if c in self.features]
        rows = self._rows(e, cols + extra)
        actions = np.asarray(rows[self.action_key].to_pylist(), np.float32).reshape(len(rows), -1)
        if self.flip_gripper:
            actions[:, -1] = -actions[:, -1]
        images = {n: self._decode(e, n, k, rows[k] if k in cols else None) for n, k in self.camera_keys.items()}
        success = e.get("success")
        if success is None and "next.success" in extra:
            success = bool(pc.any(rows["next.success"]).as_py())
        task = int(rows["task_index"][0].as_py())
        ep = Episode(images=images, proprio=np.asarray(rows[self.state_key].to_pylist(), np.float32),
                     actions=actions, instruction=self.tasks.get(task, e.get("tasks", [""])[0]), success=success,
                     rewards=(np.asarray(rows["next.reward"].to_pylist(), np.float32) if "next.reward" in extra
                              else None),
                     meta={"dataset": str(self.root), "episode_index": int(e["episode_index"])})
        return ep.check(f"{e['file']}: episode {e['episode_index']}")

    def stats(self) -> dict:
        """``{"action": ..., "proprio": ...}`` over every frame (:func:`dvla.datasets.stats.dvla_stats`),
        computed from the data (columns only, no image decoded)."""
        acts, props = [], []
        for path in dict.fromkeys(e["file"] for e in self.episodes):
            t = self._read_parquet(path, [self.action_key, self.state_key])
            acts.append(np.asarray(t[self.action_key].to_pylist(), np.float32).reshape(len(t), -1))
            props.append(np.asarray(t[self.state_key].to_pylist(), np.float32).reshape(len(t), -1))
        a = np.concatenate(acts)
        if self.flip_gripper:
            a[:, -1] = -a[:, -1]
        return dvla_stats(a, np.concatenate(props))
