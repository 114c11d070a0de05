"""Skinny GEMM for decode: y = x W^T (+ b) for x [M, K] with M <= 64, W [N, K].

At these M the cost is reading W once, so the kernel is built to stream it: each program
owns BLOCK_N output columns and one K range, loading [BLOCK_N, BLOCK_K] weight tiles
with wide contiguous loads. When N alone gives too few programs to keep every SM's
loads in flight, K is split too; the partial sums go to an fp32 scratch [S, M, N] that a
second small kernel adds up (deterministic, no atomics, no zero-fill).

M == 1 uses plain FMAs into a [BLOCK_N, BLOCK_K] fp32 accumulator reduced once at the
end; M > 1 uses tl.dot on an x tile padded to 16, 32 or 64 rows, x on the left or (swap_ab)
the weight tile, which lets a Hopper GPU use its warpgroup MMA. The engine takes the
M == 1 row kernel below for batch 1, and this one in the batch-invariant mode
(`linear_invariant`: 16-row tiles of x over a grid axis, a tile and K split fixed by the
weight's shape); otherwise it is benchmarked against cuBLAS for small decode batches
(benchmarks/gpu_kernels.py, benchmarks/throughput_kernels.py --only chain). The
reference is F.linear.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from agent_infer.kernels.triton.activation import silu_and_mul
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
    # With split_k > 1: the last program of each output tile adds the K ranges' partial
    # sums (in split order, as the second kernel does) and runs the epilogue, so there is
    # no second launch; it needs a counter per output tile (`linear`'s tile_counters).
    reduce_in_kernel: bool = False


# M is not specialised: the batch-invariant mode launches one variant for every row count
# (a row count of 1 or a multiple of 16 would otherwise compile its own, mid-serving).
@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, part_ptr,
    M, N, K, sxm, swn, som, k_per_split,
    res_ptr, nw_ptr, count_ptr, srm, eps, tile_ptr,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    SWAP_AB: tl.constexpr = False, SILU_MUL: tl.constexpr = False, ADD_NORM: tl.constexpr = False,
    BLOCK_H: tl.constexpr = 1, PDL: tl.constexpr = False, REDUCE: tl.constexpr = False,
):
    # SILU_MUL (tl.dot, x on the left; with SPLIT only with REDUCE): the weight is [gate;
    # up], 2N rows; the output silu(x gate^T) * (x up^T), N columns. ADD_NORM (no split, or
    # REDUCE): the last program of a tile of rows adds the residual and normalises those
    # rows (`_last_tile_add_norm`, one counter per tile of rows). REDUCE (SPLIT): the last
    # K range of each output tile to finish adds the partials in split order (a counter
    # per output tile at tile_ptr) and runs the epilogue.
    pdl_begin(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < M
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * swn
    x_rows = x_ptr + m.to(tl.int64)[:, None] * sxm
    if SWAP_AB:
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    elif USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if SILU_MUL:
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
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
            if SILU_MUL:
                if EVEN_K:
                    w_up = tl.load(w_rows + N * swn + kk[None, :], mask=n_mask[:, None], other=0.0)
                else:
                    w_up = tl.load(w_rows + N * swn + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                acc_up += tl.dot(x.to(w.dtype), tl.trans(w_up), input_precision=PRECISION)
        else:
            acc2 += w.to(tl.float32) * x.to(tl.float32)  # x is [1, BLOCK_K]
    if SWAP_AB:
        acc = tl.trans(acc_t)
    elif not USE_DOT:
        acc = tl.sum(acc2, axis=1)[None, :]
    if not SILU_MUL:
        acc_up = acc  # unused
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        splits = tl.num_programs(1)
        part = part_ptr + (pid_k * M + m)[:, None].to(tl.int64) * N + n[None, :]
        tl.store(part, acc, mask=out_mask)
        if SILU_MUL:
            tl.store(part + splits * M * N, acc_up, mask=out_mask)  # the up halves after the gates
        if REDUCE:
            tile = tile_ptr + tl.program_id(2) * tl.num_programs(0) + pid_n
            if last_to_arrive(tile, splits):
                tl.debug_barrier()
                rows = part_ptr + m[:, None].to(tl.int64) * N + n[None, :]
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for s in range(0, splits):  # in split order: the sums the second kernel makes
                    acc += tl.load(rows + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
                    if SILU_MUL:
                        acc_up += tl.load(rows + (splits + s) * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
                _epilogue(acc, acc_up, m, n, out_mask, out_ptr, b_ptr, res_ptr, nw_ptr, count_ptr, M, N, som, srm,
                          eps, HAS_BIAS, SILU_MUL, ADD_NORM, BLOCK_M, BLOCK_H)
                tl.store(tile, 0)
    else:
        _epilogue(acc, acc_up, m, n, out_mask, out_ptr, b_ptr, res_ptr, nw_ptr, count_ptr, M, N, som, srm, eps,
                  HAS_BIAS, SILU_MUL, ADD_NORM, BLOCK_M, BLOCK_H)


@triton.jit
def _epilogue(acc, acc_up, m, n, out_mask, out_ptr, b_ptr, res_ptr, nw_ptr, count_ptr, M, N, som, srm, eps,
              HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, ADD_NORM: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_H: tl.constexpr):
    """The output tile from its whole-K sums: (+ bias) or silu(gate) * up, stored; then
    with ADD_NORM the add + norm of the tile's rows by the last program along N."""
    n_mask = n < N
    if SILU_MUL:
        y = bias_silu_mul(acc, acc_up, n[None, :], n_mask[None, :], b_ptr, N, HAS_BIAS, True,
                          out_ptr.dtype.element_ty)
    else:
        y = acc
        if HAS_BIAS:
            y += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m.to(tl.int64)[:, None] * som + n[None, :], y.to(out_ptr.dtype.element_ty), mask=out_mask)
    if ADD_NORM:
        first = tl.program_id(2) * BLOCK_M
        _last_tile_add_norm(out_ptr, res_ptr, nw_ptr, count_ptr + tl.program_id(2), first,
                            tl.minimum(first + BLOCK_M, M), som, srm, N, eps, tl.num_programs(0), BLOCK_H)


