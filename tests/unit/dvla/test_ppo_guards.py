"""PPO's stability guards (issue #39) through the product's learner: the target-KL stop, the
learning-rate schedules, value clipping, their config checks, and learner ranks that stop
together."""

from __future__ import annotations

import math
import traceback
from datetime import timedelta
from functools import partial

import pytest
import torch
import torch.distributed as dist

from dvla.algos import build_algorithm
from dvla.algos.guards import lr_factor, value_loss
from dvla.config import AlgoConfig, ConfigError, apply_overrides
from dvla.envs import make_env
from dvla.policy import PolicySpec, build_policy
from dvla.config.presets import debug

OPTIONS = {**debug().policy.options, "value_head": True}


def _setup(seed: int = 0, **algo):
    """A tiny PPO learner and one batch of 8 fast_reach episodes."""
    from dvla.rollout import collect_episodes

    cfg = debug()
    cfg.env.reward_shaping = 1.0
    env = make_env(cfg.env, seed=seed)
    torch.manual_seed(0)
    policy = build_policy("tiny_vla", PolicySpec.for_env(env.spec), OPTIONS)
    learner = build_algorithm(AlgoConfig(**{"name": "ppo", "update_epochs": 2, "minibatches": 4, **algo}), policy)
    batch = collect_episodes(env, policy, 8, group_size=1, generator=torch.Generator().manual_seed(seed))
    return learner, batch


def _steps(learner) -> int:
    """Optimizer steps taken so far (Adam's count)."""
    return int(max(s["step"] for s in learner.optimizer.state.values())) if learner.optimizer.state else 0


def test_target_kl_stops_the_update_after_the_first_minibatch_when_the_kl_is_forced_high():
    # lr 0.5 moves the policy far in one step: the second minibatch measures a KL far above 1e-3.
    learner, batch = _setup(lr=0.5, target_kl=1e-3)
    stats = learner.update(batch, torch.Generator().manual_seed(0))
    assert stats["kl_early_stop"] == 1.0 and stats["minibatches_stepped"] == 1.0
    assert _steps(learner) == 1  # the crossing minibatch's step is skipped too
    assert stats["approx_kl"] > 1e-3 / 2  # (the mean of the first minibatch's 0 and the crossing one)
    learner, batch = _setup(lr=0.5)  # the same update without the guard takes all 2 x 4 steps
    stats = learner.update(batch, torch.Generator().manual_seed(0))
    assert _steps(learner) == 8 and "kl_early_stop" not in stats


def test_a_target_kl_that_is_never_reached_changes_nothing():
    a, batch = _setup(lr=1e-4, target_kl=10.0)
    b, _ = _setup(lr=1e-4)
    sa = a.update(batch, torch.Generator().manual_seed(0))
    sb = b.update(batch, torch.Generator().manual_seed(0))
    assert sa["kl_early_stop"] == 0.0 and sa["minibatches_stepped"] == 8.0
    assert sa["loss"] == sb["loss"]
    for p, q in zip(a.policy.parameters(), b.policy.parameters()):
        assert torch.equal(p, q)


def test_lr_factor_by_hand():
    assert [lr_factor("linear", u, 4) for u in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert [lr_factor("constant", u, 4, warmup=3) for u in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_factor("cosine", 0, 10) == 1.0 and lr_factor("cosine", 5, 10) == pytest.approx(0.5)
    assert lr_factor("cosine", 2, 6, warmup=2) == 1.0 and lr_factor("cosine", 4, 6, warmup=2) == pytest.approx(0.5)


@pytest.mark.parametrize("schedule,warmup", [("linear", 0), ("cosine", 2), ("constant", 2)])
def test_the_optimizer_follows_the_schedule_across_updates(schedule, warmup):
    learner, batch = _setup(lr=1e-3, lr_schedule=schedule, lr_warmup=warmup, update_epochs=1, minibatches=1)
    learner.horizon = 6  # run.iterations, as the swimlane passes it
    seen, logged = [], []
    for version in range(6):
        logged.append(learner.update(batch, torch.Generator().manual_seed(0), learner_version=version)["lr"])
        seen.append(learner.optimizer.param_groups[0]["lr"])
    want = [1e-3 * lr_factor(schedule, u, 6, warmup) for u in range(6)]
    assert seen == pytest.approx(want) and logged == seen
    assert len(set(seen)) > 2  # it moved


def test_the_schedule_scales_each_parameter_groups_own_rate_and_follows_the_version():
    learner, batch = _setup(lr=1e-3, lr_schedule="linear", lr_horizon=10, update_epochs=1, minibatches=1)
    learner.optimizer.param_groups[0]["lr"] = 123.0  # whatever a checkpoint restored
    learner.update(batch, torch.Generator().manual_seed(0), learner_version=5)  # resumed at version 5
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5)
    learner.follow(learner_version=8)  # an update sat out still moves the rate
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.2)
    learner._base_lrs = [2e-3]  # a group with its own rate (optim_groups) scales from it
    learner.update(batch, torch.Generator().manual_seed(0))  # no version: the count goes on (9)
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 * 0.1)


