#!/usr/bin/env python3
"""Build the OpenVLA-OFT reference-parity fixture (tests/fixtures/openvla_oft/) with the reference code itself.

Two stages, one file:

* outer (any Python): makes a throwaway venv (default /tmp/oftref, ``python3.11 -m venv``), installs
  openvla-oft's pins that matter for inference (transformers==4.40.1, tokenizers==0.19.1, timm==0.9.10;
  torch==2.13.0 CPU from the local wheel instead of its torch==2.2.0), copies the one file that
  moojink/transformers-openvla-oft changes (``src/transformers/models/llama/modeling_llama.py``:
  bidirectional SDPA attention for parallel decoding; the fork is v4.40.1 + that commit) over the
  installed transformers, then re-runs this file inside the venv with ``--inner``. Every step is
  idempotent, so the script is rerunnable.
* inner (inside the venv): imports openvla-oft's ``prismatic`` modules straight from ``--oft-src``
  (without running the package ``__init__``s, which pull in training/TF deps), builds
  ``OpenVLAForActionPrediction`` + ``L1RegressionActionHead`` + ``ProprioProjector`` at a tiny size,
  perturbs every parameter with N(0, 0.02), runs ``predict_action`` (L1 head and token head) with
  hooks that record every stage, and writes the fixture in the reference's own layouts.

Neither source tree is vendored: pass checkouts of both (the script reads them):
  git clone https://github.com/moojink/openvla-oft             (tested at 213c5ff8d6e9673885d7e4dd6f2ce73b5d8a45db)
  git clone https://github.com/moojink/transformers-openvla-oft (tested at bc339d9ad707454c0c115970db43c260067c61ab)

Usage:
  python3 bench/openvla_oft_reference.py --oft-src DIR --transformers-fork DIR [--venv /tmp/oftref]
                                         [--out tests/fixtures/openvla_oft]
  python3 bench/openvla_oft_reference.py --oft-src DIR --skip-install      # reuse the venv
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TORCH_VERSION = "2.13.0"  # CPU wheel on local disk; a looser spec pulls a CUDA build
TORCHVISION_VERSION = "0.28.0"  # pairs with torch 2.13.0 (its C ops fail to load on CPU torch: shimmed)
PINS = [  # openvla-oft pyproject.toml pins (transformers: the fork, = 4.40.1 + one file, copied in below)
    "transformers==4.40.1", "tokenizers==0.19.1", "timm==0.9.10",
    "huggingface_hub<1.0", "numpy<2", "diffusers==0.30.3",  # diffusers: action_heads.py imports DDIMScheduler
    "safetensors", "pillow", "psutil",
]
FORK_FILE = "src/transformers/models/llama/modeling_llama.py"
FORK_MARK = "NOTE (Moo Jin)"

# ---- tiny architecture (recorded in the fixture as tiny_arch.json) ----
SEED = 0
NOISE_STD = 0.02
VOCAB_TARGET = 1024  # base tokenizer vocab (Llama-2: 32000); <PAD> is appended after it, as OpenVLA does
PAD_TO_MULTIPLE_OF = 64
IMG = 32  # both towers (real: 224)
TIMM_TINY = {  # extra kwargs given to timm.create_model(name, pretrained=False, num_classes=0, img_size=, act_layer=)
    "vit_large_patch14_reg4_dinov2.lvd142m": dict(patch_size=8, embed_dim=32, depth=3, num_heads=2),
    "vit_so400m_patch14_siglip_224": dict(patch_size=8, embed_dim=48, depth=3, num_heads=3),
}
LLAMA_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-6)
UNNORM_KEY = "libero_spatial_no_noops"
RAW = 224  # raw frames are 224x224 (OPENVLA_IMAGE_SIZE), so prepare_images_for_vla's TF resize is skipped
INSTRUCTION = "Pick up the black bowl next to the plate and put it on the ketchup"  # lower()-ed by the prompt
# after the N(0, 0.02) perturbation: the LLM's q_proj/k_proj are scaled so attention is sharp enough that
# the 56 zeroed action slots differ (RoPE) by more than rounding, and the lm_head rows of the 256 action
# tokens are scaled so the token-head argmax mostly lands there (some land below: bin clipped to 254,
# one in the pad rows: clipped to 0)
QK_SCALE = 16.0
ACTION_ROW_SCALE = 1.15


# ============================== outer stage ==============================
def sh(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def setup_venv(venv: Path, fork: Path) -> Path:
    py = venv / "bin" / "python"
    if not py.exists():
        sh(["python3.11", "-m", "venv", str(venv)])
    sh([str(py), "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}", f"torchvision=={TORCHVISION_VERSION}",
        *PINS])
    src = fork / FORK_FILE
    if FORK_MARK not in src.read_text():
        sys.exit(f"--transformers-fork {fork}: {FORK_FILE} lacks the OFT bidirectional-attention patch")
    site = subprocess.run([str(py), "-c", "import sysconfig;print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    dst = Path(site) / "transformers" / "models" / "llama" / "modeling_llama.py"
    dst.write_bytes(src.read_bytes())
    print(f"copied {src} -> {dst}")
    return py


# ============================== inner stage ==============================
def torchvision_shim():
    """torchvision 0.28.0 from PyPI links libtorch_cuda; on CPU torch its _C fails to load and its
    unguarded register_fake('torchvision::nms'/'qnms') then raises. Define the two schemas so the
    import succeeds (nothing here calls them)."""
    import torch

    global _TV_LIB
    _TV_LIB = torch.library.Library("torchvision", "DEF")
    _TV_LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TV_LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


def load_oft(oft: Path, empty_id: int):
    """Import openvla-oft's modules from ``oft`` without their package __init__s (prismatic/__init__
    imports the whole training stack; prismatic/vla/__init__ imports TF datasets).

    One source patch, in memory: modeling_prismatic.predict_action hard-codes Llama-2's empty token
    '▁' as the literal 29871 (two places); it becomes ``empty_id``, the tiny tokenizer's '▁'."""
    import importlib.util

    sys.path.insert(0, str(oft))
    for name in ["prismatic", "prismatic.models", "prismatic.training", "prismatic.vla"]:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(oft / name.replace(".", "/"))]
        sys.modules[name] = pkg
    from prismatic.vla import constants as C

    assert (C.NUM_ACTIONS_CHUNK, C.ACTION_DIM, C.PROPRIO_DIM, C.ACTION_PROPRIO_NORMALIZATION_TYPE) == (
        8, 7, 8, C.NormalizationType.BOUNDS_Q99), "expected the LIBERO constants"
    from prismatic.extern.hf import configuration_prismatic, processing_prismatic  # noqa: F401

    name = "prismatic.extern.hf.modeling_prismatic"
    path = oft / "prismatic/extern/hf/modeling_prismatic.py"
    src = path.read_text()
    assert src.count("29871") == 2, "modeling_prismatic.py: expected the literal 29871 exactly twice"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    exec(compile(src.replace("29871", str(empty_id)), str(path), "exec"), mod.__dict__)
    from prismatic.models import action_heads, projectors  # noqa: F401

    return C, mod


