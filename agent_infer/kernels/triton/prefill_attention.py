"""Causal prefill attention over a ragged batch whose keys and values (cached prefix +
this step's tokens, already stored) are read from the paged cache.

Grid (query tiles, sequences, query heads): the query-tile count comes from the host's
max_query_len; tiles past a sequence's own query length exit at once. Each program runs
an online softmax (exp2, fp32 state) over the key tiles, first those wholly before its
first query (no mask), then the diagonal band with the causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from agent_infer.kernels.triton.paged import check_head_dim, kv_block_ids, kv_row_offsets, tile_load
from agent_infer.kernels.triton.utils import (
    cache_scaled, check_kv_cache_dtype, dot_precision, fp16_dots, to_f16_scaled,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _attend(
    acc, m_i, l_i, q, q_pos,
    k_cache_ptr, v_cache_ptr, table_row_ptr, k_head_off, v_head_off,
    kc_b, kc_s, vc_b, vc_s,
    lo, hi, d, d_mask, qk_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    EVEN_D: tl.constexpr, PRECISION: tl.constexpr, Q_SCALED: tl.constexpr,
):
    """The key tiles [lo, hi) folded into the running softmax state (acc, m_i, l_i) of
    the tile's queries; Q_SCALED: q already carries qk_scale."""
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kmask = kpos < hi
        block = kv_block_ids(table_row_ptr, kpos, kmask, BLOCK_SIZE, CAUSAL)
        k_offs = kv_row_offsets(block, kpos, kc_b, kc_s, BLOCK_SIZE)
        v_offs = kv_row_offsets(block, kpos, vc_b, vc_s, BLOCK_SIZE)
        k_ptrs = k_cache_ptr + k_head_off + k_offs[:, None] + d[None, :]
        v_ptrs = v_cache_ptr + v_head_off + v_offs[:, None] + d[None, :]
        # Below the causal diagonal every key exists: only padded columns need a mask.
        tile_mask = kmask[:, None] & d_mask[None, :] if CAUSAL else d_mask[None, :]
        k = tile_load(k_ptrs, tile_mask, CAUSAL or not EVEN_D)
        v = tile_load(v_ptrs, tile_mask, CAUSAL or not EVEN_D)
        k = k.to(q.dtype)  # an fp8 cache is read back as q's dtype (no-op otherwise)
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if not Q_SCALED:
            s = s * qk_scale
        if CAUSAL:
            visible = (kpos[None, :] <= q_pos[:, None]) & kmask[None, :]
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# The block-table width and the first sequence vary from step to step; specialising on
# their values (== 1, divisible by 16) would compile a new variant mid-serving for no gain.
@triton.jit(do_not_specialize=["s_table", "first_seq"])
def _prefill_kernel(
    q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, table_ptr, qsl_ptr, ctx_ptr,
    sqt, sqh, sot, soh,
    kc_b, kc_s, kc_h, vc_b, vc_s, vc_h, s_table, first_seq,
    group, head_dim, qk_scale, v_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, PRECISION: tl.constexpr, V_SCALED: tl.constexpr, F16_DOTS: tl.constexpr,
):
    # Reversed so the longest (last) query tiles of the causal triangle start first.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = first_seq + tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    m0 = pid_m * BLOCK_M
    if m0 < q_len:
        ctx = tl.load(ctx_ptr + seq)
        prefix = ctx - q_len
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        d = tl.arange(0, BLOCK_D)
        d_mask = d < head_dim
        q_rows = (q_start + rows).to(tl.int64)
        q = tl.load(
            q_ptr + q_rows[:, None] * sqt + head * sqh + d[None, :],
            mask=row_mask[:, None] & d_mask[None, :], other=0.0,
        )
        if F16_DOTS:  # over an fp8 cache (utils.fp16_dots)
            q = to_f16_scaled(q, qk_scale)
        q_pos = prefix + rows
        kv_head = (head // group).to(tl.int64)
        table_row_ptr = table_ptr + seq.to(tl.int64) * s_table

        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        # Keys before the tile's first query position are visible to every row.
        full_end = ((prefix + m0) // BLOCK_N) * BLOCK_N
        last_pos = prefix + tl.minimum(m0 + BLOCK_M, q_len) - 1
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head * kc_h, kv_head * vc_h,
            kc_b, kc_s, vc_b, vc_s, 0, full_end, d, d_mask, qk_scale,
            BLOCK_SIZE, BLOCK_N, False, EVEN_D, PRECISION, F16_DOTS,
        )
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head * kc_h, kv_head * vc_h,
            kc_b, kc_s, vc_b, vc_s, full_end, last_pos + 1, d, d_mask, qk_scale,
            BLOCK_SIZE, BLOCK_N, True, EVEN_D, PRECISION, F16_DOTS,
        )
        out = acc / l_i[:, None]
        if V_SCALED:  # an fp8 cache holds v / v_scale
            out = out * v_scale
        tl.store(
            out_ptr + q_rows[:, None] * sot + head * soh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & d_mask[None, :],
        )


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # query rows per program (capped by the batch's max_query_len)
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int


