"""RMSNorm and fused residual-add + RMSNorm.

Rows are addressed through a [A, B, N] view (see `utils.as_rows`), so Qwen3's per-head
q_norm/k_norm run directly on the strided q/k views of the merged QKV output. Arithmetic
follows the reference: fp32 statistics, normalised value cast to x's dtype, then times
the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agent_infer.kernels.triton.utils import as_rows, launch_opts, pdl_begin

# Elements one program handles; short rows (per-head norms) are packed several per program.
_TILE_ELEMS = 4096


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr,
    n_rows, rows_b, n_cols,
    sxa, sxb, soa, sob,
    eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_a = (rows // rows_b).to(tl.int64)
    row_b = (rows % rows_b).to(tl.int64)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(x_ptr + (row_a * sxa + row_b * sxb)[:, None] + cols[None, :], mask=mask, other=0.0)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=1) / n_cols + eps)
    h = (h * rstd[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    y = h * w[None, :]
    tl.store(out_ptr + (row_a * soa + row_b * sob)[:, None] + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr,
    n_rows, rows_b, n_cols,
    sxa, sxb, sra, srb,
    eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_a = (rows // rows_b).to(tl.int64)
    row_b = (rows % rows_b).to(tl.int64)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x_offs = (row_a * sxa + row_b * sxb)[:, None] + cols[None, :]
    r_offs = (row_a * sra + row_b * srb)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    r = tl.load(r_ptr + r_offs, mask=mask, other=0.0)
    # The sum is rounded to the activation dtype before the statistics, as the reference does.
    s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(r_ptr + r_offs, s.to(r_ptr.dtype.element_ty), mask=mask)
    h = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=1) / n_cols + eps)
    h = (h * rstd[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(x_ptr + x_offs, (h * w[None, :]).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def last_to_arrive(count_ptr, programs):
    """True in the last of `programs` programs to get here (an atomic counter, int32,
    zero on entry; that program must store 0 back). Every program calls it after storing
    what the last one will read: the barrier makes all its threads' stores part of the
    one thread's release (Triton runs a scalar atomic in one thread). The winner must
    pass a barrier before reading, so that its other threads read after the acquire."""
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    return done == programs - 1


@triton.jit
def add_rms_norm_row(y, cols, mask, res_ptr, w_ptr, out_ptr, n_cols, eps):
    """One row of `_fused_add_rms_norm_kernel` for a y held in registers (its values in
    the activation dtype): residual <- y + residual, out <- rms_norm(residual) * weight,
    rounded as that kernel rounds."""
    r = tl.load(res_ptr + cols, mask=mask, other=0.0)
    s = (y.to(tl.float32) + r.to(tl.float32)).to(y.dtype)
    tl.store(res_ptr + cols, s.to(res_ptr.dtype.element_ty), mask=mask)
    h = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    h = (h * rstd).to(y.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, (h * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch_shape(n_cols: int) -> tuple[int, int, int]:
    """Row block from the row width alone: a block sized to the row count too would be a
    constexpr that changes with the batch, and each new value a compilation mid-serving
    (a few masked rows in the last program cost nothing)."""
    block_n = triton.next_power_of_2(n_cols)
    block_m = max(1, _TILE_ELEMS // block_n)
    num_warps = 4 if block_m * block_n <= 2048 else 8
    return block_m, block_n, num_warps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm over the last dim of x [..., N]; returns a new contiguous tensor (dtype as
    the reference's: x's dtype promoted with the weight's)."""
    n_cols = x.shape[-1]
    assert weight.shape == (n_cols,) and weight.is_contiguous(), "weight must be a contiguous [N] vector"
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if out.numel() == 0:
        return out
    xv = as_rows(x)
    if xv is None:  # e.g. a transposed view: one copy is cheaper than a gather kernel
        xv = as_rows(x.contiguous())
    ov = as_rows(out)
    n_rows = xv.shape[0] * xv.shape[1]
    block_m, block_n, num_warps = _launch_shape(n_cols)
    _rms_norm_kernel[(triton.cdiv(n_rows, block_m),)](
        xv, weight, ov,
        n_rows, xv.shape[1], n_cols,
        xv.stride(0), xv.stride(1), ov.stride(0), ov.stride(1),
        eps,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, **launch_opts(x.device),
    )
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- x + residual, x <- rms_norm(residual). Returns (x, residual),
    the same tensor objects."""
    assert x.shape == residual.shape, f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ"
    n_cols = x.shape[-1]
    assert weight.shape == (n_cols,) and weight.is_contiguous(), "weight must be a contiguous [N] vector"
    if x.numel() == 0:
        return x, residual
    xv, rv = as_rows(x), as_rows(residual)
    if xv is None or rv is None or xv.shape != rv.shape:
        # No common row view: work on contiguous copies and write the results back.
        xc, rc = x.contiguous(), residual.contiguous()
        fused_add_rms_norm(xc, rc, weight, eps)
        if xc.data_ptr() != x.data_ptr():
            x.copy_(xc)
        if rc.data_ptr() != residual.data_ptr():
            residual.copy_(rc)
        return x, residual
    n_rows = xv.shape[0] * xv.shape[1]
    block_m, block_n, num_warps = _launch_shape(n_cols)
    _fused_add_rms_norm_kernel[(triton.cdiv(n_rows, block_m),)](
        xv, rv, weight,
        n_rows, xv.shape[1], n_cols,
        xv.stride(0), xv.stride(1), rv.stride(0), rv.stride(1),
        eps,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, **launch_opts(x.device),
    )
    return x, residual
