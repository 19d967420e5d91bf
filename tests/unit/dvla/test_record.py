"""``dvla record`` and the demonstration readers (:mod:`dvla.datasets`): fast_reach episodes of
the scripted expert (and of a policy) written as a LeRobot v3.0 dataset read back identical;
the files are what LeRobot's v3.0 format says; LIBERO's HDF5 demonstrations and an
openpi-style LeRobot v2.0 dataset read with LIBERO's conventions applied agree with each
other; every kind of bad data is a one-line error."""

import json

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dvla.app.cli import main as cli
from dvla.config import EnvConfig, apply_overrides
from dvla.datasets import DatasetError, Episode, open_dataset
from dvla.datasets.lerobot_format import write_lerobot
from dvla.datasets.libero_hdf5 import libero_instruction
from dvla.datasets.record import FastReachExpert, record_batch
from dvla.envs import env_spec, make_env
from dvla.envs.libero_env import LiberoEnv

REACH = EnvConfig(name="fast_reach", n_envs=3, image_size=16, options={"wrist_camera": 8, "max_delta": 0.08})


def one_line(exc) -> str:
    text = str(exc.value if hasattr(exc, "value") else exc)
    assert "\n" not in text.strip(), text
    return text


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Two batches of three expert episodes (one per env, different lengths) and their dataset."""
    env = make_env(REACH, seed=3)
    expert = FastReachExpert(env)
    episodes = record_batch(env, expert, max_steps=20) + record_batch(env, expert, max_steps=20)
    out = tmp_path_factory.mktemp("rec") / "ds"
    write_lerobot(out, episodes, fps=10, robot_type="fast_reach")
    return episodes, out


def test_recorded_episodes_read_back_identical(recorded):
    episodes, out = recorded
    assert len({len(e) for e in episodes}) > 1 and all(e.success for e in episodes)
    data = open_dataset(out, spec=env_spec(REACH))
    assert len(data) == len(episodes) and data.cameras == {"image": (16, 16, 3), "wrist": (8, 8, 3)}
    for want, got in zip(episodes, data):
        assert len(got) == len(want) and got.instruction == want.instruction and got.success == want.success
        for cam in ("image", "wrist"):
            assert np.array_equal(got.images[cam], want.images[cam])
        assert np.array_equal(got.actions, want.actions) and np.array_equal(got.proprio, want.proprio)
        assert np.array_equal(got.rewards, want.rewards)
    # the frames as a policy sees them, and action chunks padded past the end
    ep = data.episode(0)
    obs = ep.observations()
    assert obs.image.shape == (len(ep), 3, 16, 16) and obs.cameras["wrist"].shape == (len(ep), 3, 8, 8)
    assert obs.instruction == [ep.instruction] * len(ep) and obs.image.dtype == torch.uint8
    chunks, valid = ep.action_chunks(4)
    assert chunks.shape == (len(ep), 4, 2) and valid[-1].tolist() == [True, False, False, False]
    assert torch.equal(chunks[0, 0], torch.from_numpy(ep.actions[0])) and torch.equal(chunks[-1, 3], chunks[-1, 0])
    stats = data.stats()
    allact = np.concatenate([e.actions for e in episodes])
    assert np.allclose(stats["action"]["mean"], allact.mean(0)) and np.allclose(stats["action"]["min"], allact.min(0))
    assert set(stats["proprio"]) >= {"mean", "std", "min", "max", "count", "q01", "q99"}


def test_files_are_lerobot_v3(recorded):
    """Against LeRobot v3.0 (lerobot 0.4 ``datasets/utils.py``: create_empty_dataset_info,
    DEFAULT_FEATURES, get_hf_features_from_features; ``lerobot_dataset.py``: episodes metadata)."""
    episodes, out = recorded
    info = json.loads((out / "meta/info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["fps"] == 10 and info["video_path"] is None
    assert set(info) >= {"robot_type", "total_episodes", "total_frames", "total_tasks", "chunks_size",
                         "data_files_size_in_mb", "video_files_size_in_mb", "splits", "data_path", "features"}
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["total_episodes"] == len(episodes) and info["total_frames"] == sum(map(len, episodes))
    feats = info["features"]
    for name, dtype in (("timestamp", "float32"), ("frame_index", "int64"), ("episode_index", "int64"),
                        ("index", "int64"), ("task_index", "int64")):
        assert feats[name] == {"dtype": dtype, "shape": [1], "names": None}
    assert feats["observation.images.image"] == {"dtype": "image", "shape": [16, 16, 3],
                                                 "names": ["height", "width", "channel"]}
    assert feats["action"]["shape"] == [2] and feats["observation.state"]["shape"] == [2]
    table = pq.read_table(out / "data/chunk-000/file-000.parquet")
    assert set(table.column_names) == set(feats)  # every feature a column, nothing else
    schema = table.schema
    assert schema.field("observation.images.wrist").type == pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    assert schema.field("action").type == pa.list_(pa.float32(), 2)  # datasets.Sequence(length=2, float32)
    assert schema.field("next.done").type == pa.bool_() and schema.field("timestamp").type == pa.float32()
    cols = table.to_pydict()
    assert cols["index"] == list(range(len(table)))
    lengths = [len(e) for e in episodes]
    assert cols["frame_index"] == [t for n in lengths for t in range(n)]
    assert cols["next.done"] == [t == n - 1 for n in lengths for t in range(n)]
    assert np.allclose(cols["timestamp"], np.array(cols["frame_index"]) / 10)
    eps = pq.read_table(out / "meta/episodes/chunk-000/file-000.parquet").to_pydict()
    for key in ("episode_index", "tasks", "length", "data/chunk_index", "data/file_index", "dataset_from_index",
                "dataset_to_index", "meta/episodes/chunk_index", "meta/episodes/file_index", "success"):
        assert key in eps, key
    assert eps["length"] == lengths and eps["dataset_to_index"] == list(np.cumsum(lengths))
    assert eps["tasks"] == [[e.instruction] for e in episodes]
    tasks = pq.read_table(out / "meta/tasks.parquet")  # pandas: the task strings are the index
    assert json.loads(tasks.schema.metadata[b"pandas"])["index_columns"] == ["__index_level_0__"]
    assert tasks.to_pydict()["__index_level_0__"] == [episodes[0].instruction]
    stats = json.loads((out / "meta/stats.json").read_text())
    assert np.array(stats["observation.images.image"]["mean"]).shape == (3, 1, 1)
    assert set(stats["action"]) == {"mean", "std", "min", "max", "count", "q01", "q10", "q50", "q90", "q99"}


def test_dvla_record_cli_expert_and_policy(tmp_path, capsys):
    out = tmp_path / "expert"
    rc = cli(["record", "--expert", "fast_reach", "--preset", "debug", "env.n_envs=2", "env.image_size=16",
              "--episodes", "3", "--out", str(out), "--success-only"])
    assert rc == 0, capsys.readouterr().err
    data = open_dataset(out)
    assert len(data) == 3 and all(e.success for e in data)
    assert json.loads((out / "meta/info.json").read_text())["dvla"]["source"] == "expert fast_reach"
    # a run's policy, chunks of 3 actions executed one per frame
    from dvla.state.checkpoint import save_weights
    from dvla.config import dump_yaml
    from dvla.policy import PolicySpec, build_policy
    from dvla.config.presets import debug

    run = tmp_path / "run"
    run.mkdir()
    cfg = apply_overrides(debug(), ["policy.action_chunk=3", "env.image_size=16", "env.n_envs=2"])
    dump_yaml(cfg, run / "config.yaml")
    policy = build_policy(cfg.policy.name, PolicySpec.for_env(env_spec(cfg.env), 3), cfg.policy.options)
    save_weights(policy, run / "weights.safetensors", 0)
    rc = cli(["record", str(run), "--episodes", "2", "--max-steps", "7", "--out", str(tmp_path / "pol")])
    assert rc == 0, capsys.readouterr().err
    data = open_dataset(tmp_path / "pol")
    assert len(data) == 2 and all(len(e) <= 7 for e in data) and any(len(e) == 7 or e.success for e in data)


def test_cli_errors_are_one_line(tmp_path, capsys):
    for argv in (["--expert", "nope"], ["--expert", "fast_reach", str(tmp_path)],
                 ["--expert", "fast_reach", "--preset", "libero_spatial"]):
        assert cli(["record", *argv, "--episodes", "1", "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("dvla record: error:") and "\n" not in err, err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    assert cli(["record", "--expert", "fast_reach", "--preset", "debug", "--episodes", "1",
                "--out", str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().err


# -- LIBERO's conventions ------------------------------------------------------------------------

LIBERO_FILE = "KITCHEN_SCENE3_put_the_black_bowl_on_the_plate_demo.hdf5"


def raw_renders(t: int, size: int, seed: int) -> np.ndarray:
    """What robosuite renders (upside down): asymmetric, so a wrong flip shows."""
    return np.random.default_rng(seed).integers(0, 256, (t, size, size, 3), dtype=np.uint8)


def write_libero_hdf5(path, demos=2, t=5, size=16, convention="opengl", skip=None):
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        data = f.create_group("data")
        if convention:
            data.attrs["macros_image_convention"] = convention
        data.attrs["problem_info"] = json.dumps({"language_instruction": "put the bowl on the plate"})
        for d in range(demos):
            g = data.create_group(f"demo_{d}")
            agent, wrist = raw_renders(t, size, 2 * d), raw_renders(t, size, 2 * d + 1)
            if convention == "opencv":  # robosuite flipped it vertically already
                agent, wrist = agent[:, ::-1], wrist[:, ::-1]
            obs = {"agentview_rgb": agent, "eye_in_hand_rgb": wrist, "ee_states": rng.normal(size=(t, 6)),
                   "gripper_states": rng.normal(size=(t, 2)), "joint_states": rng.normal(size=(t, 7))}
            for k, v in obs.items():
                if k != skip:
                    g.create_dataset(f"obs/{k}", data=v)
            actions = rng.uniform(-1, 1, (t, 7))
            actions[:, -1] = np.where(np.arange(t) < 3, -1.0, 1.0)  # open, then close
            g.create_dataset("actions", data=actions)
            g.create_dataset("dones", data=np.eye(t)[-1].astype(np.uint8))
            g.create_dataset("rewards", data=np.eye(t)[-1].astype(np.uint8))
    return path


def libero_spec(size=16):
    return LiberoEnv.spec_for(EnvConfig(name="libero", image_size=size, options={"wrist_size": size}))


@pytest.mark.parametrize("convention", ["opengl", "opencv", None])
def test_libero_hdf5_reads_upright_with_libero_state_and_actions(tmp_path, convention):
    path = write_libero_hdf5(tmp_path / LIBERO_FILE, convention=convention)
    data = open_dataset(path, spec=libero_spec())
    assert len(data) == 2
    ep = data.episode(1)
    with h5py.File(path) as f:
        g = f["data/demo_1"]
        assert np.array_equal(ep.images["image"], raw_renders(5, 16, 2)[:, ::-1, ::-1])  # rotated 180 degrees
        assert np.array_equal(ep.images["wrist"], raw_renders(5, 16, 3)[:, ::-1, ::-1])
        state = np.concatenate([g["obs/ee_states"][()], g["obs/gripper_states"][()]], 1)
        assert np.allclose(ep.proprio, state) and np.allclose(ep.actions, g["actions"][()])
    assert ep.actions[0, -1] == -1.0 and ep.actions[-1, -1] == 1.0  # LIBERO's gripper sign kept
    assert ep.instruction == "put the black bowl on the plate" and ep.success is True
    assert data.stats()["action"]["count"][0] == 10


def test_libero_instruction_follows_libero_benchmark_naming():
    assert libero_instruction("pick_up_the_black_bowl_on_the_plate_demo.hdf5") == "pick up the black bowl on the plate"
    assert libero_instruction("LIVING_ROOM_SCENE10_put_it_in_the_basket_demo.hdf5") == "put it in the basket"


def test_hdf5_openpi_lerobot_and_dvla_recorded_data_agree(tmp_path):
    """The same demonstration three ways: LIBERO's HDF5 (upside down), openpi's LeRobot v2.0
    conversion (upright: image, wrist_image, state, actions) and a dvla v3.0 rewrite."""
    hdf5 = open_dataset(write_libero_hdf5(tmp_path / LIBERO_FILE, demos=1), spec=libero_spec())
    ep = hdf5.episode(0)
    root = tmp_path / "openpi"
    t = len(ep)
    from dvla.datasets.lerobot_format import IMAGE_TYPE, png

    img = {"dtype": "image", "shape": [16, 16, 3], "names": ["height", "width", "channel"]}
    scalar = {"dtype": "int64", "shape": [1], "names": None}
    info = {"codebase_version": "v2.0", "robot_type": "panda", "fps": 10, "chunks_size": 1000,
            "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
            "video_path": None, "total_episodes": 1, "total_frames": t,
            "features": {"image": img, "wrist_image": img,
                         "state": {"dtype": "float32", "shape": [8], "names": ["state"]},
                         "actions": {"dtype": "float32", "shape": [7], "names": ["actions"]},
                         "timestamp": {"dtype": "float32", "shape": [1], "names": None}, "frame_index": scalar,
                         "episode_index": scalar, "index": scalar, "task_index": scalar}}
    (root / "meta").mkdir(parents=True)
    (root / "meta/info.json").write_text(json.dumps(info))
    (root / "meta/episodes.jsonl").write_text(json.dumps({"episode_index": 0, "tasks": [ep.instruction],
                                                          "length": t}) + "\n")
    (root / "meta/tasks.jsonl").write_text(json.dumps({"task_index": 0, "task": ep.instruction}) + "\n")
    (root / "data/chunk-000").mkdir(parents=True)
    pq.write_table(pa.table({
        "image": pa.array([{"bytes": png(f), "path": None} for f in ep.images["image"]], IMAGE_TYPE),
        "wrist_image": pa.array([{"bytes": png(f), "path": None} for f in ep.images["wrist"]], IMAGE_TYPE),
        "state": ep.proprio.tolist(), "actions": ep.actions.tolist(), "timestamp": np.arange(t, dtype=np.float32) / 10,
        "frame_index": np.arange(t), "episode_index": np.zeros(t, np.int64), "index": np.arange(t),
        "task_index": np.zeros(t, np.int64)}), root / "data/chunk-000/episode_000000.parquet")
    openpi = open_dataset(root, spec=libero_spec()).episode(0)
    write_lerobot(tmp_path / "dvla", [ep], fps=20)
    rewritten = open_dataset(tmp_path / "dvla", spec=libero_spec()).episode(0)
    for other in (openpi, rewritten):
        assert other.instruction == ep.instruction
        assert np.array_equal(other.images["image"], ep.images["image"])
        assert np.array_equal(other.images["wrist"], ep.images["wrist"])
        assert np.array_equal(other.actions, ep.actions) and np.array_equal(other.proprio, ep.proprio)


# -- bad data: one line each ----------------------------------------------------------------------

def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_bad_lerobot_data_is_a_one_line_error(recorded, tmp_path):
    import shutil

    _, src = recorded
    with pytest.raises(DatasetError, match="no camera 'wrist'") as e:  # the env has a wrist camera, the data not
        write_lerobot(tmp_path / "nowrist", [Episode(images={"image": np.zeros((2, 16, 16, 3), np.uint8)},
                                                     proprio=np.zeros((2, 2), np.float32),
                                                     actions=np.zeros((2, 2), np.float32), instruction="x")], fps=10)
        open_dataset(tmp_path / "nowrist", spec=env_spec(REACH))
    one_line(e)
    with pytest.raises(DatasetError, match="actions have 2 dimensions, the env's have 7") as e:
        open_dataset(src, spec=libero_spec(16))
    one_line(e)
    bad = tmp_path / "version"
    shutil.copytree(src, bad)
    info = json.loads((bad / "meta/info.json").read_text())
    (bad / "meta/info.json").write_text(json.dumps({**info, "codebase_version": "v9.9"}))
    with pytest.raises(DatasetError, match="codebase_version 'v9.9'") as e:
        open_dataset(bad)
    one_line(e)
    cut = tmp_path / "cut"
    shutil.copytree(src, cut)
    _truncate(cut / "data/chunk-000/file-000.parquet")
    with pytest.raises(DatasetError, match="truncated or corrupt parquet") as e:
        open_dataset(cut)
    one_line(e)
    (cut / "meta/info.json").write_text("{not json")
    with pytest.raises(DatasetError, match="info.json: unreadable") as e:
        open_dataset(cut)
    one_line(e)
    with pytest.raises(DatasetError, match="neither a LeRobot dataset") as e:
        open_dataset(tmp_path)
    one_line(e)


def test_bad_libero_hdf5_is_a_one_line_error(tmp_path):
    cases = {
        "missing camera": (write_libero_hdf5(tmp_path / "a.hdf5", skip="eye_in_hand_rgb"), {}, "eye_in_hand_rgb"),
        "size": (write_libero_hdf5(tmp_path / "b.hdf5"), {"spec": libero_spec(32)}, "camera 'image' is 16x16"),
        "action dim": (write_libero_hdf5(tmp_path / "c.hdf5"), {"spec": env_spec(REACH)}, "7 dimensions"),
    }
    trunc = write_libero_hdf5(tmp_path / "d.hdf5", t=40, size=64)
    _truncate(trunc, 0.6)
    cases["truncated"] = (trunc, {}, "truncated or corrupt HDF5|unreadable")
    for name, (path, kwargs, message) in cases.items():
        with pytest.raises(DatasetError, match=message) as e:
            data = open_dataset(path, **kwargs)
            list(data)  # a truncation past the footer shows when the frames are read
        one_line(e)
