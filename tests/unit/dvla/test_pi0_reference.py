"""pi0_vla against LeRobot 0.4.4's own pi0 and pi0.5, stage by stage (tests/fixtures/pi0 and
pi05, made by bench/pi0_reference.py and bench/pi05_reference.py in a throwaway venv with
LeRobot's code; their READMEs list each tensor and the function that produced it): the
checkpoint as ``save_pretrained`` wrote it, its processor files' statistics, its tokenizer and
prompt (pi0.5's with the state's bins), the cameras' resize with padding, the vision tower,
the prefix and its keys and values, pi0.5's time conditioning, the expert's velocity, the
sampled chunk for given noise, and the full-size key sets on the meta device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dvla.policy import PolicySpec, build_policy
from dvla.types import Observation

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
FIXTURE = FIXTURES / "pi0"
ATOL = 1e-5  # float32 rounding: the stages agree to about 1e-6
VERSIONS = {"pi0": {"max_tokens": 48}, "pi05": {"version": "pi05", "prompt_tokens": 200}}


def _options(version: str = "pi0", **more) -> dict:
    fixture = FIXTURES / version
    arch = json.loads((fixture / "tiny_arch.json").read_text())
    pg, ex = arch["paligemma"], arch["action_expert"]
    assert pg["depth"] == ex["depth"] and pg["head_dim"] == ex["head_dim"]
    return {"vision": {k: v for k, v in arch["siglip"].items() if k != "projection_dim"},
            "lm": dict(width=pg["width"], mlp=pg["mlp_dim"], layers=pg["depth"], heads=pg["num_heads"],
                       kv_heads=pg["num_kv_heads"], head_dim=pg["head_dim"], vocab_size=arch["vocab_size"]),
            "expert": dict(width=ex["width"], mlp=ex["mlp_dim"], heads=ex["num_heads"]),
            "tokenizer": str(fixture / "tokenizer" / "tokenizer.json"), "pretrained_path": str(fixture),
            "flow_steps": 10, **VERSIONS[version], **more}


@pytest.fixture(scope="module", params=list(VERSIONS))
def ref(request):
    from safetensors.torch import load_file

    version = request.param
    stages = load_file(str(FIXTURES / version / "stages.safetensors"))
    prompts = json.loads((FIXTURES / version / "prompts.json").read_text())
    main, wrist = prompts["cameras"]
    frames = {c: stages[f"raw_image.{c}"].permute(0, 3, 1, 2).contiguous() for c in (main, wrist)}
    spec = PolicySpec(tuple(frames[main].shape[1:]), stages["raw_state"].shape[1], stages["chunk"].shape[2],
                      stages["chunk"].shape[1], cameras=((wrist, tuple(frames[wrist].shape[1:])),))
    policy = build_policy("pi0_vla", spec, _options(version)).eval()
    # What an env hands the policy: raw uint8 frames, the raw state, the task strings.
    obs = Observation(image=frames[main], proprio=stages["raw_state"], instruction=prompts["task"],
                      cameras={wrist: frames[wrist]})
    return policy, obs, stages, (main, wrist), version


def _close(got, want, what, atol=ATOL):
    assert got.shape == want.shape, (what, tuple(got.shape), tuple(want.shape))
    err = (got.float() - want.float()).abs().max().item()
    assert err <= atol, f"{what}: max abs difference {err:.3g}"


def test_the_observation_is_preprocessed_as_lerobot_does(ref):
    """pi0: tokens of ``task + "\\n"`` with BOS, right-padded to 48; pi0.5: of ``Task: ...,
    State: <32 bins>;\\nAction: ``, to 200. Each camera resized with padding (48x64 -> 24x32
    between bands of LeRobot's -3.0) and scaled to [-1, 1]; the state normalised with the
    checkpoint's statistics (pi0: mean and std; pi0.5: quantiles) and zero-padded to 32."""
    policy, obs, st, (main, wrist), version = ref
    pre = policy.model_inputs(obs)
    assert torch.equal(pre.instruction_ids, st["lang_tokens"])
    assert torch.equal(pre.instruction_mask, st["lang_masks"])
    for name, cam in (("image", main), (wrist, wrist)):
        _close(pre.images[name], st[f"pre_image.{cam}"], f"image {cam}")
    _close(policy.normalizer.proprio(obs.proprio), st["norm_state"], "normalised state")
    padded = st["padded_state"] if version == "pi0" else st["prompt_state"]
    _close(policy.padded_state(st["norm_state"]), padded, "padded state", 0.0)


def test_vision_prefix_and_its_keys_and_values_are_lerobots(ref):
    """The padded prefix tokens are masked out of everything (the reference's rows for them
    differ and are never read): keys and values are compared on the valid tokens."""
    policy, _, st, cams, version = ref
    obs = policy.model_inputs(ref[1])
    with torch.no_grad():
        for name, cam in zip(("image", cams[1]), cams):
            out = policy.vision(pixel_values=st[f"pre_image.{cam}"]).last_hidden_state
            _close(out, st[f"vision_out.{cam}"], f"vision {cam}")
            _close(policy.projector(out), st[f"image_emb.{cam}"], f"projector {cam}")
        emb = policy.lm.embed_tokens(st["lang_tokens"]) * policy.lm.embed_tokens.embedding_dim ** 0.5
        _close(emb, st["lang_emb"], "language embeddings")
        h, mask = policy.embed_prefix(obs)
        _close(h, st["prefix_embs"], "prefix embeddings")
        assert torch.equal(mask, st["prefix_pad_masks"])
        cache, _ = policy.encode_prefix(obs)
        valid = st["prefix_pad_masks"][:, None, :, None]
        for i, (k, v) in enumerate(zip(cache.keys, cache.values)):
            _close(k * valid, st[f"prefix_k.{i}"] * valid, f"layer {i} keys")
            _close(v * valid, st[f"prefix_v.{i}"] * valid, f"layer {i} values")
        # The expert's velocity at given noisy actions and pi0 times (dvla's clock: 1 - t,
        # its velocity the negative of pi0's).
        if version == "pi05":  # the flow time's embedding through time_mlp, the norms' condition
            _close(policy.expert.embed_suffix(st["x_t"], 1.0 - st["t"], cache.state)[1], st["adarms_cond"],
                   "adaRMS condition")
        _close(policy.expert(st["x_t"], 1.0 - st["t"], cache), -st["velocity"], "velocity")


def test_the_chunk_for_given_noise_is_lerobots(ref):
    """``sample_actions(noise=)``: ten Euler steps of all 32 padded dims; the robot's 7 are
    the action, the rest its ``chain_pad``; un-normalised with the postprocessor's statistics."""
    policy, obs, st, _, _ = ref
    with torch.no_grad():
        dist = policy(policy.model_inputs(obs)).dist
        draw = dist.draw(deterministic=True, start=st["noise"])
    for i in range(10):
        _close(draw.extras["chain"][:, i], st["sample_x_t"][i], f"step {i}'s input", 2e-5)
    _close(torch.cat([draw.actions, draw.extras["chain_pad"]], dim=-1), st["chunk_padded"], "padded chunk", 2e-5)
    _close(draw.actions, st["chunk"], "chunk", 2e-5)
    _close(policy.normalizer.unactions(draw.actions), st["chunk_unnorm"], "un-normalised chunk", 5e-5)
    # The chain's log-probability covers the padded dims it sampled.
    scored = dist.log_prob(draw.actions, draw.extras)
    assert torch.allclose(scored, draw.log_prob, atol=1e-3)
    # At temperature 0 (dvla eval --sample --temperature 0) the policy acts as the reference's
    # sampler does: noise from the generator, then the noise-free integration, un-normalised.
    policy.temperature = 0.0
    try:
        acted = policy.act(obs, generator=torch.Generator().manual_seed(3))
    finally:
        policy.temperature = 1.0
    noise = torch.randn(st["noise"].shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = dist.draw(deterministic=True, start=noise).actions
    _close(acted.actions, policy.normalizer.unactions(want), "act at temperature 0", 5e-5)
    assert torch.isfinite(acted.log_probs).all()


@pytest.mark.parametrize("version", list(VERSIONS))
def test_the_full_size_lerobot_key_set_converts(version):
    """Every key of LeRobot's full-size pi0 and pi0.5 (gemma_2b, gemma_300m, SigLIP-So400m at
    224 px), listed by the reference on the meta device, finds its parameter in the 3b shape,
    padded to 32 state and action dims."""
    from dvla.models.pi0_convert import convert_state_dict

    listed = json.loads((FIXTURES / version / "full_keys.json").read_text())["keys"]
    tensors = {k: torch.empty(shape, device="meta") for k, shape in listed}
    with torch.device("meta"):
        policy = build_policy("pi0_vla", PolicySpec((3, 224, 224), 8, 7, 50),
                              {"size": "3b", "pad_state_dim": 32, "pad_action_dim": 32, "version": version})
    out = convert_state_dict(tensors, policy)
    own = {k for k in policy.state_dict() if not k.startswith(("action_head.log_sigma", "value_mlp."))}
    assert set(out) == own and len(own) > 400


def test_statistics_that_do_not_fit_the_env_are_one_line(tmp_path):
    from dvla.models.reference_stats import StatsError

    cameras = (("left_wrist_0_rgb", (3, 48, 64)),)
    policy = build_policy("pi0_vla", PolicySpec((3, 48, 64), 8, 7, 10, cameras=cameras), _options())
    with pytest.raises(StatsError) as err:
        build_policy("pi0_vla", PolicySpec((3, 48, 64), 6, 7, 10, cameras=cameras), _options())
    assert "\n" not in str(err.value) and "state statistics have 8 dimensions, the env's state has 6" in str(err.value)
    # openpi's norm_stats.json, named: z-scores with its 1e-6, or quantile bounds.
    stats = {"norm_stats": {"state": {"mean": [0.5] * 8, "std": [2.0] * 8, "q01": [-1.0] * 8, "q99": [3.0] * 8},
                            "actions": {"mean": [0.0] * 7, "std": [1.0] * 7}}}
    (tmp_path / "norm_stats.json").write_text(json.dumps(stats))
    z = build_policy("pi0_vla", policy.spec, _options(norm_stats=str(tmp_path / "norm_stats.json")))
    assert torch.allclose(z.normalizer.proprio(torch.full((1, 8), 2.5)), torch.full((1, 8), 2.0 / (2.0 + 1e-6)))
    with pytest.raises(StatsError, match=r"state needs \['q01', 'q99'\]|actions needs \['q01', 'q99'\]"):
        build_policy("pi0_vla", policy.spec, _options(norm_stats=str(tmp_path / "norm_stats.json"), quantile_norm=True))


def test_the_launcher_says_in_one_line_that_the_checkpoints_statistics_do_not_fit_the_env(tmp_path):
    """The fast_reach preset's state has 4 dims (privileged); the checkpoint's statistics have 8."""
    import subprocess
    import sys

    options = json.dumps(_options(max_tokens=48))
    proc = subprocess.run([sys.executable, "-m", "dvla.launch", "--preset", "fast_reach", "policy.name=pi0_vla",
                           f"policy.options={options}", "run.iterations=1", f"run.out_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "state statistics have 8 dimensions, the env's state has 4" in lines[-1], lines
