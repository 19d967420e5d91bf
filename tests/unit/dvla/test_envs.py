"""Reset/step semantics of the batched env interface on the pure-torch env and the gym adapter."""

import pytest
import torch

from dvla.config import ConfigError, EnvConfig
from dvla.envs import ENV_REGISTRY, env_spec, make_env, register_env
from dvla.envs.base import EnvSpec


def fast(n=8, **kw):
    opts = kw.pop("options", {})
    return make_env(EnvConfig(name="fast_reach", n_envs=n, image_size=32, options=opts, **kw), seed=3)


def test_spec_and_observation():
    env = fast(options={"n_targets": 2})
    obs = env.reset()
    assert env.spec.image_shape == (3, 32, 32) and env.spec.action_dim == 2
    assert obs.image.shape == (8, 3, 32, 32) and obs.image.dtype == torch.uint8
    assert obs.proprio.shape == (8, 2)
    assert len(obs.instruction) == 8 and all(s.startswith("move to the") for s in obs.instruction)
    assert obs.image.float().std() > 0  # something is drawn


def test_env_spec_without_building_matches_the_built_env(monkeypatch):
    """A learner-only rank reads the spec from the config: for the built-in envs nothing is
    built (the factory is not called), and the spec is the one a built env has."""
    built = {False: fast(options={}).spec, True: fast(options={"privileged": True}).spec}

    def no_build(*args):
        raise AssertionError("env_spec built an env")

    monkeypatch.setitem(ENV_REGISTRY, "fast_reach", no_build)
    for privileged, spec in built.items():
        cfg = EnvConfig(name="fast_reach", n_envs=8, image_size=32, options={"privileged": privileged})
        assert env_spec(cfg) == spec
    monkeypatch.setitem(ENV_REGISTRY, "genesis_reach", no_build)
    assert env_spec(EnvConfig(name="genesis_reach", image_size=48, options={"privileged": True})) == EnvSpec(
        image_shape=(3, 48, 48), proprio_dim=18, action_dim=4)  # tests/unit/dvla/test_genesis.py checks a built one
    with pytest.raises(ConfigError, match="unknown option"):
        env_spec(EnvConfig(name="fast_reach", options={"colour": 1}))


def test_env_spec_builds_and_closes_an_env_that_cannot_tell():
    events = []

    class Probe:
        spec = EnvSpec(image_shape=(3, 8, 8), proprio_dim=5, action_dim=3)

        def close(self):
            events.append("close")

    def factory(cfg, device, seed):
        events.append("build")
        return Probe()

    register_env("probe_env")(factory)
    try:
        assert env_spec(EnvConfig(name="probe_env")) == Probe.spec
        assert events == ["build", "close"]
    finally:
        del ENV_REGISTRY["probe_env"]


def test_groups_share_initial_state():
    env = fast(n=8)
    env.reset(group_size=4)
    assert torch.equal(env.pos[0], env.pos[3]) and torch.equal(env.targets[0], env.targets[3])
    assert not torch.equal(env.pos[0], env.pos[4])
    with pytest.raises(ValueError, match="multiple of group_size"):
        env.reset(group_size=3)


def test_success_terminates_and_latches():
    env = fast(n=2, success_reward=1.0)
    env.reset()
    # Steer env 0 straight at its goal; env 1 stands still.
    for _ in range(30):
        direction = (env.goal - env.pos) / env.max_delta
        act = torch.stack([direction[0].clamp(-1, 1), torch.zeros(2)])
        res = env.step(act)
        if res.terminated[0]:
            break
    assert res.terminated[0] and res.success[0] and res.reward[0] == 1.0
    assert not res.terminated[1] and res.reward[1] == 0.0
    # Once done, an env reports no reward and stays done.
    res = env.step(torch.zeros(2, 2))
    assert res.reward[0] == 0.0 and env.done[0] and not res.terminated[0]


def test_shaping_rewards_progress_and_chunks_execute_in_order():
    env = fast(n=1, reward_shaping=2.0, options={"radius": 0.01})
    env.reset()
    start = env._distance().clone()
    direction = ((env.goal - env.pos) / start.unsqueeze(-1)).clamp(-1, 1) * 0.1
    res = env.step(torch.stack([direction, direction, direction], dim=1))  # chunk of K=3
    progress = start - env._distance()
    assert progress.item() > 0
    assert res.reward.item() == pytest.approx(2.0 * progress.item(), rel=1e-5)


def test_bad_actions_and_options():
    env = fast(n=2)
    env.reset()
    with pytest.raises(ValueError, match="actions must be"):
        env.step(torch.zeros(3, 2))
    with pytest.raises(ConfigError, match="unknown option"):
        fast(options={"n_target": 2})
    with pytest.raises(ConfigError, match="unknown env 'mujoco'"):
        make_env(EnvConfig(name="mujoco"))


def test_render_off_gives_zero_images():
    env = fast(render=False)
    assert env.reset().image.sum() == 0


def test_gym_adapter_continuous_and_grouped_seeds():
    env = make_env(EnvConfig(name="gym", n_envs=4, options={"gym_id": "Pendulum-v1"}), seed=1)
    assert env.spec.proprio_dim == 3 and env.spec.action_dim == 1
    obs = env.reset(group_size=2)
    assert torch.equal(obs.proprio[0], obs.proprio[1]) and not torch.equal(obs.proprio[0], obs.proprio[2])
    assert obs.instruction[0] == "solve Pendulum-v1"
    res = env.step(torch.ones(4, 2, 1))  # a chunk of two max-torque actions
    assert res.reward.shape == (4,) and (res.reward < 0).all()
    env.close()


