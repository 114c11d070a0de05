"""Dense paged attention with the Triton kernels (CUDA): the contract of
`DenseTorchBackend` (attend over the cache, which already holds this step's K/V).

Prefill uses the ragged paged kernel (its grid uses the host's max_query_len). Decode
uses the split-K kernel, whose launch depends on shapes only, so it can be captured in
a CUDA graph and replayed with new context lengths and block tables; with the backend's
counters (`meta.decode_counters`) it merges its splits in the same launch, and with
`meta.decode_order` it may take the longest contexts first.
"""

from __future__ import annotations

import torch

from agent_infer.attention.backend import AttentionBackend
from agent_infer.attention.metadata import AttentionMetadata
from agent_infer.kernels.triton.decode_attention import (
    decode_attention, decode_counters, decode_num_splits, preload_first_tile, variant_batches,
)
from agent_infer.kernels.triton.prefill_attention import prefill_attention
from agent_infer.kvcache.layouts import DenseKVCache, DenseKVLayout


class DenseTritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self, layer, max_batch: int, device: torch.device, batch_invariant: bool = False):
        super().__init__(layer, max_batch, device, batch_invariant)
        # Lets the decode kernel merge its splits in the same launch; allocated once, so
        # its address is fixed for CUDA graphs.
        self.counters = decode_counters(max_batch, self.layout.num_kv_heads, device)
        # Batch-invariant: every decode row cuts its keys into the shares of a one-row step
        # and folds their tiles in its order (a row's shares follow its own context length);
        # a step of several rows runs them on its own, smaller grid (decode_attention.launch_plan).
        self.one_row = None
        if batch_invariant:
            kv_heads = self.layout.num_kv_heads
            splits = decode_num_splits(1, kv_heads, device)
            self.one_row = {"shares": splits, "preload": preload_first_tile(1, kv_heads, splits, device)}

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        if not meta.is_prefill or meta.num_decode:
            meta.decode_counters = self.counters
        return meta

    def eager_decode_batches(self, max_batch: int, mixed: bool) -> list[int]:
        """Plain eager decode steps pass the row order, a mixed step's decode rows do not;
        both merge their splits with the counters."""
        layout: DenseKVLayout = self.layout
        return variant_batches(max_batch, layout.num_kv_heads, self.num_heads // layout.num_kv_heads,
                               layout.head_dim, counters=True, order=not mixed, device=self.device,
                               **(self.one_row or {}))

    def attend(self, q: torch.Tensor, cache: DenseKVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, H, D] -> out [T, H, D]; caches [blocks, block_size, Hkv, D]."""
        if meta.is_prefill and meta.num_decode:
            return _mixed(q, cache, meta, scale)
        if meta.is_prefill:
            return prefill_attention(
                q, cache.k, cache.v, meta.block_tables, meta.query_start_loc, meta.context_lens,
                meta.max_query_len, scale, k_scale=cache.k_scale, v_scale=cache.v_scale,
            )
        return decode_attention(
            q, cache.k, cache.v, meta.block_tables, meta.context_lens, scale, counters=meta.decode_counters,
            order=meta.decode_order, k_scale=cache.k_scale, v_scale=cache.v_scale, **(self.one_row or {}),
        )


def _mixed(q: torch.Tensor, cache: DenseKVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """A mixed step: the decode rows (first, one token each) through the decode kernel,
    which reads each KV head once for its whole query group; the prompt chunks after them
    through the prefill kernel."""
    d = meta.num_decode
    # Whole tensors with a row count or a first sequence, not slices: a slice starting at
    # an odd row is a misaligned pointer, which Triton would compile a new variant for.
    out = torch.empty_like(q)
    decode_attention(
        q[:d], cache.k, cache.v, meta.block_tables, meta.context_lens, scale,
        counters=meta.decode_counters, out=out[:d], k_scale=cache.k_scale, v_scale=cache.v_scale,
    )
    if q.shape[0] > d:
        prefill_attention(
            q, cache.k, cache.v, meta.block_tables, meta.query_start_loc, meta.context_lens,
            meta.max_query_len, scale, out=out, first_seq=d, k_scale=cache.k_scale, v_scale=cache.v_scale,
        )
    return out
