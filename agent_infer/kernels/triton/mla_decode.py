"""DeepSeek MLA decode attention over the paged latent cache, split-K, CUDA-graph safe.

With W_UK absorbed into the query, MLA decode is multi-query attention over one shared
"head": each cache row holds L = kv_lora_rank normalised latent values, then R rotated
rope-key values. Query head h of sequence b scores row t as scale * (q[b, h] . row[t])
over all L + R columns, and its output is the softmax-weighted sum of rows[:, :L] (the
model applies W_UV afterwards).

Grid (head blocks, sequences, splits). A program takes BLOCK_H query heads of one
sequence as the M rows of its dots, so every latent tile it reads serves all of them
(one 576-value row per key is the whole cache traffic; at H = 16 one program covers
every head). It handles the s-th share of its sequence's context, computed in the
kernel from context_lens and rounded to key tiles; shares past the end are empty. The
split count comes from the shapes only (batch, heads, SM count), never from the lengths,
so one captured graph replays for any lengths and block tables.

With one split the kernel writes the output directly. Otherwise each program whose share
holds keys writes a partial (normalised [BLOCK_H, L] output + log2-sum-exp) to fp32
scratch, merged either

- in the same launch (counters given and few splits): the last program of a (sequence,
  head block), found with an atomic counter, merges the splits that hold keys. Unlike
  the dense kernel's group of 4 x 128 values a partial here is 16 x 512, so one program
  merging many splits reads a lot (64 splits: 2 MB) through one SM; past
  MERGE_MAX_SPLITS the second kernel is taken even with counters.
- by a second kernel, one program per (sequence, head, column chunk): parallel.

Scratch comes from shapes alone (graph-safe). A context of 0 (a padding row of a graph
batch) gives zeros, not NaN.

An fp8 (e4m3) cache holds the rows divided by the layer's scale: the scale joins the
softmax scale and multiplies the output. With 16-bit activations the dots then run in
fp16, the query times the score scale rounded to fp16 once (as decode_attention.py does
over an fp8 cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from agent_infer.kernels.triton.paged import kv_block_ids, kv_row_offsets, tile_load, tile_row_offsets, whole_tiles_end
from agent_infer.kernels.triton.utils import (
    cache_scaled, dot_precision, e4m3_to_f16_ptx, fp16_dots, launch_opts, num_sms, pdl_begin, to_f16_scaled,
)

_LOG2E = 1.4426950408889634
# A single sequence takes up to 256 splits: at batch 1 the latent read is spread over
# every SM's two slots, each program a few key tiles.
MAX_SPLITS = 256
# The in-launch merge reads splits x BLOCK_H x L fp32 through one program; past this many
# splits the second, parallel kernel merges instead (see the module docstring).
MERGE_MAX_SPLITS = 4
# The in-launch merge loads [BLOCK_H, splits, 64 columns] of partials per step (32 fp32
# per thread at 4 warps): a 128-column step compiled the whole kernel to 255 registers
# for sm_90 against 200 (tests/test_mla_compile.py). The combine kernel, which holds
# nothing else, loads all splits of up to 128 columns at once (64 per thread).
_MERGE_COLS, _MERGE_TILE = 64, 4096
_COMBINE_COLS, _COMBINE_TILE = 128, 8192
# Splits per load of the merge kernel at most: Triton 3.6 fails to compile a tile of 256
# (its thread-locality pass); more splits take several loads.
_COMBINE_MAX_S = 128
# tl.dot needs at least 16 rows: fewer heads per rank (V2-Lite at TP 2/4) are padded.
MIN_BLOCK_H = 16


@triton.jit
def _merge_splits(
    part_o_ptr, part_lse_ptr, out_ptr, seq, heads, h_mask, sob, soh, num_heads, num_splits, used, col0,
    KV_LORA: tl.constexpr, BLOCK_H: tl.constexpr, MERGE_S: tl.constexpr, MERGE_C: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """out[seq, heads, col0 : col0 + CHUNKS * MERGE_C] = the log-sum-exp weighted mean of
    the first `used` splits' partials. Splits without keys (lse = -inf) weigh nothing;
    when no split has keys the output is zeros."""
    sp = tl.arange(0, MERGE_S)
    rows0 = (seq * num_heads + heads) * num_splits  # part_o [B, H, S, L], part_lse [B, H, S]
    # The weights first (a few values per head), so the partial outputs are then streamed
    # without rescaling. .cg: other SMs' stores do not update this SM's L1.
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    for s0 in range(0, used, MERGE_S):
        r_mask = h_mask[:, None] & ((s0 + sp) < used)[None, :]
        lse = tl.load(part_lse_ptr + rows0[:, None] + (s0 + sp)[None, :], mask=r_mask, other=float("-inf"),
                      cache_modifier=".cg")
        m = tl.maximum(m, tl.max(lse, axis=1))
    m = tl.where(m == float("-inf"), 0.0, m)  # no keys at all (or a padded head row)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    for s0 in range(0, used, MERGE_S):
        r_mask = h_mask[:, None] & ((s0 + sp) < used)[None, :]
        lse = tl.load(part_lse_ptr + rows0[:, None] + (s0 + sp)[None, :], mask=r_mask, other=float("-inf"),
                      cache_modifier=".cg")
        total += tl.sum(tl.exp2(lse - m[:, None]), axis=1)
    inv = tl.where(total > 0, 1.0 / tl.where(total > 0, total, 1.0), 0.0)
    for c in tl.static_range(CHUNKS):
        cols = col0 + c * MERGE_C + tl.arange(0, MERGE_C)
        c_mask = cols < KV_LORA
        acc = tl.zeros([BLOCK_H, MERGE_C], dtype=tl.float32)
        for s0 in range(0, used, MERGE_S):
            s_mask = (s0 + sp) < used
            r_mask = h_mask[:, None] & s_mask[None, :]
            rows = rows0[:, None] + (s0 + sp)[None, :]  # [H, S]
            lse = tl.load(part_lse_ptr + rows, mask=r_mask, other=float("-inf"), cache_modifier=".cg")
            w = tl.exp2(lse - m[:, None]) * inv[:, None]
            o = tl.load(part_o_ptr + rows[:, :, None] * KV_LORA + cols[None, None, :],
                        mask=r_mask[:, :, None] & c_mask[None, None, :], other=0.0, cache_modifier=".cg")
            acc += tl.sum(w[:, :, None] * o, axis=1)
        out_ptrs = out_ptr + seq * sob + heads[:, None] * soh + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & c_mask[None, :])


@triton.jit
def _load_rows(kv_ptr, table_row_ptr, start, kpos, kmask, cl, cr, kv_b, kv_s,
               KV_LORA: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
               HALF_L: tl.constexpr, BLOCK_R: tl.constexpr, PACKED: tl.constexpr, FULL: tl.constexpr):
    """The two latent halves [BLOCK_N, HALF_L] (columns cl and HALF_L + cl) and the
    rope-key part [BLOCK_N, BLOCK_R] of the cache rows of key positions `kpos` (the tile
    from `start`) where `kmask`; zeros elsewhere (also in padded columns). FULL: every
    position is a key, so the copies go unmasked unless columns are padded. PACKED: the
    cache's rows lie back to back (row stride KV_LORA + ROPE_DIM)."""
    if BLOCK_SIZE % BLOCK_N == 0:
        # Tiles start at multiples of BLOCK_N (split shares are whole tiles), so a tile lies
        # in one cache block: one table entry, a thread's copies at constant distances.
        rows = tile_row_offsets(table_row_ptr, start, kv_b, kv_s, BLOCK_SIZE, BLOCK_N,
                                KV_LORA + ROPE_DIM if PACKED else 0)
    else:
        block = kv_block_ids(table_row_ptr, kpos, kmask, BLOCK_SIZE, not FULL)
        rows = kv_row_offsets(block, kpos, kv_b, kv_s, BLOCK_SIZE)
    lat_lo = tile_load(kv_ptr + rows[:, None] + cl[None, :], kmask[:, None] & (cl < KV_LORA)[None, :],
                        not FULL or 2 * HALF_L != KV_LORA)
    lat_hi = tile_load(kv_ptr + rows[:, None] + HALF_L + cl[None, :],
                        kmask[:, None] & (HALF_L + cl < KV_LORA)[None, :], not FULL or 2 * HALF_L != KV_LORA)
    pe = tile_load(kv_ptr + rows[:, None] + KV_LORA + cr[None, :], kmask[:, None] & (cr < ROPE_DIM)[None, :],
                    not FULL or BLOCK_R != ROPE_DIM)
    return lat_lo, lat_hi, pe


