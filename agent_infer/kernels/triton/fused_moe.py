"""Fused MoE for routed experts (DeepSeek-V2/V3): out[t] = sum_j w[t, j] * expert_{id[t, j]}(x[t]),
expert e(x) = down_e(silu(gate_e(x)) * up_e(x)).

Weights per rank: w13 [E_local, 2 * I, D] (gate rows, then up rows, as the dense
gate_up_proj), w2 [E_local, D, I]. A token slot is `t * k + j`; under expert parallelism
`expert_map` [E_global] int32 gives each global expert its local index or -1, and a slot
of a non-local expert contributes 0 (the caller all-reduces the ranks' partial sums).

Four launches (three for one token), every grid sized from shapes alone so the whole
thing can be captured in a CUDA graph and replayed with new routing (no host sync, no
data-dependent sizes):

1. `moe_align`: slots grouped by local expert, each group padded to a multiple of
   BLOCK_M with the sentinel slot T * k, non-local slots dropped. One-hot counting and
   an in-chunk cumsum give every slot its place, in slot order (deterministic, no
   atomics). One program does it all for steps of a few tokens; larger steps use three
   kernels (count per chunk, prefix over chunks, scatter). A single token skips it
   (`SlotLayout.direct`): its k distinct experts give each slot a block of its own.
2. GEMM 1, grouped: a program takes BLOCK_M sorted slots of one expert (x rows gathered
   by slot // k) and BLOCK_N columns of I, and computes the matching gate AND up tiles,
   so SiLU-and-mul is its epilogue: the [*, 2I] projection never goes to memory (at
   decode it would be a third of the traffic besides the weights, and one more launch).
   h [P, I] is written in sorted order, so GEMM 2 reads its rows contiguously.
3. GEMM 2, grouped the same way, multiplies the routed weight in and writes its rows
   back to slot order, y [T * k, D].
4. A deterministic sum over the k slots of each token (fp32, fixed order) instead of
   atomics: greedy tokens must not depend on which program ran first.

fp32 accumulation throughout; bf16, fp16 and fp32 inputs (fp32 dots in IEEE precision).
BLOCK_M = 1 switches both GEMMs to FMA rows (one slot per block, no padding, a
[BLOCK_N, BLOCK_K] fp32 accumulator reduced once), the GEMV form of the batch-1 case;
e4m3 experts there are read as int32 words of four values and converted with integer
operations, by the dense fp8 GEMV's row dot (gemv_fp8.py). e4m3 experts carry one
scale per row or per block of each expert's matrices (DeepSeek-V3's 128 x 128), with
tiles fitted so that no K step or row tile crosses a block (`fit_blocks`).
The reference is `agent_infer.kernels.reference.fused_moe`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from agent_infer.kernels.triton.fused_moe_configs import MoeConfig, Tile, fit_blocks, get_config, takes_blocks
from agent_infer.kernels.triton.gemv_fp8 import row_dot_e4m3
from agent_infer.kernels.triton.utils import dot_precision, pdl_begin, pdl_enabled, pdl_opts

# The one-hot tiles of the align kernels hold at most this many int32 elements
# ([slots, experts] and [positions, experts]): register-sized for 4-8 warps.
_ALIGN_TILE = 8192
# Up to this many slots, one program aligns (one launch instead of three); beyond, the
# three-kernel path spreads the work over the GPU. The single program walks every padded
# position (slots + up to block_m - 1 per expert: ~1,000 at 66 experts and block_m 16)
# in turn, so its time follows the expert count more than the slots. V2-Lite with its
# shared experts joined on an H200 (tune_fused_moe.py), one program against three
# kernels: 10.8 / 15.8 µs at 16 slots, 19.4 / 29.9 at 32, 36.6 / 37.9 at 64, 45.5 / 26.7
# at 128, 59.5 / 20.3 at 256.
ONE_PROGRAM_SLOTS = 64


# Every launch here is plain, not a programmatic dependent one (utils.launch_opts), but
# one token's GEMM 2: the routing decides which weights a MoE kernel reads, so a kernel
# launched early right after the router or the alignment has nothing to prefetch, and its
# waiting programs only hold SM slots the predecessor's last programs need.
# DeepSeek-V2-Lite at batch 1 on an H200: 390.5 / 390.6 tok/s with these launches plain
# against 372.8 with PDL (the rest of the step keeps PDL; all of it plain: 387.7). One
# token's GEMM 2 follows GEMM 1, not the routing: its programs load their expert's first
# weight tile while GEMM 1's last programs run (GEMM 1 lets it start at once). The
# kernels keep their `pdl_begin` (a no-op without PDL).
PLAIN_LAUNCH = pdl_opts(False)


# ---- moe_align -------------------------------------------------------------------------


@triton.jit
def _local_experts(ids_ptr, map_ptr, s, limit, num_experts, HAS_MAP: tl.constexpr):
    """Local expert of slots s (int32); -1 for slots at or past `limit`, for experts on
    other ranks, and for local indices outside [0, num_experts) (so a bad id without a
    map reads no weights and contributes nothing; with a map the ids index it, so they
    must be global ids in [0, E_global), as a router gives them)."""
    inside = s < limit
    e = tl.load(ids_ptr + s, mask=inside, other=-1).to(tl.int32)
    if HAS_MAP:
        e = tl.load(map_ptr + e, mask=inside & (e >= 0), other=-1).to(tl.int32)
    return tl.where(inside & (e >= 0) & (e < num_experts), e, -1)


@triton.jit
def _one_hot(e, BLOCK_E: tl.constexpr):
    """[C] expert ids -> [C, BLOCK_E] int32 one-hot rows (all zero for -1)."""
    return (e[:, None] == tl.arange(0, BLOCK_E)[None, :]).to(tl.int32)


@triton.jit
def _rank_in_chunk(hot):
    """For each row of a one-hot tile, how many earlier rows have the same expert."""
    return tl.sum(tl.cumsum(hot, axis=0) * hot, axis=1) - 1


@triton.jit
def _padded_layout(counts, BLOCK_M: tl.constexpr):
    """Per expert: first position of its group, end of its real slots, end of its padded
    group; and the padded total."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    return start, start + counts, end, tl.sum(padded, axis=0)


