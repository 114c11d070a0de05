"""Paged GQA decode attention with split-K ("flash decoding"), CUDA-graph safe.

Grid (KV heads, batch, splits). The split count S is fixed by the shapes only (batch,
KV heads, SM count), never by context lengths, so one captured graph replays correctly
for any lengths and block tables written into its static inputs. Each program takes the
whole GQA group of one KV head as the M rows of its dots, so K/V are read once per KV
head, and handles the S-th share of its sequence's context (computed in the kernel from
context_lens, rounded to key tiles); shares past the end are empty. With S == 1 the
kernel writes the output directly. Otherwise each program writes a partial (normalised
output + log2-sum-exp) to fp32 scratch, and the partials are merged in one of two ways:

- merged in the same launch (when the caller passes `counters`): the last program to
  finish for a (sequence, KV head) — found with an atomic counter — merges that KV
  head's group over the splits that hold keys and writes the output; a sequence whose
  keys fit in one share writes directly. One kernel per call instead of two.
- by a second kernel over all S partials (no counters).

The batch-invariant mode fixes the shares a row's keys are cut into at a one-row step's
count (`shares`), whatever the batch: a step of several rows (a verify step's k + 1) then
launches fewer programs than shares, each program taking every grid-th share of its row
(`_decode_shares_kernel`), so a row's partials and their merge are the one-row launch's
while the grid stays the size of the batch's own (a one-row grid for each of 8 rows took
8 times the programs, most of them over empty shares).

Scratch is allocated per call from shapes alone: under CUDA-graph capture the caching
allocator hands out the same addresses on every replay. A context length of 0 (a padding
row of a graph batch) yields zeros, not NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from agent_infer.kernels.triton.paged import (
    check_head_dim, kv_block_ids, kv_row_offsets, tile_load, whole_tiles_end,
)
from agent_infer.kernels.triton.utils import (
    cache_scaled, check_kv_cache_dtype, dot_precision, e4m3_to_f16_ptx, fp16_dots, launch_opts, num_sms, pdl_begin,
    to_f16_scaled,
)

_LOG2E = 1.4426950408889634
MAX_SPLITS = 64
# fp32 partial-output elements the merging program loads per round (64 per thread at 4 warps).
_MERGE_TILE = 8192


@triton.jit
def _merge_group(
    part_o_ptr, part_lse_ptr, out_ptr, seq, kv_head, sob, soh, num_heads, group, head_dim, num_splits, used,
    GROUP_P: tl.constexpr, MERGE_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge the partials of the first `used` splits (all hold keys) for one KV head's
    group of query heads, and write the output. Each round loads MERGE_S splits of every
    head of the group at once: walking the splits one by one would put one L2 round trip
    per split on the critical path of the merging program."""
    g = tl.arange(0, GROUP_P)
    g_mask = g < group
    heads = kv_head * group + g
    sp = tl.arange(0, MERGE_S)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    rows0 = (seq * num_heads + heads) * num_splits  # part_o [B, H, S, D], part_lse [B, H, S]
    acc = tl.zeros([GROUP_P, BLOCK_D], dtype=tl.float32)
    m = tl.full([GROUP_P], float("-inf"), dtype=tl.float32)
    total = tl.zeros([GROUP_P], dtype=tl.float32)
    for s0 in range(0, used, MERGE_S):
        s_mask = (s0 + sp) < used
        rows = rows0[:, None] + (s0 + sp)[None, :]  # [G, S]
        r_mask = g_mask[:, None] & s_mask[None, :]
        # The acquire (and barrier) before the merge already order these loads; .cg also
        # keeps them out of this SM's L1, which other SMs' stores do not update. Read once.
        lse = tl.load(part_lse_ptr + rows, mask=r_mask, other=float("-inf"), cache_modifier=".cg")
        # Padded group rows get a finite lse, so no row's running max stays -inf (NaN).
        lse = tl.where(g_mask[:, None], lse, 0.0)
        o = tl.load(part_o_ptr + rows[:, :, None] * head_dim + d[None, None, :],
                    mask=r_mask[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, axis=1))  # finite: each round has a split with keys
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new[:, None])  # splits past `used`: exp2(-inf) = 0
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, axis=1)
        total = total * alpha + tl.sum(w, axis=1)
        m = m_new
    res = acc / total[:, None]
    out_ptrs = out_ptr + seq * sob + heads[:, None] * soh + d[None, :]
    tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _share_result(acc, m_i, l_i, v_scale, V_SCALED: tl.constexpr):
    """A share's normalised output and log2-sum-exp from its softmax state (the sums per
    key column): zeros and -inf where it held no key."""
    l_i = tl.sum(l_i, axis=1)
    has_keys = l_i > 0
    o = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
    if V_SCALED:  # an fp8 cache holds v / v_scale; the merges are linear in o
        o = o * v_scale
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    return o, lse


