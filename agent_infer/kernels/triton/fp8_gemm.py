"""fp8 (e4m3) W8A8 GEMM for prefill and batched decode: y = dequant(x) dequant(W)^T (+ b).

Weights come in the two layouts of `agent_infer/quantization/fp8.py`:
- **block**: w_fp8 [N, K] with one float32 scale per (bn, bk) block, w_scale
  [ceil(N / bn), ceil(K / bk)]; activations are quantized per token and per group of bk
  features, x_scale [M, ceil(K / bk)].
- **channel** (block=None): one scale per output row, w_scale [N, 1] or [N]; activations
  per token, x_scale [M, 1].

`quantize_token_groups` is the dynamic activation quantization, bit for bit the
reference's: amax / 448 scales (1 for an all-zero group), x / scale clamped to +-448 and
rounded to nearest even. The rounding is done in integer arithmetic on the fp32 bits
and the exact e4m3 value then cast, so the result does not depend on how a backend
rounds fp32 to fp8 (Triton's interpreter rounds some values wrongly); casting a value
e4m3 holds exactly is exact everywhere.

`w8a8_matmul` multiplies fp8 tiles on the tensor cores with fp32 accumulation. In the
block layout each program's tile lies inside one weight-scale row (BLOCK_N divides bn)
and one scale column per K step (BLOCK_K divides bk), so every K step's partial product
is scaled by a_scale[m] * b_scale and added to an fp32 accumulator in registers. That
add is also what keeps Hopper's fp8 tensor-core accumulation (fewer than fp32's bits)
from running over the whole K: the channel layout, whose scales are applied once at the
end, asks tl.dot for the same promotion every BLOCK_K (max_num_imprecise_acc).
Programs are ordered in groups of `group_m` row tiles so that the weight tiles a group
shares stay in L2. For few rows (decode batches) K may be split over programs; their
fp32 partial sums are added by gemv's `split_reduce` (deterministic, no atomics).

The references are `quantize_token_groups` and `w8a8_block_matmul` in
agent_infer/quantization/fp8.py; benchmarks/fp8_gemm.py times these kernels against
bf16 F.linear and torch._scaled_mm.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from agent_infer.kernels.triton.gemv import split_reduce
from agent_infer.kernels.triton.utils import DEFAULT_NUM_SMS, E4M3_MAX

FP8 = torch.float8_e4m3fn


# ---- activation quantization --------------------------------------------------------


@triton.jit
def round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, as fp32.

    The significand with its implicit bit is an integer `sig` (v = sig * 2^(e - 23));
    e4m3 keeps 4 significant bits for normals (e >= -6), and a fixed 2^-9 step below, so
    `drop` low bits go: 20, one more per binade under 2^-6, at most 25 (everything below
    2^-10 rounds to 0). The sign is carried over bit for bit, so -0.0 and small negative
    values keep the sign bit, as torch's conversion does."""
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    exp = mag >> 23  # biased; 121 is 2^-6, e4m3's smallest normal
    drop = tl.minimum(20 + tl.maximum(121 - exp, 0), 25)
    sig = (mag & 0x7FFFFF) | 0x800000
    kept = sig >> drop
    rest = sig & ((1 << drop) - 1)
    half = 1 << (drop - 1)
    up = (rest > half) | ((rest == half) & ((kept & 1) == 1))
    kept += up.to(tl.int32)
    # kept * 2^(e - 23 + drop): both factors exact, and so is their product.
    step = ((exp - 23 + drop) << 23).to(tl.float32, bitcast=True)
    r = (kept.to(tl.float32) * step).to(tl.int32, bitcast=True)
    return (r | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_values(x, scale):
    """x / scale (correctly rounded, as torch divides) clamped and rounded to e4m3."""
    v = tl.math.div_rn(x, scale)
    v = tl.minimum(tl.maximum(v, -E4M3_MAX), E4M3_MAX)
    return round_to_e4m3(v).to(tl.float8e4nv)


@triton.jit
def _quant_groups_kernel(
    x_ptr, q_ptr, s_ptr, K, GROUP, n_groups, sxm, sqm, ssm,
    GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, CHUNKS: tl.constexpr,
):
    """Row `program_id(0)`, groups [program_id(1) * GROUPS, + GROUPS) as a [GROUPS,
    BLOCK_G] tile. A group wider than one tile (CHUNKS > 1, GROUPS == 1: per token over
    a long row) is read twice, once for its amax and once to quantize."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    j = tl.arange(0, BLOCK_G)
    g_mask = g < n_groups
    x_row = x_ptr + row * sxm
    q_row = q_ptr + row * sqm
    if CHUNKS == 1:
        col = g[:, None] * GROUP + j[None, :]
        mask = g_mask[:, None] & (j[None, :] < GROUP) & (col < K)
        x = tl.load(x_row + col, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, E4M3_MAX), 1.0)
        tl.store(q_row + col, _quantize_values(x, scale[:, None]), mask=mask)
    else:
        start = g[:, None] * GROUP  # one group (GROUPS == 1)
        amax_cols = tl.zeros([GROUPS, BLOCK_G], dtype=tl.float32)
        for c in range(CHUNKS):
            jj = c * BLOCK_G + j[None, :]
            mask = g_mask[:, None] & (jj < GROUP) & (start + jj < K)
            x = tl.load(x_row + start + jj, mask=mask, other=0.0).to(tl.float32)
            amax_cols = tl.maximum(amax_cols, tl.abs(x))
        amax = tl.max(amax_cols, axis=1)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, E4M3_MAX), 1.0)
        for c in range(CHUNKS):
            jj = c * BLOCK_G + j[None, :]
            mask = g_mask[:, None] & (jj < GROUP) & (start + jj < K)
            x = tl.load(x_row + start + jj, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_row + start + jj, _quantize_values(x, scale[:, None]), mask=mask)
    tl.store(s_ptr + row * ssm + g, scale, mask=g_mask)


# A group up to this many features is held whole by one program (narrower groups share a
# program, up to half as many elements); a wider one is read in chunks of this size.
QUANT_TILE = 4096


def quantize_token_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16, fp16 or fp32; rows may be strided, features contiguous) ->
    (x_fp8 [M, K] e4m3, x_scale [M, ceil(K / group)] float32): one scale per token and
    group of `group` features (per token: group >= K). Bit-identical to
    agent_infer.quantization.fp8.quantize_token_groups."""
    assert x.dim() == 2 and (x.stride(-1) == 1 or x.shape[-1] <= 1), "x must be [M, K] with contiguous features"
    m, k = x.shape
    group = max(1, min(group, k))
    n_groups = triton.cdiv(k, group) if k else 0
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, n_groups), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scale
    width = triton.next_power_of_2(group)
    block_g = min(width, QUANT_TILE)
    chunks = triton.cdiv(group, block_g)
    groups = 1 if chunks > 1 else min(max(1, QUANT_TILE // 2 // width), triton.next_power_of_2(n_groups))
    warps = 8 if groups * block_g >= 4096 else 4
    _quant_groups_kernel[(m, triton.cdiv(n_groups, groups))](
        x, q, scale, k, group, n_groups, x.stride(0), q.stride(0), scale.stride(0),
        GROUPS=groups, BLOCK_G=block_g, CHUNKS=chunks, num_warps=warps,
    )
    return q, scale


# ---- W8A8 GEMM --------------------------------------------------------------------------


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Tile of one program (block_m x block_n outputs, block_k per K step), the number of
    row tiles ordered together for L2 reuse, launch options, and K splits (> 1: fp32
    partial sums added by a second kernel; for few rows, when the output tiles alone give
    too few programs)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1


@triton.jit
def _ab_tiles(a_rows, b_cols, k0, kk, k_hi, EVEN_K: tl.constexpr):
    """The activation tile [BLOCK_M, BLOCK_K] and weight tile [BLOCK_K, BLOCK_N] at K step
    k0, zeros past k_hi (EVEN_K: there is no tail)."""
    if EVEN_K:
        a = tl.load(a_rows + k0)
        b = tl.load(b_cols + k0)
    else:
        a = tl.load(a_rows + k0, mask=(k0 + kk)[None, :] < k_hi, other=0.0)
        b = tl.load(b_cols + k0, mask=(k0 + kk)[:, None] < k_hi, other=0.0)
    return a, b


@triton.jit
def _w8a8_kernel(
    a_ptr, b_ptr, as_ptr, bs_ptr, bias_ptr, out_ptr, part_ptr,
    M, N, K, sam, sbn, sasm, sask, sbsn, sbsk, som, k_per_split,
    BLOCKWISE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile over the K range of split program_id(1).

    Row and column indices past M / N wrap around (% M, % N) instead of being masked:
    every load is in bounds, the wrapped rows compute values nobody stores. K's tail is
    masked with zeros (EVEN_K: there is none)."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M row tiles walk the column tiles together: consecutive programs share B.
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = offs_m % M
    rows_n = offs_n % N
    kk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rows_m.to(tl.int64)[:, None] * sam + kk[None, :]  # [BLOCK_M, BLOCK_K]
    b_cols = b_ptr + rows_n.to(tl.int64)[None, :] * sbn + kk[:, None]  # [BLOCK_K, BLOCK_N], K-major
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if BLOCKWISE:
        a_scales = as_ptr + rows_m * sasm
        b_scale_row = bs_ptr + (pid_n * BLOCK_N // SCALE_BN) * sbsn  # the tile's one weight-scale row
        for k0 in range(k_lo, k_hi, BLOCK_K):
            a, b = _ab_tiles(a_rows, b_cols, k0, kk, k_hi, EVEN_K)
            ks = k0 // SCALE_BK
            s = tl.load(a_scales + ks * sask) * tl.load(b_scale_row + ks * sbsk)
            acc += tl.dot(a, b) * s[:, None]
    else:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            a, b = _ab_tiles(a_rows, b_cols, k0, kk, k_hi, EVEN_K)
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        acc *= tl.load(as_ptr + rows_m * sasm)[:, None] * tl.load(bs_ptr + rows_n * sbsn)[None, :]

    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT:
        part = part_ptr + (pid_k * M + offs_m).to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(part, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows_n).to(tl.float32)[None, :]
        out = out_ptr + offs_m.to(tl.int64)[:, None] * som + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


# tl.dot on fp8 operands takes K >= 32 (and M, N >= 16).
MIN_BLOCK_K = 32


def _pow2_divisor(size: int, cap: int) -> int:
    """The largest power of two <= cap dividing size."""
    d = 1
    while d * 2 <= cap and size % (d * 2) == 0:
        d *= 2
    return d


def default_config(m: int, n: int, k: int, block: tuple[int, int] | None) -> Fp8GemmConfig:
    """Tiles for M rows of an [N, K] weight on Hopper (sm_90), by M bucket; a starting
    point that benchmarks/fp8_gemm.py --sweep checks against alternatives.

    Few rows are bound by reading the weight: narrow column tiles give more programs, and
    K is split while the output tiles fill less than one wave of the GPU's SMs. Many rows
    are bound by the tensor cores: 128 x 128 tiles over two warp groups. In the block
    layout block_n divides bn, and block_k is bk (its largest power-of-two divisor up to
    128 for wider blocks)."""
    if m <= 16:
        block_m, block_n, warps, stages = 16, 64, 4, 4
    elif m <= 32:
        block_m, block_n, warps, stages = 32, 64, 4, 4
    elif m <= 64:
        block_m, block_n, warps, stages = 64, 64, 4, 4
    elif m <= 512:
        block_m, block_n, warps, stages = 64, 128, 4, 4
    else:
        block_m, block_n, warps, stages = 128, 128, 8, 3
    block_k = 128
    if block is not None:
        bn, bk = block
        block_n = _pow2_divisor(bn, block_n)
        block_k = _pow2_divisor(bk, 128)
        if block_n < 16 or block_k < MIN_BLOCK_K:
            raise ValueError(f"fp8 weight blocks {block} need power-of-two divisors >= 16 (rows) and >= "
                             f"{MIN_BLOCK_K} (columns)")
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_steps = triton.cdiv(k, block_k)
    split = 1
    if m <= 64 and tiles < DEFAULT_NUM_SMS:
        split = max(1, min(triton.cdiv(2 * DEFAULT_NUM_SMS, tiles), k_steps // 8))
    return Fp8GemmConfig(block_m, block_n, block_k, group_m=8, num_warps=warps, num_stages=stages, split_k=split)


def w8a8_matmul(
    x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
    block: tuple[int, int] | None, bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
    *, config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """y [M, N] = dequant(x_fp8, x_scale) @ dequant(w_fp8, w_scale)^T (+ bias), accumulated
    in fp32, in out_dtype. block = (bn, bk) for the block layout (x_scale [M, ceil(K / bk)],
    w_scale [ceil(N / bn), ceil(K / bk)]), None for per-channel weights (x_scale [M, 1],
    w_scale [N, 1] or [N]). Launches only; no host synchronisation (CUDA-graph safe)."""
    assert x_fp8.dtype == FP8 and w_fp8.dtype == FP8, f"fp8 e4m3 operands expected, got {x_fp8.dtype}, {w_fp8.dtype}"
    m, k = x_fp8.shape
    n = w_fp8.shape[0]
    assert w_fp8.shape[1] == k, f"x has {k} features, the weight expects {w_fp8.shape[1]}"
    assert x_fp8.stride(-1) == 1 and w_fp8.stride(-1) == 1, "features must be contiguous"
    assert x_scale.dtype == torch.float32 and w_scale.dtype == torch.float32
    cfg = config or default_config(m, n, k, block)
    assert cfg.block_k >= MIN_BLOCK_K and min(cfg.block_m, cfg.block_n) >= 16, f"{cfg}: tiles too small for tl.dot"
    if block is not None:
        bn, bk = block
        assert x_scale.shape == (m, triton.cdiv(k, bk)), f"x_scale {tuple(x_scale.shape)} for M={m}, K={k}, bk={bk}"
        assert w_scale.shape == (triton.cdiv(n, bn), triton.cdiv(k, bk)), (
            f"w_scale {tuple(w_scale.shape)} for N={n}, K={k}, block {block}")
        assert bn % cfg.block_n == 0 and bk % cfg.block_k == 0, (
            f"tile {cfg.block_n} x {cfg.block_k} must divide the weight block {block}")
        sasm, sask = x_scale.stride()
        sbsn, sbsk = w_scale.stride()
    else:
        bn = bk = 1
        assert x_scale.numel() == m and (x_scale.dim() == 1 or x_scale.shape[-1] == 1), (
            f"per-token x_scale must be [M, 1], got {tuple(x_scale.shape)}")
        assert w_scale.numel() == n and (w_scale.dim() == 1 or w_scale.shape[-1] == 1), (
            f"per-channel w_scale must be [N, 1] or [N], got {tuple(w_scale.shape)}")
        sasm, sask = x_scale.stride(0), 0
        sbsn, sbsk = w_scale.stride(0), 0
    if bias is not None:
        assert bias.shape == (n,) and bias.stride(0) == 1
    out = torch.empty((m, n), dtype=out_dtype, device=x_fp8.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    k_steps = triton.cdiv(k, cfg.block_k)
    split = max(1, min(cfg.split_k, k_steps))
    k_per_split = triton.cdiv(k_steps, split) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # no empty splits
    part = torch.empty((split, m, n), dtype=torch.float32, device=x_fp8.device) if split > 1 else out
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
    _w8a8_kernel[grid](
        x_fp8, w_fp8, x_scale, w_scale, bias if bias is not None else out, out, part,
        m, n, k, x_fp8.stride(0), w_fp8.stride(0), sasm, sask, sbsn, sbsk, out.stride(0), k_per_split,
        BLOCKWISE=block is not None, SCALE_BN=bn, SCALE_BK=bk,
        HAS_BIAS=bias is not None and split == 1, SPLIT=split > 1, EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1:
        split_reduce(part, bias, out)
    return out


# From this many rows on, per-channel weights go through cuBLAS's rowwise-scaled fp8 GEMM
# (torch._scaled_mm), faster there than this kernel; below, this kernel is
# (docs/PERFORMANCE.md, benchmarks/fp8_gemm.py).
SCALED_MM_MIN_ROWS = 128


@functools.cache
def _scaled_mm_rowwise(device: torch.device) -> bool:
    """torch._scaled_mm takes per-row and per-column scales on Hopper and later."""
    return hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device) >= (9, 0)


def fp8_linear(
    x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int] | None,
    bias: torch.Tensor | None = None, *, config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) for an fp8 weight, in x's dtype: x is quantized per token
    and group of block[1] features (per token for the channel layout), then multiplied
    by `w8a8_matmul`, or for per-channel weights and many rows by torch._scaled_mm (the
    same arithmetic: fp8 products, fp32 sums, both scales applied once at the end). What
    `w8a8_block_matmul(..., quantize_activations=True)` computes."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], w_fp8.shape[0]
    x_fp8, x_scale = quantize_token_groups(x2, block[1] if block is not None else k)
    if (block is None and config is None and m >= SCALED_MM_MIN_ROWS and n % 16 == 0 and k % 16 == 0
            and x.dtype in (torch.bfloat16, torch.float16) and _scaled_mm_rowwise(x.device)):
        y = torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=w_scale.reshape(1, n), out_dtype=x.dtype)
        if bias is not None:
            y += bias
    else:
        y = w8a8_matmul(x_fp8, x_scale, w_fp8, w_scale, block, bias, x.dtype, config=config)
    return y.view(*x.shape[:-1], n)