def eval_utils(oft: Path) -> dict:
    """The few pure functions of experiments/robot/openvla_utils.py this fixture runs, taken from the
    file by name (the module itself imports tensorflow, json_numpy, the hub)."""
    import numpy as np
    import torch
    from PIL import Image

    from prismatic.vla import constants as C

    path = oft / "experiments/robot/openvla_utils.py"
    tree = ast.parse(path.read_text())
    want = {"find_checkpoint_file", "load_component_state_dict", "normalize_proprio", "check_image_format",
            "prepare_images_for_vla"}
    import typing

    ns = {"np": np, "torch": torch, "os": os, "Image": Image, **{n: getattr(typing, n) for n in
                                                               ("Any", "Dict", "List", "Union", "Tuple", "Optional")},
          "NormalizationType": C.NormalizationType,
          "ACTION_PROPRIO_NORMALIZATION_TYPE": C.ACTION_PROPRIO_NORMALIZATION_TYPE, "OPENVLA_IMAGE_SIZE": 224,
          "resize_image_for_policy": None, "center_crop_image": None}  # the TF parts: never reached here
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in want:
            exec(compile(ast.Module([node], []), str(path), "exec"), ns)
            found[node.name] = node.lineno
    assert set(found) == want, found
    return ns


def make_tokenizer():
    """A small Llama-2-like tokenizer: BPE with byte fallback, '▁' word prefix (prepended to the
    first word, like SentencePiece's dummy prefix), <unk>=0 <s>=1 </s>=2, <0x00>..<0xFF>=3..258
    (so '\\n' -> <0x0A>=13 as in Llama-2), BOS prepended, no EOS; trained here: no hub access."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    byte_toks = [f"<0x{i:02X}>" for i in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])  # Llama-2's tokenizer.json decoder
    verbs = ["pick up", "put", "place", "open", "close", "push", "pull", "move", "turn on", "turn off", "stack"]
    objs = ["the black bowl", "the red block", "the blue cup", "the top drawer", "the bottom drawer", "the plate",
            "the cream cheese", "the ketchup", "the stove", "the microwave", "the mug", "the wine bottle"]
    preps = ["in", "on", "next to", "behind", "into", "onto", "between", "from"]
    corpus = []
    for i, v in enumerate(verbs):
        for j, o in enumerate(objs):
            for k, p in enumerate(preps):
                o2 = objs[(i + j + k) % len(objs)]
                corpus.append(f"In: What action should the robot take to {v} {o} {p} {o2} and put it on the plate?")
                corpus.append(f"Out: {v} {o2} {p} {o}, then {verbs[(i + k) % len(verbs)]} it")
    rng = __import__("random").Random(SEED)  # pseudo-words, so BPE has enough merges to fill the vocab
    syl = ["ka", "ro", "mi", "tu", "sel", "van", "dor", "pix", "lun", "gre", "bo", "shi", "an", "et", "qua", "zo"]
    for _ in range(600):
        corpus.append(" ".join("".join(rng.choice(syl) for _ in range(rng.randint(1, 4)))
                               for _ in range(rng.randint(3, 9))))
    alphabet = sorted(set("".join(corpus).replace(" ", "\u2581")) | {"\u2581"})
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_TARGET, special_tokens=specials + byte_toks,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    # the byte pieces were given as trainer specials only to pin their ids (3..258); make them plain
    # vocab entries again (as in Llama-2's tokenizer.json), keeping only <unk> <s> </s> as added tokens
    js = json.loads(tok.to_str())
    js["added_tokens"] = [t for t in js["added_tokens"] if t["content"] in specials]
    tok = Tokenizer.from_str(json.dumps(js))
    assert [tok.token_to_id(s) for s in specials] == [0, 1, 2] and tok.token_to_id("<0x0A>") == 13
    fast = LlamaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                              add_bos_token=True, add_eos_token=False, padding_side="right",
                              model_max_length=2048)
    # as convert_openvla_weights_to_hf.py: add <PAD> after the base vocab (Llama-2: id 32000)
    fast.add_special_tokens({"pad_token": "<PAD>"})
    return fast


def make_stats():
    import numpy as np

    g = np.random.default_rng(SEED + 5)
    a_q01 = np.array([-0.75, -0.8, -0.9, -0.1, -0.15, -0.2, 0.0])
    a_q99 = np.array([0.9, 0.85, 0.95, 0.12, 0.2, 0.25, 1.0])
    p_q01 = np.array([-0.3, -0.25, 0.0, 2.9, -0.6, -0.4, 0.0, -0.04])
    p_q99 = np.array([0.2, 0.3, 1.2, 3.3, 0.5, 0.35, 0.04, 0.0])

    def block(q01, q99, mask):
        lo, hi = q01 - 0.05, q99 + 0.05
        return {"mean": ((q01 + q99) / 2).tolist(), "std": ((q99 - q01) / 4 + g.uniform(0, 0.01, q01.size)).tolist(),
                "max": hi.tolist(), "min": lo.tolist(), "q01": q01.tolist(), "q99": q99.tolist(), "mask": mask}

    return {UNNORM_KEY: {
        "action": block(a_q01, a_q99, [True] * 6 + [False]),  # LIBERO: gripper not normalised
        "proprio": block(p_q01, p_q99, [True] * 5 + [False] + [True] * 2),  # one False to exercise the mask
        "num_transitions": 52970, "num_trajectories": 432}}


def make_frames():
    """Two 224x224 uint8 RGB frames (third-person, wrist): coarse random blocks + gradient + noise."""
    import torch

    g = torch.Generator().manual_seed(SEED + 2)
    out = []
    for _ in range(2):
        coarse = torch.rand(3, 7, 7, generator=g)
        img = torch.nn.functional.interpolate(coarse[None], size=(RAW, RAW), mode="bilinear", align_corners=False)[0]
        img = img * 0.7 + torch.linspace(0, 0.3, RAW)[None, None, :] + 0.08 * torch.randn(3, RAW, RAW, generator=g)
        out.append((img.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous())
    return out


def full_keys(out: Path, M, C):
    """(key, shape) of the full-size OpenVLA-OFT (dinosiglip-224px + Llama-2-7B, vocab 32000+64) +
    the LIBERO L1 head and proprio projector, built on the meta device."""
    import torch

    from prismatic.extern.hf.configuration_prismatic import OpenVLAConfig
    from prismatic.models.action_heads import L1RegressionActionHead
    from prismatic.models.projectors import ProprioProjector

    cfg = OpenVLAConfig(vision_backbone_id="dinosiglip-vit-so-224px", llm_backbone_id="llama2-7b-pure",
                        arch_specifier="no-align+fused-gelu-mlp", image_resize_strategy="resize-naive",
                        llm_max_length=2048, norm_stats=make_stats())
    cfg.text_config.vocab_size += cfg.pad_to_multiple_of
    cfg.text_config.pad_token_id = cfg.pad_token_id
    real_linspace = torch.linspace  # timm's ViT __init__ calls .item() on a linspace (drop-path rates)
    torch.linspace = lambda *a, **k: real_linspace(*a, **{**k, "device": k.get("device") or "cpu"})
    try:
        with torch.device("meta"):
            vla = M.OpenVLAForActionPrediction(cfg)
            head = L1RegressionActionHead(input_dim=vla.llm_dim, hidden_dim=vla.llm_dim, action_dim=C.ACTION_DIM)
            proj = ProprioProjector(llm_dim=vla.llm_dim, proprio_dim=C.PROPRIO_DIM)
    finally:
        torch.linspace = real_linspace
    parts = {"model": vla.state_dict(), "action_head": head.state_dict(), "proprio_projector": proj.state_dict()}
    res = {"note": "meta-device build; model keys as in model.safetensors, heads as in *--*_checkpoint.pt",
           "vision_backbone_id": "dinosiglip-vit-so-224px", "timm_model_ids": cfg.timm_model_ids,
           "image_sizes": cfg.image_sizes, "text_vocab_size": cfg.text_config.vocab_size}
    for k, sd in parts.items():
        res[k] = {"num_elements": sum(v.numel() for v in sd.values()),
                  "keys": [[n, list(v.shape)] for n, v in sd.items()]}
        print(f"full_keys.json: {k}: {len(sd)} keys, {res[k]['num_elements']} elements")
    (out / "full_keys.json").write_text(json.dumps(res, indent=0) + "\n")


def install_tiny_timm(M):
    """PrismaticVisionBackbone._create_featurizer calls timm.create_model(model_id, pretrained=False,
    num_classes=0, img_size=, act_layer=); add the tiny sizes for the two known ids (everything else
    -- init_values/reg_tokens/no_embed_class for DINOv2, mlp_ratio/class_token=False/global_pool='map'
    for SigLIP -- stays timm's)."""
    import timm

    real = timm.create_model

    def create_model(model_id, *a, **k):
        return real(model_id, *a, **{**k, **TIMM_TINY[model_id]})

    M.timm = types.SimpleNamespace(create_model=create_model, __version__=timm.__version__)
    return lambda: setattr(M, "timm", timm)


class Recorder:
    """Forward hooks that keep what the reference modules saw and returned during predict_action."""

    def __init__(self):
        self.calls, self.handles = {}, []

    def add(self, name, module, with_kwargs=False):
        def hook(mod, args, *rest):
            kwargs, out = (rest[0], rest[1]) if with_kwargs else ({}, rest[0])
            self.calls.setdefault(name, []).append((args, kwargs, out))

        self.handles.append(module.register_forward_hook(hook, with_kwargs=with_kwargs))

    def close(self):
        for h in self.handles:
            h.remove()


def build(out: Path, oft: Path):
    import torch

    with torch.no_grad():
        _build(out, oft)


def _build(out: Path, oft: Path):
    import numpy as np
    import PIL
    import timm
    import tokenizers
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForVision2Seq, AutoProcessor
    from transformers.models.llama import modeling_llama

    assert FORK_MARK in Path(modeling_llama.__file__).read_text(), "transformers-openvla-oft llama file not installed"
    torch.manual_seed(SEED)
    np.random.seed(SEED)
    torch.use_deterministic_algorithms(True)
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():
        if f.is_file() and f.name != "README.md":
            f.unlink()

    tokenizer = make_tokenizer()
    empty_id = tokenizer.convert_tokens_to_ids("\u2581")
    C, M = load_oft(oft, empty_id)
    from prismatic.extern.hf.configuration_prismatic import OpenVLAConfig
    from prismatic.extern.hf.processing_prismatic import PrismaticImageProcessor, PrismaticProcessor
    from prismatic.models.action_heads import L1RegressionActionHead
    from prismatic.models.projectors import ProprioProjector

    U = eval_utils(oft)
    full_keys(out, M, C)
    restore_timm = install_tiny_timm(M)

    base_vocab, pad_id = tokenizer.vocab_size, tokenizer.pad_token_id
    assert pad_id == base_vocab == VOCAB_TARGET and len(tokenizer) == base_vocab + 1, (pad_id, base_vocab)
    stats = make_stats()
    # == convert_openvla_weights_to_hf.py, with tiny sizes
    cfg = OpenVLAConfig(vision_backbone_id="dinosiglip-vit-so-224px", llm_backbone_id="llama2-7b-pure",
                        arch_specifier="no-align+fused-gelu-mlp", image_resize_strategy="resize-naive",
                        llm_max_length=2048, norm_stats=stats, pad_token_id=pad_id,
                        pad_to_multiple_of=PAD_TO_MULTIPLE_OF, image_sizes=[IMG, IMG],
                        text_config=dict(LLAMA_TINY, vocab_size=base_vocab, bos_token_id=1, eos_token_id=2),
                        torch_dtype=torch.float32)
    cfg.text_config.vocab_size += cfg.pad_to_multiple_of
    cfg.text_config.pad_token_id = cfg.pad_token_id
    assert cfg.image_sizes == [IMG, IMG] and cfg.use_fused_vision_backbone

    input_sizes, interpolations, means, stds = [], [], [], []
    for idx, mid in enumerate(cfg.timm_model_ids):
        m = M.timm.create_model(mid, pretrained=False, num_classes=0, img_size=cfg.image_sizes[idx],
                                act_layer=cfg.timm_override_act_layers[idx])
        d = timm.data.resolve_model_data_config(m)
        input_sizes.append((3, cfg.image_sizes[idx], cfg.image_sizes[idx]))
        interpolations.append(d["interpolation"])
        means.append(d["mean"])
        stds.append(d["std"])
    image_processor = PrismaticImageProcessor(use_fused_vision_backbone=True, image_resize_strategy="resize-naive",
                                              input_sizes=input_sizes, interpolations=interpolations,
                                              means=means, stds=stds)
    processor = PrismaticProcessor(image_processor=image_processor, tokenizer=tokenizer)

    torch.manual_seed(SEED)
    vla = M.OpenVLAForActionPrediction(cfg)
    assert vla.language_model.config._attn_implementation == "sdpa", vla.language_model.config._attn_implementation
    vla.vision_backbone.set_num_images_in_input(2)  # get_vla: cfg.num_images_in_input
    head = L1RegressionActionHead(input_dim=vla.llm_dim, hidden_dim=vla.llm_dim, action_dim=C.ACTION_DIM)
    proj = ProprioProjector(llm_dim=vla.llm_dim, proprio_dim=C.PROPRIO_DIM)
    g = torch.Generator().manual_seed(SEED + 1)
    for mod in (vla, head, proj):
        for p in mod.parameters():
            p.add_(torch.randn(p.shape, generator=g) * NOISE_STD)
    V = vla.vocab_size
    assert V == base_vocab
    vla.language_model.lm_head.weight[V - 256:V] *= ACTION_ROW_SCALE
    for layer in vla.language_model.model.layers:  # sharper attention: the zeroed action slots then differ
        layer.self_attn.q_proj.weight *= QK_SCALE  # by more than rounding (RoPE positions matter)
        layer.self_attn.k_proj.weight *= QK_SCALE
    for mod in (vla, head, proj):
        mod.eval()

    # ---- inputs, as get_vla_action (experiments/robot/openvla_utils.py) prepares them
    frames = make_frames()
    raw_proprio = np.array([0.05, -0.3, 1.1, 3.4, -0.2, 0.7, 0.02, -0.03])  # some outside [q01, q99]: clipped
    ucfg = types.SimpleNamespace(center_crop=False, num_images_in_input=2)
    pil = U["prepare_images_for_vla"]([f.numpy() for f in frames], ucfg)  # 224x224: no TF resize; no crop
    prompt = f"In: What action should the robot take to {INSTRUCTION.lower()}?\nOut:"
    inputs = processor(prompt, pil[0])
    wrist = processor(prompt, pil[1])
    inputs["pixel_values"] = torch.cat([inputs["pixel_values"], wrist["pixel_values"]], dim=1)
    norm_proprio = U["normalize_proprio"](raw_proprio, vla.norm_stats[UNNORM_KEY]["proprio"])

    S = {"raw_image.primary": frames[0], "raw_image.wrist": frames[1]}
    import torchvision.transforms.functional as TVF

    towers = ["dino", "siglip"]
    for cam, im in zip(["primary", "wrist"], pil):
        for t, (rp, cp) in enumerate(zip(image_processor.tvf_resize_params, image_processor.tvf_crop_params)):
            r = TVF.center_crop(TVF.resize(im, **rp), **cp)  # the first two steps of apply_transform
            S[f"resized_u8.{cam}.{towers[t]}"] = torch.from_numpy(np.array(r)).contiguous()
    S["pixel_values"] = inputs["pixel_values"]
    S["prompt_input_ids"] = inputs["input_ids"]
    S["prompt_attention_mask"] = inputs["attention_mask"]
    S["raw_proprio"] = torch.from_numpy(raw_proprio)
    S["norm_proprio"] = torch.from_numpy(np.asarray(norm_proprio))

    # ---- predict_action (L1 head), every stage recorded by hooks
    sdpa_seen = []
    real_sdpa = modeling_llama.torch.nn.functional.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        sdpa_seen.append((None if attn_mask is None else attn_mask.clone(), is_causal, q.shape))
        return real_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    def run(action_head):
        rec = Recorder()
        vb = vla.vision_backbone
        rec.add("dino", vb.featurizer)
        rec.add("siglip", vb.fused_featurizer)
        rec.add("vision", vb)
        rec.add("projector", vla.projector)
        rec.add("proprio", proj)
        rec.add("embed", vla.get_input_embeddings())
        rec.add("llm", vla.language_model, with_kwargs=True)
        if action_head is not None:
            rec.add("head", action_head.model)
        sdpa_seen.clear()
        torch.nn.functional.scaled_dot_product_attention = sdpa
        try:
            actions, ahs = vla.predict_action(**inputs, unnorm_key=UNNORM_KEY, do_sample=False,
                                              proprio=norm_proprio, proprio_projector=proj,
                                              noisy_action_projector=None, action_head=action_head, use_film=False)
        finally:
            torch.nn.functional.scaled_dot_product_attention = real_sdpa
            rec.close()
        return actions, ahs, rec.calls

    actions, ahs, calls = run(head)
    seq = calls["llm"][0][1]["inputs_embeds"].shape[1]
    llm_sdpa = [s_ for s_ in sdpa_seen if s_[2][-2] == seq]  # the LLM's calls (timm's ViTs use SDPA too)
    assert len(llm_sdpa) == LLAMA_TINY["num_hidden_layers"]
    assert all(m_ is None and c_ is False for m_, c_, _ in llm_sdpa), "expected no mask, is_causal=False"
    S["llm_sdpa_is_causal"] = torch.tensor([c_ for _, c_, _ in llm_sdpa])
    for cam, i in (("primary", 0), ("wrist", 1)):
        S[f"dino_patches.{cam}"] = calls["dino"][i][2]
        S[f"siglip_patches.{cam}"] = calls["siglip"][i][2]
    S["vision_features"] = calls["vision"][0][2]
    S["projector_out"] = calls["projector"][0][2]
    S["proprio_features"] = calls["proprio"][0][2]
    ids = calls["embed"][0][0][0]
    S["input_ids"] = ids
    _, kw, llm_out = calls["llm"][0]
    S["llm_inputs_embeds"] = kw["inputs_embeds"]
    S["llm_attention_mask"] = kw["attention_mask"]
    S["llm_last_hidden"] = llm_out.hidden_states[-1]
    n_patches = vla.vision_backbone.get_num_patches() * 2 + 1
    n_prompt = int(ids.shape[1] - C.ACTION_DIM * C.NUM_ACTIONS_CHUNK - 1) - 1  # as predict_action: len(prompt+empty)-1
    start = n_patches + n_prompt
    S["action_hidden_start"] = torch.tensor(start)
    S["actions_hidden_states"] = ahs
    assert torch.equal(ahs, S["llm_last_hidden"][:, start:start + 56])
    S["norm_actions"] = calls["head"][0][2]
    S["actions"] = torch.from_numpy(np.asarray(actions))  # float64 (numpy, as predict_action returns)
    # the un-normalisation predict_action applied (modeling_prismatic._unnormalize_actions), checked here
    st = stats[UNNORM_KEY]["action"]
    lo, hi, mask = np.array(st["q01"]), np.array(st["q99"]), np.array(st["mask"])
    na = S["norm_actions"].numpy().reshape(8, 7)
    assert np.array_equal(actions, np.where(mask, 0.5 * (na + 1) * (hi - lo + 1e-8) + lo, na))

    # ---- token-head path: predict_action without action_head (same inputs; argmax of the LM logits)
    tactions, tahs, tcalls = run(None)
    assert torch.equal(tahs, ahs)
    logits = tcalls["llm"][0][2].logits
    S["action_logits"] = logits[:, start:start + 56]
    tids = S["action_logits"].argmax(-1)
    S["action_token_ids"] = tids
    bins_idx = np.clip((V - tids.numpy()) - 1, 0, vla.bin_centers.shape[0] - 1)
    S["token_bin_index"] = torch.from_numpy(bins_idx)
    S["token_norm_actions"] = torch.from_numpy(vla.bin_centers[bins_idx].reshape(8, 7))
    S["token_actions"] = torch.from_numpy(np.asarray(tactions))
    frac = float(((tids >= V - 256) & (tids < V)).float().mean())
    print(f"token head: {frac:.0%} of the 56 argmax ids fall in the action-token range [{V - 256}, {V})")

    S = {k: v.clone().contiguous() for k, v in S.items()}
    meta = {"transformers": transformers.__version__ + " + transformers-openvla-oft llama",
            "tokenizers": tokenizers.__version__, "timm": timm.__version__, "torch": torch.__version__,
            "pillow": PIL.__version__, "prompt": prompt, "unnorm_key": UNNORM_KEY}
    save_file(S, str(out / "stages.safetensors"), metadata=meta)

    # ---- the reference's own layouts
    vla.save_pretrained(out)  # config.json + model.safetensors
    processor.save_pretrained(out)  # preprocessor_config.json + tokenizer files
    (out / "dataset_statistics.json").write_text(json.dumps(stats, indent=2) + "\n")
    torch.save(head.state_dict(), out / "action_head--latest_checkpoint.pt")  # finetune.py save_training_checkpoint
    torch.save(proj.state_dict(), out / "proprio_projector--latest_checkpoint.pt")
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(out / "action_head.safetensors"))
    save_file({k: v.contiguous() for k, v in proj.state_dict().items()}, str(out / "proprio_projector.safetensors"))
    tiny = {"vocab": {"base": base_vocab, "pad_token_id": pad_id, "text_vocab_size": cfg.text_config.vocab_size,
                      "unk": 0, "bos": 1, "eos_stop": 2, "newline_byte": 13, "empty_token_id": empty_id,
                      "action_token_ids": [V - 256, V - 1]},
            "llama": LLAMA_TINY, "timm_model_ids": cfg.timm_model_ids, "timm_tiny_kwargs": TIMM_TINY,
            "image_size": IMG, "num_images_in_input": 2, "use_proprio": True, "use_film": False,
            "num_patches_per_image": vla.vision_backbone.get_num_patches(),
            "llm_attn_implementation": vla.language_model.config._attn_implementation,
            "lm_head_action_row_scale": ACTION_ROW_SCALE, "llm_qk_proj_scale": QK_SCALE, "noise_std": NOISE_STD, "seed": SEED,
            "prompt": prompt, "instruction": INSTRUCTION, "unnorm_key": UNNORM_KEY,
            "patched_literal": {"file": "prismatic/extern/hf/modeling_prismatic.py", "from": 29871, "to": empty_id}}
    (out / "tiny_arch.json").write_text(json.dumps(tiny, indent=1) + "\n")

    # ---- round trip with the eval's loaders: Auto* registered as get_vla does, heads via find_checkpoint_file
    AutoConfig.register("openvla", OpenVLAConfig)
    AutoImageProcessor.register(OpenVLAConfig, PrismaticImageProcessor)
    AutoProcessor.register(OpenVLAConfig, PrismaticProcessor)
    AutoModelForVision2Seq.register(OpenVLAConfig, M.OpenVLAForActionPrediction)
    torch.manual_seed(123)
    vla2 = AutoModelForVision2Seq.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    vla2.vision_backbone.set_num_images_in_input(2)
    vla2.norm_stats = json.loads((out / "dataset_statistics.json").read_text())  # _load_dataset_stats
    assert vla2.language_model.config._attn_implementation == "sdpa"
    proc2 = AutoProcessor.from_pretrained(str(out))
    head2 = L1RegressionActionHead(input_dim=vla2.llm_dim, hidden_dim=vla2.llm_dim, action_dim=C.ACTION_DIM)
    head2.load_state_dict(U["load_component_state_dict"](U["find_checkpoint_file"](str(out), "action_head")))
    proj2 = ProprioProjector(llm_dim=vla2.llm_dim, proprio_dim=C.PROPRIO_DIM)
    proj2.load_state_dict(U["load_component_state_dict"](U["find_checkpoint_file"](str(out), "proprio_projector")))
    in2 = proc2(prompt, pil[0])
    in2["pixel_values"] = torch.cat([in2["pixel_values"], proc2(prompt, pil[1])["pixel_values"]], dim=1)
    assert torch.equal(in2["pixel_values"], S["pixel_values"]) and torch.equal(in2["input_ids"], S["prompt_input_ids"])
    a2, _ = vla2.predict_action(**in2, unnorm_key=UNNORM_KEY, do_sample=False, proprio=norm_proprio,
                                proprio_projector=proj2.eval(), action_head=head2.eval(), use_film=False)
    assert np.array_equal(a2, actions), np.abs(a2 - actions).max()
    t2, _ = vla2.predict_action(**in2, unnorm_key=UNNORM_KEY, do_sample=False, proprio=norm_proprio,
                                proprio_projector=proj2, action_head=None)
    assert np.array_equal(t2, tactions)
    print("reload: AutoModelForVision2Seq/AutoProcessor.from_pretrained + head checkpoints reproduce both chunks")
    restore_timm()

    for k, v in S.items():
        print(f"{k:28s} {str(v.dtype).replace('torch.', ''):8s} {list(v.shape)}")
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"fixture: {out} ({total / 1e6:.2f} MB)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--oft-src", type=Path, required=True, help="checkout of moojink/openvla-oft")
    ap.add_argument("--transformers-fork", type=Path, help="checkout of moojink/transformers-openvla-oft")
    ap.add_argument("--venv", type=Path, default=Path("/tmp/oftref"))
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "openvla_oft")
    ap.add_argument("--skip-install", action="store_true", help="reuse the venv as it is")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.inner:
        torchvision_shim()
        build(a.out.resolve(), a.oft_src.resolve())
        return
    if a.skip_install:
        py = a.venv / "bin" / "python"
    else:
        if a.transformers_fork is None:
            ap.error("--transformers-fork is required (or --skip-install)")
        py = setup_venv(a.venv, a.transformers_fork.resolve())
    env = dict(os.environ, PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    cmd = [str(py), str(Path(__file__).resolve()), "--inner", "--out", str(a.out.resolve()),
           "--oft-src", str(a.oft_src.resolve())]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


if __name__ == "__main__":
    main()