@triton.jit(do_not_specialize=["M"])
def _split_reduce_kernel(
    part_ptr, b_ptr, out_ptr, M, N, som, splits, res_ptr, nw_ptr, srm, eps,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, ADD_NORM: tl.constexpr = False, PDL: tl.constexpr = False,
):
    # ADD_NORM: BLOCK spans the row, which this program then adds to the residual and
    # normalises.
    pdl_begin(PDL)
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = n < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, splits):
        acc += tl.load(part_ptr + (s * M + row).to(tl.int64) * N + n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    y = acc.to(out_ptr.dtype.element_ty)
    if ADD_NORM:
        add_rms_norm_row(y, n, mask, res_ptr + row.to(tl.int64) * srm, nw_ptr, out_ptr + row.to(tl.int64) * som, N, eps)
    else:
        tl.store(out_ptr + row.to(tl.int64) * som + n, y, mask=mask)


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
    block_m: int | None = None, silu_mul: bool = False,
    add_norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None, pdl: bool | None = None,
    tile_counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= MAX_M) @ weight[N, K]^T (+ bias [N]) -> [M, N] in x's dtype.
    `block_m` (tl.dot configs only): x's rows in tiles of that many, one grid axis over
    them, any M; without it one tile, padded to M's next power of two (at least 16).
    `silu_mul` (tl.dot with x on the left; no K split, or one reduced in the kernel):
    weight and bias are [gate; up], the result silu_and_mul of the product, [M, N / 2].
    `add_norm` = (residual [M, N], norm weight [N], counters (int32, one per tile of rows,
    zero and left zero), eps): residual <- y + residual in place, and the result
    rms_norm(residual) * norm weight, done by the last program of each tile of rows, or
    with a K split by its second kernel. `tile_counters` (int32, one per output tile,
    zero and left zero): for a config that reduces its K split in the kernel."""
    m, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    assert weight.shape[1] == k, f"x has {k} features, weight expects {weight.shape[1]}"
    assert m >= 1 and (block_m is not None or m <= MAX_M), f"gemv handles 1..{MAX_M} rows, got {m}"
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
    reduce = split > 1 and cfg.reduce_in_kernel
    if silu_mul and (not cfg.use_dot or cfg.swap_ab or (split > 1 and not reduce) or weight.shape[0] % 2):
        raise ValueError("silu_mul takes a [gate; up] weight on the tl.dot path, x on the left, no K split "
                         "or one reduced in the kernel")
    even_k = k % cfg.block_k == 0
    if block_m is not None:
        assert cfg.use_dot and block_m >= 16 and triton.next_power_of_2(block_m) == block_m
    else:
        block_m = max(16, triton.next_power_of_2(m)) if cfg.use_dot else 1
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(m, block_m))
    if reduce:
        assert tile_counters is not None and tile_counters.dtype == torch.int32 and tile_counters.is_contiguous()
        assert tile_counters.numel() >= grid[0] * grid[2], f"{tile_counters.numel()} tile counters < {grid}"
    part = torch.empty((2 if silu_mul else 1, split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    has_bias = bias is not None
    b = bias if has_bias else out
    fused_norm = add_norm is not None and (split == 1 or reduce)
    if add_norm is not None:
        residual, norm_weight, counter, eps = add_norm
        assert residual.shape == (m, n) and residual.stride(-1) == 1 and residual.dtype == x.dtype
        assert norm_weight.shape == (n,) and norm_weight.is_contiguous() and n <= MAX_ADD_NORM_FEATURES
        assert silu_mul is False and (not fused_norm or counter.numel() >= grid[2])
        assert counter.dtype == torch.int32 and counter.is_contiguous()
    else:
        residual, norm_weight, counter, eps = out, out, out, 0.0
    opts = launch_opts(x.device, pdl)
    _gemv_kernel[grid](
        x, weight, b, out, part,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split,
        residual, norm_weight, counter, residual.stride(0), eps, tile_counters if reduce else counter,
        HAS_BIAS=has_bias, SPLIT=split > 1, USE_DOT=cfg.use_dot, EVEN_K=even_k,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION=dot_precision(weight.dtype),
        SWAP_AB=cfg.swap_ab, SILU_MUL=silu_mul, ADD_NORM=fused_norm,
        BLOCK_H=triton.next_power_of_2(n) if fused_norm else 1, REDUCE=reduce,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **opts,
    )
    if split > 1 and not reduce:
        split_reduce(part[0], bias, out, add_norm=None if add_norm is None else (residual, norm_weight, eps), pdl=pdl)
    return out


def split_reduce(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                 add_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, pdl: bool | None = None) -> None:
    """out [M, N] <- the sum over S of fp32 partials part [S, M, N] (+ bias [N]), in
    out's dtype: the second kernel of a K-split GEMM. `add_norm` = (residual [M, N], norm
    weight, eps): one program a row adds it to the residual (in place) and normalises."""
    split, m, n = part.shape
    block = triton.next_power_of_2(n) if add_norm is not None else min(1024, triton.next_power_of_2(n))
    residual, norm_weight, eps = add_norm if add_norm is not None else (out, out, 0.0)
    _split_reduce_kernel[(m, triton.cdiv(n, block))](
        part, bias if bias is not None else out, out, m, n, out.stride(0), split,
        residual, norm_weight, residual.stride(0), eps,
        HAS_BIAS=bias is not None, BLOCK=block, ADD_NORM=add_norm is not None,
        num_warps=4 if block <= 4096 else 8, **launch_opts(out.device, pdl),
    )


# ---- the batch-invariant mode: 1 to many rows, each summed as when alone ---------------

# Rows of x a tile in the mode. Fixed, not grown with M: a wider tile could take another
# MMA instruction (Hopper's warpgroup MMA from 64 rows), whose sums need not round alike.
INVARIANT_BLOCK_M = 16


# K tiles below which the mode's GEMM does not split K: a split's second kernel costs more
# than a short K loop saves (a small model's step is a chain of such launches).
INVARIANT_SPLIT_MIN_K_TILES = 16


@functools.cache  # a pure function of the shape, asked at every call of the mode's GEMM
def invariant_config(n: int, k: int, device: torch.device) -> GemvConfig:
    """The mode's tile for an [n, k] weight, from its shape alone: every row of x then
    takes the same dots over the same K ranges, summed in the same order, whatever rows
    share its step (the row count only sets how many tiles of rows the grid has). The
    widest tile of columns that still gives every SM a program, and a K split (its partial
    sums added in a fixed order by the second kernel) only for long K loops."""
    block_k = next((b for b in (128, 64, 32, 16) if k % b == 0), 64)
    block_n = next((b for b in (64, 32) if triton.cdiv(n, b) >= num_sms(device)), 16)
    long_k = triton.cdiv(k, block_k) >= INVARIANT_SPLIT_MIN_K_TILES
    split = split_for(n, k, block_n, block_k, device) if long_k else 1
    return GemvConfig(block_n, block_k, split, use_dot=True)


def invariant_fuses_silu(n: int, k: int, device: torch.device) -> bool:
    """Whether the mode's GEMM for a [gate; up] weight of 2n rows ends in SiLU-and-mul
    (its tile takes no K split), from the shape alone as the tile is."""
    return invariant_config(n, k, device).split_k == 1


def linear_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     silu_mul: bool = False,
                     add_norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) for any M, each row of the result bitwise what
    a launch for that row alone gives (the batch-invariant mode's decode and verify
    projections; ops.linear's `invariant_rows`). On the tensor cores: a one-row step costs
    more than the batch-1 GEMV, a step of several rows reads the weight once. `silu_mul`:
    a [gate; up] weight, silu(gate) * up out, in the GEMM's epilogue where
    `invariant_fuses_silu`, else by the SiLU-and-mul kernel after it (by shape alone too).
    `add_norm` as in `linear` (one counter per 16 rows): the residual add and RMSNorm
    after the projection, by the GEMM's last program of each tile of rows, or by the K
    split's second kernel, a row at a time either way."""
    k = weight.shape[1]
    if silu_mul and not invariant_fuses_silu(weight.shape[0] // 2, k, x.device):
        return silu_and_mul(linear_invariant(x, weight, bias))
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    return linear(x, weight, bias, invariant_config(n, k, x.device), block_m=INVARIANT_BLOCK_M, silu_mul=silu_mul,
                  add_norm=add_norm)


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
def _last_tile_add_norm(out_ptr, res_ptr, nw_ptr, count_ptr, first, end, som, srm, N, eps, programs,
                        BLOCK_H: tl.constexpr):
    """`_last_program_add_norm` for the rows first..end - 1 of the mode's GEMM, whose
    `programs` programs along N each stored their columns of those rows: the last one adds
    and normalises each row in turn, the same code for a row whatever rows share its tile."""
    if last_to_arrive(count_ptr, programs):
        tl.debug_barrier()
        for r in range(first, end):
            _add_norm_stored_row(out_ptr + r * som, res_ptr + r * srm, nw_ptr, N, eps, BLOCK_H)  # < 2**31 apart
        tl.store(count_ptr, 0)


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
