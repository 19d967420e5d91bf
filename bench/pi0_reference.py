#!/usr/bin/env python3
"""Build the pi0 reference-parity fixture (tests/fixtures/pi0/) with LeRobot 0.4.4's own code.

Two stages, one file:

* outer (any Python): makes a throwaway venv (default /tmp/pi0ref, ``python3.11 -m venv``),
  installs lerobot==0.4.4 + transformers==4.53.2 + the few deps its pi0 import path needs
  (torch==2.13.0 CPU from the local wheel; lerobot itself with --no-deps because it pins
  torch<2.11), copies openpi's ``transformers_replace`` files over the installed transformers
  (as LeRobot's pi0 needs: it refuses to build without them), then re-runs this file inside
  that venv with ``--inner``. Every step is idempotent, so the script is rerunnable.
* inner (inside the venv): builds LeRobot's ``PI0Policy`` at a tiny size (LeRobot hard-codes
  the gemma_2b / gemma_300m sizes and a 257152 vocab; we override them by patching
  ``modeling_pi0.get_gemma_config`` and wrapping the two HF constructors it calls), perturbs
  every parameter with N(0, 0.02), and writes save_pretrained output + stages.safetensors.

openpi's transformers_replace files are not vendored: pass the folder with --replace-dir, e.g.
``git clone https://github.com/Physical-Intelligence/openpi`` then
``--replace-dir openpi/src/openpi/models_pytorch/transformers_replace``.

Usage:
  python3 bench/pi0_reference.py --replace-dir DIR [--venv /tmp/pi0ref] [--out tests/fixtures/pi0]
  python bench/pi0_reference.py --skip-install --check-export /tmp/pi0_export

``--check-export DIR`` (run with dvla's own Python): dvla builds pi0_vla from the fixture, moves
every weight (as training would), writes it with ``dvla export``'s LeRobot layout into DIR and
records its chunk for the fixture's noise and inputs; then, in the reference venv, LeRobot's
``PI0Policy.from_pretrained(DIR)`` and the processors saved there compute the chunk for the same
raw inputs and noise, which must agree to float32 rounding.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LEROBOT_VERSION = "0.4.4"
TRANSFORMERS_VERSION = "4.53.2"  # openpi's check.py demands exactly this version
TORCH_VERSION = "2.13.0"  # CPU wheel on local disk; a looser spec pulls a CUDA build
TORCHVISION_VERSION = "0.28.0"  # pairs with torch 2.13.0 (its C ops fail to load on CPU torch: shimmed)
# lerobot 0.4.4's own pins (from its METADATA) for the modules that `import lerobot.policies` reaches.
DEPS = [
    f"transformers=={TRANSFORMERS_VERSION}",
    "datasets>=4.0.0,<5.0.0",
    "diffusers>=0.27.2,<0.36.0",
    "huggingface-hub>=0.34.2,<0.36.0",
    "accelerate>=1.10.0,<2.0.0",
    "einops>=0.8.0,<0.9.0",
    "opencv-python-headless>=4.9.0,<4.13.0",
    "av>=15.0.0,<16.0.0",
    "jsonlines>=4.0.0,<5.0.0",
    "packaging>=24.2,<26.0",
    "draccus==0.10.0",
    "gymnasium>=1.1.1,<2.0.0",
    "deepdiff>=7.0.1,<9.0.0",
    "imageio>=2.34.0,<3.0.0",
    "termcolor>=2.4.0,<4.0.0",
    "pyserial>=3.5,<4.0",
    "safetensors>=0.4.3,<1.0.0",
    "tokenizers",
]

# ---- tiny architecture (recorded in the fixture as tiny_arch.json) ----
VOCAB = 1024
TINY = {
    "vocab_size": VOCAB,
    "paligemma": dict(width=64, depth=3, mlp_dim=128, num_heads=8, num_kv_heads=1, head_dim=16),
    "action_expert": dict(width=32, depth=3, mlp_dim=64, num_heads=8, num_kv_heads=1, head_dim=16),
    "siglip": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   patch_size=8, image_size=32, projection_dim=64),
}
CAMERAS = ["base_0_rgb", "left_wrist_0_rgb"]
STATE_DIM, ACTION_DIM = 8, 7
RAW_H, RAW_W = 48, 64
PROMPTS = ["pick up the red block and put it in the bowl", "open the top drawer, quickly!"]  # ",q!" -> bytes
SEED = 0
NOISE_STD = 0.02


# ============================== outer stage ==============================
def sh(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def setup_venv(venv: Path, replace_dir: Path) -> Path:
    py = venv / "bin" / "python"
    if not py.exists():
        sh(["python3.11", "-m", "venv", str(venv)])
    pip = [str(py), "-m", "pip", "install", "-q"]
    sh(pip + [f"torch=={TORCH_VERSION}", f"torchvision=={TORCHVISION_VERSION}"])
    sh(pip + ["--no-deps", f"lerobot=={LEROBOT_VERSION}"])
    sh(pip + DEPS)
    site = subprocess.run([str(py), "-c", "import sysconfig;print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    tdir = Path(site) / "transformers"
    if not (replace_dir / "models" / "siglip" / "check.py").exists():
        sys.exit(f"--replace-dir {replace_dir} does not look like openpi's transformers_replace folder")
    # == cp -r transformers_replace/* site-packages/transformers/  (openpi README)
    shutil.copytree(replace_dir, tdir, dirs_exist_ok=True)
    return py


# ============================== inner stage ==============================
def torchvision_shim():
    """torchvision 0.28.0 from PyPI links libtorch_cuda; on CPU torch its _C fails to load and its
    unguarded register_fake('torchvision::nms'/'qnms') then raises. Define the two schemas so the
    import succeeds (pi0 never calls them)."""
    import torch

    global _TV_LIB
    _TV_LIB = torch.library.Library("torchvision", "DEF")
    _TV_LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TV_LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


def make_tokenizer():
    """A small Gemma-like tokenizer (BPE, byte fallback, '▁' for spaces, <pad>=0 <eos>=1 <bos>=2
    <unk>=3, BOS prepended, no EOS), trained here on a fixed corpus: no hub access."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    byte_toks = [f"<0x{i:02X}>" for i in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    # words never merge across a space ("\u2581the"), "\n" is its own piece, unseen chars fall back to bytes
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"),
                                                 pre_tokenizers.Metaspace("\u2581", prepend_scheme="never")])
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Metaspace("\u2581",
                                                                                                   prepend_scheme="never")])
    verbs = ["pick up", "put", "place", "open", "close", "push", "pull", "move", "turn on", "turn off", "stack"]
    objs = ["the red block", "the blue cup", "the bowl", "the top drawer", "the bottom drawer", "the plate",
            "the black bowl", "the cream cheese", "the ketchup", "the stove", "the microwave", "the mug"]
    preps = ["in", "on", "next to", "behind", "into", "onto"]
    corpus = []
    for v in verbs:
        for o in objs:
            corpus.append(f"{v} {o}\n")
            for p in preps:
                corpus.append(f"{v} {o} and put it {p} {objs[(len(v) + len(o)) % len(objs)]}\n")
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials + byte_toks,
                                  initial_alphabet=sorted(set("".join(corpus).replace(" ", "\u2581"))),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", 2)])
    assert [tok.token_to_id(s) for s in specials] == [0, 1, 2, 3]
    assert tok.get_vocab_size() <= VOCAB
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")


