"""Gemma-shaped transformer blocks for the pi0 family, named as transformers' Gemma names its
parameters (the converters rely on it), with pi0.5's adaptive RMS norm.

* :class:`RMSNorm`: ``x / rms(x) * (1 + weight)`` in fp32.
* :class:`AdaRMSNorm` (pi0.5's expert): no weight; a ``dense`` layer maps the condition (the
  flow time's embedding) to a scale, a shift and a gate, ``x / rms(x) * (1 + scale) + shift``;
  the gate multiplies the branch the norm starts where it joins the residual again.
* :class:`GemmaBlock`: one decoder layer, split into ``qkv`` and ``finish`` so that a prefix
  layer and an expert layer can attend over each other's keys and values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

class RMSNorm(nn.Module):
    """Gemma's RMS norm: ``x / rms(x) * (1 + weight)``, computed in fp32."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.zeros(width))

    def forward(self, x: Tensor) -> Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())
        return y.type_as(x)


class AdaRMSNorm(nn.Module):
    """pi0.5's adaptive RMS norm: ``x / rms(x) * (1 + scale) + shift`` with ``(scale, shift,
    gate) = dense(cond)``, computed in fp32; :meth:`gate` is the residual's gate."""

    def __init__(self, width: int, cond_dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.dense = eps, nn.Linear(cond_dim, 3 * width)
        nn.init.zeros_(self.dense.weight)

    def _modulation(self, cond: Tensor, like: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        m = self.dense(cond)
        return m[:, None].chunk(3, dim=-1) if like.dim() == 3 else m.chunk(3, dim=-1)

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        scale, shift, _ = self._modulation(cond, x)
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + scale.float()) + shift.float()
        return y.type_as(x)

    def gate(self, cond: Tensor, like: Tensor) -> Tensor:
        return self._modulation(cond, like)[2].to(like.dtype)


def norm(layer: nn.Module, x: Tensor, cond: Tensor | None) -> Tensor:
    """``layer(x)``, or ``layer(x, cond)`` for an adaptive norm."""
    return layer(x, cond) if isinstance(layer, AdaRMSNorm) else layer(x)


def _gated(residual: Tensor, branch: Tensor, layer: nn.Module, cond: Tensor | None) -> Tensor:
    branch = branch.to(residual.dtype)
    return residual + (branch * layer.gate(cond, branch) if isinstance(layer, AdaRMSNorm) else branch)


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(width, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, width, bias=False)


class _MLP(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


def rope(positions: Tensor, head_dim: int, theta: float = 10000.0) -> tuple[Tensor, Tensor]:
    """Rotary embedding tables for ``positions`` ``(B, S)``: cos and sin, ``(B, 1, S, head_dim)``."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    ang = positions.float()[..., None] * inv
    ang = torch.cat([ang, ang], dim=-1)[:, None]
    return ang.cos(), ang.sin()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-b, a], dim=-1) * sin).to(x.dtype)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Attention of ``q`` ``(B, H, S, hd)`` over ``k, v`` ``(B, KV, L, hd)`` (GQA) where ``mask``
    ``(B, S, L)`` is true."""
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None],
                                          enable_gqa=q.shape[1] != k.shape[1])


def block_mask(pad: Tensor, blocks: Tensor) -> Tensor:
    """pi0's block-causal mask ``(B, S, S)``: token ``q`` sees token ``k`` when ``k`` is valid
    (``pad``, ``(B, S)``) and its block (``blocks``, ``(S,)``, non-decreasing) is not after ``q``'s.
    Every token sees itself, so that a padding token's row is not empty."""
    see = (blocks[None, :] <= blocks[:, None])[None] & pad[:, None, :]
    return see | torch.eye(pad.shape[1], dtype=torch.bool, device=pad.device)


class GemmaBlock(nn.Module):
    """One Gemma decoder layer. ``forward(h, mask, cos, sin, past)`` returns the new hidden
    states and this layer's own keys and values (after RoPE); ``past`` (keys, values) of
    earlier tokens (the prefix's, for an expert layer) are attended before its own.
    ``cond_dim``: adaptive norms (pi0.5's expert), and ``cond`` ``(B, cond_dim)`` in every call."""

    def __init__(self, width: int, mlp: int, heads: int, kv_heads: int, head_dim: int, cond_dim: int | None = None):
        super().__init__()
        make = (lambda: AdaRMSNorm(width, cond_dim)) if cond_dim else (lambda: RMSNorm(width))
        self.input_layernorm = make()
        self.self_attn = _Attention(width, heads, kv_heads, head_dim)
        self.post_attention_layernorm = make()
        self.mlp = _MLP(width, mlp)

    def qkv(self, h: Tensor, cos: Tensor, sin: Tensor, cond: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        a, (b, s) = self.self_attn, h.shape[:2]
        n = norm(self.input_layernorm, h, cond)
        q = a.q_proj(n).reshape(b, s, a.heads, a.head_dim).transpose(1, 2)
        k = a.k_proj(n).reshape(b, s, a.kv_heads, a.head_dim).transpose(1, 2)
        v = a.v_proj(n).reshape(b, s, a.kv_heads, a.head_dim).transpose(1, 2)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def finish(self, h: Tensor, att: Tensor, cond: Tensor | None = None) -> Tensor:
        """The attention output ``(B, H, S, hd)`` through ``o_proj``, the residuals and the MLP."""
        h = _gated(h, self.self_attn.o_proj(att.transpose(1, 2).reshape(h.shape[0], h.shape[1], -1)),
                   self.input_layernorm, cond)
        return _gated(h, self.mlp(norm(self.post_attention_layernorm, h, cond)), self.post_attention_layernorm, cond)

    def forward(self, h: Tensor, mask: Tensor, cos: Tensor, sin: Tensor,
                past: tuple[Tensor, Tensor] | None = None, cond: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = self.qkv(h, cos, sin, cond)
        keys, values = (torch.cat([past[0], k.to(past[0].dtype)], 2), torch.cat([past[1], v.to(past[1].dtype)], 2)) \
            if past is not None else (k, v)
        return self.finish(h, attend(q, keys, values, mask), cond), k, v


class GemmaLM(nn.Module):
    """The prefix language model: token embeddings, layers and the final norm (named as in
    transformers' ``GemmaModel``)."""

    def __init__(self, vocab: int, width: int, mlp: int, layers: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        nn.init.normal_(self.embed_tokens.weight, std=width ** -0.5)
        self.layers = nn.ModuleList(GemmaBlock(width, mlp, heads, kv_heads, head_dim) for _ in range(layers))
        self.norm = RMSNorm(width)
