"""How many bytes one token of KV cache costs, from the model config.

Dense attention caches K and V per KV head (`2 * kv_heads * head_dim` values per layer).
MLA (DeepSeek-V2/V3) caches the compressed latent plus the decoupled RoPE key, shared by
all heads (`kv_lora_rank + qk_rope_head_dim` values per layer) — about 9x less than the
materialised per-head K/V the blueprint budgets for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVSpec:
    """Shape of one layer's cache entry for one token on one rank."""

    num_layers: int
    # Dense: K and V, each [num_kv_heads, head_dim]. MLA: one entry of [1, latent_dim].
    num_kv_heads: int
    head_dim: int
    num_kv_tensors: int  # 2 for dense (K, V), 1 for MLA (latent + rope key together)
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return self.num_layers * self.num_kv_tensors * self.num_kv_heads * self.head_dim * elem

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size


def dense_kv_spec(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, tp_size: int = 1) -> KVSpec:
    """K/V heads are split over TP ranks; with more ranks than heads each rank keeps one
    (replicated) head."""
    heads_per_rank = max(1, num_kv_heads // tp_size)
    return KVSpec(num_layers, heads_per_rank, head_dim, 2, dtype)


def mla_kv_spec(num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype) -> KVSpec:
    """The latent cache is not split by TP: every rank needs all of it."""
    return KVSpec(num_layers, 1, kv_lora_rank + qk_rope_head_dim, 1, dtype)