def install_tiny_overrides(m=None):
    """Shrink what PaliGemmaWithExpertModel.__init__ builds, without touching LeRobot's files
    (``m``: the modeling module, pi0's by default; pi0.5's for bench/pi05_reference.py)."""
    if m is None:
        from lerobot.policies.pi0 import modeling_pi0 as m

    orig_get = m.get_gemma_config
    orig_pali, orig_gemma = m.PaliGemmaForConditionalGeneration, m.GemmaForCausalLM

    def get_gemma_config(variant):
        orig_get(variant)  # keep LeRobot's validation
        return m.GemmaConfig(**TINY["paligemma" if variant == "gemma_2b" else "action_expert"])

    def pali(config):
        config._vocab_size = VOCAB
        config.image_token_index = VOCAB
        config.text_config.vocab_size = VOCAB
        for k, v in TINY["siglip"].items():
            setattr(config.vision_config, k, v)
        config.text_config.num_image_tokens = (32 // 8) ** 2
        return orig_pali(config=config)

    def gemma(config):
        config.vocab_size = VOCAB
        return orig_gemma(config=config)

    m.get_gemma_config, m.PaliGemmaForConditionalGeneration, m.GemmaForCausalLM = get_gemma_config, pali, gemma
    return lambda: setattr(m, "get_gemma_config", orig_get) or setattr(
        m, "PaliGemmaForConditionalGeneration", orig_pali) or setattr(m, "GemmaForCausalLM", orig_gemma)


def features():
    from lerobot.configs.types import FeatureType, PolicyFeature

    inp = {f"observation.images.{c}": PolicyFeature(FeatureType.VISUAL, (3, RAW_H, RAW_W)) for c in CAMERAS}
    inp["observation.state"] = PolicyFeature(FeatureType.STATE, (STATE_DIM,))
    out = {"action": PolicyFeature(FeatureType.ACTION, (ACTION_DIM,))}
    return inp, out


def full_keys(out: Path):
    import torch
    from lerobot.policies.pi0 import PI0Config, PI0Policy

    inp, outf = features()
    cfg = PI0Config(device="cpu", input_features=inp, output_features=outf)  # gemma_2b + gemma_300m, 224 px
    cfg.device = "meta"  # set after __post_init__ (which only accepts real devices): PI0Policy calls .to(device)
    with torch.device("meta"):
        policy = PI0Policy(cfg)
    keys = [[k, list(v.shape)] for k, v in policy.state_dict().items()]
    n = sum(v.numel() for v in policy.state_dict().values())
    n_unique = sum(p.numel() for p in policy.parameters())  # embed_tokens and paligemma.lm_head are tied
    (out / "full_keys.json").write_text(json.dumps(
        {"lerobot": LEROBOT_VERSION, "transformers": TRANSFORMERS_VERSION, "dtype": "float32",
         "num_state_dict_elements": n, "num_unique_params": n_unique, "keys": keys}, indent=0) + "\n")
    print(f"full_keys.json: {len(keys)} keys, {n} elements, {n_unique} unique params")


def use_local_tokenizer(tokenizer):
    """LeRobot's TokenizerProcessorStep loads "google/paligemma-3b-pt-224" through
    AutoTokenizer.from_pretrained; hand it ``tokenizer`` instead (no hub). Returns the undo."""
    from lerobot.processor import tokenizer_processor

    real = tokenizer_processor.AutoTokenizer

    class _Auto:
        @staticmethod
        def from_pretrained(name, *a, **k):
            assert name == "google/paligemma-3b-pt-224", name
            return tokenizer

    tokenizer_processor.AutoTokenizer = _Auto
    return lambda: setattr(tokenizer_processor, "AutoTokenizer", real)


def fresh_fixture(out: Path) -> None:
    """Seeds, deterministic kernels, and ``out`` emptied of everything but its README."""
    import numpy as np
    import torch

    torch.manual_seed(SEED)
    np.random.seed(SEED)
    torch.use_deterministic_algorithms(True)
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():
        if f.is_file() and f.name != "README.md":
            f.unlink()


def sample_and_save(out: Path, S: dict, model, policy, batch, pre, post, noise, sample, prompts: dict) -> None:
    """``sample()`` (the model's ``sample_actions(noise=)``) with each Euler step recorded (time,
    input, velocity: ``denoise_step``'s ``timestep`` and ``x_t``), the policy's
    7-dim and un-normalised chunks, then the fixture written: stages, prompts, sizes and the
    reference's own ``save_pretrained`` of the policy and both processors."""
    import lerobot
    import torch
    import transformers
    from safetensors.torch import save_file

    import inspect

    trace, real_step = [], model.denoise_step
    signature = inspect.signature(real_step)

    def traced(*args, **kwargs):
        v = real_step(*args, **kwargs)
        named = signature.bind(*args, **kwargs).arguments
        trace.append((named["timestep"].clone(), named["x_t"].clone(), v.clone()))
        return v

    model.denoise_step = traced
    try:
        S["chunk_padded"] = sample()
    finally:
        model.denoise_step = real_step
    S["sample_t"], S["sample_x_t"], S["sample_v_t"] = (torch.stack(x) for x in zip(*trace))
    S["chunk"] = policy.predict_action_chunk(batch, noise=noise)
    assert torch.equal(S["chunk"], S["chunk_padded"][:, :, :ACTION_DIM])
    S["chunk_unnorm"] = post(S["chunk"])
    S.update({k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in S.items()})
    save_file(S, str(out / "stages.safetensors"),
              metadata={"lerobot": lerobot.__version__, "transformers": transformers.__version__,
                        "torch": torch.__version__})
    (out / "prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")
    (out / "tiny_arch.json").write_text(json.dumps(TINY, indent=1) + "\n")
    policy.save_pretrained(out)
    pre.save_pretrained(out)
    post.save_pretrained(out)


def build(out: Path):
    import torch

    with torch.no_grad():
        _build(out)


def _build(out: Path):
    import torch

    from lerobot.envs.utils import preprocess_observation
    from lerobot.policies.pi0 import PI0Config, PI0Policy
    from lerobot.policies.pi0 import modeling_pi0 as m
    from lerobot.policies.pi0.processor_pi0 import make_pi0_pre_post_processors

    fresh_fixture(out)
    full_keys(out)

    # -- tokenizer: LeRobot's TokenizerProcessorStep loads "google/paligemma-3b-pt-224" via
    #    AutoTokenizer.from_pretrained; hand it the local tokenizer instead (no hub).
    tokenizer = make_tokenizer()
    tokenizer.save_pretrained(out / "tokenizer")
    undo_tokenizer = use_local_tokenizer(tokenizer)

    restore = install_tiny_overrides()
    inp, outf = features()
    cfg = PI0Config(device="cpu", dtype="float32", chunk_size=10, n_action_steps=10,
                    max_state_dim=32, max_action_dim=32, image_resolution=(32, 32),
                    input_features=inp, output_features=outf)
    torch.manual_seed(SEED)
    policy = PI0Policy(cfg)
    policy.eval()
    g = torch.Generator().manual_seed(SEED + 1)
    for p in policy.parameters():
        p.add_(torch.randn(p.shape, generator=g) * NOISE_STD)
    model = policy.model

    stats = {
        "observation.state": {"mean": torch.linspace(-0.5, 0.5, STATE_DIM),
                              "std": torch.linspace(0.5, 2.0, STATE_DIM)},
        "action": {"mean": torch.linspace(0.2, -0.4, ACTION_DIM), "std": torch.linspace(0.3, 1.5, ACTION_DIM)},
    }
    pre, post = make_pi0_pre_post_processors(cfg, dataset_stats=stats)

    # -- inputs: env-style raw uint8 HWC frames + state, through lerobot.envs.utils.preprocess_observation
    gi = torch.Generator().manual_seed(SEED + 2)
    raw = {c: torch.randint(0, 256, (2, RAW_H, RAW_W, 3), generator=gi, dtype=torch.uint8) for c in CAMERAS}
    raw_state = torch.randn(2, STATE_DIM, generator=gi) * 1.5
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
    S["lang_tokens"] = batch["observation.language.tokens"]
    S["lang_masks"] = batch["observation.language.attention_mask"]

    images, img_masks = policy._preprocess_images(batch)
    state = policy.prepare_state(batch)
    S["padded_state"] = state
    lang_tokens, lang_masks = S["lang_tokens"], S["lang_masks"]
    pg = model.paligemma_with_expert.paligemma
    for c, img, msk in zip(CAMERAS, images, img_masks, strict=True):
        S[f"pre_image.{c}"] = img
        S[f"image_mask.{c}"] = msk
        S[f"vision_out.{c}"] = pg.model.vision_tower(img).last_hidden_state
        S[f"image_emb.{c}"] = model.paligemma_with_expert.embed_image(img)
    S["lang_emb"] = model.paligemma_with_expert.embed_language_tokens(lang_tokens) * TINY["paligemma"]["width"] ** 0.5  # as embed_prefix

    prefix_embs, prefix_pad, prefix_att = model.embed_prefix(images, img_masks, lang_tokens, lang_masks)
    S["prefix_embs"], S["prefix_pad_masks"], S["prefix_att_masks"] = prefix_embs, prefix_pad, prefix_att
    p2d = m.make_att_2d_masks(prefix_pad, prefix_att)
    pos = torch.cumsum(prefix_pad, dim=1) - 1
    S["prefix_att_2d"], S["prefix_position_ids"] = p2d, pos
    pg.language_model.config._attn_implementation = "eager"
    (prefix_out, _), pkv = model.paligemma_with_expert.forward(
        attention_mask=model._prepare_attention_masks_4d(p2d), position_ids=pos, past_key_values=None,
        inputs_embeds=[prefix_embs, None], use_cache=True)
    S["prefix_out"] = prefix_out
    for i in range(TINY["paligemma"]["depth"]):
        S[f"prefix_k.{i}"], S[f"prefix_v.{i}"] = pkv[i][0], pkv[i][1]

    gn = torch.Generator().manual_seed(SEED + 3)
    x_t = torch.randn(2, cfg.chunk_size, cfg.max_action_dim, generator=gn)
    t = torch.tensor([0.7, 0.25])
    suf_embs, suf_pad, suf_att, _ = model.embed_suffix(state, x_t, t)
    S["x_t"], S["t"] = x_t, t
    S["suffix_embs"], S["suffix_pad_masks"], S["suffix_att_masks"] = suf_embs, suf_pad, suf_att
    S["suffix_att_2d"] = torch.cat([prefix_pad[:, None, :].expand(2, suf_pad.shape[1], prefix_pad.shape[1]),
                                    m.make_att_2d_masks(suf_pad, suf_att)], dim=2)
    S["suffix_position_ids"] = prefix_pad.sum(-1)[:, None] + torch.cumsum(suf_pad, dim=1) - 1
    S["velocity"] = model.denoise_step(state, prefix_pad, pkv, x_t, t)

    noise = torch.randn(2, cfg.chunk_size, cfg.max_action_dim, generator=gn)
    S["noise"] = noise
    sample_and_save(out, S, model, policy, batch, pre, post, noise,
                    lambda: model.sample_actions(images, img_masks, lang_tokens, lang_masks, state, noise=noise),
                    {"task": PROMPTS, "task_after_newline_step": [p + "\n" for p in PROMPTS], "cameras": CAMERAS})

    # -- round trip: LeRobot's from_pretrained (same overrides) must reproduce the chunk
    torch.manual_seed(123)
    again = PI0Policy.from_pretrained(str(out), local_files_only=True)
    again.eval()
    chunk2 = again.predict_action_chunk(batch, noise=noise)
    assert torch.equal(chunk2, S["chunk"]), (chunk2 - S["chunk"]).abs().max()
    restore()
    undo_tokenizer()
    for k, v in S.items():
        print(f"{k:28s} {str(v.dtype).replace('torch.', ''):8s} {list(v.shape)}")
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"fixture: {out} ({total / 1e6:.2f} MB)")


