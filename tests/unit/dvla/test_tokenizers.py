"""Tokenizers: ids with an explicit pad id and an attention mask, Hugging Face tokenizers
wrapped, a real subword tokenizer built offline, instruction strings kept."""

from __future__ import annotations

import pytest
import torch

from dvla.config import EnvConfig
from dvla.envs import make_env
from dvla.policy import PolicySpec, build_policy
from dvla.rollout import collect_episodes
from dvla.tokenizers import CORPUS, HashTokenizer, HFTokenizer, Tokenizer, _trained_bpe, builtin_tokenizer

tokenizers = pytest.importorskip("tokenizers")


def test_the_hash_tokenizer_pads_with_zero_and_masks_the_padding():
    tok = HashTokenizer(vocab_size=100, max_len=5)
    assert isinstance(tok, Tokenizer)
    ids, mask = tok.encode_batch(["move to the red target", "go", "a b c d e f g"])
    assert ids.shape == mask.shape == (3, 5) and mask.dtype == torch.bool
    assert mask.sum(1).tolist() == [5, 1, 5]
    assert (ids[~mask] == 0).all() and (ids[mask] > 0).all()


def test_the_builtin_tokenizer_is_a_deterministic_offline_bpe():
    tok = builtin_tokenizer(vocab_size=512, max_len=24)
    assert (tok.vocab_size, tok.pad_id) == (512, 0)
    vocab = tok.tok.get_vocab()
    _trained_bpe.cache_clear()
    assert builtin_tokenizer(vocab_size=512).tok.get_vocab() == vocab  # trained again: the same merges
    lines = [ln for ln in CORPUS.read_text().splitlines() if ln and not ln.startswith("#")]
    ids, mask = tok.encode_batch(lines[:4] + ["put the zebra in the fridge ☺"])
    assert (ids[:, 0] == tok.tok.token_to_id("<bos>")).all()
    assert bool(((ids >= 0) & (ids < 512)).all()) and (ids[~mask] == 0).all()
    # Corpus words are whole tokens (few per word); unseen text still encodes, in bytes.
    assert mask[0].sum() <= len(lines[0].split()) + 1
    assert tok.tok.decode(ids[4][mask[4]].tolist()).strip() == "put the zebra in the fridge ☺"


def test_hugging_face_tokenizers_are_wrapped_with_an_explicit_pad_id():
    transformers = pytest.importorskip("transformers")
    raw = _trained_bpe(512)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=raw)
    with pytest.raises(ValueError, match="the tokenizer has no pad token: pass pad_id"):
        HFTokenizer(fast, max_len=8)
    tok = HFTokenizer(fast, max_len=8, pad_id=3)  # <eos> as padding, as Llama-style models do
    ids, mask = tok.encode_batch(["move to the red target", "reach the blue cube now please"])
    assert (ids[~mask] == 3).all() and mask[0].sum() < 8
    # The same text through the tokenizers library and through transformers: the same ids.
    lib = HFTokenizer(raw, max_len=8)
    assert lib.pad_id == 0 and torch.equal(lib.encode_batch(["move to the red target"])[0][0][mask[0]], ids[0][mask[0]])
    fast.pad_token = "<pad>"
    assert HFTokenizer(fast, max_len=8).pad_id == 0
    with pytest.raises(ValueError, match=r"0 <= pad_id < 512"):
        HFTokenizer(raw, max_len=8, pad_id=512)
    with pytest.raises(TypeError, match="takes a tokenizers.Tokenizer or a transformers tokenizer"):
        HFTokenizer(object(), max_len=8)


def test_prepare_keeps_the_strings_and_the_mask_travels_with_the_episodes():
    env = make_env(EnvConfig(name="fast_reach", n_envs=4, image_size=16))
    policy = build_policy("tiny_vla", PolicySpec.for_env(env.spec), {"hidden_dim": 8, "vision_channels": 4,
                                                                      "embed_dim": 4})
    policy.tokenizer = HFTokenizer(_trained_bpe(512), max_len=12, pad_id=7)  # a pad id that is not 0
    obs = policy.prepare(env.reset(1))
    assert obs.instruction is not None and len(obs.instruction) == 4
    ids, mask = policy.tokenizer.encode_batch(obs.instruction)
    assert torch.equal(obs.instruction_ids, ids) and torch.equal(obs.instruction_mask, mask)
    batch = collect_episodes(env, policy, 3)
    assert torch.equal(batch.instruction_mask, mask) and (batch.instruction_ids[~mask] == 7).all()
