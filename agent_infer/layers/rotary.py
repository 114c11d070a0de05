"""Rotary position embeddings with the scalings Hugging Face configs ask for.

The cos/sin table for all positions is computed once, in float32, the way transformers
computes it (so fp32 runs match it exactly), and shared by every layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from agent_infer.config import RopeConfig


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig, max_pos: int) -> torch.Tensor:
    old_len = rope.original_max_position or max_pos
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rope: RopeConfig, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    original = rope.original_max_position or max_pos
    if rope.attention_factor is not None:
        attention = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention


def rope_inv_freq(rope: RopeConfig, rotary_dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale (YaRN's attention factor, else 1)."""
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, rotary_dim, max_pos)
    inv_freq = _base_inv_freq(rope.theta, rotary_dim)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope, max_pos)
    return inv_freq, 1.0


def build_cos_sin_cache(rope: RopeConfig, rotary_dim: int, max_pos: int, device: torch.device) -> torch.Tensor:
    """[max_pos, rotary_dim] float32: cos of each frequency, then sin."""
    inv_freq, scale = rope_inv_freq(rope, rotary_dim, max_pos)
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1).to(device)


class RotaryEmbedding(nn.Module):
    """The cos/sin table shared by every layer and the RoPE style; the rotation itself is
    part of `ops.norm_rope_store` (with the q/k norms and the KV write)."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_pos: int, is_neox: bool = True):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * rope.partial_rotary_factor)
        self.is_neox = is_neox
        cache = build_cos_sin_cache(rope, self.rotary_dim, max_pos, torch.get_default_device())
        self.register_buffer("cos_sin_cache", cache, persistent=False)
