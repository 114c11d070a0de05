"""Dense attention over the paged cache: per-head q/k RMSNorm (Qwen3), RoPE and the K/V
cache write as one op, then the bound backend attends over the cache.

The layer declares its cache layout (`cache_layout`, K and V for each of the rank's KV
heads); the engine allocates the pool and binds each layer's cache view and the
backend for that layout (`bind`). Until then (a model called on its own) there is
nothing to attend to.
"""

from __future__ import annotations

import torch
from torch import nn

from agent_infer.attention.metadata import get_attention_metadata
from agent_infer.kernels import ops
from agent_infer.kvcache.layouts import DenseKVCache, DenseKVLayout
from agent_infer.layers.norm import RMSNorm
from agent_infer.layers.rotary import RotaryEmbedding


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

    def bind(self, cache: DenseKVCache | None, backend) -> None:
        self.cache, self.backend = cache, backend

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
            meta.slot_mapping,
        )
        return self.backend.attend(q, self.cache, meta, self.scale)