@triton.jit
def _attend_tile(kv_ptr, table_row_ptr, start, hi, q_lo, q_hi, q_pe, m_i, l_i, acc_lo, acc_hi, cl, cr,
                 kv_b, kv_s, qk_scale,
                 KV_LORA: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 HALF_L: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, F16_DOTS: tl.constexpr,
                 PTX_CVT: tl.constexpr, PACKED: tl.constexpr, FULL: tl.constexpr):
    """One key tile from position `start` (keys below `hi`; FULL: all of them) folded
    into the running softmax state (m_i, l_i per key column, acc_lo, acc_hi), which it
    returns."""
    kpos = start + tl.arange(0, BLOCK_N)
    kmask = kpos < hi
    lat_lo, lat_hi, pe = _load_rows(kv_ptr, table_row_ptr, start, kpos, kmask, cl, cr, kv_b, kv_s,
                                    KV_LORA, ROPE_DIM, BLOCK_SIZE, BLOCK_N, HALF_L, BLOCK_R, PACKED, FULL)
    if PTX_CVT:  # converted before Triton stages the dot operands (utils.e4m3_to_f16_ptx)
        lat_lo = e4m3_to_f16_ptx(lat_lo)
        lat_hi = e4m3_to_f16_ptx(lat_hi)
        pe = e4m3_to_f16_ptx(pe)
    lat_lo = lat_lo.to(q_lo.dtype)  # an fp8 cache read as the query's dtype (no-op otherwise)
    lat_hi = lat_hi.to(q_hi.dtype)
    pe = pe.to(q_pe.dtype)
    # The rope part opens the first chain (its dot is the small one); the second starts
    # from the key mask (-inf past the keys). Triton folds `x + dot(.., acc=0)` into
    # the dot's accumulator, which would chain the two halves again; this dot's
    # accumulator is not zero (nor known to be in a whole tile).
    s_lo = tl.dot(q_pe, tl.trans(pe), input_precision=PRECISION)
    s_lo = tl.dot(q_lo, tl.trans(lat_lo), acc=s_lo, input_precision=PRECISION)
    masked = tl.broadcast_to(tl.where(kmask, 0.0, float("-inf"))[None, :], (q_lo.shape[0], BLOCK_N))
    s = s_lo + tl.dot(q_hi, tl.trans(lat_hi), acc=masked, input_precision=PRECISION)
    if not F16_DOTS:
        s = s * qk_scale
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    # The softmax sums stay per key column until the end: the tile's warps split its keys,
    # so a row sum a tile is a reduction across warps through shared memory (two barriers).
    l_i = l_i * alpha[:, None] + p
    p = p.to(lat_lo.dtype)
    acc_lo = acc_lo * alpha[:, None] + tl.dot(p, lat_lo, input_precision=PRECISION)
    acc_hi = acc_hi * alpha[:, None] + tl.dot(p, lat_hi, input_precision=PRECISION)
    return m_new, l_i, acc_lo, acc_hi


