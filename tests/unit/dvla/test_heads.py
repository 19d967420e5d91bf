"""Action heads that record rollout extras: the flow-matching head's exact log-prob, its
extras from rollout to learner (in one process and over the data plane), and learning."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tests.helpers.ranks import torchrun_job


from dvla.config import apply_overrides
from dvla.envs import make_env
from dvla.heads.flow import FlowMatchingHead, MLPVelocity
from dvla.policy import PolicySpec, build_policy
from dvla.config.presets import debug, fast_reach
from dvla.rollout import collect_episodes
from dvla.types import Observation
from swimlane.lanes.chunks import ChunkError, batch_from_tensors
from swimlane.lanes.validate import ChunkSpec, check_chunk


def test_the_flow_heads_log_prob_is_that_of_its_gaussian_transitions():
    """Replay the chain by hand from the same random stream: the actions, the chain and the
    log-prob (a sum of Normal log-densities, one per transition) must be what the head says."""
    torch.manual_seed(0)
    head = FlowMatchingHead(MLPVelocity(6, 3, 2, hidden_dim=32), action_chunk=3, action_dim=2, steps=5,
                            init_log_sigma=-1.0)
    with torch.no_grad():
        head.log_sigma.copy_(torch.linspace(-2.0, -0.5, 6).reshape(3, 2))
    cond = torch.randn(4, 6)
    draw = head(cond).draw(generator=torch.Generator().manual_seed(7))

    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 3, 2, generator=g)
    sigma = head.log_sigma.exp()
    chain, log_prob = [x], torch.zeros(4)
    for i in range(5):
        t = torch.full((4, 1), i / 5)
        feats = torch.cat([(t * 1000 * torch.exp(torch.arange(8) * (-math.log(1000.0) / 8))).sin(),
                           (t * 1000 * torch.exp(torch.arange(8) * (-math.log(1000.0) / 8))).cos()], dim=1)
        v = head.velocity_model.net(torch.cat([x.reshape(4, -1), feats, cond], dim=1)).reshape(4, 3, 2)
        mean = x + v / 5
        x = mean + sigma * torch.randn(4, 3, 2, generator=g)
        log_prob += torch.distributions.Normal(mean, sigma).log_prob(x).sum(dim=(1, 2))
        chain.append(x)
    assert torch.allclose(draw.actions, x, atol=1e-6)
    assert torch.allclose(draw.extras["chain"], torch.stack(chain[:-1], dim=1), atol=1e-6)
    assert torch.allclose(draw.log_prob, log_prob, atol=1e-4)
    assert torch.allclose(draw.elements.sum(dim=(1, 2)), draw.log_prob, atol=1e-5)
    # The learner's path (from the recorded chain, with gradients) gives the same numbers.
    scored = head(cond).log_prob(draw.actions, draw.extras)
    assert torch.allclose(scored, log_prob, atol=1e-4)
    scored.sum().backward()
    assert head.velocity_model.net[-1].weight.grad.abs().sum() > 0 and head.log_sigma.grad.abs().sum() > 0
    # Another chain ending in the same action is another probability: the chain is what counts.
    other = {"chain": draw.extras["chain"] + 0.1}
    assert not torch.allclose(head(cond).log_prob(draw.actions, other), log_prob, atol=1e-2)


class _Mixing(torch.nn.Module):
    """A velocity whose real dims read the padded ones (as pi0's action_in_proj does)."""

    def __init__(self, width: int):
        super().__init__()
        self.w = torch.nn.Linear(width, width)

    def forward(self, x, t, cond):
        return self.w(x) + cond[:, None, :1] * t[:, None, None]


def test_a_padded_chain_is_scored_over_everything_it_sampled():
    """``pad_to``: the chain runs in 5 dims, the action is its first 2; the padded dims of the
    last step travel as ``chain_pad``, and the learner's log-prob is the draw's, the joint
    being the sum of all 5 dims' transitions (the per-dim elements still sum to it)."""
    torch.manual_seed(0)
    head = FlowMatchingHead(_Mixing(5), action_chunk=3, action_dim=2, steps=4, init_log_sigma=-1.0, pad_to=5)
    cond = torch.randn(6, 3)
    draw = head(cond).draw(generator=torch.Generator().manual_seed(3))
    assert draw.actions.shape == (6, 3, 2) and draw.extras["chain"].shape == (6, 4, 3, 5)
    assert draw.extras["chain_pad"].shape == (6, 3, 3) and set(head.rollout_extras()) == {"chain", "chain_pad"}
    assert torch.allclose(draw.elements.sum(dim=(1, 2)), draw.log_prob, atol=1e-5)
    # By hand: the Gaussian transitions of all five dims.
    chain = draw.extras["chain"]
    last = torch.cat([draw.actions, draw.extras["chain_pad"]], dim=-1)
    nexts = torch.cat([chain[:, 1:], last[:, None]], dim=1)
    sigma, want = head.log_sigma.exp(), torch.zeros(6)
    for i in range(4):
        mean = chain[:, i] + head.velocity_model(chain[:, i], torch.full((6,), i / 4), cond) / 4
        want += torch.distributions.Normal(mean, sigma).log_prob(nexts[:, i]).sum(dim=(1, 2))
    assert torch.allclose(draw.log_prob, want, atol=1e-4)
    for batch_steps in (True, False):
        head.batch_steps = batch_steps
        assert torch.allclose(head(cond).log_prob(draw.actions, draw.extras), want, atol=1e-4)
    # The padded dims count: other padding is another probability.
    other = {**draw.extras, "chain_pad": draw.extras["chain_pad"] + 0.5}
    assert not torch.allclose(head(cond).log_prob(draw.actions, other), want, atol=1e-2)
    with pytest.raises(ValueError, match=r"extras\['chain_pad'\] of shape \(6, 3, 3\) is needed, got None"):
        head(cond).log_prob(draw.actions, {"chain": chain})
    # Imitation: zero-padded targets, the error over the real dims.
    loss, _ = head(cond).imitation_loss(torch.randn(6, 3, 2), generator=torch.Generator().manual_seed(1))
    assert loss.ndim == 0 and loss > 0
    with pytest.raises(ValueError, match="pad_to"):
        FlowMatchingHead(_Mixing(5), 3, 2, pad_to=1)


def test_only_a_flow_chain_samples_at_temperature_zero():
    """Temperature 0: a flow chain draws its start and integrates without noise (pi0's sampler),
    scored at its own sigma; a Gaussian or bins have no such thing and say so."""
    from dvla.distributions import BinnedActionDistribution, GaussianActionDistribution

    head = FlowMatchingHead(MLPVelocity(4, 2, 3, hidden_dim=8), 2, 3, steps=3)
    cond = torch.randn(5, 4)
    a = head(cond).tempered(0.0).draw(generator=torch.Generator().manual_seed(2))
    b = head(cond).tempered(0.0).draw(generator=torch.Generator().manual_seed(2))
    start = torch.randn(5, 2, 3, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a.actions, b.actions) and torch.isfinite(a.log_prob).all()
    assert torch.allclose(a.actions, head(cond).draw(deterministic=True, start=start).actions)
    assert not torch.allclose(a.actions, head(cond).mode())
    for dist in (GaussianActionDistribution(torch.zeros(2, 3), torch.zeros(2, 3)),
                 BinnedActionDistribution(torch.zeros(2, 1, 3, 5))):
        with pytest.raises(ValueError, match="must be > 0, got 0"):
            dist.tempered(0.0)


def test_the_flow_head_refuses_to_score_without_its_chain():
    head = FlowMatchingHead(MLPVelocity(4, 2, 3, hidden_dim=8), 2, 3, steps=3)
    dist = head(torch.zeros(5, 4))
    with pytest.raises(ValueError, match=r"extras\['chain'\] of shape \(5, 3, 2, 3\) is needed, got None"):
        dist.log_prob(torch.zeros(5, 2, 3))
    with pytest.raises(ValueError, match=r"got \(5, 2, 2, 3\)"):
        dist.log_prob(torch.zeros(5, 2, 3), {"chain": torch.zeros(5, 2, 2, 3)})


def test_recorded_chains_reach_the_learner_and_score_a_ratio_of_one():
    cfg = apply_overrides(debug(), ["env.image_size=16", "policy.action_chunk=2"])
    env = make_env(cfg.env, "cpu", seed=0)
    policy = build_policy("tiny_vla", PolicySpec.for_env(env.spec, 2),
                          {"hidden_dim": 16, "vision_channels": 4, "embed_dim": 4, "head": "flow", "flow_steps": 3})
    batch = collect_episodes(env, policy, episode_len=5, generator=torch.Generator().manual_seed(1))
    chain = batch.extras["chain"]
    assert chain.shape == (batch.num_steps, env.n_envs, 3, 2, env.spec.action_dim) and chain.abs().sum() > 0
    # Through the data plane's decoding, checked against the policy's declaration.
    spec = ChunkSpec.for_policy(policy, env.n_envs, 5)
    again = batch_from_tensors(batch.to_dict(), spec.optional_fields())
    assert torch.equal(again.extras["chain"], chain) and check_chunk(again, spec, learner_version=0) is None
    # The learner, at the rollout's weights, finds the behaviour log-probs again: ratio 1.
    t, b = batch.valid.nonzero(as_tuple=True)
    obs = Observation(image=batch.image[t, b], proprio=batch.proprio[t, b], instruction_ids=batch.instruction_ids[b])
    out = policy.evaluate(obs, batch.actions[t, b], batch.action_valid[t, b], "joint", {"chain": chain[t, b]})
    assert torch.allclose(out.log_probs, batch.log_probs[t, b], atol=1e-4)
    # A chunk without its chain, or with a chain of the wrong shape or with NaN, is refused.
    tensors = batch.to_dict()
    with pytest.raises(ChunkError, match=r"missing \['extras.chain'\]"):
        batch_from_tensors({k: v for k, v in tensors.items() if k != "extras.chain"}, spec.optional_fields())
    with pytest.raises(ChunkError, match="unexpected"):
        batch_from_tensors(tensors)  # a learner whose policy records no chain
    short = type(batch).from_dict({**tensors, "extras.chain": chain[:, :, :2]})
    assert check_chunk(short, spec, 0)[0] == "shape"
    nan = chain.clone()
    nan[0, 0, 0, 0, 0] = float("nan")
    assert check_chunk(type(batch).from_dict({**tensors, "extras.chain": nan}), spec, 0)[0] == "non_finite"


@pytest.mark.slow
def test_the_flow_head_learns_fast_reach(tmp_path):
    """Serial reference driver, fixed seed: success rises from chance (about 0.2) to most
    episodes within 30 updates. 16 px and 32 envs (the preset's 32 px and 64 envs took twice
    the time): success 0.15 -> 0.82, first and last 5 updates (0.15 -> 0.93 with the preset's)."""
    from swimlane import Swimlane

    cfg = apply_overrides(fast_reach(), ["policy.options.head=flow", "swimlane.mode=sync", "swimlane.driver=serial",
                                         "run.iterations=30", "env.image_size=16", "env.n_envs=32",
                                         "run.progress=false", f"run.out_dir={tmp_path}"])
    lanes = Swimlane(cfg)
    lanes.run()
    rows = [json.loads(line) for line in open(lanes.out_dir / "metrics.jsonl")]
    success = [r["success_rate"] for r in rows]
    assert sum(success[-5:]) / 5 > sum(success[:5]) / 5 + 0.3, success


@pytest.mark.slow
def test_chains_travel_over_the_data_plane(tmp_path):
    """torchrun, two processes: rank 1 samples with the flow head and sends chunks (with
    their chains) over ZeroMQ to rank 0, which checks and learns from them."""
    out = torchrun_job(tmp_path, "flow", ["run.iterations=4", "policy.options.head=flow", "policy.action_chunk=2",
                                          "swimlane.colocate=false"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["version"] == 4 and summary["chunks_consumed"] >= 4
    assert all(v == 0 for k, v in summary.items() if k.startswith("rejected_") and isinstance(v, int))
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert all(math.isfinite(r["loss"]) and r["approx_kl"] < 0.1 for r in rows)


def _tiny_lm(vocab: int = 96):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("decoding", ["autoregressive", "parallel"])
def test_the_token_heads_log_probs_match_a_direct_computation(decoding):
    """Sampling over the KV cache (autoregressive) or in one pass (parallel) gives the same
    log-probs as the learner's scoring and as a step-by-step forward pass without a cache."""
    from dvla.heads.tokens import TOKENS, TokenActionHead

    lm = _tiny_lm()
    head = TokenActionHead(vocab_size=96, n_bins=11, action_chunk=2, action_dim=3, hidden_size=32, decoding=decoding)
    prefix = torch.randn(3, 5, 32)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 1], [1, 0, 1, 1, 1]], dtype=torch.bool)  # padding inside
    with torch.no_grad():
        draw = head(lm, prefix, mask).draw(generator=torch.Generator().manual_seed(3))
    tokens = draw.extras[TOKENS]
    assert tokens.shape == (3, 6) and bool(((tokens >= 85) & (tokens < 96)).all())
    assert torch.allclose(draw.actions, ((tokens - 85).float() / 5 - 1).reshape(3, 2, 3))
    # Direct: each position's logits from a full forward pass over the prefix and what precedes it.
    embed = lm.get_input_embeddings()
    direct = torch.zeros(3, 6)
    with torch.no_grad():
        for j in range(6):
            if decoding == "autoregressive":
                x = torch.cat([prefix, embed(tokens[:, :j])], 1)
            else:
                x = torch.cat([prefix, head.queries.expand(3, -1, -1)], 1)
            m = torch.cat([mask, torch.ones(3, x.shape[1] - 5, dtype=torch.bool)], 1).long()
            logits = lm(inputs_embeds=x, attention_mask=m).logits
            pos = -1 if decoding == "autoregressive" else 5 + j
            log_p = torch.log_softmax(logits[:, pos, 85:], -1)
            direct[:, j] = log_p.gather(1, (tokens[:, j] - 85).unsqueeze(1)).squeeze(1)
    assert torch.allclose(draw.elements.reshape(3, 6), direct, atol=1e-5)
    scored = head(lm, prefix, mask).log_prob(draw.actions, draw.extras)  # teacher forcing, with gradients
    assert torch.allclose(scored, direct.sum(1), atol=1e-5) and torch.allclose(draw.log_prob, scored, atol=1e-5)
    scored.sum().backward()
    assert lm.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    assert head(lm, prefix, mask).entropy(draw.extras).shape == (3,)
    with torch.no_grad():
        greedy = head(lm, prefix, mask).draw(deterministic=True)
    assert torch.allclose(greedy.log_prob, head(lm, prefix, mask).log_prob(greedy.actions, greedy.extras), atol=1e-5)
    with pytest.raises(ValueError, match=r"extras\['action_tokens'\] of shape \(3, 6\) is needed, got None"):
        head(lm, prefix, mask).log_prob(draw.actions)
