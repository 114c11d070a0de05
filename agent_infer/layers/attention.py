"""Dense attention over the paged cache: per-head q/k RMSNorm (Qwen3), RoPE and the K/V
cache write as one op, then the bound backend attends over the cache.

The layer declares its cache layout (`cache_layout`, K and V for each of the rank's KV
heads); the engine allocates the pool and binds each layer's cache view and the
backend for that layout (`bind`). Until then (a model called on its own) there is
nothing to attend to.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from agent_infer.attention.metadata import get_attention_metadata
from agent_infer.kernels import ops
from agent_infer.kvcache.calibration import scales_from_amax
from agent_infer.kvcache.layouts import DenseKVCache, DenseKVLayout
from agent_infer.layers.norm import RMSNorm
from agent_infer.layers.rotary import RotaryEmbedding
from agent_infer.loader.weights import Weight, materialize


class PagedAttention(nn.Module):
    """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D] (heads on this rank)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.cache_layout = DenseKVLayout(num_kv_heads, head_dim)
        self.cache: DenseKVCache | None = None
        self.backend = None
        # An fp8 cache's per-layer scales (`self_attn.k_scale` / `v_scale` of a checkpoint
        # whose config has a kv_cache_scheme); 1 when the checkpoint has none. Buffers, not
        # parameters: fp32 whatever the model's dtype, and no weight a step reads.
        self.register_buffer("k_scale", _kv_scale(), persistent=False)
        self.register_buffer("v_scale", _kv_scale(), persistent=False)

    def bind(self, cache: DenseKVCache | None, backend) -> None:
        if cache is not None and cache.k.dtype == torch.float8_e4m3fn:
            cache = dataclasses.replace(cache, k_scale=float(self.k_scale), v_scale=float(self.v_scale))
        self.cache, self.backend = cache, backend

    def calibration_amax(self, tokens: int) -> torch.Tensor:
        """The largest |K| and |V| (fp32 [2]) this layer stored in cache slots [0, tokens):
        what a calibration prefill wrote into a cache of the model's dtype, after the
        layer's norms and RoPE, as an fp8 cache would receive them."""
        k, v = (x.flatten(0, 1)[:tokens] for x in (self.cache.k, self.cache.v))
        return torch.stack([k.abs().amax(), v.abs().amax()]).float()

    def use_calibrated_scales(self, amax: torch.Tensor) -> None:
        """The scales for `calibration_amax`'s figures (maximum over the ranks) by
        `kvcache.calibration.scales_from_amax`, unless the checkpoint gave this layer its own."""
        if getattr(self.k_scale, "from_checkpoint", False):
            return
        k_scale, v_scale = scales_from_amax(float(amax[0]), float(amax[1]))
        self.k_scale.fill_(k_scale)
        self.v_scale.fill_(v_scale)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        rotary: RotaryEmbedding, q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        if self.cache is None:
            raise RuntimeError("attention has no KV cache bound; run the model through the engine")
        meta = get_attention_metadata()
        q_w, k_w = (q_norm.weight, k_norm.weight) if q_norm is not None else (None, None)
        eps = q_norm.eps if q_norm is not None else 0.0
        q, k = ops.norm_rope_store(
            positions, q, k, v, q_w, k_w, eps, rotary.cos_sin_cache, rotary.is_neox, self.cache.k, self.cache.v,
            meta.slot_mapping, self.cache.k_scale, self.cache.v_scale,
        )
        return self.backend.attend(q, self.cache, meta, self.scale)


def _kv_scale() -> torch.Tensor:
    """A KV-cache scale: fp32 1 until a checkpoint's scale loads into it (optional)."""
    t = torch.ones((), dtype=torch.float32)
    t.weight_loader = _load_kv_scale
    t.expected_pieces = set()
    return t


def _load_kv_scale(param: torch.Tensor, loaded: Weight, shard_id=None, expert_id=None) -> None:
    """One positive value (stored as a scalar or a one-element tensor)."""
    value = materialize(loaded)
    if value.numel() != 1:
        raise ValueError(f"a KV-cache scale is one value per layer, got shape {tuple(value.shape)}")
    value = value.reshape(()).float()
    if not torch.isfinite(value) or value <= 0:
        raise ValueError(f"a KV-cache scale must be positive and finite, got {value.item()}")
    param.data.copy_(value)
    param.from_checkpoint = True  # kept over scales computed at start-up (--calculate-kv-scales)
