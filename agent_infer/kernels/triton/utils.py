"""Shape and launch helpers shared by the Triton kernels."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# What an H200/H100 has; used when the tensors are not on a GPU (Triton's interpreter).
DEFAULT_NUM_SMS = 132


@functools.cache
def _num_sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`: a static property, so launch grids derived
    from it stay fixed from call to call (CUDA-graph safe)."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return _num_sms_of(device.index if device.index is not None else torch.cuda.current_device())


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise go through TF32 on the tensor cores (10-bit mantissa).
    return "ieee" if dtype == torch.float32 else "tf32"


def as_rows(x: torch.Tensor) -> torch.Tensor | None:
    """A [A, B, N] view of x [..., N] whose last dim is contiguous, so a kernel can address
    row r at (r // B) * stride(0) + (r % B) * stride(1) without a copy (this covers
    contiguous tensors and per-head views into a merged QKV output). None when no such
    view exists; the caller then works on a contiguous copy."""
    if x.dim() == 0:
        return None
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        return None
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(0)
    if x.dim() == 3:
        return x
    try:
        return x.view(-1, *x.shape[-2:])
    except RuntimeError:
        return None


# ---- programmatic dependent launch -----------------------------------------------------

# Set to 0 to launch every kernel plainly (for A/B measurements and debugging).
PDL_ENV = "AGENT_INFER_PDL"


@functools.cache
def _pdl_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Programmatic dependent launch (Hopper and later): a kernel may be scheduled while
    its predecessor in the stream is still finishing, and waits (`griddepcontrol.wait`)
    only where it first needs that predecessor's results. At batch 1 a decode step is
    ~450 kernels of a few µs each, so the launch gap between them is a real share of
    the step; PDL hides it. CUDA graphs keep these edges."""
    if device.type != "cuda" or os.environ.get(PDL_ENV, "1") == "0":
        return False
    return _pdl_capable(device.index if device.index is not None else torch.cuda.current_device())


def pdl_opts(pdl: bool) -> dict:
    """Keyword arguments for a kernel launch whose kernel takes a `PDL` constexpr: launched
    as a programmatic dependent of the previous kernel (`pdl`), or plainly."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


def launch_opts(device: torch.device, pdl: bool | None = None) -> dict:
    """`pdl_opts` for a kernel that calls `pdl_begin(PDL)` before its first read of a
    predecessor's output: a programmatic dependent launch wherever the GPU has it, unless
    `pdl` says otherwise."""
    return pdl_opts(pdl_enabled(device) if pdl is None else pdl)


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """Wait for the previous kernel's writes to be visible, then let the next kernel be
    scheduled early (it waits the same way). No-op without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


# The largest finite float8 e4m3 value (torch.float8_e4m3fn, Triton's float8e4nv).
E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def bias_silu_mul(y, u, n, n_mask, b_ptr, up_offset, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                  OUT_DTYPE: tl.constexpr):
    """The end of a row GEMV: y (+ b[n]); with SILU_MUL, u is the up half's sum (+ b[up_offset
    + n]) and the result silu(y) * u, gate and up rounded to OUT_DTYPE first as the unfused
    reference rounds them. fp32 in and out."""
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
    if SILU_MUL:
        if HAS_BIAS:
            u += tl.load(b_ptr + up_offset + n, mask=n_mask, other=0.0).to(tl.float32)
        g = y.to(OUT_DTYPE).to(tl.float32)
        u = u.to(OUT_DTYPE).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g))).to(OUT_DTYPE).to(tl.float32) * u
    return y


@triton.jit
def to_cache_dtype(x, CACHE_TYPE: tl.constexpr):
    """x as a KV-cache entry of CACHE_TYPE. An fp8 cache (e4m3, the only fp8 kind the
    engine allocates) saturates at +-448, explicitly, like reference.to_cache_dtype."""
    if CACHE_TYPE.is_fp8():
        x = tl.clamp(x.to(tl.float32), -E4M3_MAX, E4M3_MAX)
    return x.to(CACHE_TYPE)


@triton.jit
def to_f16_scaled(x, scale):
    """A 16-bit query times the score scale (softmax scale, log2(e) and the K cache's
    scale), as fp16 for dots over an fp8 cache (`fp16_dots`), clamped to fp16's range.
    The scale goes in first: scores then come out at their own magnitude, whatever share
    of it the checkpoint gives q and K (a query of 2^-12 its usual size would otherwise
    fall among fp16's subnormals and lose its digits)."""
    return tl.clamp(x.to(tl.float32) * scale, -65504.0, 65504.0).to(tl.float16)


@triton.jit
def e4m3_to_f16_ptx(x):
    """float8 e4m3 -> fp16 (exact), two values per instruction, written as inline PTX that
    is not marked pure so that the compiler keeps it where it stands. As a cast, Triton
    moves the conversion of a dot operand past its shared-memory staging; for the B
    operand of P @ V (keys on the reduced axis, so transposed from V's rows) 8-bit values
    are then read back one byte per load. Converted first, V stages as fp16. CUDA only:
    the interpreter runs no PTX (use `.to(tl.float16)` there)."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h", [x.to(tl.uint8, bitcast=True)],
                                     dtype=tl.float16, is_pure=False, pack=2)


@triton.jit
def scaled_for_cache(x, inv, SCALED: tl.constexpr):
    """x / scale on its way into an fp8 cache (fp32 times the inverse, as
    reference.scaled_for_cache); x itself when the cache is not scaled."""
    if SCALED:  # one return: Triton 3.6 refuses returns of two types even under a constexpr
        x = x.to(tl.float32) * inv
    return x


def cache_scaled(k_cache: torch.Tensor, k_scale: float, v_scale: float) -> bool:
    """Whether a store divides by the KV scales: an fp8 cache only (another dtype holds the
    values as they are, its scales 1)."""
    if k_cache.dtype != torch.float8_e4m3fn:
        assert k_scale == v_scale == 1.0, f"KV scales {k_scale}, {v_scale} for a {k_cache.dtype} cache"
        return False
    assert k_scale > 0 and v_scale > 0, f"KV scales must be positive, got {k_scale}, {v_scale}"
    return True


def fp16_dots(cache_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether attention over a cache of `cache_dtype` for 16-bit `dtype` activations runs
    its dots in fp16: an fp8 cache's entries convert to fp16 in one instruction per pair,
    to bf16 only through fp32."""
    return cache_dtype == torch.float8_e4m3fn and dtype in (torch.bfloat16, torch.float16)


def check_kv_cache_dtype(k_cache: torch.Tensor, v_cache: torch.Tensor, compute: torch.dtype) -> None:
    """Both caches hold the model's dtype, or both float8 e4m3 (read back as the model's)."""
    assert k_cache.dtype == v_cache.dtype, f"K cache {k_cache.dtype}, V cache {v_cache.dtype}"
    assert k_cache.dtype in (compute, torch.float8_e4m3fn), f"a {k_cache.dtype} KV cache for {compute} activations"