def dvla_export(out: Path, fixture: Path, version: str = "pi0") -> None:
    """dvla's side of --check-export (dvla's Python): an exported, moved policy and its chunk."""
    import torch
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(REPO))
    from dvla.models.pi0_export import export_pi0
    from dvla.policy import PolicySpec, build_policy
    from dvla.types import Observation
    from tests.unit.dvla.test_pi0_reference import _options

    st = load_file(str(fixture / "stages.safetensors"))
    main_cam, wrist = CAMERAS
    frames = {c: st[f"raw_image.{c}"].permute(0, 3, 1, 2).contiguous() for c in CAMERAS}
    spec = PolicySpec((3, RAW_H, RAW_W), STATE_DIM, ACTION_DIM, 10, cameras=((wrist, (3, RAW_H, RAW_W)),))
    policy = build_policy("pi0_vla", spec, _options(version)).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(11)
        for p in policy.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    export_pi0(policy, out, "lerobot", fixture, policy.normalizer)
    obs = Observation(image=frames[main_cam], proprio=st["raw_state"], instruction=list(PROMPTS),
                      cameras={wrist: frames[wrist]})
    with torch.no_grad():
        draw = policy(policy.model_inputs(obs)).dist.draw(deterministic=True, start=st["noise"])
    save_file({"chunk": policy.normalizer.unactions(draw.actions).contiguous(), "noise": st["noise"]},
              str(out / "dvla_expected.safetensors"))
    print(f"dvla: exported a moved pi0_vla to {out} with its chunk for the fixture's inputs")


