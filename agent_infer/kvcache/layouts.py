"""Cache layouts: what one attention layer keeps per cached token, and the typed view of
its share of the pool that the layer reads and writes.

A model's attention layers each declare a layout; the pool (kvcache/pool.py) sizes and
allocates any of them, and the engine around it never looks inside: blocks, block
tables, prefix caching and CUDA graphs are the same for every layout.

- Dense attention keeps K and V for each of the rank's KV heads:
  `2 x kv_heads x head_dim` values per token (the heads are split by tensor parallelism).
- MLA (DeepSeek-V2/V3) keeps one row per token: the compressed latent (`kv_lora_rank`
  values), which doubles as V, and the shared RoPE key (`qk_rope_head_dim`): 576 values
  in every released model, about 9x less than materialised per-head K/V. It is not split
  by tensor parallelism: every rank attends over all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DenseKVCache:
    """One layer's K and V caches, each [num_blocks, block_size, kv_heads, head_dim]. An
    fp8 cache holds K / k_scale and V / v_scale (the layer's scales, 1 unless the
    checkpoint gives them); a cache in the model's dtype holds K and V, its scales 1."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0


@dataclass(frozen=True)
class LatentCache:
    """One layer's MLA cache [num_blocks, block_size, kv_lora_rank + rope_dim]: the
    normalised latent in the first `kv_lora_rank` columns, the rotated RoPE key after.
    An fp8 cache holds the rows divided by `scale` (the layer's; 1 unless computed at
    start-up); a cache in the model's dtype holds the rows, its scale 1."""

    kv: torch.Tensor
    kv_lora_rank: int
    scale: float = 1.0

    @property
    def latent(self) -> torch.Tensor:
        return self.kv[..., : self.kv_lora_rank]

    @property
    def rope(self) -> torch.Tensor:
        return self.kv[..., self.kv_lora_rank :]


@dataclass(frozen=True)
class DenseKVLayout:
    num_kv_heads: int  # on this rank
    head_dim: int

    kind = "dense"

    @property
    def values_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def view(self, buffer: torch.Tensor) -> DenseKVCache:
        return DenseKVCache(buffer[0], buffer[1])


@dataclass(frozen=True)
class LatentLayout:
    kv_lora_rank: int
    rope_dim: int

    kind = "mla"

    @property
    def values_per_token(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.kv_lora_rank + self.rope_dim)

    def view(self, buffer: torch.Tensor) -> LatentCache:
        return LatentCache(buffer, self.kv_lora_rank)


CacheLayout = DenseKVLayout | LatentLayout