@triton.jit
def _count_and_merge(part_o_ptr, part_lse_ptr, out_ptr, counter, seq, kv_head, sob, soh, num_heads, group, head_dim,
                     num_splits, used, programs, GROUP_P: tl.constexpr, MERGE_S: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """Run by each of the `programs` programs of a (sequence, KV head) after storing its
    partials: the last to count merges the `used` partials and re-arms the counter."""
    # Triton executes a scalar atomic in one thread, so its release covers only that
    # thread's own stores; the barrier first makes every thread's partial stores visible
    # to it (CTA scope), and release is cumulative, so they are published at GPU scope
    # before the count. Same pattern as a grid sync.
    tl.debug_barrier()
    done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if done == programs - 1:
        # Symmetrically, the acquire is that one thread's: the barrier orders the other
        # threads' partial loads after it.
        tl.debug_barrier()
        _merge_group(part_o_ptr, part_lse_ptr, out_ptr, seq, kv_head, sob, soh, num_heads, group, head_dim,
                     num_splits, used, GROUP_P, MERGE_S, BLOCK_D)
        # Every other program has counted already, so a plain store re-arms the counter
        # for the next launch (kernel boundary).
        tl.store(counter, 0)


@triton.jit
def _load_tile(k_base, v_base, block, kpos, mask, d, d_mask, kc_b, kc_s, vc_b, vc_s, BLOCK_SIZE: tl.constexpr,
               MASKED: tl.constexpr = True):
    """K and V [BLOCK_N, BLOCK_D] of the key positions `kpos` (cache blocks `block`) where
    `mask`; zeros elsewhere. Not MASKED: every position is a key and every column a
    feature, and the copies go unmasked."""
    k_offs = kv_row_offsets(block, kpos, kc_b, kc_s, BLOCK_SIZE)
    v_offs = kv_row_offsets(block, kpos, vc_b, vc_s, BLOCK_SIZE)
    # Both row offsets before either load: computing V's between the two loads compiled
    # to 158 registers per thread instead of 128 for sm_90 (Triton 3.9), one resident
    # program fewer per SM (tests/test_kernel_compile.py checks the count).
    tile_mask = mask[:, None] & d_mask[None, :]
    k = tile_load(k_base + k_offs[:, None] + d[None, :], tile_mask, MASKED)
    v = tile_load(v_base + v_offs[:, None] + d[None, :], tile_mask, MASKED)
    return k, v


@triton.jit
def _attend_tile(q, acc, m_i, l_i, k, v, kmask, qk_scale, PRECISION: tl.constexpr, PTX_CVT: tl.constexpr,
                 Q_SCALED: tl.constexpr):
    """One key tile (K, V; keys where `kmask`) folded into the running softmax state
    (acc, m_i, l_i per key column) of the group's queries; Q_SCALED: q already carries
    qk_scale."""
    if PTX_CVT:
        v = e4m3_to_f16_ptx(v)
    k = k.to(q.dtype)  # an fp8 cache is read back as q's dtype (no-op otherwise)
    v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if not Q_SCALED:
        s = s * qk_scale
    s = tl.where(kmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    # The softmax sums stay per key column until the share's end: the tile's warps split
    # its keys, so a row sum a tile is a reduction across warps through shared memory.
    l_i = l_i * alpha[:, None] + p
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_at(q, acc, m_i, l_i, start, hi, table_row_ptr, k_base, v_base, d, d_mask, kc_b, kc_s, vc_b, vc_s,
               qk_scale, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
               PTX_CVT: tl.constexpr, Q_SCALED: tl.constexpr, FULL: tl.constexpr, EVEN_D: tl.constexpr):
    """The key tile from position `start` (keys below `hi`; FULL: all of them) loaded and
    folded into the running softmax state, which it returns."""
    kpos = start + tl.arange(0, BLOCK_N)
    kmask = kpos < hi
    block = kv_block_ids(table_row_ptr, kpos, kmask, BLOCK_SIZE, not FULL)
    k, v = _load_tile(k_base, v_base, block, kpos, kmask, d, d_mask, kc_b, kc_s, vc_b, vc_s, BLOCK_SIZE,
                      not (FULL and EVEN_D))
    return _attend_tile(q, acc, m_i, l_i, k, v, kmask, qk_scale, PRECISION, PTX_CVT, Q_SCALED)


@triton.jit
def _attend_from(q, acc, m_i, l_i, first, lo, hi, table_row_ptr, k_base, v_base, d, d_mask, kc_b, kc_s, vc_b, vc_s,
                 qk_scale, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                 PTX_CVT: tl.constexpr, Q_SCALED: tl.constexpr, EVEN_D: tl.constexpr):
    """The keys [first, hi) of a share [lo, hi) folded into the state (first: lo, or the
    tile after a first one already folded in). The partial tile the last share of a
    sequence may end on goes before the loop (unless it was that first tile), so the loop
    runs whole tiles with unmasked copies: a mask per key row cost each copied vector its
    predicates (tests/test_kernel_compile.py)."""
    full_hi = whole_tiles_end(lo, hi, BLOCK_N)
    if (full_hi < hi) & (full_hi >= first):
        acc, m_i, l_i = _attend_at(q, acc, m_i, l_i, full_hi, hi, table_row_ptr, k_base, v_base, d, d_mask,
                                   kc_b, kc_s, vc_b, vc_s, qk_scale, BLOCK_SIZE, BLOCK_N, PRECISION, PTX_CVT,
                                   Q_SCALED, False, EVEN_D)
    for start in range(first, full_hi, BLOCK_N):
        acc, m_i, l_i = _attend_at(q, acc, m_i, l_i, start, hi, table_row_ptr, k_base, v_base, d, d_mask,
                                   kc_b, kc_s, vc_b, vc_s, qk_scale, BLOCK_SIZE, BLOCK_N, PRECISION, PTX_CVT,
                                   Q_SCALED, True, EVEN_D)
    return acc, m_i, l_i


# The block-table width varies between eager steps (the batch's longest table) and the
# graphs' static buffers; specialising on it would compile a variant mid-serving.
@triton.jit(do_not_specialize=["s_table"])
def _decode_split_kernel(
    q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, table_ptr, ctx_ptr, part_o_ptr, part_lse_ptr, counter_ptr, order_ptr,
    sqb, sqh, sob, soh,
    kc_b, kc_s, kc_h, vc_b, vc_s, vc_h, s_table,
    num_heads, num_kv_heads, group, head_dim, num_splits, qk_scale, v_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DIRECT: tl.constexpr, MERGE: tl.constexpr, GROUP_P: tl.constexpr, MERGE_S: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr, PRELOAD: tl.constexpr, ORDERED: tl.constexpr,
    V_SCALED: tl.constexpr, F16_DOTS: tl.constexpr, PTX_CVT: tl.constexpr, EVEN_D: tl.constexpr = False,
):
    # KV heads on the fastest grid axis: the programs of one sequence's heads run side by
    # side and together read whole cache rows (a row holds every KV head of a token);
    # `benchmarks/throughput_kernels.py --only decode` checks this order against the other.
    kv_head = tl.program_id(0).to(tl.int64)
    seq = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    # The context lengths and the row order are this forward's inputs (written before its
    # first kernel, by no kernel of it), so they are read before the PDL wait.
    if ORDERED:
        seq = tl.load(order_ptr + seq).to(tl.int64)
    ctx = tl.load(ctx_ptr + seq)
    chunk = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, ctx)
    table_row_ptr = table_ptr + seq * s_table
    k_base = k_cache_ptr + kv_head * kc_h
    v_base = v_cache_ptr + kv_head * vc_h
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    if PRELOAD:
        # The first tile too, overlapping the predecessor (the RoPE + KV write) instead of
        # following it: the block tables are inputs like the lengths, and every key of it
        # but the newest was written by an earlier forward. The newest key, which the
        # predecessor writes, is read after the wait.
        kpos = lo + tl.arange(0, BLOCK_N)
        kmask = kpos < hi
        block = kv_block_ids(table_row_ptr, kpos, kmask, BLOCK_SIZE, True)
        k, v = _load_tile(k_base, v_base, block, kpos, kmask & (kpos < ctx - 1), d, d_mask, kc_b, kc_s, vc_b, vc_s, BLOCK_SIZE)
    pdl_begin(PDL)

    g = tl.arange(0, BLOCK_G)
    g_mask = g < group
    heads = kv_head * group + g
    q = tl.load(q_ptr + seq * sqb + heads[:, None] * sqh + d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if F16_DOTS:  # over an fp8 cache (utils.fp16_dots); p in [0, 1] gains precision too
        q = to_f16_scaled(q, qk_scale)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    first = lo
    if PRELOAD:
        newest = kmask & (kpos == ctx - 1)  # in one program's first tile at most
        k_new, v_new = _load_tile(k_base, v_base, block, kpos, newest, d, d_mask, kc_b, kc_s, vc_b, vc_s, BLOCK_SIZE)
        k = tl.where(newest[:, None], k_new, k)
        v = tl.where(newest[:, None], v_new, v)
        if lo < hi:
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k, v, kmask, qk_scale, PRECISION, PTX_CVT, F16_DOTS)
        first = lo + BLOCK_N
    acc, m_i, l_i = _attend_from(q, acc, m_i, l_i, first, lo, hi, table_row_ptr, k_base, v_base, d, d_mask,
                                 kc_b, kc_s, vc_b, vc_s, qk_scale, BLOCK_SIZE, BLOCK_N, PRECISION, PTX_CVT,
                                 F16_DOTS, EVEN_D)

    o, lse = _share_result(acc, m_i, l_i, v_scale, V_SCALED)
    out_mask = g_mask[:, None] & d_mask[None, :]
    out_ptrs = out_ptr + seq * sob + heads[:, None] * soh + d[None, :]
    row = (seq * num_heads + heads) * num_splits + split  # part_o [B, H, S, D], part_lse [B, H, S]
    if DIRECT:
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=out_mask)
    elif MERGE:
        # Splits holding keys; split 0 stands for an empty context (o = 0). Programs past
        # them have nothing to contribute and skip the counter, so it counts to `used`.
        used = tl.maximum(tl.cdiv(ctx, tl.maximum(chunk, 1)), 1)
        if split < used:
            if used == 1:
                tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=out_mask)
            else:
                tl.store(part_o_ptr + row[:, None] * head_dim + d[None, :], o, mask=out_mask)
                tl.store(part_lse_ptr + row, lse, mask=g_mask)
                _count_and_merge(part_o_ptr, part_lse_ptr, out_ptr, counter_ptr + seq * num_kv_heads + kv_head, seq,
                                 kv_head, sob, soh, num_heads, group, head_dim, num_splits, used, used, GROUP_P,
                                 MERGE_S, BLOCK_D)
    else:
        tl.store(part_o_ptr + row[:, None] * head_dim + d[None, :], o, mask=out_mask)
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _attend_share(q, lo, hi, table_row_ptr, k_base, v_base, d, d_mask, kc_b, kc_s, vc_b, vc_s, qk_scale,
                  BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  PRECISION: tl.constexpr, PTX_CVT: tl.constexpr, Q_SCALED: tl.constexpr, EVEN_D: tl.constexpr,
                  PRELOAD_ORDER: tl.constexpr):
    """The softmax state of the group's queries over keys [lo, hi), its tiles folded in
    the order `_decode_split_kernel` takes them (so the state is bitwise its): with
    PRELOAD_ORDER the first tile, then the partial tile the share may end on, then the
    whole tiles between; without, the partial tile, then the whole tiles."""
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    first = lo
    if PRELOAD_ORDER:
        if lo < hi:
            acc, m_i, l_i = _attend_at(q, acc, m_i, l_i, lo, hi, table_row_ptr, k_base, v_base, d, d_mask, kc_b,
                                       kc_s, vc_b, vc_s, qk_scale, BLOCK_SIZE, BLOCK_N, PRECISION, PTX_CVT, Q_SCALED,
                                       False, EVEN_D)
        first = lo + BLOCK_N
    return _attend_from(q, acc, m_i, l_i, first, lo, hi, table_row_ptr, k_base, v_base, d, d_mask, kc_b, kc_s,
                        vc_b, vc_s, qk_scale, BLOCK_SIZE, BLOCK_N, PRECISION, PTX_CVT, Q_SCALED, EVEN_D)


