"""Instruction tokenizers: what a policy's ``tokenizer`` attribute must provide.

A tokenizer turns a batch of instruction strings into ``(ids, mask)``: ``(B, max_len)``
int64 token ids, right-padded with ``pad_id``, and a bool attention mask that is true on
real tokens. ``vocab_size`` bounds the ids (the learner rejects chunks with ids outside
it) and ``max_len`` the length (it sizes the data plane's message limits).

* :class:`HashTokenizer`: words hashed into a vocabulary, no file needed (TinyVLA's).
* :class:`HFTokenizer`: wraps a Hugging Face ``tokenizers.Tokenizer`` or ``transformers``
  tokenizer loaded from local files, with an explicit pad id.
* :func:`builtin_tokenizer`: a byte-level BPE trained, in a fraction of a second, on the
  instruction corpus shipped in ``dvla/data/instructions.txt``: a real subword tokenizer
  that works offline (nothing downloads).
"""

from __future__ import annotations

import functools
import re
import zlib
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

CORPUS = Path(__file__).parent / "data" / "instructions.txt"
SPECIALS = ("<pad>", "<unk>", "<bos>", "<eos>")


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    max_len: int

    def encode_batch(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        """``(ids, mask)``, each ``(len(texts), max_len)``: int64 ids right-padded with
        ``pad_id``, and true where a real token is."""


def tokenize(tokenizer: Any, texts: list[str]) -> tuple[Tensor, Tensor]:
    """``(ids, mask)`` from a :class:`Tokenizer`, or from a plain callable returning padded
    ids (its ``pad_id`` attribute, default 0, tells padding apart)."""
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode_batch(texts)
    ids = tokenizer(texts)
    return ids, ids != getattr(tokenizer, "pad_id", 0)


def _pad(rows: list[list[int]], max_len: int, pad_id: int) -> tuple[Tensor, Tensor]:
    rows = [row[:max_len] for row in rows]
    ids = torch.tensor([row + [pad_id] * (max_len - len(row)) for row in rows], dtype=torch.long)
    mask = torch.tensor([[True] * len(row) + [False] * (max_len - len(row)) for row in rows], dtype=torch.bool)
    return ids.reshape(len(rows), max_len), mask.reshape(len(rows), max_len)


class PaddedTokenizer:
    """What every tokenizer here shares: ``encode(text)`` (ids of one text, implemented by
    the subclass) padded into batches of ``max_len`` with ``pad_id``."""

    pad_id: int
    max_len: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        encoded: dict[str, list[int]] = {}  # a batch's envs mostly share their instruction
        return _pad([encoded[t] if t in encoded else encoded.setdefault(t, self.encode(t)) for t in texts],
                     self.max_len, self.pad_id)

    def __call__(self, texts: list[str]) -> Tensor:
        return self.encode_batch(texts)[0]


class Prompted(PaddedTokenizer):
    """``tokenizer`` applied to each instruction set in ``template`` (``{instruction}`` marks
    where): a model's own prompt format, e.g. pi0's ``"{instruction}\n"``."""

    def __init__(self, tokenizer: PaddedTokenizer, template: str):
        if "{instruction}" not in template:
            raise ValueError(f"a prompt template needs {{instruction}}, got {template!r}")
        self.inner, self.template = tokenizer, template
        self.pad_id, self.max_len = tokenizer.pad_id, tokenizer.max_len
        self.vocab_size = getattr(tokenizer, "vocab_size", None)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(self.template.replace("{instruction}", text))


class ByteTokenizer(PaddedTokenizer):
    """An instruction as its UTF-8 bytes (ids 1-256; 0 pads): the text itself, recoverable
    exactly on any rank (:meth:`decode`), for a model that builds its prompt at its input
    (pi0.5's carries the state). A longer instruction than ``max_len`` bytes is an error."""

    pad_id, vocab_size = 0, 257

    def __init__(self, max_len: int):
        self.max_len = max_len

    def encode(self, text: str) -> list[int]:
        data = text.encode()
        if len(data) > self.max_len:
            raise ValueError(f"an instruction of {len(data)} bytes is longer than the {self.max_len} kept "
                             f"(policy.options.max_tokens): {text[:40]!r}...")
        return [b + 1 for b in data]

    @staticmethod
    def decode(ids: Tensor, mask: Tensor) -> list[str]:
        """The texts of ``(B, L)`` ids and their mask."""
        return [bytes(int(i) - 1 for i in row[m]).decode() for row, m in zip(ids.cpu(), mask.cpu().bool())]


class HashTokenizer(PaddedTokenizer):
    """Deterministic word-level tokenizer needing no vocabulary file or download.

    Lower-cased words map to ``1 + crc32(word) % (vocab_size - 1)``; 0 is padding.
    Collisions are possible but stable across processes and machines.
    """

    pad_id = 0

    def __init__(self, vocab_size: int = 1024, max_len: int = 16):
        if vocab_size < 2 or max_len < 1:
            raise ValueError("HashTokenizer needs vocab_size >= 2 and max_len >= 1")
        self.vocab_size = vocab_size
        self.max_len = max_len
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is None:
            words = re.findall(r"[a-z0-9]+", text.lower())[: self.max_len]
            ids = [1 + zlib.crc32(w.encode()) % (self.vocab_size - 1) for w in words]
            self._cache[text] = ids
        return ids


class HFTokenizer(PaddedTokenizer):
    """A Hugging Face tokenizer as a :class:`Tokenizer`: a ``tokenizers.Tokenizer`` (e.g.
    ``Tokenizer.from_file("tokenizer.json")``) or a ``transformers`` tokenizer (e.g.
    ``AutoTokenizer.from_pretrained(local_dir)``). ``pad_id`` defaults to the tokenizer's
    own pad token; one without a pad token needs it given. ``add_special_tokens``: let the
    tokenizer add its own (e.g. a BOS token, by its post-processor)."""

    def __init__(self, tokenizer: Any, max_len: int, pad_id: int | None = None, add_special_tokens: bool = True):
        self.tok = tokenizer
        self._fast = hasattr(tokenizer, "encode_batch") and hasattr(tokenizer, "get_vocab_size")
        if self._fast:
            self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
            default_pad = tokenizer.token_to_id("<pad>")
        elif hasattr(tokenizer, "pad_token_id"):
            self.vocab_size = len(tokenizer)
            default_pad = tokenizer.pad_token_id
        else:
            raise TypeError(f"HFTokenizer takes a tokenizers.Tokenizer or a transformers tokenizer, got "
                            f"{type(tokenizer).__name__}")
        pad_id = default_pad if pad_id is None else pad_id
        if pad_id is None:
            raise ValueError("the tokenizer has no pad token: pass pad_id (an id the model treats as padding)")
        if not 0 <= pad_id < self.vocab_size or max_len < 1:
            raise ValueError(f"HFTokenizer needs 0 <= pad_id < {self.vocab_size} and max_len >= 1")
        self.pad_id, self.max_len, self.special = int(pad_id), max_len, add_special_tokens
        self._cache: dict[str, list[int]] = {}

    caching = True
    """Keep each text's ids (an env's instructions repeat); off for prompts that change every
    step (pi0.5's, which carry the state)."""

    def encode(self, text: str) -> list[int]:
        ids = self._cache.get(text) if self.caching else None
        if ids is None:
            if self._fast:
                ids = self.tok.encode(text, add_special_tokens=self.special).ids
            else:
                ids = self.tok(text, add_special_tokens=self.special)["input_ids"]
            if self.caching:
                self._cache[text] = ids
        return ids


@functools.lru_cache(maxsize=4)
def _trained_bpe(vocab_size: int):
    try:
        from tokenizers import Tokenizer as HFTok
        from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    except ImportError as exc:
        raise ImportError("the built-in tokenizer needs the `tokenizers` package: pip install 'dvla[vla]'") from exc
    tok = HFTok(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = [ln.strip() for ln in CORPUS.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    tok.train_from_iterator(lines, trainer=trainer)
    bos = "<bos>"
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def builtin_tokenizer(vocab_size: int = 512, max_len: int = 24) -> HFTokenizer:
    """A byte-level BPE of ``vocab_size`` tokens (special tokens first: ``<pad>`` is 0,
    ``<bos>`` 2) trained on ``dvla/data/instructions.txt``; its post-processor starts every
    instruction with ``<bos>`` (saved with it: ``.tok.save(path)``). Any text encodes (bytes
    are in the alphabet); the same corpus and size give the same tokenizer on every machine."""
    tok = _trained_bpe(vocab_size)
    return HFTokenizer(tok, max_len=max_len, pad_id=tok.token_to_id("<pad>"))
