"""genesis-world Franka tasks: scene build, stepping, reward and done semantics, a training run.

All tests share one process-wide genesis init; scenes after the first build in seconds.
The slow tier (``-m slow``): the first scene compiles genesis's kernels. genesis itself is
imported by the first scene built, not while pytest collects (about 10 s saved for runs that
leave these tests out).

Where the module's CPU goes (45-55 s on 2 cores, kernel cache warm): importing genesis
about 12 s (mostly quadrants' kernel decorators calling ``inspect.getframeinfo``) and the
first scene about 9 s (its kernels' first launches), both in the first test that builds a
scene; later scenes about 1.3 s each, the lift scene about 4 s (its contact kernels' first
launches); the learning run about 18-24 s (stepping 64 envs is most of it). The first
optimizer built imports ``torch._dynamo`` (about 2.5 s, in the sync training test).
"""

import importlib.util

import pytest
import torch

from dvla.config import EnvConfig, apply_overrides
from dvla.envs import env_spec, make_env
from dvla.metrics import read_metrics
from dvla.config.presets import genesis_reach
from swimlane.assembly.lifecycle import Swimlane

if importlib.util.find_spec("genesis") is None:
    pytest.skip("genesis-world is not installed", allow_module_level=True)
# One worker runs them all: one genesis init, the session's scenes built once.
pytestmark = [pytest.mark.genesis, pytest.mark.slow, pytest.mark.xdist_group("genesis")]


@pytest.fixture(scope="session")
def reach_env():
    env = make_env(EnvConfig(name="genesis_reach", n_envs=4, image_size=32, reward_shaping=1.0), seed=0)
    yield env
    env.close()


@pytest.fixture(scope="session")
def lift_env():
    env = make_env(EnvConfig(name="genesis_lift", n_envs=2, render=False), seed=0)
    yield env
    env.close()


def scripted(env, gain=1.0, grip=-1.0):
    """Move the commanded fingertip position straight to the goal."""
    d = (env.goal - env.ee_target) / env.max_delta * gain
    return torch.cat([d.clamp(-1, 1), torch.full((env.n_envs, 1), grip)], dim=-1)


def test_reach_scene_builds_and_observes(reach_env):
    env = reach_env
    obs = env.reset(group_size=2)
    assert env.spec.action_dim == 4 and env.spec.proprio_dim == 15
    assert env_spec(env.cfg) == env.spec  # what a learner-only rank reads without a scene
    assert obs.image.shape == (4, 3, 32, 32) and obs.image.dtype == torch.uint8
    assert obs.proprio.shape == (4, 15) and torch.isfinite(obs.proprio).all()
    assert obs.instruction[0] == "move the gripper to the red ball"
    # One camera image per env: group members (same goal) look the same, other groups differ.
    assert torch.equal(obs.image[0], obs.image[1])
    assert not torch.equal(obs.image[0], obs.image[2])
    assert obs.image.float().std() > 5
    assert torch.equal(env.goal[0], env.goal[1]) and not torch.equal(env.goal[0], env.goal[2])


def test_reach_reward_and_done_semantics(reach_env):
    env = reach_env
    env.reset(group_size=2)
    start = env._distance().clone()
    # Envs 0-1 drive to the goal, envs 2-3 hold still.
    total = torch.zeros(4)
    for _ in range(40):
        act = scripted(env)
        act[2:, :3] = 0.0
        res = env.step(act)
        total += res.reward
        if env.done[:2].all():
            break
    assert env.done[:2].all() and res.success[:2].all()
    assert not env.done[2:].any()
    # Sparse success (1.0) plus shaping equal to the distance covered until success.
    assert (total[:2] > 1.0).all() and (total[:2] < 1.0 + start[:2] + 0.05).all()
    assert total[2:].abs().max() < 0.05
    # Done envs stay done and earn nothing more.
    res = env.step(scripted(env))
    assert (res.reward[:2] == 0).all() and env.done[:2].all()


def test_reach_action_chunks(reach_env):
    env = reach_env
    env.reset()
    before = env.tip_pos().clone()
    up = torch.zeros(4, 3, 4)  # chunk of 3 actions: +z
    up[:, :, 2] = 1.0
    env.step(up)
    rise = env.tip_pos()[:, 2] - before[:, 2]
    assert (rise > 0.03).all(), rise


