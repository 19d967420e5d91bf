"""Every env kind starts an episode as a freshly built env would (issue #53): a freshly built
env's first reset and the next steps of a fixed action sequence, then an episode that drives
the robot away (the gripper closed, the arm moved), then a reset to the same start with the
same draws (the env's generator put back) and the same steps: bitwise equal. The simulators
are deterministic on one machine, so any difference is state that the reset kept.

LIBERO through ``LiberoEnv`` (fixed and sampled initial states, with and without the wrist
camera, in this process and in a worker process), the genesis tasks (full and per-env resets),
and the pure-torch env. Each simulator test is skipped where its extra is not installed (the
helpers come from its own test module, whose import skips)."""

import dataclasses

import pytest
import torch

from dvla.config import EnvConfig
from dvla.envs import make_env


def differences(got, want) -> list[str]:
    """What differs between two lists of observations (empty: bitwise the same)."""
    out = []
    for i, (a, b) in enumerate(zip(got, want)):
        fields = {"proprio": (a.proprio, b.proprio), "image": (a.image, b.image),
                  **{f"camera {k}": (a.cameras[k], b.cameras[k]) for k in b.cameras}}
        for name, (x, y) in fields.items():
            if not torch.equal(x, y):
                out.append(f"step {i} {name}: max |diff| {(x.double() - y.double()).abs().max().item():.3g}")
        if a.instruction != b.instruction:
            out.append(f"step {i} instruction: {a.instruction} vs {b.instruction}")
    return out


def restart_like_fresh(make, away, actions, group_size=1, then=None):
    """The observations of a freshly built env's first reset followed by ``actions``, and of
    the same env reset again with the same draws (its generator put back) after ``away(env)``
    drove it elsewhere, followed by the same actions: ``(got, want, more)``. One env built
    where two would be (a fresh env's first episode is what a fresh env does; the builds are
    most of these tests' time). ``then(env, draws)``: more checks before it closes (its value
    is ``more``)."""
    env = make()
    try:
        fresh_draws = env.generator.get_state()
        want = [env.reset(group_size)] + [env.step(a).obs for a in actions]
        moved = away(env)
        assert moved is None or differences([moved], want[:1]), "away() left the env where an episode starts"
        env.generator.set_state(fresh_draws)
        got = [env.reset(group_size)] + [env.step(a).obs for a in actions]
        more = then(env, fresh_draws) if then else None
    finally:
        env.close()
    return got, want, more


def chunk(n: int, k: int, seed: int, d: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(n, k, d, generator=g) * 2 - 1 for _ in range(3)]


@pytest.mark.slow
@pytest.mark.parametrize("init_states, wrist, workers", [("random", 16, 0), ("sampled", 0, 1)],
                         ids=["fixed-wrist-inprocess", "sampled-worker"])
def test_libero_restarts_as_a_fresh_env(init_states, wrist, workers):
    """Away: one chunk of ten actions that closes the gripper and moves the arm; then three
    chunks of two random actions. Before the fix a soft reset kept the gripper's smoothed
    command (robosuite's ``current_action``) and drew the fixtures from wherever numpy's global
    generator was: the first observation's finger positions differed by about 3e-3, and the
    images."""
    from tests.unit.dvla.test_libero import libero_cfg

    cfg = libero_cfg(1, render=True, task_ids=[1], init_states=init_states, wrist_size=wrist, workers=workers)
    close = torch.zeros(1, 10, 7)
    close[..., 0], close[..., 2], close[..., 6] = 0.8, -0.5, 1.0
    got, want, _ = restart_like_fresh(lambda: make_env(cfg, seed=4), lambda env: env.step(close).obs,
                                      chunk(1, 2, 0, 7))
    assert not differences(got, want), differences(got, want)


