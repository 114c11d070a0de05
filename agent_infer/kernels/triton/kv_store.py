"""Write this step's K and V into the paged caches at flat slots (block * block_size +
offset). A slot of -1 marks a padding row (CUDA-graph batches padded to a captured size)
and is skipped."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agent_infer.kernels.triton.utils import cache_scaled, check_kv_cache_dtype, scaled_for_cache, to_cache_dtype


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    skt, skh, svt, svh,
    kc_b, kc_s, kc_h, vc_b, vc_s, vc_h,
    n_heads, head_dim, inv_k, inv_v,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SCALED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        mask = (h < n_heads)[:, None] & (d < head_dim)[None, :]
        k = tl.load(k_ptr + t * skt + h[:, None] * skh + d[None, :], mask=mask)
        v = tl.load(v_ptr + t * svt + h[:, None] * svh + d[None, :], mask=mask)
        k_dst = k_cache_ptr + block * kc_b + offset * kc_s + h[:, None] * kc_h + d[None, :]
        v_dst = v_cache_ptr + block * vc_b + offset * vc_s + h[:, None] * vc_h + d[None, :]
        tl.store(k_dst, to_cache_dtype(scaled_for_cache(k, inv_k, SCALED), k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, to_cache_dtype(scaled_for_cache(v, inv_v, SCALED), v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """k, v [T, Hkv, D] (strided views allowed, last dim contiguous) -> caches
    [num_blocks, block_size, Hkv, D] at slot_mapping [T] (int64, -1 = skip); an fp8
    cache stores k / k_scale and v / v_scale (reference.store_kv)."""
    tokens, n_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape[0] == tokens
    assert k_cache.shape[1:] == v_cache.shape[1:] and k_cache.shape[2:] == (n_heads, head_dim)
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    check_kv_cache_dtype(k_cache, v_cache, k.dtype)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if tokens == 0:
        return
    block_h = triton.next_power_of_2(n_heads)
    block_d = triton.next_power_of_2(head_dim)
    _store_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        n_heads, head_dim, 1.0 / k_scale, 1.0 / v_scale,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_H=block_h, BLOCK_D=block_d, SCALED=cache_scaled(k_cache, k_scale, v_scale),
        num_warps=4 if block_h * block_d <= 2048 else 8,
    )
