"""The batch-1 GEMV's few-row sibling: y = x W^T (+ b) for x [M, K] with 2 <= M <=
MAX_ROWS (a speculative verify step at batch 1, a small decode batch), W [N, K].

Each program streams BLOCK_N weight rows in [BLOCK_N, BLOCK_K] tiles, as the M = 1 row
kernel (gemv.py) does, and multiplies every tile with each row of x. A thread holds whole
groups of 8 columns (one 16-byte load of bf16); the products of a group are summed in
its registers into one fp32 value per (weight row, group, row of x), and those are
reduced across the threads once, after the K loop. So nothing crosses threads inside the
loop, and each row of x costs one accumulator per group instead of one per column: the
first try, a [rows, BLOCK_N, BLOCK_K] product summed over its columns at every tile,
spilled and ran at a tenth of cuBLAS's rate; the second, one fp32 accumulator per column
and row of x, held eight times the registers and lost to this one at 5 and 8 rows
(docs/PERFORMANCE.md, Tried and rejected). The rows are written out one by one and
compiled for the exact M, so five rows hold five accumulators, not eight. The reference
is F.linear.

The engine sends it the row counts in ENGINE_ROWS (ops.linear): where a GPU measured it
faster than cuBLAS (`benchmarks/gemv_chain.py --rows M`). Like the batch-1 GEMV it ends a
[gate; up] projection in SiLU-and-mul (up to 4 rows: the up rows take the accumulators of
rows 4-7). The residual add + RMSNorm after the o and down projections stays a kernel of
its own (one program a row): done by the GEMV's last program, as at one row, it walked
the rows one after another in dependent chunks, about 7 us a row at 4,096 features, and
cost the Qwen3-8B step 1 ms at two rows (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agent_infer.kernels.triton.gemv import RowConfig, row_block_k
from agent_infer.kernels.triton.utils import bias_silu_mul, launch_opts, pdl_begin

# The most rows the kernel takes: a verify step of up to 7 drafts at batch 1; with
# SiLU-and-mul half as many (the up rows' sums take the other accumulators).
MAX_ROWS = 8
MAX_SILU_ROWS = MAX_ROWS // 2
# The row counts the engine sends here (`takes`): 2, where the kernel streams the weights
# faster than cuBLAS. Each further row of x adds its loads, conversions and FMAs to every
# tile: level with cuBLAS at 3 rows, slower at 5 and 8 (docs/PERFORMANCE.md), so those
# stay on cuBLAS.
ENGINE_ROWS = (2,)


@triton.jit
def _row_times(acc, w, x_ptr, sxm, k, j: tl.constexpr, ROWS: tl.constexpr):
    """acc + the sums over each group of VEC columns of w * x[j, k] (w: the fp32 weight
    tile [BLOCK_N, groups, VEC], k: its columns [groups, VEC]) when row j exists. A
    thread holds whole groups, so the sums stay in its registers."""
    if ROWS > j:
        acc += tl.sum(w * tl.load(x_ptr + j * sxm + k).to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _store_row(acc, up_acc, out_ptr, som, b_ptr, n, n_mask, up_offset, j: tl.constexpr, ROWS: tl.constexpr,
               HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr):
    """out[j, n] = the sum of row j's accumulator over its groups (+ b[n]); with SILU_MUL
    silu(that) * the up accumulator's sum (+ b[up_offset + n]), as the batch-1 GEMV ends."""
    if ROWS > j:
        y = tl.sum(acc, axis=1)
        u = y
        if SILU_MUL:
            u = tl.sum(up_acc, axis=1)
        y = bias_silu_mul(y, u, n, n_mask, b_ptr, up_offset, HAS_BIAS, SILU_MUL, out_ptr.dtype.element_ty)
        tl.store(out_ptr + j * som + n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemv_rows_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, N, K, sxm, swn, som, up_offset,
    ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SILU_MUL: tl.constexpr = False, VEC: tl.constexpr = 8,
):
    """out[j, n] = sum_k x[j, k] w[n, k] (+ b[n]) for j < ROWS and this program's BLOCK_N
    rows of w. K is a multiple of BLOCK_K, BLOCK_K of VEC. The next weight tile is loaded
    while this one is used; the first before the PDL wait (weights never depend on the
    predecessor). SILU_MUL (ROWS <= 4): rows n + up_offset of w are the up halves, summed
    in accumulators 4-7, and out is silu(gate) * up."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    groups: tl.constexpr = BLOCK_K // VEC
    kk = tl.arange(0, groups)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [groups, VEC]
    w_rows = w_ptr + n.to(tl.int64)[:, None, None] * swn + kk[None, :, :]
    w_mask = n_mask[:, None, None]
    a0 = tl.zeros([BLOCK_N, groups], dtype=tl.float32)
    a1 = tl.zeros([BLOCK_N, groups], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_N, groups], dtype=tl.float32)
    a3 = tl.zeros([BLOCK_N, groups], dtype=tl.float32)
    a4 = tl.zeros([BLOCK_N, groups], dtype=tl.float32)
    a5 = tl.zeros([BLOCK_N, groups], dtype=tl.float32)
    a6 = tl.zeros([BLOCK_N, groups], dtype=tl.float32)
    a7 = tl.zeros([BLOCK_N, groups], dtype=tl.float32)
    up_rows = w_rows + up_offset * swn
    w_next = tl.load(w_rows, mask=w_mask, other=0.0)
    if SILU_MUL:
        u_next = tl.load(up_rows, mask=w_mask, other=0.0)
    pdl_begin(PDL)
    for k0 in range(0, K, BLOCK_K):
        w = w_next.to(tl.float32)
        if k0 + BLOCK_K < K:
            w_next = tl.load(w_rows + k0 + BLOCK_K, mask=w_mask, other=0.0)
        k = k0 + kk
        a0 = _row_times(a0, w, x_ptr, sxm, k, 0, ROWS)
        a1 = _row_times(a1, w, x_ptr, sxm, k, 1, ROWS)
        a2 = _row_times(a2, w, x_ptr, sxm, k, 2, ROWS)
        a3 = _row_times(a3, w, x_ptr, sxm, k, 3, ROWS)
        if SILU_MUL:  # the up rows' sums, x's rows 0-3 again
            wu = u_next.to(tl.float32)
            if k0 + BLOCK_K < K:
                u_next = tl.load(up_rows + k0 + BLOCK_K, mask=w_mask, other=0.0)
            a4 = _row_times(a4, wu, x_ptr, sxm, k, 0, ROWS)
            a5 = _row_times(a5, wu, x_ptr, sxm, k, 1, ROWS)
            a6 = _row_times(a6, wu, x_ptr, sxm, k, 2, ROWS)
            a7 = _row_times(a7, wu, x_ptr, sxm, k, 3, ROWS)
        else:
            a4 = _row_times(a4, w, x_ptr, sxm, k, 4, ROWS)
            a5 = _row_times(a5, w, x_ptr, sxm, k, 5, ROWS)
            a6 = _row_times(a6, w, x_ptr, sxm, k, 6, ROWS)
            a7 = _row_times(a7, w, x_ptr, sxm, k, 7, ROWS)
    if SILU_MUL:
        _store_row(a0, a4, out_ptr, som, b_ptr, n, n_mask, up_offset, 0, ROWS, HAS_BIAS, True)
        _store_row(a1, a5, out_ptr, som, b_ptr, n, n_mask, up_offset, 1, ROWS, HAS_BIAS, True)
        _store_row(a2, a6, out_ptr, som, b_ptr, n, n_mask, up_offset, 2, ROWS, HAS_BIAS, True)
        _store_row(a3, a7, out_ptr, som, b_ptr, n, n_mask, up_offset, 3, ROWS, HAS_BIAS, True)
    else:
        _store_row(a0, a0, out_ptr, som, b_ptr, n, n_mask, up_offset, 0, ROWS, HAS_BIAS, False)
        _store_row(a1, a1, out_ptr, som, b_ptr, n, n_mask, up_offset, 1, ROWS, HAS_BIAS, False)
        _store_row(a2, a2, out_ptr, som, b_ptr, n, n_mask, up_offset, 2, ROWS, HAS_BIAS, False)
        _store_row(a3, a3, out_ptr, som, b_ptr, n, n_mask, up_offset, 3, ROWS, HAS_BIAS, False)
        _store_row(a4, a4, out_ptr, som, b_ptr, n, n_mask, up_offset, 4, ROWS, HAS_BIAS, False)
        _store_row(a5, a5, out_ptr, som, b_ptr, n, n_mask, up_offset, 5, ROWS, HAS_BIAS, False)
        _store_row(a6, a6, out_ptr, som, b_ptr, n, n_mask, up_offset, 6, ROWS, HAS_BIAS, False)
        _store_row(a7, a7, out_ptr, som, b_ptr, n, n_mask, up_offset, 7, ROWS, HAS_BIAS, False)


def rows_config(k: int) -> RowConfig:
    """The launch over K = `k`: one weight row a program, up to 2,048 columns a tile (the
    batch-1 column tile) at 512 columns a warp (two groups of 8 a thread). Where K allows
    only a short tile, a program takes enough rows that each thread still holds a group.
    The fastest or within 5 % of it on every Qwen3-8B projection at 2 rows (H100 sweep,
    `benchmarks/gemv_chain.py --rows 2`; docs/PERFORMANCE.md); the LM head, not swept,
    is timed only inside the engine's two-row steps."""
    block_k = row_block_k(k)
    warps = max(1, min(4, block_k // 512))
    return RowConfig(max(1, 8 * 32 * warps // block_k), block_k, num_warps=warps, num_stages=1)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the engine's projection x @ weight^T goes here (ENGINE_ROWS rows)."""
    return takes_rows(x, weight, ENGINE_ROWS)


def takes_rows(x: torch.Tensor, weight: torch.Tensor, rows) -> bool:
    """Whether x @ weight^T suits a few-row GEMV taking `rows` (a collection of row
    counts): 16-bit x over a weight of the same dtype, K a multiple of 64 (whole groups
    in every tile)."""
    return (
        x.dim() == 2 and x.shape[0] in rows and x.stride(1) == 1 and weight.is_contiguous()
        and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16) and x.shape[1] % 64 == 0
    )


def linear_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, silu_mul: bool = False,
    config: RowConfig | None = None, pdl: bool | None = None,
) -> torch.Tensor:
    """x [M, K] (1 <= M <= MAX_ROWS, last dim contiguous) @ weight [N, K]^T (+ bias) ->
    [M, N] in x's dtype. `silu_mul` (M <= MAX_SILU_ROWS): weight is [gate; up], 2N rows,
    and the result silu(gate) * up [M, N]."""
    m, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    most = MAX_SILU_ROWS if silu_mul else MAX_ROWS
    assert 1 <= m <= most, f"the few-row GEMV takes 1..{most} rows (silu_mul {silu_mul}), got {m}"
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    assert weight.dtype == x.dtype, f"weight {weight.dtype}, x {x.dtype}: e4m3 weights take the row kernel"
    cfg = config or rows_config(k)
    assert k % cfg.block_k == 0, f"K={k} is not a multiple of block_k={cfg.block_k}"
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemv_rows_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else out, out, n, k, x.stride(0), weight.stride(0), out.stride(0), n,
        ROWS=m, HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SILU_MUL=silu_mul,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_opts(x.device, pdl),
    )
    return out
