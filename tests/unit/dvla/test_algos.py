"""Loss terms against values computed by hand, and one update step of each algorithm."""

import math

import pytest
import torch

from dvla.algos import build_algorithm
from dvla.algos.base import obs_of
from dvla.algos.losses import clipped_policy_loss, gae, group_normalized_advantages, kl_k3
from dvla.config import AlgoConfig
from dvla.envs import make_env
from dvla.policy import PolicySpec, build_policy
from dvla.config.presets import debug
from dvla.rollout import collect_episodes


def test_clipped_policy_loss_by_hand():
    new = torch.tensor([math.log(1.5), math.log(0.5), 0.0], requires_grad=True)
    old = torch.zeros(3)
    adv = torch.tensor([1.0, -1.0, 2.0])
    loss, stats = clipped_policy_loss(new, old, adv, clip_eps=0.2)
    # ratios 1.5, 0.5, 1 -> min(r*A, clip(r)*A) = 1.2, -0.8, 2 -> loss = -(1.2 - 0.8 + 2) / 3
    assert loss.item() == pytest.approx(-0.8)
    assert stats["clip_frac"].item() == pytest.approx(2 / 3)
    kl = ((0.5 - math.log(1.5)) + (-0.5 - math.log(0.5)) + 0.0) / 3
    assert stats["approx_kl"].item() == pytest.approx(kl)
    loss.backward()
    # Clipped samples carry no gradient; the third has d(-r*A/3)/dlogp = -A/3.
    torch.testing.assert_close(new.grad, torch.tensor([0.0, 0.0, -2 / 3]))


def test_decoupled_loss_truncated_importance_weight():
    new = torch.tensor([math.log(1.5), math.log(0.5), 0.0])
    prox = torch.zeros(3)
    adv = torch.tensor([1.0, -1.0, 2.0])
    behav = torch.tensor([math.log(2.0), 0.0, 0.0])  # pi_prox / pi_behav = 0.5, 1, 1
    loss, _ = clipped_policy_loss(new, prox, adv, 0.2, behav_log_probs=behav)
    assert loss.item() == pytest.approx((-1.2 * 0.5 + 0.8 - 2.0) / 3)
    behav = torch.tensor([-math.log(2.0), 0.0, 0.0])  # weights 2, 1, 1; the 2 is truncated to 1.5
    loss, stats = clipped_policy_loss(new, prox, adv, 0.2, behav_log_probs=behav, max_is_weight=1.5)
    assert loss.item() == pytest.approx((-1.2 * 1.5 + 0.8 - 2.0) / 3)
    assert stats["is_weight_mean"].item() == pytest.approx(4 / 3)  # before truncation
    assert stats["is_weight_clipped"].item() == pytest.approx(1 / 3)
    _, stats = clipped_policy_loss(new, prox, adv, 0.2)
    assert "is_weight_mean" not in stats  # on-policy: no importance weight


def test_group_normalized_advantages_by_hand():
    returns = torch.tensor([1.0, 0.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    groups = torch.tensor([5, 5, 5, 5, 9, 9, 9, 9])
    adv = group_normalized_advantages(returns, groups, eps=0.0 + 1e-12)
    std = math.sqrt(0.1875)  # population std of (1, 0, 1, 1)
    expect = [0.25 / std, -0.75 / std, 0.25 / std, 0.25 / std, 0, 0, 0, 0]
    torch.testing.assert_close(adv, torch.tensor(expect))


def test_gae_by_hand():
    r = torch.tensor([[1.0], [0.0], [2.0]])
    v = torch.tensor([[0.5], [0.4], [0.3], [0.2]])
    no = torch.zeros(3, 1, dtype=torch.bool)
    last = torch.tensor([[False], [False], [True]])
    # Truncated at the end: bootstrap from v[3].
    adv, ret = gae(r, v, no, last, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.740992, 1.2236, 1.88]))
    torch.testing.assert_close(ret[:, 0], torch.tensor([2.240992, 1.6236, 2.18]))
    # Terminated at the end: no bootstrap.
    adv, _ = gae(r, v, last, last, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.64768, 1.094, 1.7]))
    # An episode that ends at t=0 does not see later rewards.
    first = torch.tensor([[True], [False], [False]])
    adv, _ = gae(r, v, first, first, gamma=0.9, lam=0.8)
    assert adv[0, 0].item() == pytest.approx(0.5)


def test_kl_k3_by_hand():
    val = kl_k3(torch.tensor([0.0, 0.3]), torch.tensor([math.log(2.0), 0.3]))
    torch.testing.assert_close(val, torch.tensor([2.0 - math.log(2.0) - 1.0, 0.0]))


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_update_moves_policy_towards_advantage(algo):
    cfg = debug()
    cfg.env.reward_shaping = 1.0
    env = make_env(cfg.env, seed=0)
    spec = PolicySpec.for_env(env.spec)
    policy = build_policy("tiny_vla", spec, cfg.policy.options)
    acfg = AlgoConfig(name=algo, group_size=4, lr=1e-2, update_epochs=1, minibatches=1, kl_coef=0.1)
    learner = build_algorithm(acfg, policy)
    batch = collect_episodes(env, policy, 6, group_size=acfg.group_size if algo == "grpo" else 1)
    adv, _ = learner.advantages(batch)
    before = [p.detach().clone() for p in policy.parameters()]
    stats = learner.update(batch, torch.Generator().manual_seed(0))
    assert stats["samples"] == batch.valid.sum().item()
    assert all(math.isfinite(v) for v in stats.values())
    assert any(not torch.equal(b, p) for b, p in zip(before, policy.parameters()))
    # The log-likelihood of the taken actions, weighted by advantage, went up.
    data = learner._flatten(batch, adv, adv)
    obs = obs_of(data)
    with torch.no_grad():
        new_lp = policy.evaluate(obs, data["actions"]).log_probs
    assert ((new_lp - data["behav_logp"]) * data["adv"]).sum() > 0
    if algo == "grpo":
        assert "kl_ref" in stats
    else:
        assert "value_loss" in stats


