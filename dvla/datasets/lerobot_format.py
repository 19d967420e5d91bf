"""Writing episodes as a LeRobot dataset, format v3.0 (what lerobot 0.4's ``LeRobotDataset``
reads; :mod:`dvla.datasets.lerobot_reader` reads it back, and v2.0/v2.1 too)::

    meta/info.json                          codebase_version, fps, features, path templates, totals
    meta/stats.json                         per feature mean/std/min/max/count/q01..q99
    meta/tasks.parquet                      task (the instruction, the pandas index) -> task_index
    meta/episodes/chunk-000/file-000.parquet  per episode: tasks, length, its rows in the data
                                            files, success, stats/<feature>/<stat>
    data/chunk-000/file-000.parquet         one row per frame

Features: ``observation.images.<camera>`` (dtype ``image``: PNG bytes in the parquet file,
as ``datasets.Image`` stores them: lossless, so frames read back bit for bit, and no video
decoder needed; openpi's LIBERO data stores its images the same way), ``observation.state``
(proprio), ``action``, ``next.reward``, ``next.done`` (the episode's last frame),
``next.success``, and LeRobot's ``timestamp``, ``frame_index``, ``episode_index``, ``index``,
``task_index``. Written with pyarrow alone (lerobot itself pins torch < 2.11).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from dvla.datasets.core import DatasetError, Episode
from dvla.datasets.stats import ImageStats, to_json, vector_stats

CODEBASE_VERSION = "v3.0"
CHUNK_FILE = "chunk-{chunk_index:03d}/file-{file_index:03d}"
DATA_PATH = "data/" + CHUNK_FILE + ".parquet"
EPISODES_PATH = "meta/episodes/" + CHUNK_FILE + ".parquet"
VIDEO_PATH = "videos/{video_key}/" + CHUNK_FILE + ".mp4"
CHUNKS_SIZE, DATA_FILE_MB, VIDEO_FILE_MB = 1000, 100, 200
IMAGE_PREFIX, STATE, ACTION = "observation.images.", "observation.state", "action"
IMAGE_TYPE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # datasets.Image's storage


def _scalar(dtype: str) -> dict:
    return {"dtype": dtype, "shape": [1], "names": None}


def features_for(cameras: dict[str, tuple[int, int, int]], proprio_dim: int, action_dim: int,
                 state_names: list[str] | None = None, action_names: list[str] | None = None) -> dict:
    """info.json's ``features``: cameras (name -> (H, W, 3)), state, action, LeRobot's columns."""
    feats = {IMAGE_PREFIX + c: {"dtype": "image", "shape": list(s), "names": ["height", "width", "channel"]}
             for c, s in cameras.items()}
    feats[STATE] = {"dtype": "float32", "shape": [proprio_dim],
                    "names": state_names or [f"state_{i}" for i in range(proprio_dim)]}
    feats[ACTION] = {"dtype": "float32", "shape": [action_dim],
                     "names": action_names or [f"action_{i}" for i in range(action_dim)]}
    feats.update({"next.reward": _scalar("float32"), "next.done": _scalar("bool"), "next.success": _scalar("bool"),
                  "timestamp": _scalar("float32"), "frame_index": _scalar("int64"),
                  "episode_index": _scalar("int64"), "index": _scalar("int64"), "task_index": _scalar("int64")})
    return feats


def png(frame: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def tasks_table(tasks: list[str]) -> pa.Table:
    """meta/tasks.parquet as pandas writes ``DataFrame({"task_index": ...}, index=tasks)``
    (LeRobot reads it with ``pd.read_parquet``: the task strings are the index)."""
    meta = {"index_columns": ["__index_level_0__"],
            "column_indexes": [{"name": None, "field_name": None, "pandas_type": "unicode", "numpy_type": "object",
                                "metadata": {"encoding": "UTF-8"}}],
            "columns": [{"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
                         "numpy_type": "int64", "metadata": None},
                        {"name": None, "field_name": "__index_level_0__", "pandas_type": "unicode",
                         "numpy_type": "object", "metadata": None}],
            "creator": {"library": "pyarrow", "version": pa.__version__}, "pandas_version": "2.2.3"}
    table = pa.table({"task_index": pa.array(range(len(tasks)), pa.int64()), "__index_level_0__": pa.array(tasks)})
    return table.replace_schema_metadata({b"pandas": json.dumps(meta).encode()})


class LeRobotWriter:
    """Episodes, one :meth:`add` at a time, into a new LeRobot v3.0 dataset at ``root``;
    :meth:`close` writes the metadata (a dataset without it is incomplete)."""

    def __init__(self, root: str | Path, fps: float, cameras: dict[str, tuple[int, int, int]], proprio_dim: int,
                 action_dim: int, robot_type: str | None = None, state_names: list[str] | None = None,
                 action_names: list[str] | None = None, extra_info: dict | None = None):
        self.root = Path(root)
        if self.root.exists() and any(self.root.iterdir()):
            raise DatasetError(f"{self.root}: exists and is not empty (a new dataset goes into a new directory)")
        self.fps, self.cameras = fps, dict(cameras)
        self.features = features_for(self.cameras, proprio_dim, action_dim, state_names, action_names)
        self.info = {"codebase_version": CODEBASE_VERSION, "robot_type": robot_type, "total_episodes": 0,
                     "total_frames": 0, "total_tasks": 0, "chunks_size": CHUNKS_SIZE,
                     "data_files_size_in_mb": DATA_FILE_MB, "video_files_size_in_mb": VIDEO_FILE_MB, "fps": fps,
                     "splits": {}, "data_path": DATA_PATH, "video_path": None, "features": self.features,
                     **({"dvla": extra_info} if extra_info else {})}
        cols = [(IMAGE_PREFIX + c, IMAGE_TYPE) for c in self.cameras]
        cols += [(STATE, pa.list_(pa.float32(), proprio_dim)), (ACTION, pa.list_(pa.float32(), action_dim)),
                 ("next.reward", pa.float32()), ("next.done", pa.bool_()), ("next.success", pa.bool_()),
                 ("timestamp", pa.float32()), ("frame_index", pa.int64()), ("episode_index", pa.int64()),
                 ("index", pa.int64()), ("task_index", pa.int64())]
        self.schema = pa.schema(cols)
        self.tasks: dict[str, int] = {}
        self.episodes: list[dict] = []
        self.file, self.writer, self.file_bytes = (0, 0), None, 0
        self.actions: list[np.ndarray] = []
        self.proprio: list[np.ndarray] = []
        self.image_stats = {c: ImageStats() for c in self.cameras}

    def _data_writer(self, nbytes: int) -> pq.ParquetWriter:
        if self.writer is not None and self.file_bytes + nbytes > DATA_FILE_MB << 20:
            self.writer.close()
            chunk, file = self.file
            self.file = (chunk + 1, 0) if file == CHUNKS_SIZE - 1 else (chunk, file + 1)
            self.writer, self.file_bytes = None, 0
        if self.writer is None:
            path = self.root / DATA_PATH.format(chunk_index=self.file[0], file_index=self.file[1])
            path.parent.mkdir(parents=True, exist_ok=True)
            self.writer = pq.ParquetWriter(path, self.schema, compression="snappy")
        self.file_bytes += nbytes
        return self.writer

    def add(self, ep: Episode) -> None:
        ep.check(f"episode {len(self.episodes)}")
        shapes = {c: tuple(v.shape[1:]) for c, v in ep.images.items()}
        if shapes != self.cameras:
            raise DatasetError(f"episode {len(self.episodes)}: cameras {shapes}, the dataset's {self.cameras}")
        t, start = len(ep), self.info["total_frames"]
        task = self.tasks.setdefault(ep.instruction, len(self.tasks))
        done = np.zeros(t, bool)
        done[-1] = True
        cols = {IMAGE_PREFIX + c: pa.array([{"bytes": png(f), "path": None} for f in ep.images[c]], IMAGE_TYPE)
                for c in self.cameras}
        nbytes = sum(c.nbytes for c in cols.values())
        rewards = np.zeros(t, np.float32) if ep.rewards is None else np.asarray(ep.rewards, np.float32)
        cols.update({STATE: pa.FixedSizeListArray.from_arrays(pa.array(ep.proprio.astype(np.float32).ravel()),
                                                              ep.proprio.shape[1]),
                     ACTION: pa.FixedSizeListArray.from_arrays(pa.array(ep.actions.astype(np.float32).ravel()),
                                                               ep.actions.shape[1]),
                     "next.reward": rewards, "next.done": done, "next.success": done & bool(ep.success),
                     "timestamp": (np.arange(t) / self.fps).astype(np.float32), "frame_index": np.arange(t),
                     "episode_index": np.full(t, len(self.episodes)), "index": np.arange(start, start + t),
                     "task_index": np.full(t, task)})
        table = pa.table({name: cols[name] for name in self.schema.names}, schema=self.schema)
        self._data_writer(nbytes).write_table(table)
        ep_stats = {ACTION: vector_stats(ep.actions), STATE: vector_stats(ep.proprio)}
        self.episodes.append({
            "episode_index": len(self.episodes), "tasks": [ep.instruction], "length": t,
            "data/chunk_index": self.file[0], "data/file_index": self.file[1], "dataset_from_index": start,
            "dataset_to_index": start + t, "meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0,
            "success": ep.success,
            **{f"stats/{f}/{k}": np.asarray(v, np.float64).ravel().tolist() for f, s in ep_stats.items()
               for k, v in s.items()}})
        self.info["total_frames"] += t
        self.actions.append(ep.actions)
        self.proprio.append(ep.proprio)
        for c, s in self.image_stats.items():
            s.update(ep.images[c])

    def close(self) -> dict:
        """Write the metadata; returns info.json's content."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if not self.episodes:
            raise DatasetError(f"{self.root}: no episodes to write")
        meta = self.root / "meta"
        (meta / "episodes/chunk-000").mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(self.episodes), self.root / EPISODES_PATH.format(chunk_index=0,
                                                                                             file_index=0))
        pq.write_table(tasks_table(list(self.tasks)), meta / "tasks.parquet")
        stats = {ACTION: vector_stats(np.concatenate(self.actions)), STATE: vector_stats(np.concatenate(self.proprio)),
                 **{IMAGE_PREFIX + c: s.result() for c, s in self.image_stats.items()}}
        (meta / "stats.json").write_text(json.dumps(to_json(stats), indent=2))
        n = len(self.episodes)
        self.info.update(total_episodes=n, total_tasks=len(self.tasks), splits={"train": f"0:{n}"})
        (meta / "info.json").write_text(json.dumps(self.info, indent=4))
        return self.info


def write_lerobot(root: str | Path, episodes, fps: float, **kwargs) -> dict:
    """Every episode of ``episodes`` (an iterable; the first fixes the cameras and dimensions)
    into a new LeRobot v3.0 dataset at ``root``; returns info.json's content."""
    writer = None
    for ep in episodes:
        if writer is None:
            writer = LeRobotWriter(root, fps, {c: tuple(v.shape[1:]) for c, v in ep.images.items()},
                                   ep.proprio.shape[1], ep.actions.shape[1], **kwargs)
        writer.add(ep)
    if writer is None:
        raise DatasetError(f"{root}: no episodes to write")
    return writer.close()