@triton.jit
def _store_halves(ptrs, o_lo, o_hi, lo_mask, hi_mask, HALF_L: tl.constexpr):
    """Both latent halves of the output rows at `ptrs` (columns cl, HALF_L + cl), in the
    element type of the destination."""
    tl.store(ptrs, o_lo.to(ptrs.dtype.element_ty), mask=lo_mask)
    tl.store(ptrs + HALF_L, o_hi.to(ptrs.dtype.element_ty), mask=hi_mask)


@triton.jit
def _split_shares(ctx, num_splits, BLOCK_N: tl.constexpr):
    """(keys per split, rounded up to whole key tiles; splits that hold keys). Split 0
    counts as used for an empty context too: it writes that context's zeros."""
    chunk = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    return chunk, tl.maximum(tl.cdiv(ctx, tl.maximum(chunk, 1)), 1)


# The block-table width varies between eager steps and the graphs' static buffers;
# specialising on it would compile a variant mid-serving.
@triton.jit(do_not_specialize=["s_table"])
def _mla_decode_kernel(
    q_ptr, out_ptr, kv_ptr, table_ptr, ctx_ptr, part_o_ptr, part_lse_ptr, counter_ptr,
    sqb, sqh, sob, soh, kv_b, kv_s, s_table,
    num_heads, num_head_blocks, num_splits, qk_scale, v_scale,
    KV_LORA: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    DIRECT: tl.constexpr, MERGE: tl.constexpr, MERGE_S: tl.constexpr, MERGE_C: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr, V_SCALED: tl.constexpr = False, F16_DOTS: tl.constexpr = False,
    PTX_CVT: tl.constexpr = False, PACKED: tl.constexpr = False,
):
    # Head blocks on the fastest grid axis: at H = 128 the programs of one sequence run
    # side by side, so each latent tile comes from HBM once and from L2 for the others.
    hb = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    # Lengths and block tables are this forward's inputs (written before its first
    # kernel), so they are read before the PDL wait; q and the newest cache row are what
    # the predecessor (the rope + cache write) produces.
    ctx = tl.load(ctx_ptr + seq)
    chunk, used = _split_shares(ctx, num_splits, BLOCK_N)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, ctx)
    table_row_ptr = table_ptr + seq * s_table
    pdl_begin(PDL)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    # The latent columns in two halves, each with its own dots: the score of a key tile is
    # then two chains of tensor-core products (20 and 16 steps at L = 512, R = 64) instead
    # of one of 36 that a warp runs back to back (tests/test_mla_compile.py).
    HALF_L: tl.constexpr = BLOCK_L // 2
    cl = tl.arange(0, HALF_L)
    cr = tl.arange(0, BLOCK_R)
    # A split past the context's keys reads nothing and writes nothing (the merges stop
    # at `used`): at short contexts most of a batch-1 grid's 256 splits are such.
    q_mask = h_mask & ((heads * 0 + split) < used)  # a vector: interpreters refuse a scalar bool in a mask
    q_rows = q_ptr + seq * sqb + heads.to(tl.int64)[:, None] * sqh
    q_lo = tl.load(q_rows + cl[None, :], mask=q_mask[:, None] & (cl < KV_LORA)[None, :], other=0.0)
    q_hi = tl.load(q_rows + HALF_L + cl[None, :], mask=q_mask[:, None] & (HALF_L + cl < KV_LORA)[None, :],
                   other=0.0)
    q_pe = tl.load(q_rows + KV_LORA + cr[None, :], mask=q_mask[:, None] & (cr < ROPE_DIM)[None, :], other=0.0)
    if F16_DOTS:  # over an fp8 cache: the score scale goes into q before its fp16 rounding
        q_lo = to_f16_scaled(q_lo, qk_scale)
        q_hi = to_f16_scaled(q_hi, qk_scale)
        q_pe = to_f16_scaled(q_pe, qk_scale)

    acc_lo = tl.zeros([BLOCK_H, HALF_L], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_H, HALF_L], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    # The partial key tile the last split of a sequence may end on goes first, from the
    # initial state; then whole tiles, their copies unmasked.
    full_hi = whole_tiles_end(lo, hi, BLOCK_N)
    if full_hi < hi:
        m_i, l_i, acc_lo, acc_hi = _attend_tile(
            kv_ptr, table_row_ptr, full_hi, hi, q_lo, q_hi, q_pe, m_i, l_i, acc_lo, acc_hi, cl, cr, kv_b, kv_s,
            qk_scale, KV_LORA, ROPE_DIM, BLOCK_SIZE, BLOCK_N, HALF_L, BLOCK_R, PRECISION, F16_DOTS, PTX_CVT, PACKED,
            False)
    for start in range(lo, full_hi, BLOCK_N):
        m_i, l_i, acc_lo, acc_hi = _attend_tile(
            kv_ptr, table_row_ptr, start, hi, q_lo, q_hi, q_pe, m_i, l_i, acc_lo, acc_hi, cl, cr, kv_b, kv_s,
            qk_scale, KV_LORA, ROPE_DIM, BLOCK_SIZE, BLOCK_N, HALF_L, BLOCK_R, PRECISION, F16_DOTS, PTX_CVT, PACKED,
            True)

    l_i = tl.sum(l_i, axis=1)
    has_keys = l_i > 0
    inv = tl.where(has_keys, 1.0 / tl.where(has_keys, l_i, 1.0), 0.0)
    if V_SCALED:  # an fp8 cache holds the rows divided by the scale; the merges are linear in o
        inv = inv * v_scale
    o_lo = acc_lo * inv[:, None]
    o_hi = acc_hi * inv[:, None]
    lo_mask = h_mask[:, None] & (cl < KV_LORA)[None, :]
    hi_mask = h_mask[:, None] & (HALF_L + cl < KV_LORA)[None, :]
    out_ptrs = out_ptr + seq * sob + heads.to(tl.int64)[:, None] * soh + cl[None, :]
    row = (seq * num_heads + heads) * num_splits + split  # part_o [B, H, S, L], part_lse [B, H, S]
    part_ptrs = part_o_ptr + row[:, None] * KV_LORA + cl[None, :]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    if DIRECT:
        _store_halves(out_ptrs, o_lo, o_hi, lo_mask, hi_mask, HALF_L)
    elif MERGE:
        # Programs past `used` skip the counter, so it counts to `used`.
        if split < used:
            if used == 1:
                _store_halves(out_ptrs, o_lo, o_hi, lo_mask, hi_mask, HALF_L)
            else:
                _store_halves(part_ptrs, o_lo, o_hi, lo_mask, hi_mask, HALF_L)
                tl.store(part_lse_ptr + row, lse, mask=h_mask)
                # A scalar atomic runs in one thread, so its release covers that thread's
                # stores only: the barrier first makes every thread's partial visible to
                # it (CTA scope), and release is cumulative (as in decode_attention.py).
                tl.debug_barrier()
                counter = counter_ptr + seq * num_head_blocks + hb
                done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if done == used - 1:
                    # The acquire is that one thread's too: the barrier orders the other
                    # threads' partial loads after it.
                    tl.debug_barrier()
                    _merge_splits(part_o_ptr, part_lse_ptr, out_ptr, seq, heads, h_mask, sob, soh, num_heads,
                                  num_splits, used, 0, KV_LORA, BLOCK_H, MERGE_S, MERGE_C,
                                  (KV_LORA + MERGE_C - 1) // MERGE_C)
                    # Every other program of this (sequence, head block) has counted, so a
                    # plain store re-arms the counter for the next launch.
                    tl.store(counter, 0)
    elif split < used:
        _store_halves(part_ptrs, o_lo, o_hi, lo_mask, hi_mask, HALF_L)
        tl.store(part_lse_ptr + row, lse, mask=h_mask)


@triton.jit
def _mla_combine_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, ctx_ptr, sob, soh, num_heads, num_splits,
    KV_LORA: tl.constexpr, BLOCK_N: tl.constexpr, MERGE_S: tl.constexpr, MERGE_C: tl.constexpr, PDL: tl.constexpr,
):
    """One program per (sequence, head, column chunk): the partials of that chunk from the
    splits that hold keys (BLOCK_N: the decode kernel's, which rounds the shares)."""
    seq = tl.program_id(0).to(tl.int64)
    _, used = _split_shares(tl.load(ctx_ptr + seq), num_splits, BLOCK_N)
    pdl_begin(PDL)
    heads = tl.program_id(1).to(tl.int64) + tl.arange(0, 1)
    _merge_splits(part_o_ptr, part_lse_ptr, out_ptr, seq, heads, heads < num_heads, sob, soh, num_heads, num_splits,
                  used, tl.program_id(2) * MERGE_C, KV_LORA, 1, MERGE_S, MERGE_C, 1)


