"""Skinny GEMM for decode: y = x W^T (+ b) for x [M, K] with M <= 64, W [N, K].

At these M the cost is reading W once, so the kernel is built to stream it: each program
owns BLOCK_N output columns and one K range, loading [BLOCK_N, BLOCK_K] weight tiles
with wide contiguous loads. When N alone gives too few programs to keep every SM's
loads in flight, K is split too; the partial sums go to an fp32 scratch [S, M, N] that a
second small kernel adds up (deterministic, no atomics, no zero-fill).

M == 1 uses plain FMAs into a [BLOCK_N, BLOCK_K] fp32 accumulator reduced once at the
end; M > 1 uses tl.dot on an x tile padded to 16, 32 or 64 rows, x on the left or (swap_ab)
the weight tile, which lets a Hopper GPU use its warpgroup MMA. The engine takes the
M == 1 row kernel below for batch 1 (and, in the batch-invariant mode, for fp8 weights
with a grid axis over the rows); this skinny GEMM is benchmarked against cuBLAS for small
decode batches (benchmarks/gpu_kernels.py, benchmarks/throughput_kernels.py --only chain),
and its split-reduce kernel adds the W8A8 GEMM's K split. The reference is F.linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from agent_infer.kernels.triton.gemv_fp8 import row_dot_e4m3
from agent_infer.kernels.triton.norm import add_rms_norm_row, last_to_arrive
from agent_infer.kernels.triton.utils import bias_silu_mul, dot_precision, launch_opts, num_sms, pdl_begin

MAX_M = 64

# The add + norm epilogues hold the whole output row in registers: up to this many features.
MAX_ADD_NORM_FEATURES = 16384


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    use_dot: bool = False  # tl.dot on rows padded to a power of two >= 16; required when M > 1
    # With use_dot: the weight tile is the dot's left operand ([BLOCK_N, BLOCK_K] times x^T),
    # so BLOCK_N >= 64 fills a Hopper warpgroup MMA, whose left operand must be 64 rows
    # tall, where x's 16 padded rows on the left leave only the older, narrower MMA.
    swap_ab: bool = False


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, part_ptr,
    M, N, K, sxm, swn, som, k_per_split,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    SWAP_AB: tl.constexpr = False, PDL: tl.constexpr = False,
):
    pdl_begin(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * swn
    x_rows = x_ptr + m.to(tl.int64)[:, None] * sxm
    if SWAP_AB:
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    elif USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None], other=0.0)
            x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None], other=0.0)
        else:
            k_mask = kk < k_hi
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if SWAP_AB:
            acc_t += tl.dot(w, tl.trans(x.to(w.dtype)), input_precision=PRECISION)
        elif USE_DOT:
            acc += tl.dot(x.to(w.dtype), tl.trans(w), input_precision=PRECISION)
        else:
            acc2 += w.to(tl.float32) * x.to(tl.float32)  # x is [1, BLOCK_K]
    if SWAP_AB:
        acc = tl.trans(acc_t)
    elif not USE_DOT:
        acc = tl.sum(acc2, axis=1)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        part = part_ptr + (pid_k * M + m)[:, None].to(tl.int64) * N + n[None, :]
        tl.store(part, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m.to(tl.int64)[:, None] * som + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=out_mask)


# M is not specialised: the W8A8 GEMM's K split reaches it with any row count (a count of
# 1 or a multiple of 16 would otherwise compile its own variant, mid-serving).
@triton.jit(do_not_specialize=["M"])
def _split_reduce_kernel(
    part_ptr, b_ptr, out_ptr, M, N, som, splits,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_begin(PDL)
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = n < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, splits):
        acc += tl.load(part_ptr + (s * M + row).to(tl.int64) * N + n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * som + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def default_config(m: int, n: int, k: int, device: torch.device) -> GemvConfig:
    """A starting point; benchmarks/gpu_kernels.py sweeps alternatives."""
    if m == 1:
        block_n, block_k, use_dot = 16, 512, False
    else:
        block_n, block_k, use_dot = 64, 128, True
    return GemvConfig(block_n, block_k, split_for(n, k, block_n, block_k, device), num_warps=4, num_stages=4,
                      use_dot=use_dot)


def split_for(n: int, k: int, block_n: int, block_k: int, device: torch.device) -> int:
    """K splits for [block_n, block_k] weight tiles: about four programs per SM, and at
    least four K tiles per split."""
    tiles = triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    return max(1, min(triton.cdiv(4 * num_sms(device), tiles), k_tiles // 4 or 1))


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: GemvConfig | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= MAX_M) @ weight[N, K]^T (+ bias [N]) -> [M, N] in x's dtype; x's
    rows in one tile, padded to M's next power of two (at least 16) on the tl.dot path."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k, f"x has {k} features, weight expects {weight.shape[1]}"
    assert 1 <= m <= MAX_M, f"gemv handles 1..{MAX_M} rows, got {m}"
    assert x.stride(-1) == 1 and weight.stride(-1) == 1
    cfg = config or default_config(m, n, k, x.device)
    if m > 1 and not cfg.use_dot:
        raise ValueError("the FMA path handles M == 1 only; use_dot=True for M > 1")
    if cfg.swap_ab and not cfg.use_dot:
        raise ValueError("swap_ab swaps the operands of tl.dot: it needs use_dot=True")
    assert triton.next_power_of_2(cfg.block_k) == cfg.block_k and triton.next_power_of_2(cfg.block_n) == cfg.block_n
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    k_tiles = triton.cdiv(k, cfg.block_k)
    split = max(1, min(cfg.split_k, k_tiles))
    k_per_split = triton.cdiv(k_tiles, split) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # no empty splits
    block_m = max(16, triton.next_power_of_2(m)) if cfg.use_dot else 1
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    b = bias if bias is not None else out
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x, weight, b, out, part,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split,
        HAS_BIAS=bias is not None, SPLIT=split > 1, USE_DOT=cfg.use_dot, EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION=dot_precision(weight.dtype),
        SWAP_AB=cfg.swap_ab, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_opts(x.device, pdl),
    )
    if split > 1:
        split_reduce(part, bias, out, pdl=pdl)
    return out


def split_reduce(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, pdl: bool | None = None) -> None:
    """out [M, N] <- the sum over S of fp32 partials part [S, M, N] (+ bias [N]), in
    out's dtype: the second kernel of a K-split GEMM."""
    split, m, n = part.shape
    block = min(1024, triton.next_power_of_2(n))
    _split_reduce_kernel[(m, triton.cdiv(n, block))](
        part, bias if bias is not None else out, out, m, n, out.stride(0), split,
        HAS_BIAS=bias is not None, BLOCK=block, num_warps=4, **launch_opts(out.device, pdl),
    )