@triton.jit(do_not_specialize=["s_table"])
def _decode_shares_kernel(
    q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, table_ptr, ctx_ptr, part_o_ptr, part_lse_ptr, counter_ptr,
    sqb, sqh, sob, soh,
    kc_b, kc_s, kc_h, vc_b, vc_s, vc_h, s_table,
    num_heads, num_kv_heads, group, head_dim, num_shares, num_programs, qk_scale, v_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP_P: tl.constexpr, MERGE_S: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
    V_SCALED: tl.constexpr, F16_DOTS: tl.constexpr, PTX_CVT: tl.constexpr, PRELOAD_ORDER: tl.constexpr,
    EVEN_D: tl.constexpr = False,
):
    """Grid (KV heads, batch, num_programs <= num_shares): a row's keys cut into the
    num_shares shares `_decode_split_kernel` cuts them into at num_shares splits, program
    p taking shares p, p + num_programs, ... one at a time from the initial state, each
    partial stored where that kernel stores it, and the last program of a (row, KV head)
    merging them as it does (counters needed). Every row's result is bitwise that
    kernel's at num_shares splits (PRELOAD_ORDER: its PRELOAD, whose tile order it keeps)."""
    kv_head = tl.program_id(0).to(tl.int64)
    seq = tl.program_id(1).to(tl.int64)
    prog = tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq)
    chunk = tl.cdiv(tl.cdiv(ctx, num_shares), BLOCK_N) * BLOCK_N
    used = tl.maximum(tl.cdiv(ctx, tl.maximum(chunk, 1)), 1)  # shares with keys; share 0 for an empty context
    table_row_ptr = table_ptr + seq * s_table
    k_base = k_cache_ptr + kv_head * kc_h
    v_base = v_cache_ptr + kv_head * vc_h
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    pdl_begin(PDL)
    if prog < used:
        g = tl.arange(0, BLOCK_G)
        g_mask = g < group
        heads = kv_head * group + g
        q = tl.load(q_ptr + seq * sqb + heads[:, None] * sqh + d[None, :], mask=g_mask[:, None] & d_mask[None, :],
                    other=0.0)
        if F16_DOTS:
            q = to_f16_scaled(q, qk_scale)
        out_mask = g_mask[:, None] & d_mask[None, :]
        for share in range(prog, used, num_programs):
            lo = share * chunk
            hi = tl.minimum(lo + chunk, ctx)
            acc, m_i, l_i = _attend_share(q, lo, hi, table_row_ptr, k_base, v_base, d, d_mask, kc_b, kc_s, vc_b,
                                          vc_s, qk_scale, BLOCK_G, BLOCK_D, BLOCK_SIZE, BLOCK_N, PRECISION, PTX_CVT,
                                          F16_DOTS, EVEN_D, PRELOAD_ORDER)
            o, lse = _share_result(acc, m_i, l_i, v_scale, V_SCALED)
            if used == 1:
                tl.store(out_ptr + seq * sob + heads[:, None] * soh + d[None, :], o.to(out_ptr.dtype.element_ty),
                         mask=out_mask)
            else:
                row = (seq * num_heads + heads) * num_shares + share  # part_o [B, H, S, D], part_lse [B, H, S]
                tl.store(part_o_ptr + row[:, None] * head_dim + d[None, :], o, mask=out_mask)
                tl.store(part_lse_ptr + row, lse, mask=g_mask)
        if used > 1:  # the programs holding shares count
            _count_and_merge(part_o_ptr, part_lse_ptr, out_ptr, counter_ptr + seq * num_kv_heads + kv_head, seq,
                             kv_head, sob, soh, num_heads, group, head_dim, num_shares, used,
                             tl.minimum(used, num_programs), GROUP_P, MERGE_S, BLOCK_D)


