"""pi0_vla (a PaliGemma-shaped prefix and an action expert reading its per-layer KV cache) and
the flow head's velocity-model contract: learning, the chain's log-prob, pi0's block-causal
mask, the cache against a pass over the whole sequence, FSDP units, LoRA, loading a pi0
checkpoint, the 3B shape, and a plugin expert passed to the head without subclassing it."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from torch import nn

from dvla.config import EnvConfig, apply_overrides
from dvla.envs import make_env
from dvla.heads.flow import FlowMatchingHead, time_features
from dvla.policy import PolicyOutput, PolicySpec, VLAPolicy, build_policy, register_policy
from dvla.config.presets import fast_reach
from dvla.rollout import collect_episodes
from dvla.types import Observation

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

TINY = {"vision": {"image_size": 16}, "flow_steps": 3, "max_tokens": 8}


def _setup(wrist: int = 8, **options):
    env = make_env(EnvConfig(name="fast_reach", n_envs=4, image_size=16, options={"wrist_camera": wrist}), seed=0)
    torch.manual_seed(0)
    policy = build_policy("pi0_vla", PolicySpec.for_env(env.spec, 2), {**TINY, **options})
    obs = policy.preprocess(policy.prepare(env.reset()))
    return env, policy, obs


@pytest.mark.slow
def test_pi0_vla_learns_fast_reach(tmp_path, capsys):
    """The tiny shape cut to one vision and one prefix (and so expert) layer (0.13M
    parameters), serial driver, 4 denoising steps: success from chance to most episodes in 18
    updates. Measured, first and last 5 updates, run.seed 0 (this test): 0.14 -> 0.73 (run.seed
    1: a rise of 0.36); about 11 s of one core (two layers each, 20 updates: 0.16 -> 0.61, 14 s)."""
    from swimlane import Swimlane

    cfg = apply_overrides(fast_reach(), [
        "policy.name=pi0_vla", "policy.options={}", 'policy.options.vision={"image_size": 16, "num_hidden_layers": 1}',
        'policy.options.lm={"layers": 1}', "policy.options.flow_steps=4", "policy.options.max_tokens=8",
        "policy.options.init_log_sigma=-0.5", "policy.options.pad_action_dim=4", "policy.options.pad_state_dim=4",
        "env.image_size=16", "env.n_envs=32", "algo.lr=2e-3",
        "swimlane.mode=sync", "swimlane.driver=serial", "run.iterations=18", "run.progress=false",
        f"run.out_dir={tmp_path}"])
    lanes = Swimlane(cfg)
    lanes.run()
    success = [json.loads(line)["success_rate"] for line in open(lanes.out_dir / "metrics.jsonl")]
    assert sum(success[-5:]) / 5 > sum(success[:5]) / 5 + 0.3, success
    # The trained run through `dvla export`: openpi's layout, which pi0_vla loads back to the same
    # actions; LeRobot's needs the LeRobot checkpoint the run started from (it has none).
    from dvla.app.export import main as export
    from dvla.evaluation.score import load_policy

    assert export([str(lanes.out_dir), "--format", "openpi", "--out", str(tmp_path / "openpi")]) == 0
    _, trained, _ = load_policy(lanes.out_dir)
    options = {**cfg.policy.options, "pretrained_path": str(tmp_path / "openpi")}
    again = build_policy("pi0_vla", trained.spec, options).eval()
    obs = make_env(cfg.env, seed=3).reset()
    assert torch.allclose(again.act(obs, deterministic=True).actions, trained.act(obs, deterministic=True).actions,
                          atol=1e-5)
    assert export([str(lanes.out_dir), "--format", "lerobot", "--out", str(tmp_path / "lerobot")]) == 2
    assert "config.json of the checkpoint the run started from" in capsys.readouterr().err


def test_the_prefix_runs_once_per_decision_in_the_rollout_and_in_learning():
    """act() computes the prefix once and runs the expert once per denoising step over its
    cache; evaluate() (the learner) computes the prefix once per sample and scores all steps
    in one batched call of the expert."""
    env, policy, _ = _setup()
    calls = {"prefix": 0, "expert": 0}
    policy.lm.layers[0].register_forward_hook(lambda *a: calls.__setitem__("prefix", calls["prefix"] + 1))
    policy.expert.register_forward_hook(lambda *a: calls.__setitem__("expert", calls["expert"] + 1))
    raw = env.reset()
    out = policy.act(raw)
    assert calls == {"prefix": 1, "expert": 3}
    calls.update(prefix=0, expert=0)
    policy.evaluate(raw, out.actions, extras=out.extras)
    assert calls == {"prefix": 1, "expert": 1}


def test_the_chain_log_prob_is_its_transitions_scored_by_the_expert():
    """Replay the noisy chain by hand with the expert over the cached prefix: the actions,
    the chain and the log-prob are what the head's draw says, and the learner's scoring (all
    steps in one batched call, or step by step) finds them again, with gradients reaching the
    expert and the prefix."""
    _, policy, obs = _setup()
    out = policy(obs)
    cache, sigma, n = out.dist.cond, out.dist.log_sigma.exp(), 3
    draw = out.dist.draw(generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 2, 2, generator=g)
    chain, log_prob = [], torch.zeros(4)
    for i in range(n):
        chain.append(x)
        mean = x + policy.expert(x, torch.full((4,), i / n), cache) / n
        x = mean + sigma * torch.randn(4, 2, 2, generator=g)
        log_prob += torch.distributions.Normal(mean, sigma).log_prob(x).sum(dim=(1, 2))
    assert torch.allclose(draw.actions, x, atol=1e-5)
    assert torch.allclose(draw.extras["chain"], torch.stack(chain, dim=1), atol=1e-5)
    assert torch.allclose(draw.log_prob, log_prob, atol=1e-4)
    batched = out.dist.log_prob_elements(draw.actions, draw.extras)
    policy.action_head.batch_steps = False
    stepwise = policy(obs).dist.log_prob_elements(draw.actions, draw.extras)
    assert torch.allclose(batched, stepwise, atol=1e-5) and torch.allclose(batched.sum(dim=(1, 2)), log_prob, atol=1e-4)
    batched.sum().backward()
    for unit in (policy.expert.layers[0].self_attn.q_proj, policy.lm.layers[0].mlp.up_proj, policy.projector):
        assert unit.weight.grad is not None and unit.weight.grad.abs().sum() > 0


def test_the_prefix_cache_and_the_block_causal_mask():
    """The velocity from the cached prefix is that of one pass over the whole sequence under
    pi0's mask; the prefix's keys depend on neither the actions nor the state; the actions
    depend on the prefix (the instruction) and on the state."""
    from dvla.models.pi0_vla import Pi0Expert, block_mask

    pad = torch.tensor([[True, True, False, True, True, True]])
    blocks = torch.cat([torch.zeros(3, dtype=torch.long), torch.tensor([1, 2, 2])])
    want = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],  # prefix (a pad sees itself)
                         [1, 1, 0, 1, 0, 0],  # the state: the prefix and itself
                         [1, 1, 0, 1, 1, 1], [1, 1, 0, 1, 1, 1]], dtype=torch.bool)  # actions: everything
    assert torch.equal(block_mask(pad, blocks)[0], want)

    _, policy, obs = _setup()
    cache, _ = policy.encode_prefix(obs)
    x, t = torch.randn(4, 2, 2), torch.tensor([0.0, 0.25, 0.5, 0.75])
    joint, keys = policy.joint_velocity(obs, x, t)
    assert torch.allclose(policy.expert(x, t, cache), joint, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(keys, cache.keys))
    moved = dataclasses.replace(obs, proprio=obs.proprio + 1.0)
    other_v, other_keys = policy.joint_velocity(moved, x + 1.0, t)
    assert all(torch.equal(a, b) for a, b in zip(keys, other_keys))  # the prefix sees no state, no actions
    assert not torch.allclose(other_v, joint, atol=1e-3)
    ids = obs.instruction_ids.clone()
    ids[:, 0] = (ids[:, 0] + 7) % policy.lm.embed_tokens.num_embeddings
    new_cache, _ = policy.encode_prefix(dataclasses.replace(obs, instruction_ids=ids))
    assert not torch.allclose(new_cache.keys[0], cache.keys[0])
    assert not torch.allclose(policy.expert(x, t, new_cache), joint, atol=1e-4)
    assert not torch.allclose(policy(dataclasses.replace(obs, instruction_ids=ids)).dist.mode(),
                              policy(obs).dist.mode(), atol=1e-4)


@pytest.mark.parametrize("version", ["pi0", "pi05"])
def test_each_shard_unit_uses_its_weights_only_in_its_own_forward(version):
    """As FSDP does, each unit's weights exist only while its forward runs (NaN otherwise):
    the rollout's draw and the learner's scoring stay finite. The reference pass over the
    whole sequence, which mixes a prefix and an expert layer, does not."""
    env, policy, obs = _setup(version=version)
    units = policy.shard_units()
    n_layers = len(policy.lm.layers)
    assert len(units) == 2 + 2 * n_layers and units[-1] is policy.expert.layers[-1]
    for unit in units:
        real = {name: p.detach().clone() for name, p in unit.named_parameters()}

        def gather(mod, *_, real=real):
            with torch.no_grad():
                for name, p in mod.named_parameters():
                    p.copy_(real[name])

        def free(mod, *_):
            with torch.no_grad():
                for p in mod.parameters():
                    p.fill_(float("nan"))

        free(unit)
        unit.register_forward_pre_hook(gather)
        unit.register_forward_hook(free)
    out = policy(obs)
    draw = out.dist.draw()
    assert torch.isfinite(draw.actions).all() and torch.isfinite(draw.log_prob).all()
    assert torch.isfinite(out.dist.log_prob_elements(draw.actions, draw.extras)).all()
    assert not torch.isfinite(policy.joint_velocity(obs, draw.actions, torch.zeros(4))[0]).all()


@pytest.mark.parametrize("version", ["pi0", "pi05"])
def test_lora_adapters_train_and_the_base_weights_freeze(version):
    _, policy, _ = _setup(lora_rank=4, lora_expert=True, version=version)
    named = dict(policy.named_parameters())
    lora = [n for n in named if "lora_" in n]
    assert any(n.startswith("lm.") for n in lora) and any(n.startswith("action_head.velocity_model.") for n in lora)
    assert all(named[n].requires_grad for n in lora)
    frozen = [n for n, p in named.items() if not p.requires_grad]
    assert "lm.embed_tokens.weight" in frozen and any(".expert" in n or "velocity_model.layers" in n for n in frozen)
    assert named["action_head.velocity_model.action_in_proj.weight"].requires_grad  # not an adapted layer
    assert len(policy.shard_units()) == 2 + 2 * len(policy.lm.layers)


def _openpi_layout(policy, pad_to: int = 32, tie_embeddings: bool = False, prefix: str = "") -> dict:
    """The tiny model's weights under the public pi0 PyTorch key names (written out here, not
    with the converter's tables; transformers 4's ``vision_model`` level under the vision
    tower, as LeRobot and openpi write it), state and actions zero-padded to 32 dims as pi0
    does (the padded input columns zero, the padded output rows random)."""
    root = prefix + "paligemma_with_expert."
    out = {}
    for name, value in policy.state_dict().items():
        value = value.clone()
        if name.startswith("vision."):
            out[root + "paligemma.model.vision_tower.vision_model." + name[len("vision."):]] = value
        elif name.startswith("projector."):
            out[root + "paligemma.model.multi_modal_projector.linear." + name[len("projector."):]] = value
        elif name == "lm.embed_tokens.weight" and tie_embeddings:
            out[root + "paligemma.lm_head.weight"] = value
        elif name.startswith("lm."):
            out[root + "paligemma.model.language_model." + name[len("lm."):]] = value
        elif name.startswith("action_head.velocity_model."):
            rest = name[len("action_head.velocity_model."):]
            if rest.startswith(("layers.", "norm.")):
                out[root + "gemma_expert.model." + rest] = value
            else:
                if rest in ("state_proj.weight", "action_in_proj.weight"):
                    value = torch.cat([value, torch.zeros(value.shape[0], pad_to - value.shape[1])], dim=1)
                elif rest.startswith("action_out_proj."):
                    value = torch.cat([value, torch.randn(pad_to - value.shape[0], *value.shape[1:])], dim=0)
                out[prefix + rest] = value
    out[root + "gemma_expert.lm_head.weight"] = torch.randn(5, 4)  # unused by pi0's actions
    return out


@pytest.mark.parametrize("tie, prefix", [(False, ""), (True, "model.")])  # openpi's; LeRobot's with tied embeddings
def test_a_pi0_checkpoint_converts_to_identical_outputs(tmp_path, tie, prefix):
    from safetensors.torch import save_file

    _, first, obs = _setup()
    save_file(_openpi_layout(first, tie_embeddings=tie, prefix=prefix), str(tmp_path / "model.safetensors"))
    torch.manual_seed(1)
    fresh = build_policy("pi0_vla", first.spec, TINY)
    second = build_policy("pi0_vla", first.spec, {**TINY, "pretrained_path": str(tmp_path)})
    assert not torch.equal(fresh.lm.layers[1].self_attn.k_proj.weight, first.lm.layers[1].self_attn.k_proj.weight)
    assert second.state_width == 32 and second.action_head.width == 32 and second.action_head.d == 2
    for name, p in first.state_dict().items():
        if name != "action_head.log_sigma":
            got = second.state_dict()[name]
            assert torch.equal(got[tuple(slice(0, n) for n in p.shape)], p), name
    # The padded columns are zero: the real dims' velocity is the unpadded model's whatever the
    # padded dims hold, and the noise-free chunk is the same.
    x, t = torch.randn(4, 2, 2), torch.rand(4)
    xp = torch.cat([x, torch.randn(4, 2, 30)], dim=-1)
    v = second.expert(xp, t, second.encode_prefix(obs)[0])
    assert v.shape == (4, 2, 32) and torch.allclose(v[..., :2], first.expert(x, t, first.encode_prefix(obs)[0]),
                                                    atol=1e-6)
    assert torch.allclose(second(obs).dist.mode(), first(obs).dist.mode(), atol=1e-6)


def test_a_checkpoint_that_does_not_fit_is_one_error_naming_the_keys(tmp_path):
    from safetensors.torch import save_file

    from dvla.models.pi0_convert import CheckpointError

    _, policy, _ = _setup()
    good = _openpi_layout(policy)
    bad = {k: v for k, v in good.items() if "language_model.layers.1.mlp.up_proj" not in k}
    bad["paligemma_with_expert.time_mlp_in.weight"] = torch.zeros(2, 2)  # a pi0.5 key
    bad["action_in_proj.weight"] = torch.zeros(3, 32)
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        build_policy("pi0_vla", policy.spec, {**TINY, "pretrained_path": str(tmp_path / "model.safetensors")})
    msg = str(err.value)
    assert "\n" not in msg and "missing (1): lm.layers.1.mlp.up_proj.weight;" in msg
    assert "unexpected (1): paligemma_with_expert.time_mlp_in.weight" in msg and "pi0.5" in msg
    assert "action_in_proj.weight (3, 32) vs (32, 32)" in msg
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no model.safetensors in"):
        build_policy("pi0_vla", policy.spec, {**TINY, "pretrained_path": str(tmp_path / "empty")})


def test_dvla_plan_counts_the_pi0_shape():
    """``--params pi0_vla:size=3b``: pi0's 3.3B (SigLIP-So400m, Gemma-2B, a 300M expert),
    counted on the meta device."""
    from dvla.app.plan import policy_params

    count = int(policy_params(["--params", "pi0_vla:size=3b"])[-1])
    assert 3.0e9 < count < 3.5e9, count
    with torch.device("meta"):
        policy = build_policy("pi0_vla", PolicySpec((3, 224, 224), 8, 7, 50), {"size": "3b"})
    expert = sum(p.numel() for p in policy.expert.parameters())
    assert 0.28e9 < expert < 0.33e9 and len(policy.shard_units()) == 27 + 18 + 18
    # pi0.5: adaptive norms (a 1024 -> 3072 dense layer each) and time_mlp instead of state_proj
    # and action_time_mlp; LeRobot's full pi05 holds 3.62B with the expert's unused 263M-parameter
    # language head, which pi0_vla does not build.
    count = int(policy_params(["--params", "pi0_vla:size=3b,version=pi05"])[-1])
    assert 3.3e9 < count < 3.4e9, count
    with torch.device("meta"):
        pi05 = build_policy("pi0_vla", PolicySpec((3, 224, 224), 8, 7, 50), {"size": "3b", "version": "pi05"})
    assert len(pi05.shard_units()) == 27 + 18 + 18 and not hasattr(pi05.expert, "state_proj")


# -- a plugin: a transformer expert reading a KV cache, passed to the flow head as it is ----------------------

@dataclasses.dataclass
class KVCondition:
    keys: torch.Tensor  # (B, L, W)
    values: torch.Tensor  # (B, L, W)
    mask: torch.Tensor  # (B, L) valid prefix tokens


class KVExpert(nn.Module):
    """One attention layer: the action tokens' queries over the prefix's keys and values and their own."""

    def __init__(self, action_dim: int, width: int = 32):
        super().__init__()
        self.inp, self.qkv = nn.Linear(action_dim + 8, width), nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, action_dim)

    def forward(self, x, t, cond: KVCondition):
        h = self.inp(torch.cat([x, time_features(t, 8, x)[:, None].expand(-1, x.shape[1], -1)], dim=-1))
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        mask = torch.cat([cond.mask, torch.ones(x.shape[:2], dtype=torch.bool)], dim=1)[:, None]
        att = torch.nn.functional.scaled_dot_product_attention(
            q, torch.cat([cond.keys, k], 1), torch.cat([cond.values, v], 1), attn_mask=mask.expand(-1, x.shape[1], -1))
        return self.out(h + att)


@register_policy("test_kv_expert")
class KVExpertPolicy(VLAPolicy):
    @dataclasses.dataclass(kw_only=True)
    class Config:
        width: int = 32
        steps: int = 3

    def __init__(self, spec, config):
        super().__init__(spec, config)
        w = config.width
        self.patches = nn.Conv2d(spec.image_shape[0], w, 8, stride=8)
        self.words = nn.Embedding(self.tokenizer.vocab_size, w)
        self.state = nn.Linear(spec.proprio_dim, w)
        self.kv = nn.Linear(w, 2 * w)
        self.action_head = FlowMatchingHead(KVExpert(spec.action_dim, w), spec.action_chunk, spec.action_dim,
                                            steps=config.steps, init_log_sigma=-0.5)

    def rollout_extras(self):
        return self.action_head.rollout_extras()

    def forward(self, obs):
        img = self.patches(obs.image.float() / 255.0).flatten(2).transpose(1, 2)
        tokens = torch.cat([img, self.words(obs.instruction_ids), self.state(obs.proprio.float())[:, None]], 1)
        keys, values = self.kv(tokens).chunk(2, dim=-1)
        ones = torch.ones(img.shape[:2], dtype=torch.bool)
        mask = torch.cat([ones, obs.instruction_mask.bool(), ones[:, :1]], dim=1)
        return PolicyOutput(dist=self.action_head(KVCondition(keys, values, mask)))


def test_a_plugin_expert_reading_a_kv_cache_needs_no_subclass_of_the_head(tmp_path):
    """A policy passes its own expert module, called with a dataclass condition, to the
    flow head: its weights are the head's submodule (trained, saved), the rollout records
    chains the learner scores at ratio one, and a run of the product trains it."""
    from swimlane import Swimlane
    from swimlane.lanes.validate import ChunkSpec, check_chunk

    env = make_env(EnvConfig(name="fast_reach", n_envs=4, image_size=16), seed=0)
    policy = build_policy("test_kv_expert", PolicySpec.for_env(env.spec, 2), {})
    assert any(k.startswith("action_head.velocity_model.qkv") for k in policy.state_dict())
    batch = collect_episodes(env, policy, 4, generator=torch.Generator().manual_seed(1))
    assert check_chunk(batch, ChunkSpec.for_policy(policy, env.n_envs, 4), 0) is None
    t, b = batch.valid.nonzero(as_tuple=True)
    obs = Observation(image=batch.image[t, b], proprio=batch.proprio[t, b], instruction_ids=batch.instruction_ids[b])
    out = policy.evaluate(obs, batch.actions[t, b], batch.action_valid[t, b], "dim", {"chain": batch.extras["chain"][t, b]})
    assert torch.allclose(out.log_probs.sum(dim=(1, 2)), batch.log_probs[t, b], atol=1e-4)
    cfg = apply_overrides(fast_reach(), ["policy.name=test_kv_expert", "policy.options={}", "env.image_size=16",
                                         "env.n_envs=8", "algo.group_size=4", "swimlane.mode=sync",
                                         "swimlane.driver=serial", "run.iterations=2", "run.progress=false",
                                         f"run.out_dir={tmp_path}"])
    lanes = Swimlane(cfg)
    before = {n: p.detach().clone() for n, p in lanes.policy.named_parameters()}
    lanes.run()
    after = dict(lanes.policy.named_parameters())
    assert not torch.equal(before["action_head.velocity_model.qkv.weight"], after["action_head.velocity_model.qkv.weight"])


def test_a_bound_method_as_the_velocity_model_makes_no_cycle():
    class Owner(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.head = FlowMatchingHead(self.velocity, 1, 2, steps=2)

        def velocity(self, x, t, cond):
            return self.lin(cond)[:, None] + t[:, None, None]

    owner = Owner()
    assert [n for n, _ in owner.named_modules()] == ["", "lin", "head"]
    assert sorted(owner.state_dict()) == ["head.log_sigma", "lin.bias", "lin.weight"]
    twin = copy.deepcopy(owner)  # as GRPO's reference policy is made
    with torch.no_grad():
        twin.lin.weight.add_(1.0)
    cond = torch.ones(5, 3)
    assert not torch.allclose(twin.head(cond).mode(), owner.head(cond).mode())  # the copy calls its own method
    with pytest.raises(TypeError, match="MLPVelocity"):
        FlowMatchingHead(16, 1, 2)
    with pytest.raises(ValueError, match=r"returned \(5, 2\) for x of shape \(5, 1, 2\)"):
        FlowMatchingHead(lambda x, t, c: c[:, :2], 1, 2)(cond).draw()
