"""The Triton attention backend: same contract as `TorchAttentionBackend` in
`agent_infer/layers/attention.py` (store this step's K/V, then attend over the cache).

Prefill uses the ragged paged kernel (its grid uses the host's max_query_len). Decode
uses the split-K kernel, whose launch depends on shapes only, so it can be captured in
a CUDA graph and replayed with new context lengths and block tables; with the runner's
`meta.decode_counters` it merges its splits in the same launch, and with
`meta.decode_order` it may take the longest contexts first.
"""

from __future__ import annotations

import torch

from agent_infer.engine.forward_context import AttentionMetadata
from agent_infer.kernels.triton.decode_attention import decode_attention, decode_counters, variant_batches
from agent_infer.kernels.triton.kv_store import store_kv
from agent_infer.kernels.triton.prefill_attention import prefill_attention


class TritonAttentionBackend:
    name = "triton"

    @staticmethod
    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, store: bool = True,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> out [T, H, D]; caches [blocks, block_size, Hkv, D].
        store=False: the caller already wrote k/v into the caches."""
        if store:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_prefill and meta.num_decode:
            return _mixed(q, k_cache, v_cache, meta, scale)
        if meta.is_prefill:
            return prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens,
                meta.max_query_len, scale,
            )
        return decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, counters=meta.decode_counters,
            order=meta.decode_order,
        )

    @staticmethod
    def decode_workspace(max_batch: int, num_kv_heads: int, device: torch.device) -> torch.Tensor | None:
        """`AttentionMetadata.decode_counters` for decode batches up to `max_batch`."""
        return decode_counters(max_batch, num_kv_heads, device)

    @staticmethod
    def eager_decode_batches(
        max_batch: int, num_heads: int, num_kv_heads: int, head_dim: int, mixed: bool, device: torch.device,
    ) -> list[int]:
        """Decode-row counts whose eager steps compile every decode-kernel variant that
        eager steps of up to `max_batch` rows need: plain decode steps (with the row
        order) or, `mixed`, the decode rows of mixed steps (without it). Both merge
        their splits with the runner's counters."""
        return variant_batches(max_batch, num_kv_heads, num_heads // num_kv_heads, head_dim, counters=True,
                               order=not mixed, device=device)


def _mixed(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """A mixed step: the decode rows (first, one token each) through the decode kernel,
    which reads each KV head once for its whole query group; the prompt chunks after them
    through the prefill kernel."""
    d = meta.num_decode
    # Whole tensors with a row count or a first sequence, not slices: a slice starting at
    # an odd row is a misaligned pointer, which Triton would compile a new variant for.
    out = torch.empty_like(q)
    decode_attention(
        q[:d], k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
        counters=meta.decode_counters, out=out[:d],
    )
    if q.shape[0] > d:
        prefill_attention(
            q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens,
            meta.max_query_len, scale, out=out, first_seq=d,
        )
    return out
