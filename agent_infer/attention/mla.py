"""MLA backends over the latent cache (`kvcache.LatentLayout`): plain PyTorch (any device)
and Triton (CUDA). `layers.mla.LatentAttention` does the model's part (absorbing W_UK and
W_UV, up-projecting the context for prefill); a backend gives it

- `decode(q_lat, cache, meta, scale)`: multi-query attention of the absorbed queries over
  each sequence's cached latent rows, [N, H, latent]; graph-safe on the Triton path;
- `prefill_context(cache, meta)`: where the step's prefill sequences' context rows
  (cached prefix and this step's tokens) sit in the cache, cut into windows of at most
  `context_tile_tokens` rows in all, so that a long context is up-projected a window at
  a time and the memory a prefill step takes is bounded by the window, not the context;
- `context_rows(cache, window, dtype)`: a window's rows, gathered in sequence order, in `dtype`;
- `prefill(..., ctx, window, scale)`: causal attention over a window's materialised keys
  and values: the output, and with several windows its log-sum-exp for the merge.

An fp8 (e4m3) cache holds the rows divided by the layer's scale (`LatentCache.scale`):
decode reads it as it is, a prefill window's rows are converted back to the model's
dtype before the up-projection.
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


# Context rows up-projected at once in a prefill step, over all its sequences: a V2-Lite
# layer's keys and values for this many rows take 128 MiB in bf16.
CONTEXT_TILE_TOKENS = 16384


class ContextWindow:
    """Each prefill sequence's context positions start .. start + n - 1 (n may be 0): their
    cache slots in sequence order, the ragged key lengths, and (when the context is cut
    into several windows) the start positions the kernel needs."""

    def __init__(self, tables: np.ndarray, starts: np.ndarray, lengths: np.ndarray, block_size: int,
                 windowed: bool, device: torch.device):
        _, slots, cu_k = ragged_slots(tables, starts, lengths, block_size)
        self.slots = torch.from_numpy(slots).to(device, non_blocking=True)
        self.cu_k = torch.from_numpy(cu_k).to(device, non_blocking=True)
        self.key_start = torch.from_numpy(starts.astype(np.int32)).to(device, non_blocking=True) if windowed else None


class PrefillContext:
    """Host-built: the prefill sequences' queries and their context in windows. One
    window holds every context row while they fit `tile_tokens`; past that each window
    takes the same span of positions of every sequence."""

    def __init__(self, meta: AttentionMetadata, block_size: int, tile_tokens: int):
        first = meta.num_decode
        tables = meta.block_tables_host[first:]
        q_lens = np.asarray(meta.query_lens_host[first:], dtype=np.int64)
        ctx_lens = np.asarray(meta.context_lens_host[first:], dtype=np.int64)
        cu_q = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu_q[1:])
        device = meta.slot_mapping.device
        self.cu_q = torch.from_numpy(cu_q).to(device, non_blocking=True)
        self.max_q = int(q_lens.max()) if len(q_lens) else 0
        zeros = np.zeros_like(ctx_lens)
        if ctx_lens.sum() <= tile_tokens:
            self.context_lens = None
            self.windows = [ContextWindow(tables, zeros, ctx_lens, block_size, False, device)]
            return
        self.context_lens = torch.from_numpy(ctx_lens.astype(np.int32)).to(device, non_blocking=True)
        span = max(block_size, tile_tokens // len(ctx_lens) // block_size * block_size)
        self.windows = []
        for start in range(0, int(ctx_lens.max()), span):
            starts = np.minimum(start, ctx_lens)
            lengths = np.minimum(start + span, ctx_lens) - starts
            self.windows.append(ContextWindow(tables, starts, lengths, block_size, True, device))


class LatentTorchBackend(AttentionBackend):
    name = "torch"
    context_tile_tokens = CONTEXT_TILE_TOKENS

    @classmethod
    def check_cache_dtype(cls, cache_dtype: torch.dtype, model_dtype: torch.dtype) -> None:
        if cache_dtype not in (model_dtype, torch.float8_e4m3fn):
            raise ConfigError(f"an MLA latent cache holds the model's dtype or fp8 (e4m3), not {cache_dtype}")

    def decode(self, q_lat: torch.Tensor, cache: LatentCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return reference.mla_decode(q_lat, cache.kv, meta.block_tables, meta.context_lens, scale, cache.kv_lora_rank,
                                    cache.scale)

    def prefill_context(self, cache: LatentCache, meta: AttentionMetadata) -> PrefillContext:
        ctx = meta.backend_data
        if ctx is None:  # built by the first layer, shared by the others
            ctx = meta.backend_data = PrefillContext(meta, cache.kv.shape[1], self.context_tile_tokens)
        return ctx

    def context_rows(self, cache: LatentCache, window: ContextWindow, dtype: torch.dtype) -> torch.Tensor:
        """A window's rows in `dtype` (an fp8 cache's entries times its scale)."""
        rows = cache.kv.reshape(-1, cache.kv.shape[-1])[window.slots]
        if rows.dtype == dtype:
            return rows
        return (rows.float() * cache.scale).to(dtype)

    def prefill(self, q_nope, q_pe, k_nope, k_pe, v, ctx: PrefillContext, window: ContextWindow,
                scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        whole, windowed = self._prefill_kernels()
        if window.key_start is None:
            return whole(q_nope, q_pe, k_nope, k_pe, v, ctx.cu_q, window.cu_k, ctx.max_q, scale), None
        return windowed(q_nope, q_pe, k_nope, k_pe, v, ctx.cu_q, window.cu_k, window.key_start, ctx.context_lens,
                        ctx.max_q, scale)

    def _prefill_kernels(self):
        """(attention over every context key, attention over a window of them)."""
        return reference.mla_prefill_attention, reference.mla_prefill_attention_window


class LatentTritonBackend(LatentTorchBackend):
    name = "triton"

    def __init__(self, layer, max_batch: int, device: torch.device, batch_invariant: bool = False):
        super().__init__(layer, max_batch, device, batch_invariant)
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
                          counters=meta.decode_counters, cache_scale=cache.scale)

    def _prefill_kernels(self):
        from agent_infer.kernels.triton import mla_prefill

        return mla_prefill.mla_prefill_attention, mla_prefill.mla_prefill_attention_window