def test_a_schedule_without_a_horizon_is_a_config_error():
    learner, batch = _setup(lr_schedule="cosine")
    with pytest.raises(ConfigError, match="algo.lr_schedule: cosine needs a horizon"):
        learner.update(batch)


def test_value_loss_clipped_by_hand():
    v, ret, old = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([2.0, 0.0, 0.0]), torch.tensor([0.0, 0.5, 1.9])
    per, clipped = value_loss(v, ret, old, 0.0)
    assert clipped is None and per.tolist() == [0.5, 0.0, 2.0]
    per, clipped = value_loss(v, ret, old, 0.2)
    # v moved 1.0, -0.5, 0.1 from old: the first two are clipped to 0.2 and 0.3. Clipped values
    # 0.2, 0.3 (1.9 + 0.1 = 2.0 unclipped): losses 0.5 max(1, 3.24), 0.5 max(0, 0.09), 0.5 max(4, 4).
    assert per.tolist() == pytest.approx([1.62, 0.045, 2.0])
    assert clipped.tolist() == [1.0, 1.0, 0.0]


def test_value_clipping_changes_the_learners_value_loss_as_specified():
    learner, batch = _setup(update_epochs=1, minibatches=1, lr=1e-9)
    clipped, _ = _setup(update_epochs=1, minibatches=1, lr=1e-9, value_clip=1e-4)
    batch.values += 0.5  # the recorded values (V_old) now differ from the learner's by 0.5
    a = learner.update(batch, torch.Generator().manual_seed(0))
    b = clipped.update(batch, torch.Generator().manual_seed(0))
    assert "value_clip_frac" not in a and b["value_clip_frac"] == 1.0
    # Every sample clipped: the loss takes the larger of the two squared errors, never the smaller.
    assert b["value_loss"] > a["value_loss"]
    with torch.no_grad():  # by hand, from the learner's own values and returns
        adv, ret = learner.advantages(batch)
        data = learner._flatten(batch, adv, ret)
        from dvla.algos.base import obs_of

        v = learner.policy.evaluate(obs_of(data), data["actions"]).values
        old = data["old_value"]
        want = 0.5 * torch.maximum((v - ret[batch.valid]) ** 2,
                                   (old + (v - old).clamp(-1e-4, 1e-4) - ret[batch.valid]) ** 2)
    assert b["value_loss"] == pytest.approx(float(want.mean()), rel=1e-4)


@pytest.mark.parametrize("override,message", [
    ("algo.target_kl=-0.1", "algo.target_kl: must be >= 0 and finite, got -0.1"),
    ("algo.value_clip=0.2", "algo.value_clip: clips PPO's value loss; grpo has none"),
    ("algo.lr_schedule=step", "algo.lr_schedule: expected one of 'constant', 'linear', 'cosine'"),
])
def test_bad_guard_settings_are_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as err:
        apply_overrides(debug(), [override]).validate()
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="algo.lr_warmup: 5 updates of warmup leave nothing of algo.lr_horizon"):
        apply_overrides(debug(), ["algo.lr_schedule=linear", "algo.lr_warmup=5", "algo.lr_horizon=5"]).validate()