def check_export(out: Path, fixture: Path, policy_class=None, overrides=None) -> None:
    """The reference's side of --check-export (the reference venv): LeRobot's ``policy_class``
    (PI0Policy) at the tiny sizes ``overrides`` installs."""
    import torch
    from safetensors.torch import load_file

    from lerobot.envs.utils import preprocess_observation
    from lerobot.processor import PolicyProcessorPipeline
    from lerobot.processor.converters import policy_action_to_transition, transition_to_policy_action

    use_local_tokenizer(make_tokenizer())
    if policy_class is None:
        from lerobot.policies.pi0 import PI0Policy as policy_class
    restore = (overrides or install_tiny_overrides)()
    with torch.no_grad():
        policy = policy_class.from_pretrained(str(out), local_files_only=True).eval()
        pre = PolicyProcessorPipeline.from_pretrained(str(out), config_filename="policy_preprocessor.json")
        post = PolicyProcessorPipeline.from_pretrained(str(out), config_filename="policy_postprocessor.json",
                                                       to_transition=policy_action_to_transition,
                                                       to_output=transition_to_policy_action)
        st = load_file(str(fixture / "stages.safetensors"))
        obs = preprocess_observation({"pixels": {c: st[f"raw_image.{c}"].numpy() for c in CAMERAS},
                                      "agent_pos": st["raw_state"].numpy()})
        obs["task"] = list(PROMPTS)
        want = load_file(str(out / "dvla_expected.safetensors"))
        chunk = post(policy.predict_action_chunk(pre(obs), noise=want["noise"]))
    restore()
    err = (chunk - want["chunk"]).abs().max().item()
    print(f"LeRobot {out}: the chunk differs from dvla's by at most {err:.2e}")
    if err > 1e-4:
        raise SystemExit(f"check-export: FAIL (max abs difference {err:.2e})")
    print("check-export: PASS")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replace-dir", type=Path, help="openpi src/openpi/models_pytorch/transformers_replace")
    ap.add_argument("--venv", type=Path, default=Path("/tmp/pi0ref"))
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "pi0")
    ap.add_argument("--skip-install", action="store_true", help="reuse the venv as it is")
    ap.add_argument("--check-export", type=Path, metavar="DIR",
                    help="export a moved pi0_vla to DIR with dvla and check that LeRobot computes the same chunk")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.inner:
        torchvision_shim()
        from transformers.models.siglip import check

        assert check.check_whether_transformers_replace_is_installed_correctly()
        if a.check_export:
            check_export(a.check_export.resolve(), a.out.resolve())
        else:
            build(a.out.resolve())
        return
    if a.check_export:
        dvla_export(a.check_export.resolve(), a.out.resolve())
    if a.skip_install:
        py = a.venv / "bin" / "python"
    else:
        if a.replace_dir is None:
            ap.error("--replace-dir is required (or --skip-install)")
        py = setup_venv(a.venv, a.replace_dir.resolve())
    env = dict(os.environ, PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               CUBLAS_WORKSPACE_CONFIG=":4096:8")
    sh_env = [str(py), str(Path(__file__).resolve()), "--inner", "--out", str(a.out.resolve()),
              *(["--check-export", str(a.check_export.resolve())] if a.check_export else [])]
    print("+", " ".join(sh_env), flush=True)
    subprocess.run(sh_env, check=True, env=env)


if __name__ == "__main__":
    main()