def test_gym_adapter_discrete_episode_end():
    env = make_env(EnvConfig(name="gym", n_envs=2, options={"gym_id": "CartPole-v1"}), seed=0)
    assert env.spec.action_dim == 1
    env.reset()
    for _ in range(100):  # always push left: the pole falls within a few dozen steps
        res = env.step(-torch.ones(2, 1))
        if env.done.all():
            break
    assert env.done.all() and res.terminated.any()
    with pytest.raises(ConfigError, match="gym_id: required"):
        make_env(EnvConfig(name="gym", n_envs=2))


def _greedy_lengths(options, n=256, steps=200, group_size=1):
    """Steps to success of a greedy controller (full speed towards the goal), every env of a
    batch reset together and none reset again: batch-synchronous episodes."""
    env = fast(n, options={"privileged": True, **options}, render=False)
    obs = env.reset(group_size=group_size)
    done_at = torch.full((n,), steps)
    for t in range(steps):
        pos, goal = obs.proprio[:, :2], obs.proprio[:, 2:]
        res = env.step(((goal - pos) / env.max_delta).clamp(-1, 1))
        obs = res.obs
        done_at[res.terminated & (done_at == steps)] = t + 1
    return env, done_at.float()


def test_long_tail_option_gives_heavy_tailed_episode_lengths():
    """options.long_tail=1.5: most episodes as usual, a few many times longer. Episodes that
    wait for the slowest of their batch then leave most env-steps idle (the workload for
    per-env stepping); the default draws the same tasks and no slowness."""
    plain_env, plain = _greedy_lengths({})
    tail_env, tail = _greedy_lengths({"long_tail": 1.5})
    assert torch.equal(plain_env.targets, tail_env.targets)  # the same tasks: slowness is drawn after them
    assert bool((plain_env.slowness == 1).all()) and float(tail_env.slowness.max()) <= 20.0

    def idle(lengths):  # env-steps spent done while the batch waits for its slowest episode
        return float((lengths.max() - lengths).sum() / (lengths.max() * len(lengths)))

    assert plain.max() <= 3 * plain.median() and tail.max() >= 5 * tail.median()
    assert idle(tail) > 0.8 > idle(plain)
    grouped, lengths = _greedy_lengths({"long_tail": 1.5}, group_size=4)
    assert bool((grouped.slowness.view(-1, 4) == grouped.slowness.view(-1, 4)[:, :1]).all())  # one per group
    assert bool((lengths.view(-1, 4) == lengths.view(-1, 4)[:, :1]).all())  # a group's episodes alike
    with pytest.raises(ConfigError, match="long_tail_cap"):
        fast(options={"long_tail": 1.0, "long_tail_cap": 0.5})


@pytest.mark.alone
def test_render_cost_shifts_after_phase_after_renders(tmp_path):
    """options.phase_after: the workload's render cost changes mid-run (autotune's bench)."""
    import time

    env = fast(n=2, options={"render_cost_ms": 0.0, "phase_after": 3, "render_cost_ms_after": 20.0})
    env.reset()
    took = []
    for _ in range(5):
        t0 = time.perf_counter()
        env.step(torch.zeros(2, 2))
        took.append(time.perf_counter() - t0)
    assert max(took[:2]) < 0.015 and min(took[3:]) >= 0.02  # renders 1-3 cheap, from the 4th on 20 ms
    with pytest.raises(ConfigError, match="phase_after"):
        fast(options={"phase_after": -1})
    # options.phase_after_s: the same shift after that many seconds since the env was built.
    env = fast(n=2, options={"render_cost_ms": 0.0, "phase_after_s": 0.3, "render_cost_ms_after": 20.0})
    env.reset()
    t0 = time.perf_counter()
    env.step(torch.zeros(2, 2))
    assert time.perf_counter() - t0 < 0.015
    time.sleep(0.3)
    t0 = time.perf_counter()
    env.step(torch.zeros(2, 2))
    assert time.perf_counter() - t0 >= 0.02
    with pytest.raises(ConfigError, match="phase_after_s"):
        fast(options={"phase_after_s": -1.0})
    # options.phase_file: the second phase while the file exists, decided from outside the run.
    flag = tmp_path / "phase"
    env = fast(n=2, options={"render_wait_ms": 0.0, "phase_file": str(flag), "render_wait_ms_after": 30.0})
    env.reset()
    for present, slow in ((False, False), (True, True), (False, False)):
        flag.touch() if present else flag.unlink(missing_ok=True)
        t0 = time.perf_counter()
        env.step(torch.zeros(2, 2))
        assert (time.perf_counter() - t0 >= 0.03) == slow, present
    with pytest.raises(ConfigError, match="phase_file"):
        fast(options={"phase_file": 3})
    # options.render_wait_ms_after (a wait, no core used) and render_python_ms_after (work in
    # Python, the GIL held) shift with the phase too.
    for key in ("render_wait_ms", "render_python_ms"):
        env = fast(n=2, options={key: 30.0, "phase_after": 2, f"{key}_after": 0.0})
        env.reset()  # render 1
        t0 = time.perf_counter()
        env.step(torch.zeros(2, 2))  # render 2: still the first phase
        assert time.perf_counter() - t0 >= 0.03, key
        t0 = time.perf_counter()
        env.step(torch.zeros(2, 2))  # render 3: the second phase
        assert time.perf_counter() - t0 < 0.02, key
        for bad in (key, f"{key}_after"):
            with pytest.raises(ConfigError, match=bad):
                fast(options={bad: -1.0})