def default_config(head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """Tiles sized to fit shared memory; benchmarks/gpu_kernels.py and
    benchmarks/throughput_kernels.py sweep alternatives. Head dim 128 in 16 bits: 64 query
    rows per 4-warp program, twice the programs of 128 rows per 8 warps, evens out the
    causal triangle's uneven tiles. On an H200 (32/8 heads): 184 against 243 us for 14
    prompts of 562 tokens, 439 against 509 us for 4 of 2,048, 348 against 404 us for 8 of
    1,024 after 256 cached, 40 against 44 us for one of 512."""
    if dtype == torch.float32 or head_dim > 128:
        return PrefillConfig(64, 32, 4, 2)
    if head_dim <= 64:
        return PrefillConfig(128, 64, 4, 3)
    return PrefillConfig(64, 64, 4, 2)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    config: PrefillConfig | None = None,
    out: torch.Tensor | None = None,
    first_seq: int = 0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [T, H, D] (rows of all sequences, flattened) -> out [T, H, D].

    Sequence i owns rows query_start_loc[i]:query_start_loc[i+1]; its context_lens[i]
    tokens (cached prefix + these queries) are in the cache under block_tables[i]. Query j
    of sequence i sits at position context_len - query_len + j and sees keys at positions
    <= its own. Only sequences from `first_seq` on are computed (a mixed step's decode
    rows come first and go to the decode kernel), into `out` when given; rows of other
    sequences, or not covered by query_start_loc, are left unwritten. An fp8 cache's
    entries times `k_scale` / `v_scale` are K and V (k_scale joins the softmax scale).
    """
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    check_kv_cache_dtype(k_cache, v_cache, q.dtype)
    v_scaled = cache_scaled(k_cache, k_scale, v_scale)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1
    block_d = check_head_dim(head_dim)
    if out is None:
        out = torch.empty((tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    batch = block_tables.shape[0] - first_seq
    assert first_seq >= 0 and context_lens.shape[0] >= first_seq + batch
    if tokens == 0 or batch <= 0 or max_query_len <= 0:
        return out
    cfg = config or default_config(head_dim, q.dtype)
    block_m = max(16, min(cfg.block_m, triton.next_power_of_2(max_query_len)))
    grid = (triton.cdiv(max_query_len, block_m), batch, num_heads)
    _prefill_kernel[grid](
        q, out, k_cache, v_cache, block_tables, query_start_loc, context_lens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), first_seq,
        num_heads // num_kv_heads, head_dim, scale * k_scale * _LOG2E, v_scale,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
        EVEN_D=block_d == head_dim, PRECISION=dot_precision(q.dtype), V_SCALED=v_scaled,
        F16_DOTS=fp16_dots(k_cache.dtype, q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
