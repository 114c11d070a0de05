"""Rotary position embedding of q and k in place, Neox or GPT-J (interleaved) style.

One program per token rotates all query and key heads of that token, so the token's
cos/sin row is read once. q [T, H, D] and k [T, Hkv, D] may be strided views (rows of
the merged QKV output); only their last dim must be contiguous. Features past rot_dim
(partial rotary) are left untouched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
def _rotate_heads(
    x_ptr, stride_h, n_heads, cos, sin, idx1, idx2, pair_mask,
    BLOCK_H: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    mask = (heads < n_heads)[:, None] & pair_mask[None, :]
    base = x_ptr + heads.to(tl.int64)[:, None] * stride_h
    x1 = tl.load(base + idx1[None, :], mask=mask, other=0.0)
    x2 = tl.load(base + idx2[None, :], mask=mask, other=0.0).to(tl.float32)
    # Like the reference, cos/sin are rounded to the activation dtype first.
    c = cos.to(x1.dtype).to(tl.float32)[None, :]
    s = sin.to(x1.dtype).to(tl.float32)[None, :]
    x1f = x1.to(tl.float32)
    tl.store(base + idx1[None, :], (x1f * c - x2 * s).to(x1.dtype), mask=mask)
    tl.store(base + idx2[None, :], (x2 * c + x1f * s).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cs_ptr,
    sqt, sqh, skt, skh, scs,
    n_q_heads, n_k_heads, half,
    IS_NEOX: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    pair_mask = r < half
    cos = tl.load(cs_ptr + pos * scs + r, mask=pair_mask, other=0.0)
    sin = tl.load(cs_ptr + pos * scs + half + r, mask=pair_mask, other=0.0)
    idx1, idx2 = rope_pair_index(r, half, IS_NEOX)
    _rotate_heads(q_ptr + t * sqt, sqh, n_q_heads, cos, sin, idx1, idx2, pair_mask, BLOCK_HQ)
    _rotate_heads(k_ptr + t * skt, skh, n_k_heads, cos, sin, idx1, idx2, pair_mask, BLOCK_HK)


def apply_rotary_qk(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] in place by cos_sin_cache [max_pos, rot_dim]
    (float32: cos of the rot_dim/2 frequencies, then sin) at `positions` [T]. Returns (q, k)."""
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] == positions.shape[0]
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "q and k need a contiguous last dim"
    assert cos_sin_cache.stride(-1) == 1
    rot_dim = cos_sin_cache.shape[-1]
    assert rot_dim % 2 == 0 and rot_dim <= q.shape[-1] and rot_dim <= k.shape[-1]
    tokens = q.shape[0]
    if tokens == 0:
        return q, k
    half = rot_dim // 2
    _rotary_kernel[(tokens,)](
        positions, q, k, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        q.shape[1], k.shape[1], half,
        IS_NEOX=is_neox,
        BLOCK_HQ=triton.next_power_of_2(q.shape[1]),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_R=triton.next_power_of_2(half),
        num_warps=4,
    )
    return q, k
