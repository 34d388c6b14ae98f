"""Rotary position embeddings (the "rotate half" layout of HF Llama), with linear, llama3 and longrope
(Phi-3) scaling, over the whole head or its first `rotary_dim` dims (partial rotary, Phi-4-mini).

`rotate` is the named op the model calls: the C++ kernel in place where the op table (ops.py) chose it,
else `apply_rotary`, the torch reference (the same roundings). A partial rotary always takes the torch
path: the kernel turns whole heads.

LongRoPE (transformers' _compute_longrope_parameters): inv_freq = 1 / (factors * theta^(2i/dim)), with
`short_factor` while the sequence is within original_max_position_embeddings and `long_factor` beyond,
and cos/sin times attention_factor (sqrt(1 + ln(factor) / ln(original_max)), factor = max_position /
original_max). transformers picks the factors per forward call (long for every position once the longest
position reaches original_max), and its Phi-3 generate() drops the KV cache at the step that crosses
original_max to recompute the whole sequence with the long factors. A paged engine does not know a
sequence's final length and does not re-rotate cached keys, so the choice here is per position: short
below original_max, long from it on (vLLM's Phi3LongRoPEScaledRotaryEmbedding likewise precomputes both
caches and indexes the long one past original_max, switching a whole batch at once; per position does not
depend on what else is batched). This equals transformers exactly for every sequence within original_max;
past it, it equals transformers' forward with a kept cache (each new token at position p >= original_max
rotated with the long factors, the cached prompt keeping its short ones), not generate()'s recomputation,
nor a single forward over a prompt longer than original_max (all-long there, short-then-long here).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pagedllm.model.layers import cpu_ops


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """The inverse frequencies of the `head_dim` rotated dims (for longrope: the short ones)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "longrope":
        return _longrope_inv_freq(head_dim, theta, scaling["short_factor"])
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, longrope)")


def _longrope_inv_freq(dim: int, theta: float, factors) -> torch.Tensor:
    # transformers' exact arithmetic: 1 / (ext_factors * base ** (arange(0, dim, 2) / dim))
    ext = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def longrope_attention_factor(scaling: dict, max_positions: int) -> float:
    """transformers' default: sqrt(1 + ln(factor) / ln(original_max)), factor = max_positions / original_max
    (or the config's factor), 1 where the context is not extended; a configured attention_factor wins
    (hf_config.py fills it in from config.json's own max_position_embeddings, before any context cap)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_positions, rotary_dim]; rotary_dim is head_dim unless the rotary is partial."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(rotary_dim, theta, scaling))
        scale = 1.0
        if scaling and scaling.get("rope_type", scaling.get("type")) == "longrope":
            # per position (module docstring): the long factors from original_max on
            original = int(scaling["original_max_position_embeddings"])
            long = torch.outer(positions, _longrope_inv_freq(rotary_dim, theta, scaling["long_factor"]))
            freqs = torch.where((positions >= original)[:, None], long, freqs)
            scale = longrope_attention_factor(scaling, max_positions)
        emb = torch.cat((freqs, freqs), dim=-1)
        # cos/sin for every position, computed once in float32 and cast with the model
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, hd] of the step's positions: looked up once a step, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, H, hd], k [T, kvh, hd] rotated to their positions. The C++ op writes into q and k: callers
    pass this step's fresh projections, never a tensor someone else holds. cos/sin narrower than the head
    (partial rotary) turn its first dims only, on the torch path."""
    kernel = cpu_ops.usable(q)
    if kernel is None or cos.shape[-1] != q.shape[-1]:
        return apply_rotary(q, k, cos, sin)
    kernel.rotary_(q, cos, sin)
    kernel.rotary_(k, cos, sin)
    return q, k


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [T, H, hd], k [T, kvh, hd] -> rotated, same shapes. With cos/sin [T, 1, rd], rd < hd (partial
    rotary), the first rd dims of each head are rotated (rotate-half within them) and the rest pass."""
    rd = cos.shape[-1]
    if rd != q.shape[-1]:
        q_rot, k_rot = q[..., :rd], k[..., :rd]
        return (
            torch.cat((q_rot * cos + _rotate_half(q_rot) * sin, q[..., rd:]), dim=-1),
            torch.cat((k_rot * cos + _rotate_half(k_rot) * sin, k[..., rd:]), dim=-1),
        )
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
