"""``policy.temperature``: rollouts sample from, and the learner scores under, every head's
distribution at the run's temperature; the most likely actions do not move."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dvla.config import apply_overrides
from dvla.envs import make_env
from dvla.heads.tokens import TokenActionHead
from dvla.policy import PolicySpec, build_policy
from dvla.config.presets import debug
from dvla.types import Observation

SMALL = {"hidden_dim": 16, "vision_channels": 4, "embed_dim": 4, "n_bins": 21, "flow_steps": 3, "init_log_std": -1.0}


def _obs(env, n: int) -> Observation:
    obs = env.reset()
    return Observation(image=obs.image[:n], proprio=obs.proprio[:n], instruction=obs.instruction[:n])


@pytest.mark.parametrize("head", ["gaussian", "bins", "flow"])
def test_a_policy_samples_and_scores_at_its_temperature(head):
    env = make_env(apply_overrides(debug(), ["env.image_size=16"]).env, "cpu", seed=0)
    spec = PolicySpec.for_env(env.spec, 2)
    torch.manual_seed(0)
    hot = build_policy("tiny_vla", spec, {**SMALL, "head": head})
    if head == "bins":  # logits far from uniform (they start near it)
        with torch.no_grad():
            hot.action_head.weight.normal_(std=1.0)
    cold = build_policy("tiny_vla", spec, {**SMALL, "head": head}, temperature=0.25)
    cold.load_state_dict(hot.state_dict())
    obs = _obs(env, 6)
    # The most likely actions are the same at any temperature.
    assert torch.equal(hot.act(obs, deterministic=True).actions, cold.act(obs, deterministic=True).actions)
    # The learner finds the rollout's log-probs again (a ratio of 1 at unchanged weights) ...
    drawn = cold.act(obs, generator=torch.Generator().manual_seed(1))
    valid = torch.ones(6, 2, dtype=torch.bool)
    scored = cold.evaluate(obs, drawn.actions, valid, "joint", drawn.extras)
    assert torch.allclose(scored.log_probs, drawn.log_probs, atol=1e-4)
    # ... which a policy at another temperature does not.
    assert not torch.allclose(hot.evaluate(obs, drawn.actions, valid, "joint", drawn.extras).log_probs,
                              drawn.log_probs, atol=1e-2)
    entropy = scored.entropy.detach()
    hot_entropy = hot.evaluate(obs, drawn.actions, valid, "joint", drawn.extras).entropy.detach()
    if head == "bins":  # sharper logits
        assert bool((entropy < hot_entropy - 3.0).all())
    else:  # a Gaussian's std, a chain's noise: every dimension of every (transition) step times 0.25
        dims = 2 * env.spec.action_dim * (3 if head == "flow" else 1)
        assert torch.allclose(entropy, hot_entropy + dims * math.log(0.25), atol=1e-4)
    # A Gaussian's samples: the same noise at a quarter of the spread.
    if head == "gaussian":
        mode = cold.act(obs, deterministic=True).actions
        hot_drawn = hot.act(obs, generator=torch.Generator().manual_seed(1)).actions
        assert torch.allclose(drawn.actions - mode, 0.25 * (hot_drawn - mode), atol=1e-5)


def test_the_token_head_divides_its_logits_by_the_temperature():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128)).eval()
    head = TokenActionHead(vocab_size=96, n_bins=11, action_chunk=2, action_dim=3, hidden_size=32)
    prefix, mask = torch.randn(3, 5, 32), torch.ones(3, 5, dtype=torch.bool)
    with torch.no_grad():
        dist = head(lm, prefix, mask)
        cold = dist.tempered(0.5)
        drawn = cold.draw(generator=torch.Generator().manual_seed(3))
        assert torch.equal(cold.draw(deterministic=True).actions, dist.draw(deterministic=True).actions)
        # Scored with teacher forcing: the same log-probs as drawn, and those of logits / 0.5.
        assert torch.allclose(head(lm, prefix, mask).tempered(0.5).log_prob(drawn.actions, drawn.extras),
                              drawn.log_prob, atol=1e-5)
        logits = lm(inputs_embeds=torch.cat([prefix, lm.get_input_embeddings()(drawn.extras["action_tokens"][:, :5])], 1),
                    attention_mask=torch.ones(3, 10, dtype=torch.long)).logits[:, 4:, 85:]
        direct = torch.log_softmax(logits / 0.5, -1).gather(-1, (drawn.extras["action_tokens"] - 85).unsqueeze(-1))
        assert torch.allclose(drawn.elements.reshape(3, 6), direct.squeeze(-1), atol=1e-5)
        assert bool((cold.entropy(drawn.extras) < dist.entropy(drawn.extras)).all())


def test_an_rl_run_samples_and_learns_at_the_configured_temperature(tmp_path):
    """Through the product's own wiring (the serial driver): the learner's first update sees
    the entropy of a Gaussian head at temperature 0.5 and scores the rollouts at a ratio of 1."""
    from swimlane import Swimlane

    cfg = apply_overrides(debug(), ["policy.options.head=gaussian", "policy.options.init_log_std=-1.0",
                                    "policy.temperature=0.5", "algo.lr=1e-12", "run.iterations=1",
                                    "swimlane.mode=sync", "swimlane.driver=serial", "env.image_size=16",
                                    f"run.out_dir={tmp_path}"])
    lanes = Swimlane(cfg)
    lanes.run()
    row = json.loads(open(lanes.out_dir / "metrics.jsonl").readline())
    dims = cfg.policy.action_chunk * make_env(cfg.env, "cpu", seed=0).spec.action_dim
    assert row["entropy"] == pytest.approx(dims * (0.5 + 0.5 * math.log(2 * math.pi) - 1.0 + math.log(0.5)), abs=1e-3)
    assert abs(row["approx_kl"]) < 1e-4