@pytest.mark.genesis
@pytest.mark.slow
@pytest.mark.xdist_group("genesis")
@pytest.mark.parametrize("name", ["genesis_reach", "genesis_lift"])
def test_genesis_restarts_as_a_fresh_env(name):
    """Away: ten steps to the goal (the lift's cube) closing the gripper. A full reset, then a
    reset of env 0 alone (what the independent clock does) while env 1 goes on: env 0 starts as
    a fresh env's env 0 and env 1's robot and object are left as they were (before the fix the
    lift's reset of one env set every env's cube upright and stopped it)."""
    from tests.unit.dvla.test_genesis import scripted

    reach = name == "genesis_reach"  # the lift's observation shows its cube's goal (no camera)
    cfg = EnvConfig(name=name, n_envs=2, image_size=32, render=reach, options={} if reach else {"privileged": True})
    actions = chunk(2, 1, 0, 4)

    def away(env, steps=10):
        for _ in range(steps):
            obs = env.step(scripted(env, grip=1.0)).obs
        return obs

    def one_env(env, fresh_draws):
        env.reset()
        away(env, 6)
        if name == "genesis_lift":  # env 1's cube tilted and moving
            env.obj.set_quat(torch.tensor([[0.9238795, 0.0, 0.3826834, 0.0]]), envs_idx=[1])
            env.obj.set_dofs_velocity(torch.tensor([[0.1, 0.0, 0.0, 0.0, 0.0, 0.5]]), envs_idx=[1])
        parts = ("robot q", "robot velocity", "object pose", "object velocity")
        state = lambda: [x[1].clone() for x in (env.robot.get_dofs_position(), env.robot.get_dofs_velocity(),  # noqa: E731
                                                env.obj.get_qpos(), env.obj.get_dofs_velocity())]
        before = state()
        env.generator.set_state(fresh_draws)  # env 0's goal: a fresh env's first
        env._reset_envs(torch.tensor([0]), 1)
        changed = [p for p, x, y in zip(parts, before, state()) if not torch.equal(x, y)]
        return changed, [env._observe()] + [env.step(a).obs for a in actions]

    got, want, (changed, alone) = restart_like_fresh(lambda: make_env(cfg, seed=0), away, actions, then=one_env)
    assert not differences(got, want), differences(got, want)
    row0 = lambda obs: [dataclasses.replace(o, proprio=o.proprio[:1], image=o.image[:1],  # noqa: E731
                                            instruction=o.instruction[:1]) for o in obs]
    assert not differences(row0(alone), row0(want)), differences(row0(alone), row0(want))
    assert not changed, f"resetting env 0 changed env 1's {changed}"


def test_fast_reach_restarts_as_a_fresh_env():
    """The pure-torch env (both cameras, groups of two)."""
    cfg = EnvConfig(name="fast_reach", n_envs=4, image_size=16, options={"wrist_camera": 8, "n_targets": 3})
    got, want, _ = restart_like_fresh(lambda: make_env(cfg, seed=2), lambda env: env.step(torch.ones(4, 5, 2)).obs,
                                      chunk(4, 2, 0, 2), group_size=2)
    assert not differences(got, want), differences(got, want)


def test_gym_restarts_as_a_fresh_env():
    """The gymnasium adapter: a reset seeds every env (from the env's seed and the episode's
    index), and gymnasium's reset with a seed starts an env afresh. An episode after one that
    swung the pendulum hard equals a fresh env's episode of the same index."""
    pytest.importorskip("gymnasium")
    cfg = EnvConfig(name="gym", n_envs=2, options={"gym_id": "Pendulum-v1"})
    actions = chunk(2, 1, 0, 1)
    used = make_env(cfg, seed=3)
    try:
        start = used.reset()
        for _ in range(5):
            used.step(torch.ones(2, 1, 1))
        got = [used.reset()] + [used.step(a).obs for a in actions]
    finally:
        used.close()
    fresh = make_env(cfg, seed=3)
    try:
        fresh._episode = 1  # built for that episode: the used env's second
        want = [fresh.reset()] + [fresh.step(a).obs for a in actions]
    finally:
        fresh.close()
    assert differences([start], got[:1]), "the used env's first episode started where the compared one does"
    assert not differences(got, want), differences(got, want)
