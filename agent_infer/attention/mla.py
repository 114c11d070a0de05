"""MLA backends over the latent cache (`kvcache.LatentLayout`): plain PyTorch (any device)
and Triton (CUDA). `layers.mla.LatentAttention` does the model's part (absorbing W_UK and
W_UV, up-projecting the context for prefill); a backend gives it

- `decode(q_lat, cache, meta, scale)`: multi-query attention of the absorbed queries over
  each sequence's cached latent rows, [N, H, latent]; graph-safe on the Triton path;
- `prefill_context(cache, meta)`: every context row (cached prefix and this step's
  tokens) of the step's prefill sequences, gathered from the cache in sequence order,
  with the ragged lengths the prefill kernel needs;
- `prefill(...)`: causal attention over those materialised keys and values.

An fp8 cache is refused: the MLA kernels read the latent in the model's dtype.
"""

from __future__ import annotations

import numpy as np
import torch

from agent_infer.attention.backend import AttentionBackend
from agent_infer.attention.metadata import AttentionMetadata
from agent_infer.config import ConfigError
from agent_infer.kernels import reference
from agent_infer.kvcache.layouts import LatentCache
from agent_infer.kvcache.slots import ragged_slots


class PrefillContext:
    """Host-built: where the prefill sequences' context rows sit in the cache."""

    def __init__(self, meta: AttentionMetadata, block_size: int):
        first = meta.num_decode
        tables = meta.block_tables_host[first:]
        q_lens = np.asarray(meta.query_lens_host[first:], dtype=np.int64)
        ctx_lens = np.asarray(meta.context_lens_host[first:], dtype=np.int64)
        _, slots, cu_k = ragged_slots(tables, np.zeros_like(ctx_lens), ctx_lens, block_size)
        cu_q = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu_q[1:])
        device = meta.slot_mapping.device
        self.slots = torch.from_numpy(slots).to(device, non_blocking=True)
        self.cu_q = torch.from_numpy(cu_q).to(device, non_blocking=True)
        self.cu_k = torch.from_numpy(cu_k).to(device, non_blocking=True)
        self.max_q = int(q_lens.max()) if len(q_lens) else 0


class LatentTorchBackend(AttentionBackend):
    name = "torch"

    @classmethod
    def check_cache_dtype(cls, cache_dtype: torch.dtype, model_dtype: torch.dtype) -> None:
        if cache_dtype != model_dtype:
            raise ConfigError("MLA models keep the latent cache in the model's dtype: --kv-cache-dtype fp8 is not "
                              "supported for them")

    def decode(self, q_lat: torch.Tensor, cache: LatentCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return reference.mla_decode(q_lat, cache.kv, meta.block_tables, meta.context_lens, scale, cache.kv_lora_rank)

    def prefill_context(self, cache: LatentCache, meta: AttentionMetadata):
        ctx = meta.backend_data
        if ctx is None:  # built by the first layer, shared by the others
            ctx = meta.backend_data = PrefillContext(meta, cache.kv.shape[1])
        rows = cache.kv.reshape(-1, cache.kv.shape[-1])[ctx.slots]
        return rows, ctx.cu_q, ctx.cu_k, ctx.max_q

    def prefill(self, q_nope, q_pe, k_nope, k_pe, v, cu_q, cu_k, max_q: int, scale: float) -> torch.Tensor:
        return reference.mla_prefill_attention(q_nope, q_pe, k_nope, k_pe, v, cu_q, cu_k, max_q, scale)


class LatentTritonBackend(LatentTorchBackend):
    name = "triton"

    def __init__(self, layer, max_batch: int, device: torch.device):
        super().__init__(layer, max_batch, device)
        from agent_infer.kernels.triton.mla_decode import mla_decode_counters

        # Lets the decode kernel merge its splits in the same launch; a fixed address for graphs.
        self.counters = mla_decode_counters(max_batch, self.num_heads, device)

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        if not meta.is_prefill or meta.num_decode:
            meta.decode_counters = self.counters
        return meta

    def eager_decode_batches(self, max_batch: int, mixed: bool) -> list[int]:
        from agent_infer.kernels.triton.mla_decode import mla_variant_batches

        return mla_variant_batches(max_batch, self.num_heads, self.layout.kv_lora_rank, True, self.device)

    def decode(self, q_lat: torch.Tensor, cache: LatentCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        from agent_infer.kernels.triton.mla_decode import mla_decode

        return mla_decode(q_lat, cache.kv, meta.block_tables, meta.context_lens, scale, cache.kv_lora_rank,
                          counters=meta.decode_counters)

    def prefill(self, q_nope, q_pe, k_nope, k_pe, v, cu_q, cu_k, max_q: int, scale: float) -> torch.Tensor:
        from agent_infer.kernels.triton.mla_prefill import mla_prefill_attention

        return mla_prefill_attention(q_nope, q_pe, k_nope, k_pe, v, cu_q, cu_k, max_q, scale)
