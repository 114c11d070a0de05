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
SiLU-and-mul (a second dot over the up rows). The residual add + RMSNorm after the o and
down projections stays a kernel of its own (one program a row): done by the last
program, as at one row, it walked the rows one after another in dependent chunks, about
7 us a row at 4,096 features: 4.4 ms more for a Qwen3-8B verify step of 4 drafts (a
graph of 8 rows).
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
from agent_infer.kernels.triton.utils import bias_silu_mul, dot_precision, launch_opts, pdl_begin

# x's rows in the dot's right operand: the narrowest tile tl.dot takes.
BLOCK_M = 16
# The row counts the engine sends here (`takes`); one row takes the batch-1 GEMV (outside
# the batch-invariant mode).
ENGINE_ROWS = range(2, BLOCK_M + 1)


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


# M is not specialised: each row count would otherwise compile its own variant.
@triton.jit(do_not_specialize=["M"])
def _gemv_rows_mma_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, sxm, swn, som, up_offset,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, PRECISION: tl.constexpr, SILU_MUL: tl.constexpr = False, PREFETCH: tl.constexpr = True,
    EVEN_K: tl.constexpr = True,
):
    """out[j, n] = sum_k x[j, k] w[n, k] (+ b[n]) for this program's BLOCK_M rows j < M
    of x and BLOCK_N rows of w; EVEN_K: K a multiple of BLOCK_K, else the last tile's
    columns past K are masked (loaded as zeros). SILU_MUL: rows n + up_offset of w are
    the up halves, and out is silu(gate) * up."""
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
    m, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    assert m >= 1 and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    assert weight.dtype == x.dtype, f"weight {weight.dtype}, x {x.dtype}"
    cfg = config or mma_config(n, k, silu_mul, x.element_size())
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, cfg.block_n))
    assert grid[1] <= MAX_GRID_Y, f"{grid[1]} column tiles: over the grid's second axis limit"
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemv_rows_mma_kernel[grid](
        x, weight, bias if bias is not None else out, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0), n,
        HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_M=BLOCK_M,
        PRECISION=dot_precision(x.dtype), SILU_MUL=silu_mul, PREFETCH=cfg.prefetch, EVEN_K=k % cfg.block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_opts(x.device, pdl),
    )
    return out
