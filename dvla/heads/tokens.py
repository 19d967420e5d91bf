"""A token action head: actions as tokens of a causal language model (RT-2/OpenVLA style).

Each action dimension is cut into ``n_bins`` uniform bins over [-1, 1], and bin ``i`` is the
vocabulary id ``vocab_size - n_bins + i`` (the last ids of the vocabulary, as OpenVLA
does). A chunk of ``K`` steps of ``D`` dimensions is ``K * D`` tokens after a prefix of
embeddings (image patches, instruction, state) that the policy builds.

* ``autoregressive``: token ``j`` is sampled given the prefix and tokens ``< j``, one
  forward step per token over the language model's KV cache. The log-prob of each token is
  taken while sampling (no second pass); the learner scores the recorded tokens with
  teacher forcing, in one pass over ``prefix + tokens[:-1]``.
* ``parallel``: ``K * D`` learned query embeddings follow the prefix, and all tokens are
  sampled at once from their logits (one pass, independent given the prefix), as
  OpenVLA-OFT's parallel decoding does.

The sampled tokens are the extra ``action_tokens`` (``(K * D,)`` int64 per decision), so
the learner evaluates exactly the tokens that were sampled. Only the bin ids' logits count:
the distribution is a softmax over the ``n_bins`` action tokens.

The language model is any Hugging Face style causal LM: called with ``inputs_embeds``,
``attention_mask`` and a cache, it returns ``.logits`` and the extended cache.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Literal

import torch
from torch import Tensor, nn

from dvla.distributions import ActionDistribution, Draw, Extras, ExtraSpec, masked_step_mean

TOKENS = "action_tokens"


def _cache_arg(lm: nn.Module) -> str:
    """The name the LM's forward takes its KV cache by (``cache`` in newer transformers,
    ``past_key_values`` before)."""
    base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm  # through a peft wrapper
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def run_lm(lm: nn.Module, embeds: Tensor, mask: Tensor, cache: Any = None, use_cache: bool = False):
    """``(logits, cache)`` of ``lm`` over ``embeds`` (``(B, N, H)``) with attention ``mask``
    (``(B, past + N)``), continuing ``cache`` when given."""
    kw = {_cache_arg(lm): cache} if cache is not None else {}
    out = lm(inputs_embeds=embeds, attention_mask=mask.long(), use_cache=use_cache, **kw)
    if not use_cache:
        return out.logits, None
    keys = out.keys() if hasattr(out, "keys") else ()
    return out.logits, out["cache"] if "cache" in keys else out.past_key_values


class TokenActionHead(nn.Module):
    """``head(lm, prefix, prefix_mask)`` gives a :class:`TokenActionDistribution`."""

    def __init__(self, *, vocab_size: int, n_bins: int, action_chunk: int, action_dim: int, hidden_size: int,
                 decoding: Literal["autoregressive", "parallel"] = "autoregressive"):
        super().__init__()
        if not 2 <= n_bins <= vocab_size:
            raise ValueError(f"TokenActionHead needs 2 <= n_bins <= vocab_size, got {n_bins} and {vocab_size}")
        if decoding not in ("autoregressive", "parallel"):
            raise ValueError(f"decoding must be autoregressive or parallel, got {decoding!r}")
        self.vocab_size, self.n_bins, self.decoding = vocab_size, n_bins, decoding
        self.first_bin = vocab_size - n_bins
        self.k, self.d = action_chunk, action_dim
        self.n_tokens = action_chunk * action_dim
        if decoding == "parallel":
            self.queries = nn.Parameter(torch.randn(self.n_tokens, hidden_size) * 0.02)

    def rollout_extras(self) -> dict[str, ExtraSpec]:
        return {TOKENS: ExtraSpec((self.n_tokens,), torch.int64, high=self.vocab_size)}

    def to_actions(self, tokens: Tensor) -> Tensor:
        """Bin centres of action tokens ``(B, K * D)`` -> actions ``(B, K, D)``."""
        idx = (tokens - self.first_bin).float()
        return (idx * (2.0 / (self.n_bins - 1)) - 1.0).reshape(tokens.shape[0], self.k, self.d)

    def to_tokens(self, actions: Tensor) -> Tensor:
        """Actions ``(B, K, D)`` -> the tokens of their nearest bins ``(B, K * D)`` (values
        outside [-1, 1] take the end bins)."""
        idx = torch.round((actions.float() + 1.0) * ((self.n_bins - 1) / 2.0)).clamp_(0, self.n_bins - 1).long()
        return idx.reshape(actions.shape[0], -1) + self.first_bin

    def forward(self, lm: nn.Module, prefix: Tensor, prefix_mask: Tensor) -> TokenActionDistribution:
        return TokenActionDistribution(self, lm, prefix, prefix_mask)


class TokenActionDistribution(ActionDistribution):
    def __init__(self, head: TokenActionHead, lm: nn.Module, prefix: Tensor, prefix_mask: Tensor):
        self.head, self.lm, self.prefix, self.mask = head, lm, prefix, prefix_mask.bool()
        self._scored: tuple[Tensor, Tensor] | None = None  # (tokens, bin log-probs) of the last scoring
        self.temperature = 1.0

    def tempered(self, temperature: float) -> "TokenActionDistribution":
        """Every position's bin logits divided by ``temperature`` (greedy decoding unchanged)."""
        if not temperature > 0:
            raise ValueError(f"the sampling temperature of action tokens must be > 0, got {temperature}")
        out = copy.copy(self)
        out.temperature, out._scored = self.temperature * temperature, None
        return out

    def _bin_log_p(self, logits: Tensor) -> Tensor:
        logits = logits[..., self.head.first_bin:].float()
        return torch.log_softmax(logits if self.temperature == 1.0 else logits / self.temperature, dim=-1)

    def _embed(self, tokens: Tensor) -> Tensor:
        return self.lm.get_input_embeddings()(tokens).to(self.prefix.dtype)

    def _ones(self, n: int) -> Tensor:
        return torch.ones(self.mask.shape[0], n, dtype=torch.bool, device=self.mask.device)

    def _parallel_log_p(self) -> Tensor:
        b, p = self.prefix.shape[:2]
        queries = self.head.queries.to(self.prefix.dtype).expand(b, -1, -1)
        logits, _ = run_lm(self.lm, torch.cat([self.prefix, queries], 1), torch.cat([self.mask, self._ones(self.head.n_tokens)], 1))
        return self._bin_log_p(logits[:, p:])

    def bin_log_probs(self, tokens: Tensor) -> Tensor:
        """``(B, K * D, n_bins)``: each position's distribution over the bins given the prefix
        and (autoregressive) the recorded tokens before it, in one pass."""
        if self._scored is not None and self._scored[0] is tokens:
            return self._scored[1]
        if self.head.decoding == "parallel":
            log_p = self._parallel_log_p()
        else:
            p = self.prefix.shape[1]
            n = self.head.n_tokens
            embeds = torch.cat([self.prefix, self._embed(tokens[:, : n - 1])], 1)
            logits, _ = run_lm(self.lm, embeds, torch.cat([self.mask, self._ones(n - 1)], 1))
            log_p = self._bin_log_p(logits[:, p - 1:])
        self._scored = (tokens, log_p)
        return log_p

    def draw(self, deterministic: bool = False, generator: torch.Generator | None = None) -> Draw:
        h = self.head

        def pick(log_p: Tensor) -> Tensor:  # (..., n_bins) -> bin indices
            if deterministic:
                return log_p.argmax(-1)
            flat = log_p.exp().reshape(-1, h.n_bins)
            return torch.multinomial(flat, 1, generator=generator).reshape(log_p.shape[:-1])

        if h.decoding == "parallel":
            log_p = self._parallel_log_p()
            bins = pick(log_p)
            chosen = log_p.gather(-1, bins.unsqueeze(-1)).squeeze(-1)
        else:  # one token at a time over the KV cache
            logits, cache = run_lm(self.lm, self.prefix, self.mask, use_cache=True)
            mask, picked, scores = self.mask, [], []
            for j in range(h.n_tokens):
                log_p = self._bin_log_p(logits[:, -1])
                b = pick(log_p)
                picked.append(b)
                scores.append(log_p.gather(-1, b.unsqueeze(-1)).squeeze(-1))
                if j + 1 < h.n_tokens:
                    mask = torch.cat([mask, self._ones(1)], 1)
                    logits, cache = run_lm(self.lm, self._embed((b + h.first_bin).unsqueeze(1)), mask, cache,
                                           use_cache=True)
            bins, chosen = torch.stack(picked, 1), torch.stack(scores, 1)
        tokens = bins + h.first_bin
        elements = chosen.reshape(-1, h.k, h.d)
        return Draw(actions=h.to_actions(tokens), log_prob=elements.sum(dim=(1, 2)), elements=elements,
                    extras={TOKENS: tokens})

    def sample(self, generator: torch.Generator | None = None) -> Tensor:
        return self.draw(False, generator).actions

    def mode(self) -> Tensor:
        return self.draw(True).actions

    def _tokens(self, extras: Extras | None) -> Tensor:
        tokens = (extras or {}).get(TOKENS)
        want = (self.prefix.shape[0], self.head.n_tokens)
        if tokens is None or tuple(tokens.shape) != want:
            got = None if tokens is None else tuple(tokens.shape)
            raise ValueError(f"the token head scores the sampled tokens: extras['{TOKENS}'] of shape {want} "
                             f"is needed, got {got}")
        return tokens

    def log_prob_elements(self, actions: Tensor, extras: Extras | None = None) -> Tensor:
        tokens = self._tokens(extras)
        log_p = self.bin_log_probs(tokens)
        chosen = log_p.gather(-1, (tokens - self.head.first_bin).clamp(0, self.head.n_bins - 1).unsqueeze(-1))
        return chosen.squeeze(-1).reshape(-1, self.head.k, self.head.d)

    def imitation_loss(self, actions: Tensor, valid: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        """The demonstrated chunk's tokens (its actions' bins) scored with teacher forcing:
        their negative log-likelihood per valid chunk step, as the default's."""
        tokens = self.head.to_tokens(actions)
        nll = -masked_step_mean(self.log_prob_elements(actions, {TOKENS: tokens}).sum(-1), valid)
        return nll, {"nll": float(nll.detach())}

    def entropy(self, extras: Extras | None = None) -> Tensor:
        """Summed entropy of the positions' bin distributions (autoregressive: given the
        recorded tokens before each)."""
        log_p = self._parallel_log_p() if self.head.decoding == "parallel" and extras is None \
            else self.bin_log_probs(self._tokens(extras))
        return -(log_p.exp() * log_p).sum(-1).sum(-1)