def _latent_block(kv_lora_rank: int) -> int:
    """The decode kernel's padded latent width: two halves of at least 16 columns (a dot's
    smallest K)."""
    return max(32, triton.next_power_of_2(kv_lora_rank))


@dataclass(frozen=True)
class MlaDecodeConfig:
    block_h: int  # query heads per program (the M rows of the dots; at least 16)
    block_n: int  # keys per inner step (split shares are rounded to it)
    num_warps: int
    num_stages: int


def default_config(dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> MlaDecodeConfig:
    """A bf16/fp16 tile of 32 keys is 32 x 576 x 2 B = 36 KB per pipeline stage; fp32 takes
    16 keys for the same bytes. 16-bit queries over a 16-bit cache take 5 stages, the
    fewest at which Triton keeps a key tile in flight while the one before it is used
    (tests/test_mla_compile.py; two such programs still fit an SM): faster at every batch
    and context benchmarks/mla_kernels.py --sweep timed (docs/PERFORMANCE.md). Over an
    fp8 cache with 16-bit queries (fp16 dots) 32 keys spill registers at 4 warps in the
    one-split variant (tests/test_mla_compile.py): 16 keys, not yet measured against
    others on a GPU. fp32 (tests, exactness runs) takes 8 warps: at 4 the two latent
    halves' accumulators spilled registers."""
    if dtype == torch.float32:
        return MlaDecodeConfig(16, 16, 8, 2)
    if cache_dtype == torch.float8_e4m3fn:
        return MlaDecodeConfig(16, 16, 4, 2)
    return MlaDecodeConfig(16, 32, 4, 5)


def num_head_blocks(num_heads: int, block_h: int = MIN_BLOCK_H) -> int:
    return triton.cdiv(num_heads, block_h)


# Programs of the bf16 kernel resident per SM (tests/test_mla_compile.py checks the
# register count and shared memory for sm_90 that allow it).
RESIDENT_PER_SM = 2


def mla_decode_num_splits(batch: int, num_heads: int, device: torch.device, block_h: int = MIN_BLOCK_H) -> int:
    """Splits per (sequence, head block), from static shapes only: as many as every SM's
    resident slots hold in one wave, at most MAX_SPLITS. Rounded down: a grid a few
    programs past the slots runs those few as a second wave as long as the first (32
    sequences took 9 splits on 264 slots when rounded up: docs/PERFORMANCE.md)."""
    units = max(1, batch * num_head_blocks(num_heads, block_h))
    return max(1, min(MAX_SPLITS, RESIDENT_PER_SM * num_sms(device) // units))


@dataclass(frozen=True)
class MlaLaunchPlan:
    """The host's choices for one decode call. Triton specialises the split count (1, a
    multiple of 16, or other), so `variant` tells apart the calls that need different
    compiled kernels (the merge kernel's tile included)."""

    splits: int
    direct: bool  # one split: the programs write the output
    merge: bool  # the splits are merged in the same launch
    merge_s: int  # splits per step of the in-launch merge (1 without it)
    combine_s: int  # the merge kernel's splits per load (0: no merge kernel)
    combine_c: int  # and its columns per program

    @property
    def variant(self) -> tuple:
        split_class = 1 if self.splits == 1 else 16 if self.splits % 16 == 0 else 0
        return (self.direct, self.merge, self.merge_s, self.combine_s, self.combine_c, split_class)


def mla_launch_plan(
    batch: int, num_heads: int, kv_lora_rank: int, counters: bool, device: torch.device,
    num_splits: int | None = None, block_h: int = MIN_BLOCK_H, merge_in_launch: bool | None = None,
) -> MlaLaunchPlan:
    """What `mla_decode` launches for `batch` sequences (`counters`: whether the caller
    passes them; the other arguments override the shape-derived choices)."""
    splits = num_splits or mla_decode_num_splits(batch, num_heads, device, block_h)
    assert splits >= 1
    direct = splits == 1
    if merge_in_launch is None:
        merge_in_launch = counters and splits <= MERGE_MAX_SPLITS
    merge = merge_in_launch and not direct
    assert not merge or counters, "merging in the launch needs the counters workspace"
    block_l = _latent_block(kv_lora_rank)
    merge_s = max(1, min(triton.next_power_of_2(splits), _MERGE_TILE // (block_h * min(_MERGE_COLS, block_l))))
    combine_s = combine_c = 0
    if not direct and not merge:
        # All splits of one column chunk in one load (up to _COMBINE_MAX_S): no round trip per split.
        combine_s = min(triton.next_power_of_2(splits), _COMBINE_MAX_S)
        combine_c = max(16, min(_COMBINE_COLS, block_l, _COMBINE_TILE // combine_s))
    return MlaLaunchPlan(splits, direct, merge, merge_s if merge else 1, combine_s, combine_c)


def mla_variant_batches(
    max_batch: int, num_heads: int, kv_lora_rank: int, counters: bool, device: torch.device,
    block_h: int = MIN_BLOCK_H,
) -> list[int]:
    """The smallest batch of each distinct compiled variant that calls of 1..max_batch
    sequences need: running these once compiles every variant such calls meet (what a
    start-up warm-up of eager decode steps runs)."""
    first: dict[tuple, int] = {}
    for batch in range(1, max_batch + 1):
        plan = mla_launch_plan(batch, num_heads, kv_lora_rank, counters, device, block_h=block_h)
        first.setdefault(plan.variant, batch)
    return sorted(first.values())


def mla_decode_counters(max_batch: int, num_heads: int, device: torch.device | str) -> torch.Tensor:
    """The zeroed int32 workspace that lets `mla_decode` merge its splits in one launch:
    one counter per (sequence, head block) for batches up to `max_batch` (sized for the
    smallest head block, so any config fits). Allocate once (a fixed address for CUDA
    graphs) and pass it to every call; each call leaves it zero. Calls sharing it must
    not run concurrently. `num_heads` is the per-rank count under tensor parallelism."""
    return torch.zeros(max_batch * num_head_blocks(num_heads), dtype=torch.int32, device=device)


def _cache_rows(kv_cache: torch.Tensor) -> tuple[int, int, int]:
    """(block stride, row stride, row width) of a latent cache [blocks, bs, L + R] or the
    pool's [blocks, bs, 1, L + R]."""
    if kv_cache.dim() == 4:
        assert kv_cache.shape[2] == 1, f"an MLA cache has one latent 'head', not {kv_cache.shape[2]}"
    else:
        assert kv_cache.dim() == 3, f"MLA cache of shape {tuple(kv_cache.shape)}"
    assert kv_cache.stride(-1) == 1
    return kv_cache.stride(0), kv_cache.stride(1), kv_cache.shape[-1]


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    out: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: MlaDecodeConfig | None = None,
    merge_in_launch: bool | None = None,
    cache_scale: float = 1.0,
) -> torch.Tensor:
    """q [N, H, L + R] (absorbed latent query, then the rotated rope query; strided rows
    allowed) over the latent cache [blocks, block_size, L + R] (or [.., 1, L + R]) ->
    out [N, H, L] = softmax(scale * q . row) @ row[:L], a row being the cache's entry times
    `cache_scale` (an e4m3 cache's; 1 for a cache of q's dtype).

    Sequence b reads its context_lens[b] rows under block_tables[b] (extra table / length
    rows are ignored). Reads no device value on the host. `counters` (from
    `mla_decode_counters`, zero on entry, left zero) lets the splits merge in the same
    launch when there are at most MERGE_MAX_SPLITS of them; `merge_in_launch` overrides
    that choice (True needs counters). `num_splits` overrides the shape-derived count,
    `config` the tiles. `out` (strided rows allowed) receives the result.

    Under PDL the kernel reads lengths and block tables before waiting for the kernel
    launched just before it, which may write q and the newest cache rows only."""
    batch, num_heads, width = q.shape
    kv_b, kv_s, cache_width = _cache_rows(kv_cache)
    rope_dim = width - kv_lora_rank
    assert 0 < kv_lora_rank < width and cache_width == width, (
        f"q width {width}, cache width {cache_width}, kv_lora_rank {kv_lora_rank}"
    )
    assert kv_cache.dtype in (q.dtype, torch.float8_e4m3fn), f"a {kv_cache.dtype} latent cache for {q.dtype} queries"
    scaled = cache_scaled(kv_cache, cache_scale, cache_scale)
    f16_dots = fp16_dots(kv_cache.dtype, q.dtype)
    assert q.stride(-1) == 1
    assert block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1
    assert block_tables.shape[0] >= batch and context_lens.shape[0] >= batch
    if out is None:
        out = torch.empty((batch, num_heads, kv_lora_rank), dtype=q.dtype, device=q.device)
    assert out.shape == (batch, num_heads, kv_lora_rank) and out.dtype == q.dtype and out.stride(-1) == 1
    if batch == 0:
        return out
    cfg = config or default_config(q.dtype, kv_cache.dtype)
    assert cfg.block_h >= MIN_BLOCK_H and cfg.block_h & (cfg.block_h - 1) == 0
    head_blocks = num_head_blocks(num_heads, cfg.block_h)
    plan = mla_launch_plan(batch, num_heads, kv_lora_rank, counters is not None, q.device, num_splits, cfg.block_h,
                           merge_in_launch)
    splits = plan.splits
    if plan.merge:
        assert counters.dtype == torch.int32 and counters.is_contiguous() and counters.device == q.device
        assert counters.numel() >= batch * head_blocks, (
            f"MLA decode counters hold {counters.numel()} < batch {batch} x head blocks {head_blocks}"
        )
    block_l = _latent_block(kv_lora_rank)
    merge_c = min(_MERGE_COLS, block_l)
    if plan.direct:
        part_o = part_lse = out  # unused
    else:
        part_o = torch.empty((batch, num_heads, splits, kv_lora_rank), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
    opts = launch_opts(q.device)
    _mla_decode_kernel[(head_blocks, batch, splits)](
        q, out, kv_cache, block_tables, context_lens, part_o, part_lse,
        counters if plan.merge else context_lens,  # unused without MERGE
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), kv_b, kv_s, block_tables.stride(0),
        num_heads, head_blocks, splits, scale * cache_scale * _LOG2E, cache_scale,
        KV_LORA=kv_lora_rank, ROPE_DIM=rope_dim, BLOCK_SIZE=kv_cache.shape[1],
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, BLOCK_L=block_l, BLOCK_R=max(16, triton.next_power_of_2(rope_dim)),
        DIRECT=plan.direct, MERGE=plan.merge, MERGE_S=plan.merge_s, MERGE_C=merge_c, PRECISION=dot_precision(q.dtype),
        V_SCALED=scaled, F16_DOTS=f16_dots, PTX_CVT=f16_dots and q.device.type == "cuda", PACKED=kv_s == width,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **opts,
    )
    if plan.combine_s:
        _mla_combine_kernel[(batch, num_heads, triton.cdiv(kv_lora_rank, plan.combine_c))](
            part_o, part_lse, out, context_lens, out.stride(0), out.stride(1), num_heads, splits,
            KV_LORA=kv_lora_rank, BLOCK_N=cfg.block_n, MERGE_S=plan.combine_s, MERGE_C=plan.combine_c, num_warps=4,
            **opts,
        )
    return out
