"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache.

Per token the cache keeps one row: the RMS-normalised latent c (kv_lora_rank values),
which doubles as V before the up-projection, and the rotated RoPE key shared by every
head. kv_b_proj's weight holds, per head, W_UK [nope dim, latent] and W_UV [v dim, latent].

- Decode absorbs W_UK into the query (q_nope @ W_UK: a query over the latent), so
  attention is multi-query over the cached rows and every head shares each row it loads;
  the output, an average of latents, goes through W_UV to each head's values.
- Prefill materialises K and V from the latent of every context token (the cached prefix,
  read back through its blocks, and this step's tokens) and runs causal attention with
  the query's nope and RoPE parts; a long context a window at a time (the backend's
  `context_tile_tokens`), the windows merged, so a step's memory does not grow with the
  context. A mixed step's decode rows take the decode path.

The layer declares its cache layout (`LatentLayout`, not split by tensor parallelism:
every rank attends over all of it); the engine binds each layer's view and the backend.
An fp8 (e4m3) cache holds the rows divided by the layer's `cache_scale` (1, or computed
from a calibration prefill with --calculate-kv-scales).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from agent_infer.attention.metadata import get_attention_metadata
from agent_infer.kernels import ops
from agent_infer.kvcache.calibration import K_TARGET, scale_from_amax
from agent_infer.kvcache.layouts import LatentCache, LatentLayout
from agent_infer.layers.norm import RMSNorm
from agent_infer.layers.rotary import RotaryEmbedding


class LatentAttention(nn.Module):
    def __init__(self, num_heads: int, kv_lora_rank: int, nope_dim: int, rope_dim: int, v_dim: int, scale: float):
        """`num_heads`: the heads on this rank."""
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = nope_dim, rope_dim, v_dim
        self.scale = scale
        self.cache_layout = LatentLayout(kv_lora_rank, rope_dim)
        self.cache: LatentCache | None = None
        self.backend = None
        self.cache_scale = 1.0  # an fp8 cache's; checkpoints give MLA layers none

    def bind(self, cache: LatentCache | None, backend) -> None:
        if cache is not None and cache.kv.dtype == torch.float8_e4m3fn:
            cache = dataclasses.replace(cache, scale=self.cache_scale)
        self.cache, self.backend = cache, backend

    def calibration_amax(self, tokens: int) -> torch.Tensor:
        """The largest |value| (fp32 [1]) of the rows this layer stored in cache slots
        [0, tokens): what --calculate-kv-scales reads after its prefill."""
        rows = self.cache.kv.reshape(-1, self.cache.kv.shape[-1])[:tokens]
        return rows.abs().amax().float().reshape(1)

    def use_calibrated_scales(self, amax: torch.Tensor) -> None:
        """The cache scale for `calibration_amax`'s figure (maximum over the ranks), at
        the keys' target (the rows are the keys, and the values through W_UV)."""
        self.cache_scale = scale_from_amax(float(amax[0]), K_TARGET)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, kv_a: torch.Tensor, kv_norm: RMSNorm,
        rotary: RotaryEmbedding, kv_b_weight: torch.Tensor,
    ) -> torch.Tensor:
        """q [T, H, nope + rope] (q_proj's output), kv_a [T, latent + rope]
        (kv_a_proj_with_mqa's, consumed), kv_b_weight [H x (nope + v), latent] ->
        [T, H x v], the input of o_proj."""
        if self.cache is None:
            raise RuntimeError("attention has no KV cache bound; run the model through the engine")
        meta = get_attention_metadata()
        h, dn, dv, lat = self.num_heads, self.nope_dim, self.v_dim, self.kv_lora_rank
        w = kv_b_weight.view(h, dn + dv, lat)
        store = (positions, kv_norm.weight, kv_norm.eps, rotary.cos_sin_cache, self.cache.kv, meta.slot_mapping,
                 rotary.is_neox, self.cache.scale)
        tokens = q.shape[0]
        decode_rows = meta.num_decode if meta.is_prefill else tokens
        if decode_rows == tokens:  # a decode step: the cache write and the absorbed query together
            q_lat = ops.mla_rope_store_absorb(kv_a, q, w[:, :dn], *store)
            return self._decode(q_lat, w, meta).reshape(tokens, h * dv)
        ops.mla_rope_store(kv_a, q[..., dn:], *store)
        out = q.new_empty(tokens, h, dv)
        if decode_rows:
            q_lat = ops.mla_absorb_query(q[:decode_rows], w[:, :dn])
            out[:decode_rows] = self._decode(q_lat, w, meta)
        out[decode_rows:] = self._prefill(q[decode_rows:], kv_b_weight, meta)
        return out.view(tokens, h * dv)

    def _decode(self, q_lat: torch.Tensor, w: torch.Tensor, meta) -> torch.Tensor:
        """[N, H, v]: the absorbed query [N, H, latent + rope] attends over the cached
        rows; W_UV goes from the averaged latent to each head's values."""
        o_lat = self.backend.decode(q_lat, self.cache, meta, self.scale)
        return torch.bmm(o_lat.transpose(0, 1), w[:, self.nope_dim:].transpose(1, 2)).transpose(0, 1)

    def _prefill(self, q: torch.Tensor, kv_b_weight: torch.Tensor, meta) -> torch.Tensor:
        """[T', H, v] for the prefill sequences' rows: K/V up-projected from the latent of
        their whole context (prefix and new tokens), read back from the cache a window at
        a time; the windows' partial results are merged by their log-sum-exps."""
        h, dn, dv, lat = self.num_heads, self.nope_dim, self.v_dim, self.kv_lora_rank
        ctx = self.backend.prefill_context(self.cache, meta)
        out = lse = None
        for window in ctx.windows:
            rows = self.backend.context_rows(self.cache, window, q.dtype)
            kv = ops.linear(rows[:, :lat], kv_b_weight).view(-1, h, dn + dv)
            part, part_lse = self.backend.prefill(q[..., :dn], q[..., dn:], kv[..., :dn], rows[:, lat:], kv[..., dn:],
                                                  ctx, window, self.scale)
            del rows, kv  # the next window's take their place
            out, lse = (part, part_lse) if out is None else ops.merge_attention_partials(out, lse, part, part_lse)
        return out.to(q.dtype)  # merged windows are fp32