@pytest.mark.parametrize("train_mode", [False, True])
def test_with_dropout_the_ratio_of_unchanged_weights_is_one_in_the_rollouts_mode(train_mode):
    """A policy with heavy dropout, a learning rate of 0: in the rollouts' (eval) mode every
    ratio is exactly 1; in train mode dropout alone moves samples out of the clip range."""
    from torch import nn

    from dvla.algos import build_algorithm
    from dvla.config import AlgoConfig, EnvConfig
    from dvla.envs import make_env
    from dvla.models.tiny_vla import TinyVLA
    from dvla.policy import PolicySpec
    from dvla.rollout import collect_episodes

    class DropoutVLA(TinyVLA):
        def forward(self, obs):
            out = super().forward(obs)
            out.dist.mean = self.drop(out.dist.mean)  # the Gaussian head's mean, through dropout
            return out

    env = make_env(EnvConfig(name="fast_reach", n_envs=16, episode_len=6, image_size=16), "cpu", seed=0)
    torch.manual_seed(0)
    policy = DropoutVLA(PolicySpec.for_env(env.spec), TinyVLA.Config(head="gaussian"))
    policy.drop = nn.Dropout(0.5)
    with torch.no_grad():
        policy.log_std.fill_(-2.0)  # a narrow Gaussian: dropout on its mean moves log-probs a lot
    batch = collect_episodes(env, policy, 6, group_size=4, generator=torch.Generator().manual_seed(0))
    algo = build_algorithm(AlgoConfig(lr=0.0, group_size=4, update_epochs=1, minibatches=1, train_mode=train_mode),
                           policy)
    stats = algo.update(batch, torch.Generator().manual_seed(1))
    if train_mode:
        assert stats["clip_frac"] > 0.1 and stats["approx_kl"] > 1e-3, sorted(stats.items())
    else:
        assert stats["clip_frac"] == 0.0 and abs(stats["approx_kl"]) < 1e-6, stats


def _grouped_policy(groups_fn):
    from dvla.models.tiny_vla import TinyVLA
    from dvla.policy import PolicySpec

    class Grouped(TinyVLA):
        def optim_groups(self):
            return groups_fn(self)

    torch.manual_seed(0)
    return Grouped(PolicySpec((3, 16, 16), 4, 2), TinyVLA.Config())


def test_optim_groups_set_per_module_learning_rates_and_leave_frozen_parameters_out(tmp_path):
    from dvla.algos import build_algorithm
    from dvla.state.checkpoint import CheckpointManager
    from dvla.config import AlgoConfig
    from swimlane.agreement.checkpoints import RunCheckpoints

    def groups(policy):
        head = list(policy.action_head.parameters())
        rest = [p for p in policy.parameters() if all(p is not h for h in head)]
        return [{"params": rest, "lr": 1e-4, "weight_decay": 0.0}, {"params": head}]  # head: algo.lr, algo.wd

    policy = _grouped_policy(groups)
    policy.embed.requires_grad_(False)  # a frozen module
    algo = build_algorithm(AlgoConfig(lr=1e-3, weight_decay=0.01), policy)
    opt = algo.optimizer
    assert isinstance(opt, torch.optim.AdamW)
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(1e-4, 0.0), (1e-3, 0.01)]
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert all(id(p) not in in_opt for p in policy.embed.parameters())
    assert {id(p) for p in algo.params} == in_opt
    # The optimizer's state, groups included, survives a checkpoint.
    for p in algo.params:
        p.grad = torch.ones_like(p)
    opt.step()
    ck = RunCheckpoints(CheckpointManager(tmp_path), policy, algo, {})
    ck.save(1, {"env_steps": 0, "counters": {}})
    other = _grouped_policy(groups)
    other.embed.requires_grad_(False)
    algo2 = build_algorithm(AlgoConfig(lr=1e-3, weight_decay=0.01), other)
    RunCheckpoints(CheckpointManager(tmp_path), other, algo2, {}).resume(0)
    assert [g["lr"] for g in algo2.optimizer.param_groups] == [1e-4, 1e-3]
    p0 = algo2.params[0]
    assert torch.equal(algo2.optimizer.state[p0]["exp_avg"], opt.state[algo.params[0]]["exp_avg"])


def test_optim_groups_must_cover_every_trainable_parameter_once():
    from dvla.algos import build_algorithm
    from dvla.config import AlgoConfig

    missing = _grouped_policy(lambda p: [{"params": list(p.action_head.parameters())}])
    with pytest.raises(ValueError, match=r"trainable parameter\(s\) in no group: .*requires_grad_\(False\)"):
        build_algorithm(AlgoConfig(), missing)
    twice = _grouped_policy(lambda p: [{"params": list(p.parameters())}, {"params": list(p.action_head.parameters())}])
    with pytest.raises(ValueError, match=r"parameter action_head\.\S+ is in groups 0 and 1"):
        build_algorithm(AlgoConfig(), twice)


def test_weight_decay_runs_end_to_end_with_pooled_optimizer_state(tmp_path):
    from dvla.config import apply_overrides
    from dvla.config.presets import debug
    from swimlane import Swimlane

    lanes = Swimlane(apply_overrides(debug(), ["algo.weight_decay=0.05", "run.iterations=2",
                                              f"run.out_dir={tmp_path}"]))
    assert isinstance(lanes.algo.optimizer, torch.optim.AdamW) and lanes.memory is not None
    assert lanes.run()["version"] == 2
