"""The batch-1 GEMV's few-row sibling: y = x W^T (+ b) for x [M, K] with 2 <= M <=
MAX_ROWS (a speculative verify step at batch 1, a small decode batch), W [N, K].

Each program streams BLOCK_N weight rows in [BLOCK_N, BLOCK_K] tiles, as the M = 1 row
kernel (gemv.py) does, and multiplies every tile with each row of x into that row's own
fp32 accumulator of the tile's shape, reduced once after the K loop. The weights are
read once, x's rows come from L1, and nothing crosses threads inside the loop: the
first try, a [rows, BLOCK_N, BLOCK_K] product summed over its columns at every tile,
spilled and ran at a tenth of cuBLAS's rate (docs/PERFORMANCE.md, Tried and rejected).
The accumulators are written out one per row and compiled for the exact M, so five rows
hold five, not eight.

A column tile of 8 values a thread across the program's threads (BLOCK_K = 256 x warps)
gives x's rows the weight tile's own layout, so no row is re-laid out through shared
memory either. The reference is F.linear.

Not yet taken by the engine, whose steps of 2-8 rows run cuBLAS: this is the candidate
for them, timed against cuBLAS by `benchmarks/gemv_chain.py --rows M`; ops.linear is to
dispatch to it where that measurement finds it faster.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agent_infer.kernels.triton.gemv import RowConfig, row_block_k
from agent_infer.kernels.triton.utils import launch_opts, pdl_begin

# The most rows the kernel takes: a verify step of up to 7 drafts at batch 1.
MAX_ROWS = 8


@triton.jit
def _row_times(acc, w, x_ptr, sxm, k, j: tl.constexpr, ROWS: tl.constexpr):
    """acc + w * x[j, k] (w: the fp32 weight tile, k: its columns) when row j exists."""
    if ROWS > j:
        acc += w * tl.load(x_ptr + j * sxm + k).to(tl.float32)[None, :]
    return acc


@triton.jit
def _store_row(acc, out_ptr, som, b_ptr, n, n_mask, j: tl.constexpr, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr):
    """out[j, n] = the sum of row j's accumulator over its columns (+ b[n])."""
    if ROWS > j:
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + j * som + n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemv_rows_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, N, K, sxm, swn, som,
    ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[j, n] = sum_k x[j, k] w[n, k] (+ b[n]) for j < ROWS and this program's BLOCK_N
    rows of w. K is a multiple of BLOCK_K. The next weight tile is loaded while this one
    is used; the first before the PDL wait (weights never depend on the predecessor)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * swn + kk[None, :]
    a0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    a1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    a3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    a4 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    a5 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    a6 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    a7 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    w_next = tl.load(w_rows, mask=n_mask[:, None], other=0.0)
    pdl_begin(PDL)
    for k0 in range(0, K, BLOCK_K):
        w = w_next.to(tl.float32)
        if k0 + BLOCK_K < K:
            w_next = tl.load(w_rows + k0 + BLOCK_K, mask=n_mask[:, None], other=0.0)
        k = k0 + kk
        a0 = _row_times(a0, w, x_ptr, sxm, k, 0, ROWS)
        a1 = _row_times(a1, w, x_ptr, sxm, k, 1, ROWS)
        a2 = _row_times(a2, w, x_ptr, sxm, k, 2, ROWS)
        a3 = _row_times(a3, w, x_ptr, sxm, k, 3, ROWS)
        a4 = _row_times(a4, w, x_ptr, sxm, k, 4, ROWS)
        a5 = _row_times(a5, w, x_ptr, sxm, k, 5, ROWS)
        a6 = _row_times(a6, w, x_ptr, sxm, k, 6, ROWS)
        a7 = _row_times(a7, w, x_ptr, sxm, k, 7, ROWS)
    _store_row(a0, out_ptr, som, b_ptr, n, n_mask, 0, ROWS, HAS_BIAS)
    _store_row(a1, out_ptr, som, b_ptr, n, n_mask, 1, ROWS, HAS_BIAS)
    _store_row(a2, out_ptr, som, b_ptr, n, n_mask, 2, ROWS, HAS_BIAS)
    _store_row(a3, out_ptr, som, b_ptr, n, n_mask, 3, ROWS, HAS_BIAS)
    _store_row(a4, out_ptr, som, b_ptr, n, n_mask, 4, ROWS, HAS_BIAS)
    _store_row(a5, out_ptr, som, b_ptr, n, n_mask, 5, ROWS, HAS_BIAS)
    _store_row(a6, out_ptr, som, b_ptr, n, n_mask, 6, ROWS, HAS_BIAS)
    _store_row(a7, out_ptr, som, b_ptr, n, n_mask, 7, ROWS, HAS_BIAS)


def rows_config(m: int, k: int) -> RowConfig:
    """The launch for M = `m` rows over K = `k`: up to 1,024 columns a tile (the batch-1
    column tile, capped), 8 // m weight rows a program, so that the m accumulators hold
    about 8 x 1,024 values (64 registers a thread at 4 warps) whatever m is, and 256
    columns a warp (8 values a thread)."""
    block_k = min(1024, row_block_k(k))
    return RowConfig(max(1, 8 // m), block_k, num_warps=max(1, block_k // 256), num_stages=1)


def linear_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    config: RowConfig | None = None, pdl: bool | None = None,
) -> torch.Tensor:
    """x [M, K] (1 <= M <= MAX_ROWS, last dim contiguous) @ weight [N, K]^T (+ bias) ->
    [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    assert 1 <= m <= MAX_ROWS, f"the few-row GEMV takes 1..{MAX_ROWS} rows, got {m}"
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    assert weight.dtype == x.dtype, f"weight {weight.dtype}, x {x.dtype}: e4m3 weights take the row kernel"
    cfg = config or rows_config(m, k)
    assert k % cfg.block_k == 0, f"K={k} is not a multiple of block_k={cfg.block_k}"
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    opts = launch_opts(x.device, pdl)
    _gemv_rows_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else out, out, n, k, x.stride(0), weight.stride(0), out.stride(0),
        ROWS=m, HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **opts,
    )
    return out