# ---- M = 1: one program per BLOCK_N output rows, the whole K, no second kernel ----------


@dataclass(frozen=True)
class RowConfig:
    """Launch shape of the M = 1 kernel: BLOCK_N rows per program, BLOCK_K columns per load."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    prefetch: int = 1  # weight tiles loaded before the PDL wait (1 or 2), see row_dot


@triton.jit
def _add_norm_stored_row(out_ptr, res_ptr, nw_ptr, N, eps, BLOCK_H: tl.constexpr):
    """residual <- y + residual, out <- rms_norm(residual) * weight for a row y that
    other programs stored in `out`."""
    h = tl.arange(0, BLOCK_H)
    mask = h < N
    # .cg: other SMs wrote y, and this SM's L1 is not kept coherent with them.
    y = tl.load(out_ptr + h, mask=mask, other=0.0, cache_modifier=".cg")
    add_rms_norm_row(y, h, mask, res_ptr, nw_ptr, out_ptr, N, eps)


@triton.jit
def _last_program_add_norm(out_ptr, res_ptr, nw_ptr, count_ptr, N, eps, programs, BLOCK_H: tl.constexpr):
    """Run by every one of the `programs` programs of a row after storing its part of y:
    the last one to arrive does residual <- y + residual, out <- rms_norm(residual) *
    weight over the whole row and re-arms the counter. One program of a few µs instead of
    a dependent launch of its own."""
    if last_to_arrive(count_ptr, programs):
        tl.debug_barrier()
        _add_norm_stored_row(out_ptr, res_ptr, nw_ptr, N, eps, BLOCK_H)
        tl.store(count_ptr, 0)  # the next launch starts after this kernel ends


@triton.jit
def row_dot(
    x_ptr, w_ptr, b_ptr, n, n_mask, K, swn, up_offset,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, PDL: tl.constexpr, BLOCK_K: tl.constexpr,
    OUT_DTYPE: tl.constexpr, PREFETCH: tl.constexpr = 1,
):
    """The M = 1 dot products of rows `n`: sum_k w[n, k] x[k] (+ b[n]), fp32; with
    SILU_MUL, rows n and n + up_offset are a gate/up pair and the result is silu(gate) *
    up (gate and up rounded to OUT_DTYPE first, as the unfused reference does). K is a
    multiple of BLOCK_K.

    With PDL (programmatic dependent launch, Hopper+), the first PREFETCH (1 or 2) weight
    tiles are loaded before waiting for the previous kernel: weights never depend on it,
    so the loads overlap that kernel's tail instead of following it. At batch 1 the
    kernels between two GEMVs (all-reduce, norm, attention) are latency-bound and leave
    the memory system idle; a deeper prefetch streams more of the next weights meanwhile,
    at the price of registers (fewer programs resident)."""
    kk = tl.arange(0, BLOCK_K)
    rows = w_ptr + n.to(tl.int64)[:, None] * swn + kk[None, :]
    w = tl.load(rows, mask=n_mask[:, None], other=0.0)
    if SILU_MUL:
        up_rows = rows + up_offset * swn
        wu = tl.load(up_rows, mask=n_mask[:, None], other=0.0)
    start = BLOCK_K
    if PREFETCH > 1:
        # A per-column mask (not a scalar `BLOCK_K < K`: some Triton interpreters refuse
        # a scalar bool broadcast into a mask).
        mask2 = n_mask[:, None] & ((BLOCK_K + kk) < K)[None, :]
        w2 = tl.load(rows + BLOCK_K, mask=mask2, other=0.0)
        if SILU_MUL:
            wu2 = tl.load(up_rows + BLOCK_K, mask=mask2, other=0.0)
        start = 2 * BLOCK_K
    pdl_begin(PDL)
    x = tl.load(x_ptr + kk).to(tl.float32)[None, :]
    acc = w.to(tl.float32) * x
    if SILU_MUL:
        acc_u = wu.to(tl.float32) * x
    if PREFETCH > 1:
        x2 = tl.load(x_ptr + BLOCK_K + kk, mask=(BLOCK_K + kk) < K, other=0.0).to(tl.float32)[None, :]
        acc += w2.to(tl.float32) * x2
        if SILU_MUL:
            acc_u += wu2.to(tl.float32) * x2
    for k0 in range(start, K, BLOCK_K):
        x = tl.load(x_ptr + k0 + kk).to(tl.float32)[None, :]
        acc += tl.load(rows + k0, mask=n_mask[:, None], other=0.0).to(tl.float32) * x
        if SILU_MUL:
            acc_u += tl.load(up_rows + k0, mask=n_mask[:, None], other=0.0).to(tl.float32) * x
    y = tl.sum(acc, axis=1)
    u = y
    if SILU_MUL:
        u = tl.sum(acc_u, axis=1)
    return bias_silu_mul(y, u, n, n_mask, b_ptr, up_offset, HAS_BIAS, SILU_MUL, OUT_DTYPE)


@triton.jit
def _gemv_row_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, res_ptr, nw_ptr, count_ptr, s_ptr,
    N, K, swn, up_offset, eps, s_stride, sxm, som, srm,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, ADD_NORM: tl.constexpr, PDL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, PREFETCH: tl.constexpr,
    SCALE: tl.constexpr, S_ROWS: tl.constexpr, S_COLS: tl.constexpr, ROW_GRID: tl.constexpr = False,
):
    """out[n] = row_dot(n) for this program's BLOCK_N rows; with ADD_NORM, the residual
    add + RMSNorm that follows the projection is done by the last program
    (`_last_program_add_norm`). fp8 weights (SCALE 1: per row, 2: per block; w_ptr then
    points at their bytes as int32 words, see gemv_fp8.py): row_dot_e4m3. Block-scaled
    weights: BLOCK_N divides S_ROWS, so the program's rows share one scale row.

    ROW_GRID: grid axis 0 is the row of x and axis 1 the block of outputs (strides sxm,
    som, srm for x, out and the residual, one add + norm counter per row). Every row runs
    the M = 1 code unchanged, so each is bitwise what a launch for that row alone gives
    (`linear_m1` on several rows); the rows are the fast axis, so the programs that read
    one weight tile run together and all but the first find it in L2 (each still moves
    the tile into its SM: a row costs about a third of a one-row step on an 8B model,
    docs/PERFORMANCE.md). A constexpr, so the
    M = 1 launch compiles as it did without the axis (the offsets alone moved ptxas's
    register allocation in the K = 4,096 loop)."""
    if ROW_GRID:
        row = tl.program_id(0)
        x_ptr += row * sxm
        out_ptr += row * som
        if ADD_NORM:
            res_ptr += row * srm
            count_ptr += row
        block = tl.program_id(1)
        programs = tl.num_programs(1)
    else:
        block = tl.program_id(0)
        programs = tl.num_programs(0)
    first = block * BLOCK_N
    n = first + tl.arange(0, BLOCK_N)
    n_mask = n < N
    if SCALE == 0:
        y = row_dot(x_ptr, w_ptr, b_ptr, n, n_mask, K, swn, up_offset,
                    HAS_BIAS, SILU_MUL, PDL, BLOCK_K, out_ptr.dtype.element_ty, PREFETCH)
    else:
        s_row = first // S_ROWS
        y = row_dot_e4m3(x_ptr, w_ptr, b_ptr, n, n_mask, K, swn, up_offset,
                         HAS_BIAS, SILU_MUL, PDL, BLOCK_K, out_ptr.dtype.element_ty, PREFETCH,
                         s_ptr, s_row, s_row + up_offset // S_ROWS, s_stride, SCALE, S_COLS)
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n_mask)
    if ADD_NORM:
        _last_program_add_norm(out_ptr, res_ptr, nw_ptr, count_ptr, N, eps, programs, BLOCK_H)


# CUDA's limit on a grid's second and third axes: the row grid puts its output blocks there.
MAX_GRID_Y = 65535

# Two tiles before the PDL wait, not one: the GEMV's first loads overlap the predecessor's
# tail; more tiles hold registers with no further overlap (docs/PERFORMANCE.md).
ROW_PREFETCH_TILES = 2


def row_block_k(k: int, most: int = 2048) -> int:
    """The M = 1 kernels' column tile for K: `most` (a power of two), or the largest power
    of two below it that divides K."""
    block_k = most
    while k % block_k:
        block_k //= 2
    return block_k


def row_config(n: int, k: int, device: torch.device, fp8: bool = False, silu_mul: bool = False) -> RowConfig:
    """`n` output rows (gate/up pairs with `silu_mul`) over K = `k`. bf16: 4 rows x 2048
    columns per load, two tiles before the PDL wait: the fastest in a sweep over the
    Qwen3-8B shapes at TP = 1 and 2 on an H200 (benchmarks/gemv_chain.py;
    docs/PERFORMANCE.md). Few rows per program give N / 4 programs, several per SM, each
    streaming long contiguous rows; the column tile shrinks to a power of two that
    divides K.

    fp8 (2048 columns are 512 words of four e4m3 values) prefetches one tile: a second
    one holds enough registers to cost one or two resident programs per SM, and was the
    slower in the same sweep. Outputs of at most 4,096 rows take 8 rows per program
    (half the programs, each streaming twice the rows); the wider ones, and the gate/up
    pairs whose programs already load two tiles, keep 4."""
    block_k = row_block_k(k)
    if fp8:
        return RowConfig(8 if n <= 4096 and not silu_mul else 4, block_k, prefetch=1)
    if k == 2048 and n <= 8192 and not silu_mul:
        # Narrow outputs over K = 2,048 (the attention projections of Qwen3-30B-A3B and
        # V2-Lite, whose hidden size it is): 2 rows x 1,024 columns, one tile before the
        # wait. Twice the programs of 4 rows, each with less in flight, fill the SMs better
        # when the output has only a few thousand rows; the faster in their batch-1 steps
        # (docs/PERFORMANCE.md, A/B table). Wider outputs (an LM head) and gate/up pairs
        # (twice the rows, not measured this way) keep the default.
        return RowConfig(2, 1024, prefetch=1)
    # A row of one tile (K = 2,048 past the narrow outputs above) prefetches that tile
    # alone: a second, wholly masked, held 36 more registers a thread for sm_90 (203
    # against 167), two resident programs per SM instead of three. Outputs of at most
    # 2,048 rows (Qwen3-30B-A3B's o projection, K = 4,096) prefetch one tile too: with
    # few programs a second one costs residency and gains no overlap.
    prefetch = 1 if n <= 2048 else min(ROW_PREFETCH_TILES, k // block_k)
    return RowConfig(4, block_k, prefetch=prefetch)


def fuses_scale(n: int, block: tuple[int, int] | None) -> bool:
    """Whether the row kernel can take a block-scaled weight whose rows split at `n`
    (the up half of a [gate | up] pair, or the end): the split must fall on a block row."""
    return block is None or n % block[0] == 0


def linear_m1(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    silu_mul: bool = False, config: RowConfig | None = None, pdl: bool | None = None,
    scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """x [1, K] @ weight[N, K]^T (+ bias) -> [1, N]; with silu_mul the N rows are
    [gate | up] halves and the result is silu(gate) * up, [1, N / 2]. An fp8 weight
    comes with its `scale`: per `block` (rows, columns), or per row without one.

    x [M, K] (rows at any stride): each row of the result bitwise what x's row alone
    gives, the weight re-read (mostly from L2) per row: the batch-invariant mode's
    projections (`ops.linear`'s `invariant_rows`), not a fast path for M > 1."""
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    _launch_row(x, weight, bias, out, n, silu_mul=silu_mul, config=config, pdl=pdl, scale=scale, block=block)
    return out


def _launch_row(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, n: int, *,
    silu_mul: bool = False, add_norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None,
    config: RowConfig | None = None, pdl: bool | None = None,
    scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
) -> None:
    """One `_gemv_row_kernel` launch writing `out` [M, n], each row of x [M, K] as a
    launch for it alone would; add_norm = (residual [M, n], norm weight, counters (one
    per row), eps) turns on the last program's add + RMSNorm."""
    rows, k = x.shape
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and weight.shape[1] == k and out.shape == (rows, n)
    fp8 = weight.dtype == torch.float8_e4m3fn
    cfg = config or row_config(n, k, x.device, fp8, silu_mul)
    if rows > 1 and triton.cdiv(n, cfg.block_n) > MAX_GRID_Y:
        # More blocks than a grid's second axis holds (an LM head of over 262k rows at 4
        # rows a program): a launch per row, each the M = 1 one.
        for i in range(rows):
            one_norm = None if add_norm is None else (add_norm[0][i:i + 1], add_norm[1], add_norm[2][i:], add_norm[3])
            _launch_row(x[i:i + 1], weight, bias, out[i:i + 1], n, silu_mul=silu_mul, add_norm=one_norm,
                        config=cfg, pdl=pdl, scale=scale, block=block)
        return
    assert k % cfg.block_k == 0, f"K={k} is not a multiple of block_k={cfg.block_k}"
    assert fp8 == (scale is not None), "an fp8 weight needs its scales, and only an fp8 weight has them"
    mode, s_rows, s_cols = (0, 1, 1) if scale is None else ((1, 1, 1) if block is None else (2, *block))
    if mode == 2:
        assert s_rows % cfg.block_n == 0 and (not silu_mul or n % s_rows == 0), (block, cfg.block_n, n)
        assert scale.shape == (triton.cdiv(weight.shape[0], s_rows), triton.cdiv(k, s_cols)) and scale.stride(1) == 1
    if fp8:  # its bytes as int32 words, four e4m3 values each (gemv_fp8.py)
        assert weight.stride(0) % 4 == 0 and weight.data_ptr() % 4 == 0
        weight = weight.view(torch.int32)
    opts = launch_opts(x.device, pdl)
    residual, norm_weight, counter, eps = add_norm if add_norm is not None else (out, out, out, 0.0)
    blocks = triton.cdiv(n, cfg.block_n)
    _gemv_row_kernel[(rows, blocks) if rows > 1 else (blocks,)](
        x, weight, bias if bias is not None else out, out, residual, norm_weight, counter,
        scale if scale is not None else out,
        n, k, weight.stride(0), n, eps, scale.stride(0) if scale is not None else 0,
        x.stride(0), out.stride(0), residual.stride(0),
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, ADD_NORM=add_norm is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PREFETCH=cfg.prefetch,
        BLOCK_H=triton.next_power_of_2(n) if add_norm is not None else 1,
        SCALE=mode, S_ROWS=s_rows, S_COLS=s_cols, ROW_GRID=rows > 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **opts,
    )


def linear_m1_add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, counter: torch.Tensor,
    *, config: RowConfig | None = None, pdl: bool | None = None,
    scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm(x [1, K] @ weight[N, K]^T (+ bias), residual [1, N], norm_weight,
    eps) in one launch: returns (normed [1, N], residual), residual updated in place.
    `counter` is an int32 tensor, zero on entry and left zero (its address may be
    captured in a CUDA graph); one per call site that can be in flight at once. fp8
    weights as in `linear_m1`. x [M, K] and residual [M, N] as in `linear_m1`, with one
    counter per row."""
    m, n = x.shape[0], weight.shape[0]
    assert residual.shape == (m, n) and residual.stride(-1) == 1 and residual.dtype == x.dtype
    assert norm_weight.shape == (n,) and norm_weight.is_contiguous()
    assert n <= MAX_ADD_NORM_FEATURES, f"{n} features > {MAX_ADD_NORM_FEATURES}"
    assert counter.dtype == torch.int32 and counter.numel() >= m and counter.device == x.device
    assert counter.is_contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _launch_row(x, weight, bias, out, n, add_norm=(residual, norm_weight, counter, eps), config=config, pdl=pdl,
                scale=scale, block=block)
    return out, residual