def test_reach_target_mode_and_workspace_units():
    """action_mode=target: an action names the commanded fingertip position in workspace
    units, so acting with the goal's own coordinates (privileged proprio) reaches it."""
    cfg = EnvConfig(name="genesis_reach", n_envs=4, render=False, reward_shaping=1.0,
                    options={"action_mode": "target", "privileged": True})
    env = make_env(cfg, seed=1)
    try:
        obs = env.reset(group_size=2)
        assert env.spec.proprio_dim == 18
        goal_units = obs.proprio[:, 15:18]
        torch.testing.assert_close(goal_units, env.workspace_units(env.goal))
        assert goal_units.abs().max() <= 1.0  # goals lie inside the target box
        # The commanded position is observed (proprio 12:15) and follows the action at once.
        act = torch.cat([goal_units, torch.full((4, 1), -1.0)], dim=-1)
        res = env.step(act)
        torch.testing.assert_close(res.obs.proprio[:, 12:15], goal_units, atol=1e-5, rtol=0)
        for _ in range(8):
            if env.done.all():
                break
            res = env.step(act)
        assert res.success.all(), env._distance()
    finally:
        env.close()


def test_lift_cube_rests_then_counts_lift(lift_env):
    env = lift_env
    env.reset()
    assert env.spec.action_dim == 4
    obs_img = env._observe().image
    assert obs_img.sum() == 0  # render=False: no camera
    res = env.step(torch.zeros(2, 4))
    cube = env.obj.get_pos()
    torch.testing.assert_close(cube[:, 2], torch.full((2,), 0.02), atol=5e-3, rtol=0)
    assert (env._distance() > env.lift_height).all()
    assert not res.terminated.any()
    # Raising the cube by the lift height counts as success.
    env.obj.set_pos(env.goal + torch.tensor([0.0, 0.0, 0.15]))
    assert (env._distance() == 0).all()


def test_sync_training_on_genesis(tmp_path):
    cfg = apply_overrides(
        genesis_reach(),
        ["env.n_envs=4", "algo.group_size=2", "env.episode_len=3", "env.image_size=32", "run.iterations=2",
         "run.progress=false", "run.tensorboard=false", f"run.out_dir={tmp_path}", "swimlane.mode=sync",
         "swimlane.driver=serial"],
    )
    summary = Swimlane(cfg).run()
    assert summary["version"] == 2 and summary["env_steps"] > 0
    assert (tmp_path / "weights.safetensors").exists()


def test_the_default_job_learns_without_its_camera(tmp_path):
    """The default preset, shortened: the camera off (rendering is what makes the README run
    take minutes) and so its blank image at 16 px (it carries nothing; at 64 px the policy's
    convolutions took half of the test's 64 s of CPU, for the same curve), no TensorBoard files
    (nothing reads them here; about 1 s of CPU), everything else as the README command runs it.
    Success rises from chance to most episodes (bench/RESULTS.md records the full run with the
    camera): the mean of the last five updates was 0.66-0.73 in three runs of 36 updates (0 in
    the first five), crossing 0.5 around update 27, so the run is not shortened further. About
    18-24 s of CPU on 2 cores: stepping the two 64-env groups 8-11 s, learning 2-4 s, the two
    scene builds and the model about 3 s."""
    cfg = apply_overrides(genesis_reach(), ["env.render=false", "env.image_size=16", "run.iterations=36",
                                           "run.progress=false", "run.tensorboard=false", f"run.out_dir={tmp_path}"])
    summary = Swimlane(cfg).run()
    assert summary["version"] == 36
    rows = read_metrics(tmp_path / "metrics.jsonl")
    success = [r["success_rate"] for r in rows]
    first, last = sum(success[:5]) / 5, sum(success[-5:]) / 5
    assert first <= 0.2 and last >= 0.5, (first, last, success)


@pytest.mark.parametrize("which", ["reach_env", "lift_env"])
def test_single_envs_restart_while_the_others_go_on(which, request):
    """Per-env reset (envs_idx): the restarted envs are back home with a new goal and
    object, the others keep their state."""
    env = request.getfixturevalue(which)
    n = env.n_envs
    env.reset(1, independent=True)
    for _ in range(2):
        env.step(scripted(env, gain=0.5))
    q_before, goal_before = env.robot.get_dofs_position().clone(), env.goal.clone()
    home = env._home
    assert not torch.allclose(q_before[0, :7], home[:7], atol=1e-2)  # it moved
    env._reset_envs(torch.tensor([0]), 1)
    q = env.robot.get_dofs_position()
    torch.testing.assert_close(q[0], home, atol=1e-4, rtol=0)
    torch.testing.assert_close(q[1:], q_before[1:])
    torch.testing.assert_close(env.goal[1:], goal_before[1:])
    assert not torch.equal(env.goal[0], goal_before[0])
    torch.testing.assert_close(env.obj.get_pos()[0], env.goal[0], atol=1e-4, rtol=0)
    assert env.ee_target.shape == (n, 3)
    env.reset()
