"""One kernel for what happens between the QKV projection and attention: per-head RMSNorm
of q and k (Qwen3's q_norm/k_norm; optional), RoPE on q and k, and the K/V cache write.

At batch 1 each of these is a few-µs kernel whose cost is its launch, not its bytes, so
doing all three in one launch saves two to four launches per layer. One program per
(token, head): heads [0, H) are query heads, [H, H + Hkv) key heads, whose program
also copies that head's V into the cache. q and k are rewritten in place (strided views
of the merged QKV output are fine). Rounding follows the unfused reference: normalised
values and cos/sin are rounded to the activation dtype before the rotation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agent_infer.kernels.triton.utils import launch_opts, pdl_begin


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
    n_q_heads, half, tail, eps, inv_dim,
    QK_NORM: tl.constexpr, IS_NEOX: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    is_q = head < n_q_heads
    kv_head = (head - n_q_heads).to(tl.int64)
    if is_q:
        row = q_ptr + t * sqt + head.to(tl.int64) * sqh
        w_ptr = qw_ptr
    else:
        row = k_ptr + t * skt + kv_head * skh
        w_ptr = kw_ptr
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
    cos = tl.load(cs_ptr + pos * scs + r, mask=r_mask, other=0.0)
    sin = tl.load(cs_ptr + pos * scs + half + r, mask=r_mask, other=0.0)
    if QK_NORM:
        w1 = tl.load(w_ptr + idx1, mask=r_mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + idx2, mask=r_mask, other=0.0).to(tl.float32)
        wt = tl.load(w_ptr + tail_idx, mask=tail_mask, other=0.0).to(tl.float32)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    pdl_begin(PDL)

    x1 = tl.load(row + idx1, mask=r_mask, other=0.0)
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = tl.load(row + idx2, mask=r_mask, other=0.0).to(tl.float32)
    c = tl.load(row + tail_idx, mask=tail_mask, other=0.0).to(tl.float32)
    if QK_NORM:
        rstd = tl.rsqrt((tl.sum(a * a) + tl.sum(b * b) + tl.sum(c * c)) * inv_dim + eps)
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
    tl.store(row + idx1, y1, mask=r_mask)
    tl.store(row + idx2, y2, mask=r_mask)
    if QK_NORM:
        tl.store(row + tail_idx, yt, mask=tail_mask)
    if not is_q:
        if slot >= 0:
            block = slot // BLOCK_SIZE
            offset = slot % BLOCK_SIZE
            kc = k_cache_ptr + block * kc_b + offset * kc_s + kv_head * kc_h
            tl.store(kc + idx1, y1.to(k_cache_ptr.dtype.element_ty), mask=r_mask)
            tl.store(kc + idx2, y2.to(k_cache_ptr.dtype.element_ty), mask=r_mask)
            tl.store(kc + tail_idx, yt.to(k_cache_ptr.dtype.element_ty), mask=tail_mask)
            vr = v_ptr + t * svt + kv_head * svh
            vc = v_cache_ptr + block * vc_b + offset * vc_s + kv_head * vc_h
            d = tl.arange(0, 2 * BLOCK_R)
            d_mask = d < 2 * half
            tl.store(vc + d, tl.load(vr + d, mask=d_mask).to(v_cache_ptr.dtype.element_ty), mask=d_mask)
            tl.store(vc + tail_idx, tl.load(vr + tail_idx, mask=tail_mask).to(v_cache_ptr.dtype.element_ty),
                     mask=tail_mask)


def norm_rope_store(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
    cos_sin_cache: torch.Tensor, is_neox: bool,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k/v [T, Hkv, D] (last dim contiguous): q, k <- rope(rms_norm(.)) in
    place (no norm when the weights are None), then k and v into the caches
    [blocks, block_size, Hkv, D] at slot_mapping [T] (-1 = skip). Returns (q, k).

    Under PDL the kernel reads positions, slots, cos/sin and the norm weights before
    waiting for the kernel launched just before it, which may write q, k and v only."""
    tokens, n_q, dim = q.shape
    n_kv = k.shape[1]
    assert k.shape == v.shape == (tokens, n_kv, dim) and positions.shape[0] == slot_mapping.shape[0] == tokens
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.shape[2:] == (n_kv, dim) and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    rot_dim = cos_sin_cache.shape[-1]
    assert rot_dim % 2 == 0 and rot_dim <= dim and cos_sin_cache.stride(-1) == 1
    qk_norm = q_weight is not None
    assert qk_norm == (k_weight is not None)
    if tokens == 0:
        return q, k
    half = rot_dim // 2
    tail = dim - rot_dim
    _rope_store_kernel[(tokens, n_q + n_kv)](
        positions, q, k, v, q_weight if qk_norm else q, k_weight if qk_norm else k, cos_sin_cache,
        k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        n_q, half, tail, eps, 1.0 / dim,
        QK_NORM=qk_norm, IS_NEOX=is_neox, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_R=triton.next_power_of_2(half), BLOCK_T=triton.next_power_of_2(max(tail, 1)),
        num_warps=1, **launch_opts(q.device),
    )
    return q, k