def _two_learners(rank: int, port: int, out) -> None:
    """Two learners averaging gradients as the swimlane's do (masked mean, adaptive roles):
    rank 0 learns with a KL target it crosses after its first step, rank 1 has its own data
    (first update) and then none (second update: it follows). The second update reuses rank
    0's batch, which the first moved far from: its KL is above the target before any step."""
    from dvla.distributed import allreduce_mean_grads

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                                timeout=timedelta(seconds=30))
        learner, batch = _setup(seed=rank, lr=0.5, target_kl=1e-3)
        learner.grad_sync = partial(allreduce_mean_grads, group=dist.group.WORLD, masked=True)
        learner.learner_group = dist.group.WORLD
        first = learner.update(batch, torch.Generator().manual_seed(0))
        if rank == 0:
            second = learner.update(batch, torch.Generator().manual_seed(1))
        else:
            learner.follow()
            second = {}
        weights = [p.detach().clone() for p in learner.policy.parameters()]
        gathered = [None, None]
        dist.all_gather_object(gathered, [w.sum().item() for w in weights])
        out.put((rank, {"first": first.get("minibatches_stepped"), "second": second.get("minibatches_stepped"),
                        "steps": _steps(learner), "same_weights": gathered[0] == gathered[1]}))
        dist.destroy_process_group()
    except BaseException as exc:
        out.put((rank, {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}))


@pytest.mark.slow
def test_learner_ranks_stop_together():
    """Without a collective decision rank 1 (low KL on its data, or no data) would go on into
    gradient all-reduces rank 0 no longer makes: a deadlock (here a 30 s timeout)."""
    from tests.helpers.ranks import spawn_ranks

    res = spawn_ranks(_two_learners, 2, timeout=120)
    assert res[0]["first"] == res[1]["first"] == 1.0, res
    assert res[0]["second"] == 0.0 and res[0]["steps"] == res[1]["steps"] == 1, res
    assert res[0]["same_weights"] and res[1]["same_weights"], res


def test_guards_off_leave_the_update_as_it_was():
    """The defaults add nothing: no stop (and no collective), no schedule, no value clipping."""
    cfg = AlgoConfig(name="ppo")
    assert (cfg.target_kl, cfg.lr_schedule, cfg.lr_warmup, cfg.value_clip) == (0.0, "constant", 0, 0.0)
    learner, batch = _setup(lr=1e-3)
    stats = learner.update(batch, torch.Generator().manual_seed(0), learner_version=3)
    assert not {"lr", "kl_early_stop", "minibatches_stepped", "value_clip_frac"} & stats.keys()
    assert learner.optimizer.param_groups[0]["lr"] == 1e-3 and math.isfinite(stats["loss"])


def test_gamma_discounts_per_decision_and_a_time_limit_bootstraps_whatever_the_chunk():
    """What the issue #39 cure rests on (docs/running.md, PPO guards): ``algo.gamma`` discounts
    once per decision, a chunk of K actions counting as one step, and an episode cut by
    ``env.episode_len`` bootstraps from its last value while one that reached the goal does not.
    With lambda 0 each return is then ``r_t + gamma * V_{t+1}`` (``V`` of the last observation at
    the time limit, nothing after a success)."""
    from dvla.rollout import collect_episodes

    cfg = debug()
    cfg.env.reward_shaping, cfg.env.episode_len = 1.0, 3
    env = make_env(cfg.env, seed=0)
    torch.manual_seed(0)
    spec = PolicySpec.for_env(env.spec, action_chunk=4)
    policy = build_policy("tiny_vla", spec, {**OPTIONS, "head": "gaussian"})
    learner = build_algorithm(AlgoConfig(name="ppo", gamma=0.5, gae_lambda=0.0), policy)
    batch = collect_episodes(env, policy, 3, group_size=1, generator=torch.Generator().manual_seed(0))
    assert batch.actions.shape[2] == 4 and batch.truncated.any()
    _, ret = learner.advantages(batch)
    nxt = torch.where(batch.truncated, batch.bootstrap, batch.values[1:])
    want = batch.rewards + 0.5 * nxt * (~batch.terminated).float()
    v = batch.valid
    assert torch.allclose(ret[v], want[v], atol=1e-6)
    if batch.terminated.any():  # a success: its reward alone, however many actions of the chunk ran
        assert torch.allclose(ret[batch.terminated], batch.rewards[batch.terminated], atol=1e-6)