@triton.jit
def _fill_padding(
    slots_ptr, blocks_ptr, filled, end, total, sentinel, num_positions, first, step,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Positions [first, first + BLOCK_P), [first + step, ...) ...: the sentinel slot into
    every padding position (never a real slot's, so no ordering against the scatter is
    needed) and each block's expert (-1 past the padded total)."""
    ex = tl.arange(0, BLOCK_E)
    for p0 in range(first, num_positions, step):
        p = p0 + tl.arange(0, BLOCK_P)
        inside = p < num_positions
        # The expert whose group holds p: the number of groups that end at or before p
        # (empty groups end where they start, so they are counted exactly when passed).
        owner = tl.sum((end[None, :] <= p[:, None]).to(tl.int32), axis=1)
        real_end = tl.sum(tl.where(ex[None, :] == owner[:, None], filled[None, :], 0), axis=1)
        pad = inside & ((p >= total) | (p >= real_end))
        tl.store(slots_ptr + p, tl.full([BLOCK_P], 0, tl.int32) + sentinel, mask=pad)
        tl.store(blocks_ptr + p // BLOCK_M, tl.where(p < total, owner, -1), mask=inside & (p % BLOCK_M == 0))


# The slot and chunk counts change with every step's token count: not specialised, so a
# count divisible by 16 never compiles a variant of its own mid-serving.
_ALIGN_SIZES = ["num_slots", "num_positions", "num_chunks"]


@triton.jit(do_not_specialize=_ALIGN_SIZES[:2])
def _align_one_program_kernel(
    ids_ptr, map_ptr, slots_ptr, blocks_ptr, npad_ptr, num_slots, num_experts, num_positions,
    HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_P: tl.constexpr, PDL: tl.constexpr,
):
    """The whole alignment in one program: count (pass 1), layout, scatter (pass 2)."""
    pdl_begin(PDL)
    c = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for s0 in range(0, num_slots, CHUNK):
        e = _local_experts(ids_ptr, map_ptr, s0 + c, num_slots, num_experts, HAS_MAP)
        counts += tl.sum(_one_hot(e, BLOCK_E), axis=0)
    start, filled, end, total = _padded_layout(counts, BLOCK_M)
    tl.store(npad_ptr, total)
    seen = start
    for s0 in range(0, num_slots, CHUNK):
        s = s0 + c
        e = _local_experts(ids_ptr, map_ptr, s, num_slots, num_experts, HAS_MAP)
        hot = _one_hot(e, BLOCK_E)
        base = tl.sum(hot * seen[None, :], axis=1)
        tl.store(slots_ptr + base + _rank_in_chunk(hot), s, mask=e >= 0)
        seen += tl.sum(hot, axis=0)
    _fill_padding(slots_ptr, blocks_ptr, filled, end, total, num_slots, num_positions, 0, BLOCK_P,
                  BLOCK_M, BLOCK_E, BLOCK_P)


@triton.jit(do_not_specialize=_ALIGN_SIZES[:1])
def _align_count_kernel(
    ids_ptr, map_ptr, counts_ptr, num_slots, num_experts,
    HAS_MAP: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
):
    """counts[chunk, e]: slots of chunk `program_id` routed to local expert e."""
    pdl_begin(PDL)
    chunk = tl.program_id(0)
    e = _local_experts(ids_ptr, map_ptr, chunk * CHUNK + tl.arange(0, CHUNK), num_slots, num_experts, HAS_MAP)
    tl.store(counts_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E), tl.sum(_one_hot(e, BLOCK_E), axis=0))


@triton.jit(do_not_specialize=_ALIGN_SIZES[2:])
def _align_offsets_kernel(
    counts_ptr, layout_ptr, npad_ptr, num_chunks,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr,
):
    """One program: counts[chunk, e] becomes the chunk's offset within expert e's group
    (an exclusive prefix over chunks), and layout = (start, filled, end) per expert."""
    pdl_begin(PDL)
    ex = tl.arange(0, BLOCK_E)
    carry = tl.zeros([BLOCK_E], tl.int32)
    for r0 in range(0, num_chunks, ROWS):
        r = r0 + tl.arange(0, ROWS)
        ptrs = counts_ptr + r[:, None] * BLOCK_E + ex[None, :]
        cnt = tl.load(ptrs, mask=(r < num_chunks)[:, None], other=0)
        tl.store(ptrs, tl.cumsum(cnt, axis=0) - cnt + carry[None, :], mask=(r < num_chunks)[:, None])
        carry += tl.sum(cnt, axis=0)
    start, filled, end, total = _padded_layout(carry, BLOCK_M)
    tl.store(layout_ptr + ex, start)
    tl.store(layout_ptr + BLOCK_E + ex, filled)
    tl.store(layout_ptr + 2 * BLOCK_E + ex, end)
    tl.store(npad_ptr, total)


@triton.jit(do_not_specialize=_ALIGN_SIZES[:2])
def _align_scatter_kernel(
    ids_ptr, map_ptr, offsets_ptr, layout_ptr, npad_ptr, slots_ptr, blocks_ptr,
    num_slots, num_experts, num_positions,
    HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_P: tl.constexpr, PDL: tl.constexpr,
):
    """Each chunk's slots to their places; the padding of a share of the positions."""
    pdl_begin(PDL)
    chunk = tl.program_id(0)
    ex = tl.arange(0, BLOCK_E)
    s = chunk * CHUNK + tl.arange(0, CHUNK)
    e = _local_experts(ids_ptr, map_ptr, s, num_slots, num_experts, HAS_MAP)
    hot = _one_hot(e, BLOCK_E)
    base = tl.load(layout_ptr + ex) + tl.load(offsets_ptr + chunk * BLOCK_E + ex)
    tl.store(slots_ptr + tl.sum(hot * base[None, :], axis=1) + _rank_in_chunk(hot), s, mask=e >= 0)
    filled = tl.load(layout_ptr + BLOCK_E + ex)
    end = tl.load(layout_ptr + 2 * BLOCK_E + ex)
    _fill_padding(slots_ptr, blocks_ptr, filled, end, tl.load(npad_ptr), num_slots, num_positions,
                  chunk * BLOCK_P, tl.num_programs(0) * BLOCK_P, BLOCK_M, BLOCK_E, BLOCK_P)


def num_positions(num_slots: int, num_local_experts: int, block_m: int) -> int:
    """Length P of the sorted slot list: every local slot plus at most block_m - 1 padding
    slots per non-empty expert (at most min(E, slots) of them), in whole blocks."""
    bound = num_slots + min(num_local_experts, num_slots) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


# Slots per chunk at most: the scatter kernel's running count down a [128, 64] one-hot
# tile (V2-Lite's 64 experts) spilled 280 bytes a thread when compiled by Triton 3.6 for
# sm_90; 64 rows spill nothing at any expert width (tests/test_moe_compile.py).
_ALIGN_MAX_CHUNK = 64


def _align_shapes(num_slots: int, num_local_experts: int) -> tuple[int, int]:
    """(BLOCK_E, CHUNK): the expert width of the one-hot tiles and the slots per chunk."""
    block_e = triton.next_power_of_2(num_local_experts)
    chunk = max(16, min(_ALIGN_TILE // block_e, _ALIGN_MAX_CHUNK, triton.next_power_of_2(num_slots)))
    return block_e, chunk


def moe_align(
    topk_ids: torch.Tensor, num_local_experts: int, block_m: int, expert_map: torch.Tensor | None = None,
    *, one_program: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the token slots (t * k + j) of topk_ids [T, k] by local expert, on the device.

    Returns (sorted_slots [P] int32, block_experts [P // block_m] int32, num_padded [1]
    int32): expert e's slots in increasing order, padded to a multiple of block_m with
    the sentinel T * k, groups in expert order, then the sentinel up to P
    (`num_positions`); block b holds positions [b * block_m, (b + 1) * block_m) of expert
    block_experts[b], -1 for blocks at or past num_padded (the padded total). Slots whose
    expert is not local (expert_map -1) are left out; topk_ids must be global ids in
    [0, E_global) (without a map, ids outside [0, num_local_experts) are left out too).
    Sizes depend on shapes only (graph-safe). `one_program` forces a path (default: by
    size)."""
    assert topk_ids.dim() == 2 and block_m >= 1
    device = topk_ids.device
    num_slots = topk_ids.numel()
    p = num_positions(num_slots, num_local_experts, block_m)
    sorted_slots = torch.empty(p, dtype=torch.int32, device=device)
    block_experts = torch.empty(p // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    if num_slots == 0:
        num_padded.zero_()
        return sorted_slots, block_experts, num_padded
    ids = topk_ids.reshape(-1)  # a view when contiguous
    has_map = expert_map is not None
    emap = expert_map if has_map else ids
    block_e, chunk = _align_shapes(num_slots, num_local_experts)
    block_p = max(16, min(_ALIGN_TILE // block_e, triton.next_power_of_2(p)))
    num_chunks = triton.cdiv(num_slots, chunk)
    opts = PLAIN_LAUNCH
    if one_program if one_program is not None else num_slots <= ONE_PROGRAM_SLOTS:
        _align_one_program_kernel[(1,)](
            ids, emap, sorted_slots, block_experts, num_padded, num_slots, num_local_experts, p,
            HAS_MAP=has_map, BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk, BLOCK_P=block_p, num_warps=8, **opts,
        )
        return sorted_slots, block_experts, num_padded
    offsets = torch.empty(num_chunks, block_e, dtype=torch.int32, device=device)
    layout = torch.empty(3, block_e, dtype=torch.int32, device=device)
    _align_count_kernel[(num_chunks,)](
        ids, emap, offsets, num_slots, num_local_experts,
        HAS_MAP=has_map, BLOCK_E=block_e, CHUNK=chunk, num_warps=4, **opts,
    )
    _align_offsets_kernel[(1,)](
        offsets, layout, num_padded, num_chunks,
        BLOCK_M=block_m, BLOCK_E=block_e, ROWS=max(1, _ALIGN_TILE // block_e), num_warps=8, **opts,
    )
    _align_scatter_kernel[(num_chunks,)](
        ids, emap, offsets, layout, num_padded, sorted_slots, block_experts, num_slots, num_local_experts, p,
        HAS_MAP=has_map, BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk, BLOCK_P=block_p, num_warps=4, **opts,
    )
    return sorted_slots, block_experts, num_padded


# ---- the grouped GEMMs -----------------------------------------------------------------

# Arguments that change with the step's token count: Triton would otherwise specialise
# them (divisible by 16 or not) and compile each GEMM twice over the decode sizes.
_STEP_SIZES = ["num_slots", "num_tiles_n"]


@triton.jit
def _block_rows(slots_ptr, blocks_ptr, npad_ptr, ids_ptr, map_ptr, num_slots, num_experts, num_tiles_n,
                HAS_MAP: tl.constexpr, DIRECT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's block of sorted positions, their slots and which are real (not the
    sentinel), its expert (-1: nothing to do, the block lies past the padded total) and
    its BLOCK_N output columns. DIRECT (no alignment): block b is slot b alone, its
    expert read from the routing (-1 when not local)."""
    pid = tl.program_id(0)
    blk = pid // num_tiles_n
    pos = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    if DIRECT:
        slot = tl.where(tl.arange(0, BLOCK_M) == 0, blk, num_slots)
        e = tl.max(_local_experts(ids_ptr, map_ptr, blk + tl.arange(0, 1), num_slots, num_experts, HAS_MAP), axis=0)
    else:
        slot = tl.load(slots_ptr + pos)
        e = tl.where(blk * BLOCK_M < tl.load(npad_ptr), tl.load(blocks_ptr + blk), -1)
    return pos, slot, slot < num_slots, e, (pid % num_tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _load_k(ptrs, k_in, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=k_in, other=0.0)


@triton.jit
def _b_tile(b_rows, k0, kk, k_in, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """The weight tile of rows b_rows at columns k0 + kk: [BLOCK_N, BLOCK_K] for the FMA
    rows (BLOCK_M == 1), else [BLOCK_K, BLOCK_N] for tl.dot."""
    if BLOCK_M == 1:
        b = _load_k(b_rows[:, None] + k0 + kk[None, :], k_in[None, :], EVEN_K)
    else:
        b = _load_k(b_rows[None, :] + k0 + kk[:, None], k_in[:, None], EVEN_K)
    return b


@triton.jit
def _accumulate(a, b, acc, s_rows, k0, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr, SCALE: tl.constexpr,
                S_COLS: tl.constexpr):
    """acc + a times the weight tile b (_b_tile's layout). e4m3 weights with per-row
    scales become a's dtype exactly in the dots (the scales come after the K loop); with
    block scales (SCALE == 2) each column is multiplied by its scale in the column of
    blocks holding k0 (s_rows [BLOCK_N]: each column's scale row; a step must not cross
    a block: BLOCK_K divides S_COLS) and the product rounded to a's dtype, the weight a
    model in that dtype holding the dequantized checkpoint has. Scaling the step's
    partial sums instead would be exact, but needs a second accumulator tile: GEMM 1's
    paired 128 x 128 tiles then spill (twice the registers a thread has)."""
    if BLOCK_M == 1:
        acc = acc + b.to(tl.float32) * a.to(tl.float32)  # a is [1, BLOCK_K]
    elif SCALE == 2:
        w = (b.to(tl.float32) * tl.load(s_rows + k0 // S_COLS)[None, :]).to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    else:
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _grouped_tiles(
    a_rows, a_valid, b_rows, pair_offset, s_rows, s_pair, K,
    PAIR: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, SCALE: tl.constexpr, S_COLS: tl.constexpr,
    PRELOAD: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """The K loop of one program: rows a_rows [BLOCK_M] (pointers, masked by a_valid) times
    weight rows b_rows [BLOCK_N] (K contiguous), fp32 [BLOCK_M, BLOCK_N]; with PAIR, also
    times the weight rows pair_offset further on (GEMM 1's up rows), on the same A loads.
    BLOCK_M == 1: FMA rows, [BLOCK_N, BLOCK_K] partial products reduced once at the end.
    Without PAIR the second result is zeros. SCALE == 2: block-scaled e4m3 weights, the
    scale rows of b_rows' blocks at s_rows (pointers), the pair's s_pair further on
    (`_accumulate`); otherwise s_rows and s_pair are unread. PRELOAD: the first weight
    tile is loaded before the PDL wait (`pdl_begin(PDL)`), which the caller has not
    passed yet: the weights must not depend on the previous kernel, the rows of a may."""
    kk = tl.arange(0, BLOCK_K)
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    start = 0
    if PRELOAD:
        k_in = kk < K
        b = _b_tile(b_rows, 0, kk, k_in, EVEN_K, BLOCK_M)
        if PAIR:
            b2 = _b_tile(b_rows + pair_offset, 0, kk, k_in, EVEN_K, BLOCK_M)
        pdl_begin(PDL)
        a = tl.load(a_rows[:, None] + kk[None, :], mask=a_valid[:, None] & k_in[None, :], other=0.0)
        acc = _accumulate(a, b, acc, s_rows, 0, BLOCK_M, PRECISION, SCALE, S_COLS)
        if PAIR:
            acc2 = _accumulate(a, b2, acc2, s_rows + s_pair, 0, BLOCK_M, PRECISION, SCALE, S_COLS)
        start = BLOCK_K
    for k0 in range(start, K, BLOCK_K):
        k_in = (k0 + kk) < K
        a = tl.load(a_rows[:, None] + k0 + kk[None, :], mask=a_valid[:, None] & k_in[None, :], other=0.0)
        acc = _accumulate(a, _b_tile(b_rows, k0, kk, k_in, EVEN_K, BLOCK_M), acc, s_rows, k0, BLOCK_M, PRECISION,
                          SCALE, S_COLS)
        if PAIR:
            acc2 = _accumulate(a, _b_tile(b_rows + pair_offset, k0, kk, k_in, EVEN_K, BLOCK_M), acc2,
                               s_rows + s_pair, k0, BLOCK_M, PRECISION, SCALE, S_COLS)
    if BLOCK_M == 1:
        out, out2 = tl.sum(acc, axis=1)[None, :], tl.sum(acc2, axis=1)[None, :]
    else:
        out, out2 = acc, acc2
    return out, out2


@triton.jit(do_not_specialize=_STEP_SIZES)
def _moe_gate_up_kernel(
    x_ptr, w_ptr, h_ptr, slots_ptr, blocks_ptr, npad_ptr, ids_ptr, map_ptr, s_ptr,
    N, K, top_k, num_slots, num_experts, num_tiles_n, sxm, swe, swn, shm, sse, ssn,
    HAS_MAP: tl.constexpr, DIRECT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr, SCALE: tl.constexpr, S_ROWS: tl.constexpr, S_COLS: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    """h[pos, n] = silu(x[tok] . w[e, n]) * (x[tok] . w[e, N + n]) for a block of one
    expert's sorted slots (tok = slot // top_k) and BLOCK_N of the N = I columns; gate
    and up are rounded to h's dtype first, as the unfused reference does. SCALE: w is
    e4m3 with one scale per row (1: s[e, row], row stride 1) or per block of S_ROWS x
    S_COLS (2: s[e, row // S_ROWS, k // S_COLS], row stride ssn; N a multiple of
    S_ROWS), expert stride sse. TRIGGER: let the next kernel (GEMM 2, launched as a
    programmatic dependent) start at once."""
    if TRIGGER:
        gdc_launch_dependents()
    pdl_begin(PDL)
    pos, slot, valid, e, n = _block_rows(slots_ptr, blocks_ptr, npad_ptr, ids_ptr, map_ptr, num_slots, num_experts,
                                         num_tiles_n, HAS_MAP, DIRECT, BLOCK_M, BLOCK_N)
    if e < 0:
        return
    out_ty = h_ptr.dtype.element_ty
    s_e = s_ptr + e.to(tl.int64) * sse
    if SCALE > 0 and BLOCK_M == 1:
        # e4m3 experts at one slot a block: w is their bytes as int32 words, read and
        # converted as the dense fp8 GEMV does (gemv_fp8.py), whose SiLU-and-mul epilogue
        # rounds as the branch below does. BLOCK_N rows, BLOCK_K values a tile; with block
        # scales the tile's rows lie in one block (BLOCK_N divides S_ROWS), the up rows'
        # N / S_ROWS scale rows further on.
        tok = tl.max(tl.where(valid, slot, 0), axis=0) // top_k
        s_row = (tl.program_id(0) % num_tiles_n) * BLOCK_N // S_ROWS
        h = row_dot_e4m3(x_ptr + tok.to(tl.int64) * sxm, w_ptr + e.to(tl.int64) * swe, h_ptr, n, n < N, K, swn, N,
                         False, True, False, BLOCK_K, out_ty, 1, s_e, s_row, s_row + N // S_ROWS, ssn, SCALE, S_COLS,
                         EVEN_K)[None, :]
    else:
        # Tail columns wrap onto real rows, so weight loads need no mask; their results
        # are dropped at the store.
        w_gate = w_ptr + e.to(tl.int64) * swe + (n % N).to(tl.int64) * swn
        x_rows = x_ptr + (slot // top_k).to(tl.int64) * sxm
        # The up rows are N rows on: I * D < 2**31 for every DeepSeek shape.
        gate, up = _grouped_tiles(x_rows, valid, w_gate, N * swn, s_e + (n % N) // S_ROWS * ssn,
                                  N // S_ROWS * ssn, K, True, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, SCALE,
                                  S_COLS)
        if SCALE == 1:
            scales = s_e + n % N
            gate = gate * tl.load(scales)[None, :]
            up = up * tl.load(scales + N)[None, :]
        g = gate.to(out_ty).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)
        h = act * up.to(out_ty).to(tl.float32)
    mask = valid[:, None] & (n < N)[None, :]
    tl.store(h_ptr + pos.to(tl.int64)[:, None] * shm + n[None, :], h.to(out_ty), mask=mask)


@triton.jit(do_not_specialize=_STEP_SIZES)
def _moe_down_kernel(
    h_ptr, w_ptr, y_ptr, slots_ptr, blocks_ptr, npad_ptr, ids_ptr, map_ptr, topw_ptr, s_ptr,
    N, K, num_slots, num_experts, num_tiles_n, shm, swe, swn, sym, sse, ssn,
    HAS_MAP: tl.constexpr, DIRECT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr, SCALE: tl.constexpr, S_ROWS: tl.constexpr, S_COLS: tl.constexpr,
    PRELOAD: tl.constexpr,
):
    """y[slot, n] = topk_weight[slot] * (h[pos] . w[e, n]) for a block of one expert's
    sorted positions (h rows contiguous) and BLOCK_N of the N = D columns; rows go back
    to slot order. SCALE: e4m3 weights with per-row or block scales, as in GEMM 1.

    PRELOAD: the block's slots and expert, and its first weight tile, are read before the
    PDL wait: only h is GEMM 1's output; the routing and the alignment come from kernels
    before it, which a plain launch of GEMM 1 has let finish."""
    if not PRELOAD:
        pdl_begin(PDL)
    pos, slot, valid, e, n = _block_rows(slots_ptr, blocks_ptr, npad_ptr, ids_ptr, map_ptr, num_slots, num_experts,
                                         num_tiles_n, HAS_MAP, DIRECT, BLOCK_M, BLOCK_N)
    if e < 0:
        return
    s_e = s_ptr + e.to(tl.int64) * sse
    if SCALE > 0 and BLOCK_M == 1:  # e4m3 words at one slot a block, as in GEMM 1
        h_row = h_ptr + tl.max(pos, axis=0).to(tl.int64) * shm
        s_row = (tl.program_id(0) % num_tiles_n) * BLOCK_N // S_ROWS
        acc = row_dot_e4m3(h_row, w_ptr + e.to(tl.int64) * swe, y_ptr, n, n < N, K, swn, 0, False, False,
                           PDL and PRELOAD, BLOCK_K, tl.float32, 1, s_e, s_row, s_row, ssn, SCALE, S_COLS,
                           EVEN_K)[None, :]
    else:
        w_rows = w_ptr + e.to(tl.int64) * swe + (n % N).to(tl.int64) * swn  # tail columns wrap, as in GEMM 1
        acc, _ = _grouped_tiles(h_ptr + pos.to(tl.int64) * shm, valid, w_rows, 0, s_e + (n % N) // S_ROWS * ssn, 0,
                                K, False, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, SCALE, S_COLS, PRELOAD, PDL)
        if SCALE == 1:
            acc = acc * tl.load(s_e + n % N)[None, :]
    weight = tl.load(topw_ptr + slot, mask=valid, other=0.0)
    mask = valid[:, None] & (n < N)[None, :]
    y = acc * weight[:, None]
    tl.store(y_ptr + slot.to(tl.int64)[:, None] * sym + n[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _moe_sum_kernel(
    y_ptr, ids_ptr, map_ptr, out_ptr, N, top_k, num_experts, sym, som,
    HAS_MAP: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    """out[t] = sum over j of y[t * top_k + j], in fp32 and a fixed order, over the slots
    whose expert is local (the others were never written)."""
    pdl_begin(PDL)
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = n < N
    slot = t * top_k + tl.arange(0, BLOCK_J)
    live = _local_experts(ids_ptr, map_ptr, slot, (t + 1) * top_k, num_experts, HAS_MAP) >= 0
    y = tl.load(y_ptr + slot.to(tl.int64)[:, None] * sym + n[None, :], mask=live[:, None] & n_in[None, :], other=0.0)
    total = tl.sum(y.to(tl.float32), axis=0)
    tl.store(out_ptr + t.to(tl.int64) * som + n, total.to(out_ptr.dtype.element_ty), mask=n_in)


def _as_words(w: torch.Tensor, block_m: int) -> torch.Tensor:
    """The experts as the kernels read them: e4m3 ones at one slot a block (FMA rows) as
    int32 words of four values each (gemv_fp8.py), everything else as it is."""
    if w.dtype != torch.float8_e4m3fn or block_m != 1:
        return w
    assert w.shape[-1] % 4 == 0 and w.stride(0) % 4 == 0 and w.stride(1) % 4 == 0 and w.data_ptr() % 4 == 0, \
        f"e4m3 experts {tuple(w.shape)} cannot be read as 4-byte words"
    return w.view(torch.int32)


def _gemm_opts(tile: Tile, pdl: bool = False) -> dict:
    return {"num_warps": tile.num_warps, "num_stages": tile.num_stages, **pdl_opts(pdl)}


def _scale_args(scale: torch.Tensor | None, block: tuple[int, int] | None) -> dict:
    """The GEMMs' scale layout: none, one per row, or one per block of rows x columns
    (expert stride, scale-row stride and the constexprs)."""
    if scale is None:
        return {"sse": 0, "ssn": 0, "SCALE": 0, "S_ROWS": 1, "S_COLS": 1}
    if block is None:
        return {"sse": scale.stride(0), "ssn": 0, "SCALE": 1, "S_ROWS": 1, "S_COLS": 1}
    return {"sse": scale.stride(0), "ssn": scale.stride(1), "SCALE": 2, "S_ROWS": block[0], "S_COLS": block[1]}


@dataclass(frozen=True)
class SlotLayout:
    """Where the GEMMs' programs find their slots: the expert-sorted, padded list of
    `moe_align`, or (`direct`) one block per slot in slot order with its expert read from
    the routing. Direct needs no alignment launch; it reads an expert once per slot that
    names it, so it is taken for one token only, whose k experts are distinct (the
    router's top-k)."""

    ids: torch.Tensor  # [T * k] the routing's expert ids, flattened
    expert_map: torch.Tensor | None
    num_local: int
    block_m: int
    direct: bool
    sorted_slots: torch.Tensor  # moe_align's outputs (the ids again when direct: unread)
    block_experts: torch.Tensor
    num_padded: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.ids.numel() if self.direct else self.block_experts.numel()

    def kernel_args(self) -> tuple:
        emap = self.expert_map if self.expert_map is not None else self.ids
        return self.sorted_slots, self.block_experts, self.num_padded, self.ids, emap

    def kernel_flags(self) -> dict:
        return {"HAS_MAP": self.expert_map is not None, "DIRECT": self.direct}


def slot_layout(
    topk_ids: torch.Tensor, num_local_experts: int, block_m: int, expert_map: torch.Tensor | None = None,
    direct: bool | None = None,
) -> SlotLayout:
    """The layout of topk_ids [T, k] (contiguous) for the GEMMs: direct for T = 1 unless
    `direct` says otherwise, else aligned by `moe_align`."""
    ids = topk_ids.reshape(-1)
    if direct if direct is not None else topk_ids.shape[0] == 1:
        return SlotLayout(ids, expert_map, num_local_experts, block_m, True, ids, ids, ids)
    aligned = moe_align(topk_ids, num_local_experts, block_m, expert_map)
    return SlotLayout(ids, expert_map, num_local_experts, block_m, False, *aligned)


def gate_up_silu(x: torch.Tensor, w13: torch.Tensor, layout: SlotLayout, top_k: int, tile: Tile,
                 w13_scale: torch.Tensor | None = None, trigger: bool = False,
                 block: tuple[int, int] | None = None) -> torch.Tensor:
    """GEMM 1 + SiLU-and-mul over the slots: h [P, I] in x's dtype (P = blocks x
    block_m), row p = silu(gate) * up of the slot at position p (rows of padding
    positions unwritten). An e4m3 w13 comes with w13_scale [E, 2I] (one per row) or,
    with `block`, [E, 2I / rows, ceil(D / columns)] (`fit_blocks` tiles).
    `trigger`: the next kernel is a programmatic dependent launch, let it start at once."""
    num_tokens, d = x.shape
    inter = w13.shape[1] // 2
    bm = layout.block_m
    h = torch.empty(layout.num_blocks * bm, inter, dtype=x.dtype, device=x.device)
    tiles_n = triton.cdiv(inter, tile.block_n)
    w = _as_words(w13, bm)
    _moe_gate_up_kernel[(layout.num_blocks * tiles_n,)](
        x, w, h, *layout.kernel_args(), w13_scale if w13_scale is not None else h,
        inter, d, top_k, num_tokens * top_k, layout.num_local, tiles_n, x.stride(0), w.stride(0), w.stride(1),
        h.stride(0), **_scale_args(w13_scale, block), **layout.kernel_flags(),
        EVEN_K=d % tile.block_k == 0, BLOCK_M=bm, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        PRECISION=dot_precision(x.dtype), TRIGGER=trigger, **_gemm_opts(tile),
    )
    return h


def down_weighted(
    h: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, layout: SlotLayout, tile: Tile,
    w2_scale: torch.Tensor | None = None, preload: bool = False, pdl: bool = False,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """GEMM 2 over the slots: y [T * k, D] in h's dtype, row slot = its routed weight
    (topk_weights [T, k] fp32, flattened) times h[pos] @ w2[e]^T (rows of non-local slots
    unwritten). An e4m3 w2 comes with w2_scale [E, D] (one per row) or, with `block`,
    [E, ceil(D / rows), ceil(I / columns)] (`fit_blocks` tiles). `preload`: each
    program loads its first weight tile before it reads h; `pdl` (with preload): launched
    as a programmatic dependent of GEMM 1 (whose launch must trigger it), so those loads
    overlap GEMM 1's end."""
    assert preload or not pdl, "a programmatic dependent GEMM 2 must preload: it waits inside the K loop"
    num_slots = topk_weights.numel()
    inter = h.shape[1]
    d = w2.shape[1]
    y = torch.empty(num_slots, d, dtype=h.dtype, device=h.device)
    tiles_n = triton.cdiv(d, tile.block_n)
    bm = layout.block_m
    w = _as_words(w2, bm)
    _moe_down_kernel[(layout.num_blocks * tiles_n,)](
        h, w, y, *layout.kernel_args(), topk_weights, w2_scale if w2_scale is not None else topk_weights,
        d, inter, num_slots, layout.num_local, tiles_n, h.stride(0), w.stride(0), w.stride(1), y.stride(0),
        **_scale_args(w2_scale, block), **layout.kernel_flags(),
        EVEN_K=inter % tile.block_k == 0, BLOCK_M=bm, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        PRECISION=dot_precision(h.dtype), PRELOAD=preload, **_gemm_opts(tile, pdl),
    )
    return y


def sum_topk(
    y: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local_experts: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """out [T, D] <- the sum of each token's k rows of y [T * k, D] whose expert is local."""
    num_tokens, top_k = topk_ids.shape
    d = y.shape[1]
    block_n = min(1024, triton.next_power_of_2(d))
    ids = topk_ids.reshape(-1)
    _moe_sum_kernel[(num_tokens, triton.cdiv(d, block_n))](
        y, ids, expert_map if expert_map is not None else ids, out, d, top_k, num_local_experts,
        y.stride(0), out.stride(0),
        HAS_MAP=expert_map is not None, BLOCK_J=triton.next_power_of_2(top_k), BLOCK_N=block_n, num_warps=4,
        **PLAIN_LAUNCH,
    )
    return out


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None, config: MoeConfig | None = None, out: torch.Tensor | None = None,
    direct: bool | None = None, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down(silu(gate(x[t])) * up(x[t])) of expert topk_ids[t, j].

    x [T, D] (bf16/fp16/fp32, last dim contiguous); w13 [E_local, 2I, D] (gate rows
    0..I-1, up rows I..2I-1) and w2 [E_local, D, I] in x's dtype, last dims contiguous;
    topk_weights [T, k] (fp32); topk_ids [T, k] int32/int64 global expert ids;
    expert_map [E_global] int32 (local index or -1) under EP, None when every expert is
    local. Returns [T, D] in x's dtype (written into `out` when given). `config`
    defaults to the table in fused_moe_configs.py for the shape and T; `direct`
    overrides `slot_layout`'s choice (direct for one token). e4m3 weights come with one
    fp32 scale per row, w13_scale [E_local, 2I] and w2_scale [E_local, D], or with
    `block` (rows, columns: DeepSeek-V3's 128 x 128) one per block of each expert's
    matrices, w13_scale [E_local, 2I / rows, ceil(D / columns)] and w2_scale [E_local,
    ceil(D / rows), ceil(I / columns)], I a multiple of rows and `takes_blocks(block)`
    (the config's tiles are fitted to the blocks: `fit_blocks`). x stays as it is: the
    weights' values are converted exactly to x's dtype in the GEMMs, to fp32 in the FMA
    rows (per-row scales multiply the sums after the K loop, block scales the weights in
    each K step: `_accumulate`)."""
    num_tokens, d = x.shape
    num_experts, two_i, d_w = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    assert d_w == d and two_i == 2 * inter, f"w13 {tuple(w13.shape)} does not fit x {tuple(x.shape)}"
    assert w2.shape == (num_experts, d, inter), f"w2 {tuple(w2.shape)}, expected {(num_experts, d, inter)}"
    assert topk_ids.shape == topk_weights.shape == (num_tokens, top_k)
    fp8 = w13.dtype == torch.float8_e4m3fn
    assert (w13_scale is not None) == fp8 == (w2_scale is not None) == (w2.dtype == torch.float8_e4m3fn)
    assert fp8 or x.dtype == w13.dtype == w2.dtype, f"x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}"
    if fp8:
        assert w13_scale.dtype == w2_scale.dtype == torch.float32
        if block is None:
            assert w13_scale.shape == (num_experts, two_i) and w2_scale.shape == (num_experts, d)
            assert w13_scale.stride(1) == 1 and w2_scale.stride(1) == 1
        else:
            rows, cols = block
            assert inter % rows == 0 and takes_blocks(block), f"experts of I = {inter} in blocks {block}"
            assert w13_scale.shape == (num_experts, two_i // rows, triton.cdiv(d, cols)), tuple(w13_scale.shape)
            assert w2_scale.shape == (num_experts, triton.cdiv(d, rows), triton.cdiv(inter, cols)), \
                tuple(w2_scale.shape)
            assert w13_scale.stride(2) == 1 and w2_scale.stride(2) == 1
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1, "last dims must be contiguous"
    if out is None:
        out = torch.empty(num_tokens, d, dtype=x.dtype, device=x.device)
    assert out.shape == (num_tokens, d) and out.dtype == x.dtype and out.stride(1) == 1
    if num_tokens == 0:
        return out
    if expert_map is not None:
        assert expert_map.dim() == 1 and not expert_map.is_floating_point()
    cfg = fit_blocks(config or get_config(num_experts, inter, d, num_tokens, top_k,
                                          expert_map.numel() if expert_map is not None else num_experts, fp8), block)
    weights = topk_weights.to(torch.float32).contiguous()  # no copy when already fp32 and contiguous
    ids = topk_ids.contiguous()
    layout = slot_layout(ids, num_experts, cfg.block_m, expert_map, direct)
    # One token's GEMM 2 preloads and starts early. Larger steps keep it plain: the tile
    # held across the wait costs the large tiles a third more shared memory (98 against
    # 74 KB at 64 slots a block), a resident program fewer per SM.
    pdl = layout.direct and pdl_enabled(x.device)
    h = gate_up_silu(x, w13, layout, top_k, cfg.up, w13_scale, trigger=pdl, block=block)
    y = down_weighted(h, w2, weights, layout, cfg.down, w2_scale, preload=layout.direct, pdl=pdl, block=block)
    return sum_topk(y, ids, expert_map, num_experts, out)
