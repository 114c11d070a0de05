"""SiLU-and-mul: x = [gate | up] along the last dim -> silu(gate) * up."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agent_infer.kernels.triton.utils import as_rows, launch_opts, pdl_begin

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr,
    rows_b, d,
    sxa, sxb, soa, sob,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    row_a = (row // rows_b).to(tl.int64)
    row_b = (row % rows_b).to(tl.int64)
    x_row = x_ptr + row_a * sxa + row_b * sxb
    gate = tl.load(x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    # silu is rounded to the activation dtype before the product, as in the reference.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row_a * soa + row_b * sob + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] -> silu(x[..., :d]) * x[..., d:] as a new contiguous [..., d] tensor."""
    assert x.shape[-1] % 2 == 0, f"last dim must be even, got {x.shape[-1]}"
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    xv = as_rows(x)
    if xv is None:
        xv = as_rows(x.contiguous())
    ov = as_rows(out)
    n_rows = xv.shape[0] * xv.shape[1]
    block = min(_BLOCK, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(n_rows, triton.cdiv(d, block))](
        xv, ov,
        xv.shape[1], d,
        xv.stride(0), xv.stride(1), ov.stride(0), ov.stride(1),
        BLOCK=block, num_warps=4, **launch_opts(x.device),
    )
    return out
