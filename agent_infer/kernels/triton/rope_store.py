"""One kernel for what happens between the QKV projection and attention: per-head RMSNorm
of q and k (Qwen3's q_norm/k_norm; optional), RoPE on q and k, and the K/V cache write.

At batch 1 each of these is a few-µs kernel whose cost is its launch, not its bytes, so
doing all three in one launch saves two to four launches per layer. One program per
(token, group of heads): heads [0, H) are query heads, [H, H + Hkv) key heads, whose
program also copies those heads' V into the cache. Small batches take one head per
program, large ones a group (`heads_per_program`). q and k are rewritten in place
(strided views of the merged QKV output are fine). Rounding follows the unfused
reference: normalised values and cos/sin are rounded to the activation dtype before the
rotation.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from agent_infer.kernels.triton.utils import (
    cache_scaled, check_kv_cache_dtype, launch_opts, pdl_begin, scaled_for_cache, to_cache_dtype,
)

# Token counts from which a program takes a group of heads. One head per one-warp program
# keeps the batch-1 chain as it was tuned; at hundreds of tokens and more (large decode
# batches, prefill), 40 tiny programs per token made this kernel ~4x slower than its bytes
# (195 us for 7,868 prompt tokens of Qwen3-8B on an H200, against ~50 us of traffic).
GROUP_FROM_TOKENS = 64
MAX_HEADS_PER_PROGRAM = 8


def heads_per_program(tokens: int, n_q: int, n_kv: int) -> int:
    """1 below GROUP_FROM_TOKENS tokens; else the largest power of two, up to
    MAX_HEADS_PER_PROGRAM, dividing both head counts (so a group never mixes q and k)."""
    if tokens < GROUP_FROM_TOKENS:
        return 1
    common = math.gcd(n_q, n_kv)
    return min(MAX_HEADS_PER_PROGRAM, common & -common)


@triton.jit
def rope_pair_index(r, half, IS_NEOX: tl.constexpr):
    """Feature indices of rotation pairs r = 0..half-1: (r, r + half) in Neox style,
    (2r, 2r + 1) in GPT-J (interleaved) style."""
    if IS_NEOX:
        first = r
        second = r + half
    else:
        first = 2 * r
        second = 2 * r + 1
    return first, second


@triton.jit
def _rope_store_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cs_ptr,
    k_cache_ptr, v_cache_ptr, slot_ptr,
    sqt, sqh, skt, skh, svt, svh, scs,
    kc_b, kc_s, kc_h, vc_b, vc_s, vc_h,
    n_q_heads, half, tail, eps, inv_dim, inv_k, inv_v,
    QK_NORM: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr, SCALED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    head0 = tl.program_id(1) * BLOCK_H  # BLOCK_H divides both head counts
    is_q = head0 < n_q_heads
    hs = tl.arange(0, BLOCK_H)
    kv_heads = (head0 - n_q_heads + hs).to(tl.int64)  # meaningful for key groups only
    if is_q:
        rows = q_ptr + t * sqt + (head0 + hs).to(tl.int64) * sqh
        w_ptr = qw_ptr
    else:
        rows = k_ptr + t * skt + kv_heads * skh
        w_ptr = kw_ptr
    rows = rows[:, None]  # [BLOCK_H, 1]: each head's row of features
    r = tl.arange(0, BLOCK_R)
    r_mask = r < half
    idx1, idx2 = rope_pair_index(r, half, IS_NEOX)
    tail_idx = 2 * half + tl.arange(0, BLOCK_T)
    tail_mask = tl.arange(0, BLOCK_T) < tail
    # Before the PDL wait, overlapping the predecessor (the QKV projection): positions and
    # slots are this forward's inputs (written before its first kernel, by no kernel of
    # it), the cos/sin cache and norm weights are constants. The chain position -> cos/sin
    # then no longer follows the wait; only q, k and v do.
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cs_ptr + pos * scs + r, mask=r_mask, other=0.0)[None, :]
    sin = tl.load(cs_ptr + pos * scs + half + r, mask=r_mask, other=0.0)[None, :]
    if QK_NORM:
        w1 = tl.load(w_ptr + idx1, mask=r_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + idx2, mask=r_mask, other=0.0).to(tl.float32)[None, :]
        wt = tl.load(w_ptr + tail_idx, mask=tail_mask, other=0.0).to(tl.float32)[None, :]
    slot = tl.load(slot_ptr + t).to(tl.int64)
    pdl_begin(PDL)

    idx1 = idx1[None, :]
    idx2 = idx2[None, :]
    tail_idx = tail_idx[None, :]
    r_mask = r_mask[None, :]
    tail_mask = tail_mask[None, :]
    x1 = tl.load(rows + idx1, mask=r_mask, other=0.0)
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = tl.load(rows + idx2, mask=r_mask, other=0.0).to(tl.float32)
    c = tl.load(rows + tail_idx, mask=tail_mask, other=0.0).to(tl.float32)
    if QK_NORM:
        squares = tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1) + tl.sum(c * c, axis=1)
        rstd = tl.rsqrt(squares * inv_dim + eps)[:, None]
        a = (a * rstd).to(dtype).to(tl.float32) * w1
        b = (b * rstd).to(dtype).to(tl.float32) * w2
        c = (c * rstd).to(dtype).to(tl.float32) * wt
        a = a.to(dtype).to(tl.float32)
        b = b.to(dtype).to(tl.float32)
    cos = cos.to(dtype).to(tl.float32)
    sin = sin.to(dtype).to(tl.float32)
    y1 = (a * cos - b * sin).to(dtype)
    y2 = (b * cos + a * sin).to(dtype)
    yt = c.to(dtype)
    tl.store(rows + idx1, y1, mask=r_mask)
    tl.store(rows + idx2, y2, mask=r_mask)
    if QK_NORM:
        tl.store(rows + tail_idx, yt, mask=tail_mask)
    if not is_q:
        if slot >= 0:
            block = slot // BLOCK_SIZE
            offset = slot % BLOCK_SIZE
            kc = (k_cache_ptr + block * kc_b + offset * kc_s + kv_heads * kc_h)[:, None]
            kt = k_cache_ptr.dtype.element_ty
            tl.store(kc + idx1, to_cache_dtype(scaled_for_cache(y1, inv_k, SCALED), kt), mask=r_mask)
            tl.store(kc + idx2, to_cache_dtype(scaled_for_cache(y2, inv_k, SCALED), kt), mask=r_mask)
            tl.store(kc + tail_idx, to_cache_dtype(scaled_for_cache(yt, inv_k, SCALED), kt), mask=tail_mask)
            vr = (v_ptr + t * svt + kv_heads * svh)[:, None]
            vc = (v_cache_ptr + block * vc_b + offset * vc_s + kv_heads * vc_h)[:, None]
            vt = v_cache_ptr.dtype.element_ty
            d = tl.arange(0, 2 * BLOCK_R)[None, :]
            d_mask = d < 2 * half
            v_main = scaled_for_cache(tl.load(vr + d, mask=d_mask), inv_v, SCALED)
            v_tail = scaled_for_cache(tl.load(vr + tail_idx, mask=tail_mask), inv_v, SCALED)
            tl.store(vc + d, to_cache_dtype(v_main, vt), mask=d_mask)
            tl.store(vc + tail_idx, to_cache_dtype(v_tail, vt), mask=tail_mask)


def norm_rope_store(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
    cos_sin_cache: torch.Tensor, is_neox: bool,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, heads: int | None = None,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k/v [T, Hkv, D] (last dim contiguous): q, k <- rope(rms_norm(.)) in
    place (no norm when the weights are None), then k and v into the caches
    [blocks, block_size, Hkv, D] at slot_mapping [T] (-1 = skip); an fp8 cache stores
    k / k_scale and v / v_scale (reference.store_kv). Returns (q, k).
    `heads` (heads per program) overrides `heads_per_program`.

    Under PDL the kernel reads positions, slots, cos/sin and the norm weights before
    waiting for the kernel launched just before it, which may write q, k and v only."""
    tokens, n_q, dim = q.shape
    n_kv = k.shape[1]
    assert k.shape == v.shape == (tokens, n_kv, dim) and positions.shape[0] == slot_mapping.shape[0] == tokens
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.shape[2:] == (n_kv, dim) and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    check_kv_cache_dtype(k_cache, v_cache, k.dtype)
    rot_dim = cos_sin_cache.shape[-1]
    assert rot_dim % 2 == 0 and rot_dim <= dim and cos_sin_cache.stride(-1) == 1
    qk_norm = q_weight is not None
    assert qk_norm == (k_weight is not None)
    if tokens == 0:
        return q, k
    half = rot_dim // 2
    tail = dim - rot_dim
    group = heads or heads_per_program(tokens, n_q, n_kv)
    assert group & (group - 1) == 0 and n_q % group == 0 and n_kv % group == 0, f"bad head group {group}"
    block_r = triton.next_power_of_2(half)
    _rope_store_kernel[(tokens, (n_q + n_kv) // group)](
        positions, q, k, v, q_weight if qk_norm else q, k_weight if qk_norm else k, cos_sin_cache,
        k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        n_q, half, tail, eps, 1.0 / dim, 1.0 / k_scale, 1.0 / v_scale,
        QK_NORM=qk_norm, IS_NEOX=is_neox, BLOCK_SIZE=k_cache.shape[1], SCALED=cache_scaled(k_cache, k_scale, v_scale),
        BLOCK_H=group, BLOCK_R=block_r, BLOCK_T=triton.next_power_of_2(max(tail, 1)),
        num_warps=max(1, min(4, group * block_r // 128)), **launch_opts(q.device),
    )
    return q, k
