"""token_vla: the transformer VLA built from ``transformers`` configs (SigLIP + Llama, action
tokens), learning, local pretrained weights, LoRA through peft, the named sizes."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tests.helpers.ranks import torchrun_job


from dvla.config import EnvConfig, apply_overrides
from dvla.envs import make_env
from dvla.policy import PolicySpec, build_policy
from dvla.config.presets import fast_reach

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

TINY = ["policy.name=token_vla", "policy.options={}", "policy.options.n_bins=21", "env.image_size=16",
        'policy.options.vision={"image_size": 16}']


def _policy(**options):
    env = make_env(EnvConfig(name="fast_reach", n_envs=4, image_size=16))
    policy = build_policy("token_vla", PolicySpec.for_env(env.spec),
                          {"n_bins": 21, "vision": {"image_size": 16}, **options})
    return env, policy


@pytest.mark.slow
def test_token_vla_learns_fast_reach(tmp_path):
    """The tiny configuration cut to one vision and one LM layer and 8 instruction tokens
    (0.19M parameters, autoregressive action tokens), serial driver, fixed seed: success rises
    from chance (about 0.1) to most episodes in 22 updates of 32 envs, lr 2e-3. First and last
    5 updates: 0.11 -> 0.65 here (run.seed 1: 0.08 -> 0.48); about 14 s of one core (the
    full tiny shape, two layers each and 24 tokens, took 28 updates and 39 s for 0.10 -> 0.63)."""
    from swimlane import Swimlane

    cfg = apply_overrides(fast_reach(), [*TINY, 'policy.options.vision={"image_size": 16, "num_hidden_layers": 1}',
                                         'policy.options.lm={"num_hidden_layers": 1}', "policy.options.max_tokens=8",
                                         "swimlane.mode=sync", "swimlane.driver=serial", "env.n_envs=32",
                                         "algo.lr=2e-3", "run.iterations=22", "run.progress=false",
                                         f"run.out_dir={tmp_path}"])
    lanes = Swimlane(cfg)
    lanes.run()
    success = [json.loads(line)["success_rate"] for line in open(lanes.out_dir / "metrics.jsonl")]
    assert sum(success[-5:]) / 5 > sum(success[:5]) / 5 + 0.3, success


def test_pretrained_backbones_and_tokenizer_load_from_a_local_directory(tmp_path):
    _, first = _policy()
    first.save_backbones(tmp_path / "ckpt")
    first.tokenizer.tok.save(str(tmp_path / "ckpt" / "tokenizer.json"))
    _, second = _policy(pretrained_path=str(tmp_path / "ckpt"))
    for a, b in ((first.vision, second.vision), (first.lm, second.lm)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    _, fresh = _policy()
    assert not torch.equal(fresh.lm.lm_head.weight, first.lm.lm_head.weight)  # random init differs
    texts = ["pick up the red cube and lift it"]
    assert torch.equal(second.tokenizer.encode_batch(texts)[0], first.tokenizer.encode_batch(texts)[0])
    from dvla.config import ConfigError
    from dvla.policy import policy_config

    with pytest.raises(ConfigError, match="pretrained_path: not a directory"):
        policy_config("token_vla", {"pretrained_path": str(tmp_path / "missing")})


def test_lora_adapters_train_and_the_base_weights_stay(tmp_path):
    """peft LoRA on the LM: the base weights are frozen and out of the optimizer; a short run
    (serial driver) changes the adapters and the projector, never the base."""
    from swimlane import Swimlane

    cfg = apply_overrides(fast_reach(), [*TINY, "policy.options.lora_rank=4", "swimlane.mode=sync",
                                         "swimlane.driver=serial", "env.n_envs=16", "algo.group_size=4",
                                         "run.iterations=3", "run.progress=false", f"run.out_dir={tmp_path}"])
    lanes = Swimlane(cfg)
    policy = lanes.policy
    named = dict(policy.named_parameters())
    lora = {n for n in named if "lora_" in n}
    base = {n for n, p in named.items() if n.startswith("lm.") and "lora_" not in n}
    assert lora and all(named[n].requires_grad for n in lora) and not any(named[n].requires_grad for n in base)
    in_optimizer = {id(p) for g in lanes.algo.optimizer.param_groups for p in g["params"]}
    assert all(id(named[n]) in in_optimizer for n in lora) and not any(id(named[n]) in in_optimizer for n in base)
    before = {n: p.detach().clone() for n, p in named.items()}
    lanes.run()
    after = dict(policy.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in base)
    assert any(not torch.equal(before[n], after[n]) for n in lora)


@pytest.mark.slow
def test_action_tokens_cameras_and_lora_travel_under_torchrun(tmp_path):
    """Two processes: rank 1 decodes action tokens over its KV cache and sends them with each
    chunk (and the images of two cameras, 16 and 8 px) over ZeroMQ; rank 0 checks them
    against the vocabulary and the cameras' sizes and learns (LoRA)."""
    out = torchrun_job(tmp_path, "tok", ["run.iterations=3", *TINY, "policy.options.lora_rank=4",
                                         "env.options.wrist_camera=8", "policy.action_chunk=2",
                                         "swimlane.colocate=false"], timeout=240)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["version"] == 3 and summary["chunks_consumed"] >= 3
    assert all(v == 0 for k, v in summary.items() if k.startswith("rejected_") and isinstance(v, int))
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert all(math.isfinite(r["loss"]) for r in rows)
    # The LM's frozen base weights went over the control plane once, with version 0; every
    # later version carried the trainable weights (adapters, projector, ...) alone.
    from planes.buckets import frozen_names, named_weights

    env = make_env(EnvConfig(name="fast_reach", n_envs=4, image_size=16, options={"wrist_camera": 8}))
    policy = build_policy("token_vla", PolicySpec.for_env(env.spec, 2),
                          {"n_bins": 21, "vision": {"image_size": 16}, "lora_rank": 4})
    frozen = frozen_names(policy)
    trainable = sum(t.numel() * t.element_size() for n, t in named_weights(policy) if n not in frozen)
    everything = sum(t.numel() * t.element_size() for _, t in named_weights(policy))
    assert frozen and trainable < everything / 2
    # A row holds the last version sent when it was written (the broadcast lane may not have
    # sent the row's own yet): version 0 whole, every later one the trainable part alone.
    sent = [r["publish_bytes"] for r in rows]
    assert sent[0] == everything and set(sent) <= {everything, trainable}, sent
    # Every version sent after the first the trainable part alone (under load the broadcast lane
    # may skip one that a newer replaced before it was sent: the last one always goes).
    later, rest = divmod(summary["broadcast_traffic"]["flat_sent_bytes"] - everything, trainable)
    assert rest == 0 and 1 <= later <= 3, summary["broadcast_traffic"]
    rollout = json.loads((out / "summary_rank1.json").read_text())
    assert rollout["replica_version"] == 3 and rollout["replica_digest"] == summary["weights_digest"]


def test_an_action_token_outside_the_vocabulary_is_rejected():
    from dvla.rollout import collect_episodes
    from swimlane.lanes.validate import ChunkSpec, check_chunk

    env, policy = _policy()
    batch = collect_episodes(env, policy, 3)
    spec = ChunkSpec.for_policy(policy, env.n_envs, 3)
    assert check_chunk(batch, spec, 0) is None
    batch.extras["action_tokens"][0, 0, 0] = policy.lm.config.vocab_size
    reason, detail = check_chunk(batch, spec, 0)
    assert reason == "extras" and "action_tokens holds values in" in detail


@pytest.mark.parametrize("size, low, high", [("0.5b", 0.4e9, 0.6e9), ("7b", 6.5e9, 7.5e9)])
def test_named_sizes_scale_to_half_a_billion_and_seven_billion(size, low, high):
    """Built on the meta device (no memory): the parameter counts of the named sizes."""
    with torch.device("meta"):
        policy = build_policy("token_vla", PolicySpec((3, 224, 224), 8, 7, 1), {"size": size})
    n = sum(p.numel() for p in policy.parameters())
    assert low < n < high, n