@triton.jit
def _decode_combine_kernel(
    part_o_ptr, part_lse_ptr, out_ptr,
    sob, soh, num_heads, head_dim, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    row = (seq * num_heads + head) * num_splits + s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # empty splits: exp2(-inf) = 0
    total = tl.sum(w, axis=0)
    o = tl.load(part_o_ptr + row[:, None] * head_dim + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    res = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * sob + head * soh + d, res.to(out_ptr.dtype.element_ty), mask=d_mask)


def _resident_programs(device: torch.device, preload: bool = True, merge: bool = False) -> int:
    """Programs of this kernel resident at once on `device` (4 warps each, 64K registers
    per SM; tests/test_kernel_compile.py checks the register counts for sm_90): two per
    SM with the first tile held across the PDL wait (up to ~190 registers per thread);
    without it four (128), three when the programs also merge splits (150 at 16 splits a
    merge round; at two splits 128 would allow four, so three is a conservative bound)."""
    return (2 if preload else 3 if merge else 4) * num_sms(device)


def decode_num_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per (sequence, KV head): about two programs per SM in all, from static
    shapes only. Rounded up: rounding down left batches of 17-33 sequences (8 KV heads)
    one split each, 136-264 programs over long contexts: too few programs to keep enough
    KV loads in flight."""
    return max(1, min(MAX_SPLITS, triton.cdiv(_resident_programs(device), max(1, batch * num_kv_heads))))


def preload_first_tile(batch: int, num_kv_heads: int, splits: int, device: torch.device) -> bool:
    """Whether each program loads its first key tile before the PDL wait: only when the
    whole grid is resident at once (batch 1 at 8 KV heads: 33 splits, 264 programs on
    132 SMs). The preload is what lets a short batch-1 program overlap its predecessor,
    but the registers it holds cut residency from four programs per SM to two; a larger
    grid then streams the KV cache with fewer loads in flight (`benchmarks/decode_residency.py`
    measures the cost per batch)."""
    return batch * num_kv_heads * splits <= _resident_programs(device)


def ordered_rows(batch: int, num_kv_heads: int, splits: int, merge: bool, device: torch.device) -> bool:
    """Whether to launch the sequences in the caller's order (longest context first)
    rather than row order: only when the grid is larger than about one wave. Programs
    then start as others finish, and with the longest first the call no longer ends on a
    few long contexts running alone. In a single wave every program starts at once and
    the order only decides which programs share an SM; longest first then puts the long
    ones together.

    A wave is `_resident_programs` without the preload (which `preload_first_tile` keeps
    to single waves); `benchmarks/throughput_kernels.py --only splits` rechecks the
    threshold on a new GPU (docs/PERFORMANCE.md has the H200's figures)."""
    return batch * num_kv_heads * splits > _resident_programs(device, preload=False, merge=merge)


@dataclass(frozen=True)
class LaunchPlan:
    """The host's choices for one decode call; all but `splits` are constexprs of the
    kernels, and `splits` is specialised by Triton (1, a multiple of 16, or other), so
    `variant` tells apart the calls that need different compiled kernels (the combining
    kernel's tile, without an in-launch merge, included)."""

    splits: int  # programs per (sequence, KV head)
    direct: bool  # one split: the programs write the output
    merge: bool  # the splits are merged in the same launch (counters given)
    preload: bool
    ordered: bool
    group_p: int
    merge_s: int
    shares: int = 0  # > splits: the keys cut into this many shares, several a program (_decode_shares_kernel)

    @property
    def variant(self) -> tuple:
        split_class = 1 if self.splits == 1 else 16 if self.splits % 16 == 0 else 0
        combine = 0 if self.direct or self.merge else triton.next_power_of_2(self.splits)
        return (self.direct, self.merge, self.preload, self.ordered, self.group_p, self.merge_s, split_class, combine,
                bool(self.shares))


def launch_plan(
    batch: int, num_kv_heads: int, group: int, block_d: int, counters: bool, order: bool, device: torch.device,
    num_splits: int | None = None, preload: bool | None = None, ordered: bool | None = None,
    shares: int | None = None,
) -> LaunchPlan:
    """What `decode_attention` launches for `batch` sequences (`counters`/`order`: whether
    the caller passes them; the other arguments override the shape-derived choices).
    `shares`: the split count every row's keys are cut into whatever the batch (the
    batch-invariant mode's one-row count); where the batch's own grid has fewer programs
    per row, they take several shares each, merged in the launch (counters needed), with
    the merge's tile of `shares` splits."""
    if shares:
        grid = num_splits or decode_num_splits(batch, num_kv_heads, device)
        if grid < shares:
            assert counters, "rows cut into more shares than programs merge in the launch: pass the counters"
            plan = launch_plan(batch, num_kv_heads, group, block_d, True, False, device, shares, False, False)
            # `preload` here: whether the one-row launch preloads, whose tile order the shares keep.
            if preload is None:
                preload = preload_first_tile(1, num_kv_heads, shares, device)
            return replace(plan, splits=grid, shares=shares, preload=preload)
        num_splits = shares
    splits = num_splits or decode_num_splits(batch, num_kv_heads, device)
    if preload is None:
        preload = preload_first_tile(batch, num_kv_heads, splits, device)
    direct = splits == 1
    merge = counters and not direct
    if not order:
        ordered = False
    elif ordered is None:
        ordered = ordered_rows(batch, num_kv_heads, splits, merge, device)
    group_p = triton.next_power_of_2(group) if merge else 1
    merge_s = max(1, min(triton.next_power_of_2(splits), _MERGE_TILE // (group_p * block_d))) if merge else 1
    return LaunchPlan(splits, direct, merge, preload, ordered, group_p, merge_s)


def variant_batches(
    max_batch: int, num_kv_heads: int, group: int, head_dim: int, counters: bool, order: bool, device: torch.device,
    num_splits: int | None = None, preload: bool | None = None, shares: int | None = None,
) -> list[int]:
    """The smallest batch of each distinct compiled variant that calls of 1..max_batch
    sequences need (with the same `num_splits`, `preload` and `shares` overrides, if any):
    running these batches once compiles every variant such calls can meet (what a
    start-up warm-up of eager decode steps runs)."""
    block_d = check_head_dim(head_dim)
    first: dict[tuple, int] = {}
    for batch in range(1, max_batch + 1):
        plan = launch_plan(batch, num_kv_heads, group, block_d, counters, order, device, num_splits, preload,
                           shares=shares)
        first.setdefault(plan.variant, batch)
    return sorted(first.values())


def decode_counters(max_batch: int, num_kv_heads: int, device: torch.device | str) -> torch.Tensor:
    """The zeroed int32 workspace that lets `decode_attention` merge its splits in one
    launch: one counter per (sequence, KV head) for batches up to `max_batch`. Allocate it
    once (its address must stay fixed for CUDA graphs) and pass it to every decode call;
    each call leaves it zero again. Calls sharing it must not run concurrently (one
    stream); `num_kv_heads` is the per-rank count under tensor parallelism."""
    return torch.zeros(max_batch * num_kv_heads, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int  # keys per inner step (split shares are rounded to it)
    num_warps: int
    num_stages: int


def default_config(head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> DecodeConfig:
    """benchmarks/gpu_kernels.py sweeps alternatives, benchmarks/throughput_kernels.py
    --kv-cache-dtype fp8 those of an fp8 cache."""
    if dtype == torch.float32 or head_dim > 128:
        return DecodeConfig(32, 4, 2)
    if cache_dtype == torch.float8_e4m3fn:
        return DecodeConfig(64, 4, 2)
    return DecodeConfig(64, 4, 3)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    counters: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    preload: bool | None = None,
    order: torch.Tensor | None = None,
    ordered: bool | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    shares: int | None = None,
) -> torch.Tensor:
    """q [B, H, D] (one query per sequence, strided rows allowed) -> out [B, H, D].

    Sequence b attends to its context_lens[b] cached tokens under block_tables[b] (the
    tables and lengths may hold more rows, e.g. a mixed step's prefill rows after the
    decode rows; those are ignored). Reads no device value on the host. `num_splits`
    overrides the shape-derived split count and `config` the tile configuration.
    `counters` (from `decode_counters`, at least B * KV heads, zero on entry and left
    zero) merges the splits in the same launch; without it a second kernel merges them.
    `out`, when given, receives the result (strided rows allowed). `preload` overrides
    `preload_first_tile`. `order` (int32, at least B, a permutation of 0..B-1: e.g. the
    rows by context length, longest first) is the order the grid takes the sequences in
    where `ordered_rows` says it pays; `ordered` overrides that choice. An fp8 cache's
    entries times `k_scale` / `v_scale` are K and V (k_scale joins the softmax scale).
    `shares` (with `preload` as a one-row call's): each row's keys are cut as a one-row
    call at `shares` splits cuts them, whatever the batch, so each row's result is
    bitwise that call's (`launch_plan`).

    Under PDL the kernel reads the context lengths before waiting for the kernel launched
    just before it, and with the preload also the block tables and the first tile's keys
    but each sequence's newest: that kernel may write q and the newest keys (as the
    RoPE + KV write does), nothing else read here.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert block_tables.shape[0] >= batch and context_lens.shape[0] >= batch
    check_kv_cache_dtype(k_cache, v_cache, q.dtype)
    v_scaled = cache_scaled(k_cache, k_scale, v_scale)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1
    if counters is not None:
        assert counters.dtype == torch.int32 and counters.is_contiguous() and counters.device == q.device
        assert counters.numel() >= batch * num_kv_heads, (
            f"decode counters hold {counters.numel()} < batch {batch} x KV heads {num_kv_heads}"
        )
    block_d = check_head_dim(head_dim)
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if batch == 0:
        return out
    if order is not None:
        assert order.dtype == torch.int32 and order.shape[0] >= batch and order.device == q.device
    plan = launch_plan(batch, num_kv_heads, group, block_d, counters is not None, order is not None, q.device,
                       num_splits, preload, ordered, shares)
    splits, direct, merge, ordered = plan.splits, plan.direct, plan.merge, plan.ordered
    cfg = config or default_config(head_dim, q.dtype, k_cache.dtype)
    f16_dots = fp16_dots(k_cache.dtype, q.dtype)
    if plan.shares:  # fewer programs than shares
        part_o = torch.empty((batch, num_heads, plan.shares, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, plan.shares), dtype=torch.float32, device=q.device)
        _decode_shares_kernel[(num_kv_heads, batch, splits)](
            q, out, k_cache, v_cache, block_tables, context_lens, part_o, part_lse, counters,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
            num_heads, num_kv_heads, group, head_dim, plan.shares, splits, scale * k_scale * _LOG2E, v_scale,
            BLOCK_SIZE=k_cache.shape[1], BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=cfg.block_n,
            BLOCK_D=block_d, GROUP_P=plan.group_p, MERGE_S=plan.merge_s, PRECISION=dot_precision(q.dtype),
            V_SCALED=v_scaled, F16_DOTS=f16_dots, PTX_CVT=f16_dots and q.device.type == "cuda",
            PRELOAD_ORDER=plan.preload, EVEN_D=head_dim == block_d,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_opts(q.device),
        )
        return out
    if direct:
        part_o = part_lse = out  # unused
    else:
        part_o = torch.empty((batch, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_kv_heads, batch, splits)](
        q, out, k_cache, v_cache, block_tables, context_lens, part_o, part_lse,
        counters if merge else context_lens,  # unused without MERGE
        order if ordered else context_lens,  # unused unless ORDERED
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        num_heads, num_kv_heads, group, head_dim, splits, scale * k_scale * _LOG2E, v_scale,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=cfg.block_n,
        BLOCK_D=block_d, DIRECT=direct, MERGE=merge, GROUP_P=plan.group_p, MERGE_S=plan.merge_s,
        PRECISION=dot_precision(q.dtype), PRELOAD=plan.preload, ORDERED=ordered, V_SCALED=v_scaled,
        F16_DOTS=f16_dots, PTX_CVT=f16_dots and q.device.type == "cuda", EVEN_D=head_dim == block_d,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_opts(q.device),
    )
    if not direct and not merge:
        _decode_combine_kernel[(batch, num_heads)](
            part_o, part_lse, out,
            out.stride(0), out.stride(1), num_heads, head_dim, splits,
            BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d, num_warps=4, **launch_opts(q.device),
        )
    return out
