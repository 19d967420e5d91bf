"""genesis-world Franka tasks: scene build, stepping, reward and done semantics, a training run.

All tests share one process-wide genesis init; scenes after the first build in seconds.
"""


import pytest
import torch

from dvla.config import EnvConfig, apply_overrides
from dvla.envs import env_spec, make_env
from dvla.presets import genesis_reach
from dvla.trainer import SyncTrainer

pytest.importorskip("genesis")
pytestmark = pytest.mark.genesis


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
    assert env.spec.action_dim == 4 and env.spec.proprio_dim == 12
    assert env_spec(env.cfg) == env.spec  # what a learner-only rank reads without a scene
    assert obs.image.shape == (4, 3, 32, 32) and obs.image.dtype == torch.uint8
    assert obs.proprio.shape == (4, 12) and torch.isfinite(obs.proprio).all()
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
         "run.progress=false", f"run.out_dir={tmp_path}"],
    )
    summary = SyncTrainer(cfg).run()
    assert summary["version"] == 2 and summary["env_steps"] > 0
    assert (tmp_path / "weights.safetensors").exists()
