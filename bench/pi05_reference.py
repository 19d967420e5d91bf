#!/usr/bin/env python3
"""Build the pi0.5 reference-parity fixture (tests/fixtures/pi05/) with LeRobot 0.4.4's own code.

Same approach, venv, patches and sizes as ``bench/pi0_reference.py`` (whose helpers this file imports
by path; see that file's docstring for the outer/inner stages and the openpi ``transformers_replace``
requirement). pi0.5 differences handled here:

* the tiny-size overrides patch ``lerobot.policies.pi05.modeling_pi05`` (its own ``get_gemma_config``
  and HF constructors);
* normalisation is QUANTILES for state and action (PI05Config default), so the stats carry q01/q99
  (plus q10/q90, mean/std/min/max so every mode works);
* the state goes into the prompt as 256-bin discrete tokens (``Pi05PrepareStateTokenizerProcessorStep``),
  tokenizer max length 200 (PI05Config default); no state token in the suffix;
* the expert's RMSNorms are adaptive (adaRMS), conditioned on ``time_mlp_out`` output.

Usage:
  python3 bench/pi05_reference.py --replace-dir DIR [--venv /tmp/pi0ref] [--out tests/fixtures/pi05]
  python3 bench/pi05_reference.py --skip-install [--verify]  # reuse the venv bench/pi0_reference.py built
  python bench/pi05_reference.py --skip-install --check-export DIR  # dvla's Python: as pi0_reference's, for pi0.5
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("pi0_reference", Path(__file__).resolve().parent / "pi0_reference.py")
p0 = importlib.util.module_from_spec(_spec)
_dwb, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # leave bench/ untouched
_spec.loader.exec_module(p0)
sys.dont_write_bytecode = _dwb

LEROBOT_VERSION, TRANSFORMERS_VERSION = p0.LEROBOT_VERSION, p0.TRANSFORMERS_VERSION
TINY, VOCAB, CAMERAS = p0.TINY, p0.VOCAB, p0.CAMERAS
STATE_DIM, ACTION_DIM, RAW_H, RAW_W = p0.STATE_DIM, p0.ACTION_DIM, p0.RAW_H, p0.RAW_W
PROMPTS, SEED, NOISE_STD = p0.PROMPTS, p0.SEED, p0.NOISE_STD
TOKENIZER_MAX_LENGTH = 200  # PI05Config.tokenizer_max_length default (openpi: 200 if pi05 else 48)


def install_tiny_overrides():
    """pi0_reference.install_tiny_overrides, aimed at modeling_pi05 instead of modeling_pi0."""
    from lerobot.policies.pi05 import modeling_pi05

    return p0.install_tiny_overrides(modeling_pi05)


def full_keys(out: Path):
    import torch
    from lerobot.policies.pi05 import PI05Config, PI05Policy

    inp, outf = p0.features()
    cfg = PI05Config(device="cpu", input_features=inp, output_features=outf)  # gemma_2b + gemma_300m, 224 px
    cfg.device = "meta"
    with torch.device("meta"):
        policy = PI05Policy(cfg)
    keys = [[k, list(v.shape)] for k, v in policy.state_dict().items()]
    n = sum(v.numel() for v in policy.state_dict().values())
    n_unique = sum(p.numel() for p in policy.parameters())
    (out / "full_keys.json").write_text(json.dumps(
        {"lerobot": LEROBOT_VERSION, "transformers": TRANSFORMERS_VERSION, "dtype": "float32",
         "num_state_dict_elements": n, "num_unique_params": n_unique, "keys": keys}, indent=0) + "\n")
    print(f"full_keys.json: {len(keys)} keys, {n} elements, {n_unique} unique params")


def make_stats():
    import torch

    def block(q01, q99):
        span = q99 - q01
        return {"q01": q01, "q99": q99, "q10": q01 + 0.1 * span, "q90": q99 - 0.1 * span,
                "mean": q01 + 0.45 * span, "std": 0.25 * span,
                "min": q01 - 0.05 * span, "max": q99 + 0.05 * span}

    s = block(torch.linspace(-4.0, -3.0, STATE_DIM), torch.linspace(3.0, 4.5, STATE_DIM))
    a = block(torch.linspace(-1.0, -0.2, ACTION_DIM), torch.linspace(0.5, 2.0, ACTION_DIM))
    return {"observation.state": s, "action": a}


def build(out: Path):
    import torch

    with torch.no_grad():
        _build(out)


def _build(out: Path):
    import numpy as np
    import torch
    from lerobot.envs.utils import preprocess_observation
    from lerobot.policies.pi05 import PI05Config, PI05Policy
    from lerobot.policies.pi05 import modeling_pi05 as m
    from lerobot.policies.pi05.processor_pi05 import make_pi05_pre_post_processors

    p0.fresh_fixture(out)
    full_keys(out)

    tokenizer = p0.make_tokenizer()  # identical to the pi0 fixture's tokenizer
    tokenizer.save_pretrained(out / "tokenizer")
    undo_tokenizer = p0.use_local_tokenizer(tokenizer)

    restore = install_tiny_overrides()
    inp, outf = p0.features()
    cfg = PI05Config(device="cpu", dtype="float32", chunk_size=10, n_action_steps=10,
                     max_state_dim=32, max_action_dim=32, image_resolution=(32, 32),
                     tokenizer_max_length=TOKENIZER_MAX_LENGTH, input_features=inp, output_features=outf)
    torch.manual_seed(SEED)
    policy = PI05Policy(cfg)
    policy.eval()
    g = torch.Generator().manual_seed(SEED + 1)
    for p in policy.parameters():
        p.add_(torch.randn(p.shape, generator=g) * NOISE_STD)
    model = policy.model
    pwe = model.paligemma_with_expert
    expert = pwe.gemma_expert.model

    stats = make_stats()
    pre, post = make_pi05_pre_post_processors(cfg, dataset_stats=stats)

    gi = torch.Generator().manual_seed(SEED + 2)
    raw = {c: torch.randint(0, 256, (2, RAW_H, RAW_W, 3), generator=gi, dtype=torch.uint8) for c in CAMERAS}
    raw_state = torch.randn(2, STATE_DIM, generator=gi) * 1.5
    # edge bins: one value below q01 (normalised < -1 -> bin -1), one above q99 (-> bin 255)
    raw_state[1, 0] = stats["observation.state"]["q01"][0] - 0.5
    raw_state[1, 1] = stats["observation.state"]["q99"][1] + 0.3
    obs = preprocess_observation({"pixels": {c: raw[c].numpy() for c in CAMERAS},
                                  "agent_pos": raw_state.numpy()})
    obs["task"] = list(PROMPTS)
    batch = pre(obs)

    S = {}
    for c in CAMERAS:
        S[f"raw_image.{c}"] = raw[c]
        S[f"obs_image.{c}"] = obs[f"observation.images.{c}"]
    S["raw_state"] = raw_state
    S["norm_state"] = batch["observation.state"]
    S["prompt_state"] = m.pad_vector(S["norm_state"], cfg.max_state_dim)
    S["discrete_state"] = torch.from_numpy(
        np.digitize(S["prompt_state"].numpy(), bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1).to(torch.int64)
    full_prompts = [f"Task: {t.strip().replace('_', ' ').replace(chr(10), ' ')}, State: "
                    f"{' '.join(map(str, S['discrete_state'][i].tolist()))};\nAction: " for i, t in enumerate(PROMPTS)]
    assert list(batch["task"]) == full_prompts, (batch["task"], full_prompts)
    S["lang_tokens"] = batch["observation.language.tokens"]
    S["lang_masks"] = batch["observation.language.attention_mask"]
    enc = tokenizer(full_prompts)["input_ids"]
    assert max(len(e) for e in enc) < TOKENIZER_MAX_LENGTH, "prompt truncated"
    for i, e in enumerate(enc):
        assert S["lang_tokens"][i, :len(e)].tolist() == e and int(S["lang_masks"][i].sum()) == len(e)

    images, img_masks = policy._preprocess_images(batch)
    lang_tokens, lang_masks = S["lang_tokens"], S["lang_masks"]
    pg = pwe.paligemma
    for c, img, msk in zip(CAMERAS, images, img_masks, strict=True):
        S[f"pre_image.{c}"] = img
        S[f"image_mask.{c}"] = msk
        S[f"vision_out.{c}"] = pg.model.vision_tower(img).last_hidden_state
        S[f"image_emb.{c}"] = pwe.embed_image(img)
    S["lang_emb"] = pwe.embed_language_tokens(lang_tokens) * TINY["paligemma"]["width"] ** 0.5

    prefix_embs, prefix_pad, prefix_att = model.embed_prefix(images, img_masks, lang_tokens, lang_masks)
    S["prefix_embs"], S["prefix_pad_masks"], S["prefix_att_masks"] = prefix_embs, prefix_pad, prefix_att
    p2d = m.make_att_2d_masks(prefix_pad, prefix_att)
    pos = torch.cumsum(prefix_pad, dim=1) - 1
    S["prefix_att_2d"], S["prefix_position_ids"] = p2d, pos
    pg.language_model.config._attn_implementation = "eager"
    (prefix_out, _), pkv = pwe.forward(
        attention_mask=model._prepare_attention_masks_4d(p2d), position_ids=pos, past_key_values=None,
        inputs_embeds=[prefix_embs, None], use_cache=True)
    S["prefix_out"] = prefix_out
    for i in range(TINY["paligemma"]["depth"]):
        S[f"prefix_k.{i}"], S[f"prefix_v.{i}"] = pkv[i][0], pkv[i][1]

    gn = torch.Generator().manual_seed(SEED + 3)
    x_t = torch.randn(2, cfg.chunk_size, cfg.max_action_dim, generator=gn)
    t = torch.tensor([0.7, 0.25])
    S["x_t"], S["t"] = x_t, t
    S["time_sincos"] = m.create_sinusoidal_pos_embedding(t, TINY["action_expert"]["width"], cfg.min_period,
                                                         cfg.max_period, device=t.device).float()
    suf_embs, suf_pad, suf_att, adarms_cond = model.embed_suffix(x_t, t)
    assert torch.equal(suf_embs, model.action_in_proj(x_t))
    S["suffix_embs"], S["suffix_pad_masks"], S["suffix_att_masks"] = suf_embs, suf_pad, suf_att
    S["adarms_cond"] = adarms_cond
    for i, layer in enumerate(expert.layers):
        S[f"adarms_mod.{i}.input"] = layer.input_layernorm.dense(adarms_cond)
        S[f"adarms_mod.{i}.post_attention"] = layer.post_attention_layernorm.dense(adarms_cond)
    S["adarms_mod.final"] = expert.norm.dense(adarms_cond)
    s2d = torch.cat([prefix_pad[:, None, :].expand(2, suf_pad.shape[1], prefix_pad.shape[1]),
                     m.make_att_2d_masks(suf_pad, suf_att)], dim=2)
    S["suffix_att_2d"] = s2d
    spos = prefix_pad.sum(-1)[:, None] + torch.cumsum(suf_pad, dim=1) - 1
    S["suffix_position_ids"] = spos
    S["velocity"] = model.denoise_step(prefix_pad, pkv, x_t, t)
    (_, suffix_out), _ = pwe.forward(attention_mask=model._prepare_attention_masks_4d(s2d), position_ids=spos,
                                     past_key_values=pkv, inputs_embeds=[None, suf_embs], use_cache=False,
                                     adarms_cond=[None, adarms_cond])
    S["suffix_out"] = suffix_out
    assert torch.equal(model.action_out_proj(suffix_out), S["velocity"])

    noise = torch.randn(2, cfg.chunk_size, cfg.max_action_dim, generator=gn)
    S["noise"] = noise
    p0.sample_and_save(out, S, model, policy, batch, pre, post, noise,
                       lambda: model.sample_actions(images, img_masks, lang_tokens, lang_masks, noise=noise), {
                           "task": PROMPTS, "full_prompt": full_prompts, "discrete_state": S["discrete_state"].tolist(),
                           "token_counts": [len(e) for e in enc], "tokenizer_max_length": TOKENIZER_MAX_LENGTH,
                           "cameras": CAMERAS})

    # -- round trip: LeRobot's from_pretrained (same overrides) must reproduce the chunk
    torch.manual_seed(123)
    again = PI05Policy.from_pretrained(str(out), local_files_only=True)
    again.eval()
    # PI05Policy.from_pretrained loads with strict=True; the tied embed_tokens key (saved only as
    # paligemma.lm_head.weight) makes load_state_dict raise *after* copying every tensor, which
    # LeRobot catches and prints ("Could not remap state dict keys"). Check every tensor arrived.
    sd0, sd1 = policy.state_dict(), again.state_dict()
    assert sd0.keys() == sd1.keys() and all(torch.equal(sd0[k], sd1[k]) for k in sd0)
    chunk2 = again.predict_action_chunk(batch, noise=noise)
    assert torch.equal(chunk2, S["chunk"]), (chunk2 - S["chunk"]).abs().max()
    restore()
    undo_tokenizer()
    for k, v in S.items():
        print(f"{k:28s} {str(v.dtype).replace('torch.', ''):8s} {list(v.shape)}")
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"fixture: {out} ({total / 1e6:.2f} MB)")


def verify(out: Path):
    """Fresh process: rebuild the raw inputs, run the saved pre/post-processors and
    PI05Policy.from_pretrained (same tiny overrides, local tokenizer) and compare with stages.safetensors."""
    import torch
    from lerobot.envs.utils import preprocess_observation
    from lerobot.policies.pi05 import PI05Policy
    from lerobot.processor import PolicyProcessorPipeline
    from lerobot.processor.converters import (
        policy_action_to_transition,
        transition_to_policy_action,
    )
    from safetensors.torch import load_file
    from transformers import PreTrainedTokenizerFast

    S = load_file(str(out / "stages.safetensors"))
    tok = PreTrainedTokenizerFast.from_pretrained(str(out / "tokenizer"))
    p0.use_local_tokenizer(tok)
    install_tiny_overrides()
    pre = PolicyProcessorPipeline.from_pretrained(str(out), "policy_preprocessor.json", local_files_only=True)
    post = PolicyProcessorPipeline.from_pretrained(
        str(out), "policy_postprocessor.json", local_files_only=True,
        to_transition=policy_action_to_transition, to_output=transition_to_policy_action)
    policy = PI05Policy.from_pretrained(str(out), local_files_only=True)
    policy.eval()
    obs = preprocess_observation({"pixels": {c: S[f"raw_image.{c}"].numpy() for c in CAMERAS},
                                  "agent_pos": S["raw_state"].numpy()})
    obs["task"] = list(PROMPTS)
    with torch.no_grad():
        batch = pre(obs)
        for k in ("lang_tokens", "lang_masks"):
            key = "observation.language." + ("tokens" if k == "lang_tokens" else "attention_mask")
            assert torch.equal(batch[key], S[k]), k
        assert torch.equal(batch["observation.state"], S["norm_state"])
        chunk = policy.predict_action_chunk(batch, noise=S["noise"])
        unnorm = post(chunk)
    assert torch.equal(chunk, S["chunk"]), (chunk - S["chunk"]).abs().max()
    assert torch.equal(unnorm, S["chunk_unnorm"]), (unnorm - S["chunk_unnorm"]).abs().max()
    print("verify: tokens, norm_state, chunk and chunk_unnorm reproduced exactly from the saved fixture")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replace-dir", type=Path, help="openpi src/openpi/models_pytorch/transformers_replace")
    ap.add_argument("--venv", type=Path, default=Path("/tmp/pi0ref"))
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "pi05")
    ap.add_argument("--skip-install", action="store_true", help="reuse the venv as it is")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--verify", action="store_true", help="after building, reload the fixture in a fresh process")
    ap.add_argument("--check-export", type=Path, metavar="DIR",
                    help="export a moved pi0_vla (version=pi05) to DIR with dvla; LeRobot's PI05Policy must agree")
    a = ap.parse_args()
    if a.inner:
        p0.torchvision_shim()
        from transformers.models.siglip import check

        assert check.check_whether_transformers_replace_is_installed_correctly()
        if a.check_export:
            from lerobot.policies.pi05 import PI05Policy

            p0.check_export(a.check_export.resolve(), a.out.resolve(), PI05Policy, install_tiny_overrides)
        else:
            (verify if a.verify else build)(a.out.resolve())
        return
    if a.check_export:
        p0.dvla_export(a.check_export.resolve(), a.out.resolve(), "pi05")
    if a.skip_install:
        py = a.venv / "bin" / "python"
    else:
        if a.replace_dir is None:
            ap.error("--replace-dir is required (or --skip-install)")
        py = p0.setup_venv(a.venv, a.replace_dir.resolve())
    env = dict(os.environ, PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               CUBLAS_WORKSPACE_CONFIG=":4096:8")
    cmd = [str(py), str(Path(__file__).resolve()), "--inner", "--out", str(a.out.resolve()),
           *(["--check-export", str(a.check_export.resolve())] if a.check_export else [])]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)
    if a.verify:
        print("+", " ".join(cmd + ["--verify"]), flush=True)
        subprocess.run(cmd + ["--verify"], check=True, env=env)


if __name__ == "__main__":
    main()
