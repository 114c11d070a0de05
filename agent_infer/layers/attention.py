"""Paged attention: store this step's K/V in the cache, then attend over the cache.

The backend is chosen per device: the plain-PyTorch reference (any device) or Triton
kernels (CUDA). Both read the same cache layout: [num_blocks, block_size, kv_heads, head_dim]
for K and for V.
"""

from __future__ import annotations

import torch
from torch import nn

from agent_infer.engine.forward_context import AttentionMetadata, get_attention_metadata
from agent_infer.kernels import ops, reference
from agent_infer.layers.norm import RMSNorm
from agent_infer.layers.rotary import RotaryEmbedding


class TorchAttentionBackend:
    name = "torch"

    @staticmethod
    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, store: bool = True,
    ) -> torch.Tensor:
        if store:
            reference.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_prefill:
            return reference.prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.query_lens_host, meta.context_lens_host, scale
            )
        return reference.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)

    @staticmethod
    def decode_workspace(max_batch: int, num_kv_heads: int, device: torch.device) -> torch.Tensor | None:
        return None

    @staticmethod
    def eager_decode_batches(
        max_batch: int, num_heads: int, num_kv_heads: int, head_dim: int, mixed: bool, device: torch.device,
    ) -> list[int]:
        return []  # nothing is compiled


def get_attention_backend(name: str, device: torch.device):
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend
    if name == "triton":
        if device.type != "cuda":
            raise ValueError("the triton attention backend needs a CUDA device")
        from agent_infer.kernels.triton.attention import TritonAttentionBackend

        return TritonAttentionBackend
    raise ValueError(f"unknown attention backend {name!r} (choose auto, torch or triton)")


class Attention(nn.Module):
    """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]. The engine binds `kv_cache` ([2, blocks,
    block_size, Hkv, D]) and `backend` after allocating the pool; until then (a model
    called on its own) there is nothing to attend to."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_cache: torch.Tensor | None = None
        self.backend = TorchAttentionBackend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self._cache()
        meta = get_attention_metadata()
        return self.backend.forward(q, k, v, cache[0], cache[1], meta, self.scale)

    def forward_with_rope(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        rotary: RotaryEmbedding, q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """Per-head q/k RMSNorm (Qwen3; when given), RoPE and the K/V cache write as one
        op (one kernel on GPU), then attention over the cache."""
        cache = self._cache()
        meta = get_attention_metadata()
        q_w, k_w = (q_norm.weight, k_norm.weight) if q_norm is not None else (None, None)
        eps = q_norm.eps if q_norm is not None else 0.0
        q, k = ops.norm_rope_store(
            positions, q, k, v, q_w, k_w, eps, rotary.cos_sin_cache, rotary.is_neox, cache[0], cache[1],
            meta.slot_mapping,
        )
        return self.backend.forward(q, k, v, cache[0], cache[1], meta, self.scale, store=False)

    def _cache(self) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("attention has no KV cache bound; run the model through the engine")
        return self.kv_cache
