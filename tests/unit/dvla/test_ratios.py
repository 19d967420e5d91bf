"""Importance ratios per chunk, per chunk step or per action dimension (``algo.ratio``), and
the actions of a chunk the env never applied (the episode ended inside it) left out of all
of them: checked by hand on small tensors, on a recorded batch, and in a training run."""

from __future__ import annotations

import math

import pytest
import torch

from dvla.algos.losses import clipped_policy_loss
from dvla.config import EnvConfig, apply_overrides
from dvla.distributions import ActionDistribution, GaussianActionDistribution
from dvla.envs.base import BatchedEnv, EnvSpec
from dvla.policy import ActOutput, chunk_log_probs
from dvla.config.presets import fast_reach
from dvla.rollout import EpisodeRecorder
from dvla.types import Observation


def test_per_step_ratios_are_clipped_each_and_masked_entries_count_for_nothing():
    new = torch.tensor([[0.5, 0.0], [0.1, 9.0]])  # (N=2, K=2); the last entry is masked
    old = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[True, True], [True, False]])
    loss, stats = clipped_policy_loss(new, old, adv, 0.2, mask=mask)
    r = [math.exp(0.5), 1.0, math.exp(0.1)]
    # sample 0: adv 1, ratios e^0.5 (clipped to 1.2) and 1; sample 1: adv -2, ratio e^0.1 (inside)
    per = [-min(r[0] * 1, 1.2 * 1), -1.0, -min(r[2] * -2, min(max(r[2], 0.8), 1.2) * -2)]
    assert loss.item() == pytest.approx(sum(per) / 3, abs=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(1 / 3)
    # The joint ratio over the same sample moves by the product: e^0.5 * e^0 = e^0.5 for
    # sample 0, and a masked entry never enters it.
    joint, _ = clipped_policy_loss((new * mask).sum(1), old.sum(1), adv, 0.2)
    r1 = math.exp(0.1)
    assert joint.item() == pytest.approx((-min(math.exp(0.5), 1.2) - min(r1 * -2, min(max(r1, 0.8), 1.2) * -2)) / 2,
                                         abs=1e-6)


def test_per_dimension_ratios_with_importance_weights():
    new = torch.zeros(1, 1, 3)
    prox = torch.tensor([[[0.0, 0.0, -1.0]]])
    behav = torch.tensor([[[0.0, -1.0, 0.0]]])
    loss, stats = clipped_policy_loss(new, prox, torch.tensor([1.0]), 0.2, behav_log_probs=behav, max_is_weight=2.0)
    # ratios new/prox: 1, 1, e (clipped 1.2 since adv > 0); weights prox/behav: 1, e (capped 2), e^-1
    expected = -(1.0 * 1.0 + 1.0 * 2.0 + 1.2 * math.exp(-1.0)) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["is_weight_clipped"].item() == pytest.approx(1 / 3)


class _EndsAt(BatchedEnv):
    """Env i terminates at its ``ends[i]``-th action (1-based), inside the first chunk."""

    spec = EnvSpec(image_shape=(3, 4, 4), proprio_dim=2, action_dim=2)

    def __init__(self, ends):
        super().__init__(EnvConfig(name="fast_reach", n_envs=len(ends), episode_len=3, image_size=4))
        self.ends, self.count = torch.tensor(ends), 0

    def _reset(self, group_size):
        self.count = 0

    def _step_action(self, action):
        self.count += 1
        te = self.count >= self.ends
        z = torch.zeros(self.n_envs)
        return z, te, torch.zeros_like(te), te

    def _observe(self):
        return Observation(image=torch.zeros(self.n_envs, 3, 4, 4, dtype=torch.uint8),
                           proprio=torch.zeros(self.n_envs, 2), instruction_ids=torch.ones(self.n_envs, 2).long(),
                           instruction_mask=torch.ones(self.n_envs, 2, dtype=torch.bool))


def test_actions_after_the_end_inside_a_chunk_are_masked_in_the_behaviour_log_prob():
    env = _EndsAt([1, 2, 9])  # K = 3: env 0 ends at its first action, env 1 at its second, env 2 runs on
    rec = EpisodeRecorder(env, action_chunk=3, episode_len=2)
    obs = env.reset()
    rec.start(obs)
    dist = GaussianActionDistribution(torch.zeros(3, 3, 2), torch.zeros(3, 2))
    actions = dist.sample(torch.Generator().manual_seed(0))
    elements = dist.log_prob_elements(actions)
    res = env.step(actions)
    assert res.executed.tolist() == [1, 2, 3]
    rec.record(ActOutput(actions, elements.sum((1, 2)), torch.zeros(3), elements), res, version=0)
    batch = rec.build(torch.arange(3))
    assert batch.action_valid[0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    for i, n in enumerate([1, 2, 3]):
        assert batch.log_probs[0, i].item() == pytest.approx(elements[i, :n].sum().item(), rel=1e-6)
    # The learner's log-probs of the same actions, at each granularity, with the same mask.
    valid = batch.action_valid[0]
    assert torch.allclose(chunk_log_probs(dist, actions, valid, "joint"), batch.log_probs[0])
    assert torch.allclose(chunk_log_probs(dist, actions, valid, "step"), batch.action_log_probs[0].sum(-1))
    assert torch.allclose(chunk_log_probs(dist, actions, valid, "dim"), batch.action_log_probs[0])


def test_a_head_without_per_dimension_log_probs_takes_only_the_joint_ratio():
    class Opaque(ActionDistribution):
        def log_prob(self, actions, extras=None):
            return torch.zeros(actions.shape[0])

    a = torch.zeros(2, 3, 2)
    assert chunk_log_probs(Opaque(), a, None, "joint").shape == (2,)
    with pytest.raises(ValueError, match=r"algo.ratio=step needs per-dimension log-probs, and Opaque has no "
                                         r"log_prob_elements: use algo.ratio=joint"):
        chunk_log_probs(Opaque(), a, None, "step")


@pytest.mark.parametrize("ratio", ["step", "dim"])
def test_training_with_per_step_and_per_dimension_ratios(tmp_path, ratio):
    from swimlane import Swimlane

    cfg = apply_overrides(fast_reach(), [f"algo.ratio={ratio}", "policy.action_chunk=3", "run.iterations=3",
                                         "env.image_size=16", "run.progress=false", f"run.out_dir={tmp_path}"])
    lanes = Swimlane(cfg)
    summary = lanes.run()
    assert summary["version"] == 3 and summary["rejected_shape"] == 0
    assert all(bool(torch.isfinite(p).all()) for p in lanes.policy.parameters())
