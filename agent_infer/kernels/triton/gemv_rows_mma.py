"""The few-row GEMV on the tensor cores: y = x W^T (+ b) for x [M, K] with a few rows (a
speculative verify step at batch 1, a small decode batch), W [N, K].

The products go to the tensor cores, a few instructions a weight whatever the rows (a
GEMV on the FMA units spends them in proportion to the rows: at 5 rows about 19 a weight,
2.0 TB/s on the Qwen3-8B projections against cuBLAS's 2.5; docs/PERFORMANCE.md), and the
launch keeps the batch-1 GEMV's shape: each program owns BLOCK_N weight rows over the
whole K (no split, no second kernel), the weight tiles streamed through shared memory by
Triton's pipeline (optionally the first one loaded before the PDL wait), x's rows padded
to one 16-row operand by masked loads that move no bytes. The weight tile is the dot's
left operand, [BLOCK_N, BLOCK_K] times x^T [BLOCK_K, 16], so a 64-row tile can take
Hopper's warpgroup MMA. Like the batch-1 GEMV it ends a [gate; up] projection in
SiLU-and-mul (a second dot over the up rows). For short rows (up to
MAX_ADD_NORM_FEATURES) it also ends the o and down projections in the residual add +
RMSNorm: the last program of a tile of rows to finish (an atomic counter per tile) walks
its rows a few at a time, where a kernel of its own would cost a dependent launch per
projection. Longer rows keep that kernel (one program a row): walked by one program, a
Qwen3-8B row of 4,096 features took about 7 us, 4.4 ms more for a verify step of 4 drafts
(a graph of 8 rows).
The reference is F.linear.

The engine sends it 2 to 16 rows (ENGINE_ROWS): its time hardly moves with the rows (x is
always one 16-row operand); at 8 rows it streamed Qwen3-8B's projections 12 % faster than
cuBLAS, and a verify step of 2 rows ran 0.67 ms shorter on it than on the FMA kernel it
replaced (docs/PERFORMANCE.md). The batch-invariant mode sends it every decode and verify
step's projections, one row included: more than 16 rows take several 16-row tiles, a grid
axis over them, and since the launch's tile depends on the weight's shape alone, a row's
sums are the same whatever rows share its step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from agent_infer.kernels.triton.gemv import MAX_GRID_Y, row_block_k
from agent_infer.kernels.triton.norm import add_rms_norm_rows, last_to_arrive
from agent_infer.kernels.triton.utils import bias_silu_mul, dot_precision, launch_opts, pdl_begin

# x's rows in the dot's right operand: the narrowest tile tl.dot takes.
BLOCK_M = 16
# The row counts the engine sends here (`takes`); one row takes the batch-1 GEMV (outside
# the batch-invariant mode).
ENGINE_ROWS = range(2, BLOCK_M + 1)
# The widest rows the last program adds and normalises (`linear_rows_mma_add_rms_norm`),
# and the elements it takes at a time (rows of the next power of two of the features).
MAX_ADD_NORM_FEATURES = 1024
_NORM_TILE_ELEMS = 4096


@dataclass(frozen=True)
class MmaConfig:
    """Launch shape: BLOCK_N weight rows a program, BLOCK_K columns a tile; num_stages
    tiles in flight through shared memory (Triton's pipeliner) after the first."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    prefetch: bool = True  # the first tile loaded before the PDL wait, into registers


@triton.jit
def _tile_mask(rows_mask, kk, k_left, EVEN_K: tl.constexpr):
    """The load mask of a [rows, BLOCK_K] tile: its rows, and with a K tail (not EVEN_K)
    the columns short of the `k_left` that remain."""
    if EVEN_K:
        mask = rows_mask[:, None]
    else:
        mask = rows_mask[:, None] & (kk < k_left)[None, :]
    return mask


@triton.jit
def _add_norm_stored_rows(out_ptr, res_ptr, nw_ptr, first, M, N, som, srm, eps, BLOCK_M: tl.constexpr,
                          BLOCK_H: tl.constexpr, NORM_ROWS: tl.constexpr):
    """residual <- y + residual, out <- rms_norm(residual) * weight for rows first ..
    first + BLOCK_M - 1 (those under M) of a y that other programs stored in `out`,
    NORM_ROWS rows at a time: a row's sums do not depend on the rows beside it."""
    h = tl.arange(0, BLOCK_H)
    end = tl.minimum(first + BLOCK_M, M)
    for r0 in range(first, end, NORM_ROWS):
        r = r0 + tl.arange(0, NORM_ROWS)
        mask = (r < end)[:, None] & (h < N)[None, :]
        y_ptrs = out_ptr + r[:, None] * som + h[None, :]
        # .cg: other SMs wrote y, and this SM's L1 is not kept coherent with them.
        y = tl.load(y_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        add_rms_norm_rows(y, mask, h, res_ptr + r[:, None] * srm + h[None, :], nw_ptr, y_ptrs, N, eps)


# M is not specialised: each row count would otherwise compile its own variant.
@triton.jit(do_not_specialize=["M"])
def _gemv_rows_mma_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, res_ptr, nw_ptr, count_ptr, M, N, K, sxm, swn, som, srm, up_offset, eps,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, PRECISION: tl.constexpr, SILU_MUL: tl.constexpr = False, PREFETCH: tl.constexpr = True,
    EVEN_K: tl.constexpr = True, ADD_NORM: tl.constexpr = False, BLOCK_H: tl.constexpr = 1,
    NORM_ROWS: tl.constexpr = 1,
):
    """out[j, n] = sum_k x[j, k] w[n, k] (+ b[n]) for this program's BLOCK_M rows j < M
    of x and BLOCK_N rows of w; EVEN_K: K a multiple of BLOCK_K, else the last tile's
    columns past K are masked (loaded as zeros). SILU_MUL: rows n + up_offset of w are
    the up halves, and out is silu(gate) * up. ADD_NORM: the last program of the tile of
    rows (its counter at count_ptr + the tile's index, zero on entry, re-armed) adds
    out's rows to the residual's (row stride srm) and normalises them by nw (N <= BLOCK_H)."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < M
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * swn + kk[None, :]
    up_rows = w_rows + up_offset * swn
    x_rows = x_ptr + m[:, None] * sxm + kk[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = acc
    start = 0
    if PREFETCH:
        # The first tile before the wait: weights never depend on the previous kernel.
        w_mask = _tile_mask(n_mask, kk, K, EVEN_K)
        w = tl.load(w_rows, mask=w_mask, other=0.0)
        if SILU_MUL:
            u = tl.load(up_rows, mask=w_mask, other=0.0)
        pdl_begin(PDL)
        x = tl.trans(tl.load(x_rows, mask=_tile_mask(m_mask, kk, K, EVEN_K), other=0.0))
        acc = tl.dot(w, x, input_precision=PRECISION)
        if SILU_MUL:
            acc_u = tl.dot(u, x, input_precision=PRECISION)
        start = BLOCK_K
    else:
        pdl_begin(PDL)
    for k0 in range(start, K, BLOCK_K):
        w_mask = _tile_mask(n_mask, kk, K - k0, EVEN_K)
        x = tl.trans(tl.load(x_rows + k0, mask=_tile_mask(m_mask, kk, K - k0, EVEN_K), other=0.0))
        acc = tl.dot(tl.load(w_rows + k0, mask=w_mask, other=0.0), x, acc, input_precision=PRECISION)
        if SILU_MUL:
            acc_u = tl.dot(tl.load(up_rows + k0, mask=w_mask, other=0.0), x, acc_u, input_precision=PRECISION)
    y = bias_silu_mul(acc, acc_u, n[:, None], n_mask[:, None], b_ptr, up_offset, HAS_BIAS, SILU_MUL,
                      out_ptr.dtype.element_ty)
    tl.store(out_ptr + m[None, :] * som + n[:, None], y.to(out_ptr.dtype.element_ty),
             mask=n_mask[:, None] & m_mask[None, :])
    if ADD_NORM:
        if last_to_arrive(count_ptr + tl.program_id(0), tl.num_programs(1)):
            tl.debug_barrier()
            _add_norm_stored_rows(out_ptr, res_ptr, nw_ptr, tl.program_id(0) * BLOCK_M, M, N, som, srm, eps,
                                  BLOCK_M, BLOCK_H, NORM_ROWS)
            tl.store(count_ptr + tl.program_id(0), 0)  # the next launch starts after this kernel ends


def mma_config(n: int, k: int, silu_mul: bool = False, itemsize: int = 2) -> MmaConfig:
    """The launch for an [n, k] weight of `itemsize`-byte values (n output rows; a
    [gate; up] pair (`silu_mul`) counts its gate rows), from the sweep at 8 rows over
    Qwen3-8B's bf16 projections (`benchmarks/gemv_chain.py --rows 8`, docs/PERFORMANCE.md):
    64-row tiles on a warpgroup over 256 columns were the fastest or within 1 % on q/k/v,
    o and gate/up, over 128 with SiLU (whose two tiles a stage would take 288 KB of shared
    memory at 256); 16-row tiles on two warps over 512 columns on down (K = 12,288) and
    the LM head; 4 stages on all. Outputs under 4,096 rows (not swept) take 16-row tiles,
    so they still spread over most SMs. fp32 (tests) takes half the columns, the same
    bytes a stage."""
    if 4096 <= n < 65536 and k < 8192:
        block_k = row_block_k(k, (128 if silu_mul else 256) * 2 // itemsize)
        return MmaConfig(64, block_k, num_warps=4, num_stages=4, prefetch=False)
    return MmaConfig(16, row_block_k(k, 1024 // itemsize), num_warps=2, num_stages=4, prefetch=False)


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x @ weight^T can run here at all: 2-D x with its last dim contiguous, a
    contiguous weight of x's dtype (16- or 32-bit), K a multiple of 16 (tl.dot's least)."""
    return (
        x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous() and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.shape[1] % 16 == 0
    )


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the engine's projection x @ weight^T goes here: ENGINE_ROWS rows of 16-bit
    x over a weight of the same dtype, K a multiple of 64."""
    return (
        fits(x, weight) and x.shape[0] in ENGINE_ROWS and x.dtype != torch.float32 and x.shape[1] % 64 == 0
    )


def takes_add_norm(n: int) -> bool:
    """Whether the residual add + RMSNorm after a projection of n output features can end
    its launch here (`linear_rows_mma_add_rms_norm`); that depends on the weight alone,
    so the batch-invariant mode may rely on it."""
    return n <= MAX_ADD_NORM_FEATURES


def linear_rows_mma(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, silu_mul: bool = False,
    config: MmaConfig | None = None, pdl: bool | None = None,
) -> torch.Tensor:
    """x [M, K] (M >= 1, last dim contiguous) @ weight [N, K]^T (+ bias) -> [M, N] in x's
    dtype. `silu_mul`: weight is [gate; up], 2N rows, and the result silu(gate) * up
    [M, N]. x's rows go in tiles of BLOCK_M over the grid's first axis, the fastest, so
    the tiles that read one weight tile run side by side; each row's sums are the same
    dots in the same order whatever rows share its launch (the tile comes from the
    weight's shape alone), which the batch-invariant mode relies on."""
    return _launch(x, weight, bias, silu_mul, config, pdl)


def linear_rows_mma_add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
    norm_weight: torch.Tensor, eps: float, counter: torch.Tensor, *, config: MmaConfig | None = None,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm(linear_rows_mma(x, weight, bias), residual, norm_weight, eps) in
    one launch for N <= MAX_ADD_NORM_FEATURES: returns (normed [M, N], residual), the
    residual [M, N] (last dim contiguous) updated in place. `counter`: int32, one per tile
    of BLOCK_M rows, zero on entry and left zero (its address may be captured in a CUDA
    graph). Each row is added and normalised alike whatever rows share the launch."""
    m, n = x.shape[0], weight.shape[0]
    assert takes_add_norm(n), f"{n} features > {MAX_ADD_NORM_FEATURES}"
    assert residual.shape == (m, n) and residual.stride(-1) == 1 and residual.dtype == x.dtype
    assert norm_weight.shape == (n,) and norm_weight.is_contiguous()
    assert counter.dtype == torch.int32 and counter.is_contiguous() and counter.device == x.device
    assert counter.numel() >= triton.cdiv(m, BLOCK_M), f"{counter.numel()} counters for {m} rows"
    out = _launch(x, weight, bias, False, config, pdl, add_norm=(residual, norm_weight, counter, eps))
    return out, residual


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool, config: MmaConfig | None,
    pdl: bool | None, add_norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    assert m >= 1 and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    assert weight.dtype == x.dtype, f"weight {weight.dtype}, x {x.dtype}"
    cfg = config or mma_config(n, k, silu_mul, x.element_size())
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, cfg.block_n))
    assert grid[1] <= MAX_GRID_Y, f"{grid[1]} column tiles: over the grid's second axis limit"
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    residual, norm_weight, counter, eps = add_norm if add_norm is not None else (out, out, out, 0.0)
    block_h = triton.next_power_of_2(n) if add_norm is not None else 1
    _gemv_rows_mma_kernel[grid](
        x, weight, bias if bias is not None else out, out, residual, norm_weight, counter, m, n, k, x.stride(0),
        weight.stride(0), out.stride(0), residual.stride(0), n, eps,
        HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_M=BLOCK_M,
        PRECISION=dot_precision(x.dtype), SILU_MUL=silu_mul, PREFETCH=cfg.prefetch, EVEN_K=k % cfg.block_k == 0,
        ADD_NORM=add_norm is not None, BLOCK_H=block_h, NORM_ROWS=max(1, _NORM_TILE_ELEMS // block_h),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_opts(x.device, pdl),
    )
    return out
