"""The batch-1 dot products of gemv.py for e4m3 weights: `row_dot_e4m3`.

The weight is read as int32 words of four e4m3 values (little-endian: byte i of word j
is column 4 j + i) and converted with integer operations rather than the hardware's
e4m3x2 -> f16x2 -> f32 conversions: the same speed on an H200 (docs/PERFORMANCE.md), a
quarter of the accumulators (one per word, not per value), and no spills in any variant
(the gate/up one spilled with the conversions). Shifting byte i to the top of the word
and back down by 4, arithmetically, leaves its sign at bit 31 and its 4 exponent and 3
mantissa bits at bits 26..20; clearing bits 30..27 gives the fp32 whose exponent field
is the e4m3 exponent field and whose mantissa starts with the e4m3 mantissa: exactly
the e4m3 value times 2^-120, zero, subnormals and signs included (e4m3's bias is 7,
fp32's 127, and an e4m3 subnormal lands on an fp32 subnormal of the same significand;
the FMAs keep subnormals). The sums are multiplied by 2^120 at the end, with the row's
scale (per-row layout); a block-scaled weight's scales multiply x instead (one per
block of columns).

x is not quantized: the result is x times the weight's exact values, in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from agent_infer.kernels.triton.utils import bias_silu_mul, pdl_begin

# Sign bit and bits 26..20 (0x87F00000) as an int32 constant.
_E4M3_BITS = tl.constexpr(-0x78100000)
_TWO_POW_120 = tl.constexpr(2.0**120)


@triton.jit
def _e4m3(words, i: tl.constexpr):
    """Byte i of each int32 word, an e4m3 value, as the fp32 value times 2^-120."""
    if i == 3:
        b = words >> 4
    else:
        b = (words << (24 - 8 * i)) >> 4
    return (b & _E4M3_BITS).to(tl.float32, bitcast=True)


@triton.jit
def _x_byte(x_ptr, k, mask, word_scale, s_ptr, s_row, s_stride, SCALE: tl.constexpr, S_COLS: tl.constexpr,
            MASKED: tl.constexpr):
    """x[k] in fp32 as a [1, W] row; block-scaled weights (SCALE == 2): times the scale of
    each column's block in scale row s_row, which is the word's (`word_scale`, loaded
    once for its four columns) when blocks are whole words."""
    if MASKED:
        x = tl.load(x_ptr + k, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(x_ptr + k).to(tl.float32)
    if SCALE == 2:
        if S_COLS % 4 == 0:
            x = x * word_scale
        else:
            x = x * tl.load(s_ptr + s_row * s_stride + k // S_COLS, mask=mask, other=0.0)
    return x[None, :]


@triton.jit
def _words_dot(words, x_ptr, k0, jj, mask, s_ptr, s_row, s_stride, SCALE: tl.constexpr, S_COLS: tl.constexpr,
               MASKED: tl.constexpr):
    """[BLOCK_N, W] partial sums of one tile of words [BLOCK_N, W] (columns k0 + 4 jj + i).
    Block scales of blocks that hold whole words are loaded once per word, not per
    column: a quarter of the scale loads, which as many as x's own were the tile's
    largest cost after the weights (the MoE's one-token rows and the dense GEMV at
    DeepSeek-V3's and Qwen3's 128 x 128 blocks)."""
    k = k0 + 4 * jj
    word_scale = 1.0
    if SCALE == 2 and S_COLS % 4 == 0:
        word_scale = tl.load(s_ptr + s_row * s_stride + k // S_COLS, mask=mask, other=0.0)
    acc = _e4m3(words, 0) * _x_byte(x_ptr, k, mask, word_scale, s_ptr, s_row, s_stride, SCALE, S_COLS, MASKED)
    acc += _e4m3(words, 1) * _x_byte(x_ptr, k + 1, mask, word_scale, s_ptr, s_row, s_stride, SCALE, S_COLS, MASKED)
    acc += _e4m3(words, 2) * _x_byte(x_ptr, k + 2, mask, word_scale, s_ptr, s_row, s_stride, SCALE, S_COLS, MASKED)
    acc += _e4m3(words, 3) * _x_byte(x_ptr, k + 3, mask, word_scale, s_ptr, s_row, s_stride, SCALE, S_COLS, MASKED)
    return acc


@triton.jit
def row_dot_e4m3(
    x_ptr, w_ptr, b_ptr, n, n_mask, K, swn, up_offset,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, PDL: tl.constexpr, BLOCK_K: tl.constexpr,
    OUT_DTYPE: tl.constexpr, PREFETCH: tl.constexpr,
    s_ptr, s_row, s_up_row, s_stride, SCALE: tl.constexpr, S_COLS: tl.constexpr, EVEN_K: tl.constexpr = True,
):
    """gemv.row_dot for an e4m3 weight read as int32 words (w_ptr, row stride swn in
    words; BLOCK_K and K count values, K a multiple of 4, and of BLOCK_K unless EVEN_K is
    off: then every tile's loads are masked at K). SCALE == 1: one scale
    per row (s_ptr[n], s_ptr[up_offset + n] for the up rows); SCALE == 2: one per block of
    S_COLS columns in scale row s_row (s_up_row for the up rows). Loads, prefetch before
    the PDL wait, the SiLU-and-mul epilogue and its rounding are row_dot's."""
    W: tl.constexpr = BLOCK_K // 4
    jj = tl.arange(0, W)
    in1 = (4 * jj) < K  # every column of a whole tile (used by the scales' loads)
    rows = w_ptr + n.to(tl.int64)[:, None] * swn + jj[None, :]
    mask1 = n_mask[:, None] if EVEN_K else n_mask[:, None] & in1[None, :]
    w = tl.load(rows, mask=mask1, other=0)
    if SILU_MUL:
        up_rows = rows + up_offset * swn
        wu = tl.load(up_rows, mask=mask1, other=0)
    start = BLOCK_K
    if PREFETCH > 1:
        in2 = (BLOCK_K + 4 * jj) < K
        mask2 = n_mask[:, None] & in2[None, :]
        w2 = tl.load(rows + W, mask=mask2, other=0)
        if SILU_MUL:
            wu2 = tl.load(up_rows + W, mask=mask2, other=0)
        start = 2 * BLOCK_K
    pdl_begin(PDL)
    acc = _words_dot(w, x_ptr, 0, jj, in1, s_ptr, s_row, s_stride, SCALE, S_COLS, not EVEN_K)
    if SILU_MUL:
        acc_u = _words_dot(wu, x_ptr, 0, jj, in1, s_ptr, s_up_row, s_stride, SCALE, S_COLS, not EVEN_K)
    if PREFETCH > 1:
        acc += _words_dot(w2, x_ptr, BLOCK_K, jj, in2, s_ptr, s_row, s_stride, SCALE, S_COLS, True)
        if SILU_MUL:
            acc_u += _words_dot(wu2, x_ptr, BLOCK_K, jj, in2, s_ptr, s_up_row, s_stride, SCALE, S_COLS, True)
    for k0 in range(start, K, BLOCK_K):
        k_in = in1 if EVEN_K else (k0 + 4 * jj) < K
        mask = n_mask[:, None] if EVEN_K else n_mask[:, None] & k_in[None, :]
        words = tl.load(rows + k0 // 4, mask=mask, other=0)
        acc += _words_dot(words, x_ptr, k0, jj, k_in, s_ptr, s_row, s_stride, SCALE, S_COLS, not EVEN_K)
        if SILU_MUL:
            words_u = tl.load(up_rows + k0 // 4, mask=mask, other=0)
            acc_u += _words_dot(words_u, x_ptr, k0, jj, k_in, s_ptr, s_up_row, s_stride, SCALE, S_COLS, not EVEN_K)
    y = tl.sum(acc, axis=1) * _TWO_POW_120
    if SCALE == 1:
        y *= tl.load(s_ptr + n, mask=n_mask, other=0.0)
    u = y
    if SILU_MUL:
        u = tl.sum(acc_u, axis=1) * _TWO_POW_120
        if SCALE == 1:
            u *= tl.load(s_ptr + up_offset + n, mask=n_mask, other=0.0)
    return bias_silu_mul(y, u, n, n_mask, b_ptr, up_offset, HAS_BIAS, SILU_MUL, OUT_DTYPE)
