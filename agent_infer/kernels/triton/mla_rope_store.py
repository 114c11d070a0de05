"""One kernel for DeepSeek MLA's new tokens between the projections and attention:
kv_a_layernorm (RMSNorm of the latent), RoPE on the shared rope key and on every head's
q_pe, and the latent-cache write.

kv_a [T, L + R] is kv_a_proj_with_mqa's output (raw latent, then the un-rotated rope
key); it is rewritten in place as [normed latent | rotated k_pe], which is also the cache
row written at the token's slot. q_pe [T, H, R] (a strided view into the q projection,
or into the absorbed decode query's last R columns) is rotated in place.

Grid (tokens, 1 + query-head blocks): program 0 of a token does the latent row and its
cache write, the others BLOCK_HQ heads of q_pe each; at batch 1 the two kinds run side
by side instead of one after the other.

`mla_rope_store_absorb`, for decode steps of a few tokens, also builds the absorbed
query [q_nope @ W_UK | rope(q_pe)] in the same launch: grid (tokens, 1 + heads x latent
chunks), each program one head's BLOCK_C latent columns over the Dn nope values (its
W_UK tile loaded before the PDL wait: weights never depend on the kernel before), the
first chunk's program rotating that head's q_pe into the last R columns. At batch 1 it
replaces three launches (this kernel, a batched GEMM, the concatenation: 8.3 µs of a
DeepSeek-V2-Lite layer on an H200). Each token's programs read all of W_UK (2 MB for
V2-Lite), so beyond `ABSORB_MAX_TOKENS` a batched GEMM does the absorption.

Arithmetic as transformers' DeepseekV2 (see reference.mla_rope_store): the norm in fp32,
rounded to the activation dtype before the weight multiply; the rotation in fp32 with
the fp32 cos/sin table, rounded once. An fp8 (e4m3) cache receives the row divided by
the layer's cache scale, saturating at +-448; kv_a keeps the row itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agent_infer.kernels.triton.rope_store import rope_pair_index
from agent_infer.kernels.triton.utils import cache_scaled, launch_opts, pdl_begin, scaled_for_cache, to_cache_dtype

# Query heads per program: 16 x 32 rotation pairs at R = 64.
MAX_HEADS_PER_PROGRAM = 16
# Decode steps of up to this many tokens absorb W_UK in the kernel (W_UK read per token).
ABSORB_MAX_TOKENS = 4
# Latent columns per absorbing program: a [Dn, 64] W_UK tile, 64 values a thread at Dn 128.
_ABSORB_C = 64


@triton.jit
def _rotate(x_ptr, idx1, idx2, mask, cos, sin):
    """x[idx1], x[idx2] <- the pairs rotated by (cos, sin), in fp32, rounded once."""
    x1 = tl.load(x_ptr + idx1, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = tl.load(x_ptr + idx2, mask=mask, other=0.0).to(tl.float32)
    y1 = (a * cos - b * sin).to(x1.dtype)
    y2 = (b * cos + a * sin).to(x1.dtype)
    tl.store(x_ptr + idx1, y1, mask=mask)
    tl.store(x_ptr + idx2, y2, mask=mask)
    return y1, y2


@triton.jit
def _token_rotation(pos_ptr, cs_ptr, scs, ROPE_DIM: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The rotation pairs' indices, their mask and a token's fp32 cos and sin."""
    half: tl.constexpr = ROPE_DIM // 2
    r = tl.arange(0, BLOCK_HALF)
    r_mask = r < half
    idx1, idx2 = rope_pair_index(r, half, IS_NEOX)
    pos = tl.load(pos_ptr).to(tl.int64)
    cos = tl.load(cs_ptr + pos * scs + r, mask=r_mask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * scs + half + r, mask=r_mask, other=0.0).to(tl.float32)
    return idx1, idx2, r_mask, cos, sin


@triton.jit
def _latent_row(
    row, w_ptr, cache_ptr, slot_ptr, kc_b, kc_s, eps, idx1, idx2, r_mask, cos, sin, inv_scale,
    KV_LORA: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_L: tl.constexpr, PDL: tl.constexpr,
    SCALED: tl.constexpr,
):
    """One token's kv_a row [latent | k_pe] <- [rms_norm(latent) * w | rope(k_pe)] in
    place, and into the cache at its slot (none when -1); SCALED: an fp8 cache, which
    takes the row times inv_scale."""
    cl = tl.arange(0, BLOCK_L)
    cl_mask = cl < KV_LORA
    w = tl.load(w_ptr + cl, mask=cl_mask, other=0.0).to(tl.float32)
    slot = tl.load(slot_ptr).to(tl.int64)
    pdl_begin(PDL)
    x = tl.load(row + cl, mask=cl_mask, other=0.0)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / KV_LORA + eps)
    latent = ((h * rstd).to(x.dtype).to(tl.float32) * w).to(x.dtype)
    tl.store(row + cl, latent, mask=cl_mask)
    y1, y2 = _rotate(row + KV_LORA, idx1, idx2, r_mask, cos, sin)
    if slot >= 0:
        dst = cache_ptr + (slot // BLOCK_SIZE) * kc_b + (slot % BLOCK_SIZE) * kc_s
        ct = cache_ptr.dtype.element_ty
        tl.store(dst + cl, to_cache_dtype(scaled_for_cache(latent, inv_scale, SCALED), ct), mask=cl_mask)
        tl.store(dst + KV_LORA + idx1, to_cache_dtype(scaled_for_cache(y1, inv_scale, SCALED), ct), mask=r_mask)
        tl.store(dst + KV_LORA + idx2, to_cache_dtype(scaled_for_cache(y2, inv_scale, SCALED), ct), mask=r_mask)


@triton.jit
def _mla_rope_store_kernel(
    kv_a_ptr, q_pe_ptr, pos_ptr, w_ptr, cs_ptr, cache_ptr, slot_ptr,
    skv, sqt, sqh, scs, kc_b, kc_s, num_heads, eps, inv_scale,
    KV_LORA: tl.constexpr, ROPE_DIM: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, PDL: tl.constexpr,
    SCALED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    # Before the PDL wait, overlapping the projection that produces kv_a and q_pe:
    # positions and slots are this forward's inputs, the table and weight constants.
    idx1, idx2, r_mask, cos, sin = _token_rotation(pos_ptr + t, cs_ptr, scs, ROPE_DIM, IS_NEOX, BLOCK_HALF)
    if part == 0:
        _latent_row(kv_a_ptr + t * skv, w_ptr, cache_ptr, slot_ptr + t, kc_b, kc_s, eps, idx1, idx2, r_mask, cos, sin,
                    inv_scale, KV_LORA, BLOCK_SIZE, BLOCK_L, PDL, SCALED)
    else:
        pdl_begin(PDL)
        heads = (part - 1) * BLOCK_HQ + tl.arange(0, BLOCK_HQ)
        rows = q_pe_ptr + t * sqt + heads.to(tl.int64)[:, None] * sqh
        _rotate(rows, idx1[None, :], idx2[None, :], (heads < num_heads)[:, None] & r_mask[None, :],
                cos[None, :], sin[None, :])


@triton.jit
def _mla_rope_store_absorb_kernel(
    kv_a_ptr, q_ptr, pos_ptr, w_ptr, cs_ptr, cache_ptr, slot_ptr, uk_ptr, out_ptr,
    skv, sqt, sqh, scs, kc_b, kc_s, suh, suk, sot, soh, eps, inv_scale,
    KV_LORA: tl.constexpr, ROPE_DIM: tl.constexpr, NOPE: tl.constexpr, IS_NEOX: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_C: tl.constexpr, NUM_C: tl.constexpr, PDL: tl.constexpr, SCALED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    idx1, idx2, r_mask, cos, sin = _token_rotation(pos_ptr + t, cs_ptr, scs, ROPE_DIM, IS_NEOX, BLOCK_HALF)
    if part == 0:
        _latent_row(kv_a_ptr + t * skv, w_ptr, cache_ptr, slot_ptr + t, kc_b, kc_s, eps, idx1, idx2, r_mask, cos, sin,
                    inv_scale, KV_LORA, BLOCK_SIZE, BLOCK_L, PDL, SCALED)
    else:
        head = ((part - 1) // NUM_C).to(tl.int64)
        chunk = (part - 1) % NUM_C
        c = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
        d = tl.arange(0, BLOCK_D)
        c_mask, d_mask = c < KV_LORA, d < NOPE
        w = tl.load(uk_ptr + head * suh + d[:, None] * suk + c[None, :], mask=d_mask[:, None] & c_mask[None, :],
                    other=0.0)
        pdl_begin(PDL)
        q_row = q_ptr + t * sqt + head * sqh
        out_row = out_ptr + t * sot + head * soh
        q_nope = tl.load(q_row + d, mask=d_mask, other=0.0)
        q_lat = tl.sum(q_nope.to(tl.float32)[:, None] * w.to(tl.float32), axis=0)
        tl.store(out_row + c, q_lat.to(out_ptr.dtype.element_ty), mask=c_mask)
        if chunk == 0:
            y1, y2 = _rotate(q_row + NOPE, idx1, idx2, r_mask, cos, sin)
            tl.store(out_row + KV_LORA + idx1, y1, mask=r_mask)
            tl.store(out_row + KV_LORA + idx2, y2, mask=r_mask)


def _check_args(kv_a, q_pe, positions, norm_weight, cos_sin_cache, kv_cache, slot_mapping,
                cache_scale) -> tuple[int, bool]:
    """The shared contract of both kernels; returns the rope dimension and whether the
    stores divide by the cache scale (an fp8 cache)."""
    tokens, width = kv_a.shape
    rank = norm_weight.shape[0]
    rope_dim = width - rank
    assert 0 < rank < width and rope_dim % 2 == 0, f"kv_a width {width}, kv_lora_rank {rank}"
    assert q_pe.dim() == 3 and q_pe.shape[0] == tokens and q_pe.shape[2] == rope_dim
    assert cos_sin_cache.shape[-1] == rope_dim and cos_sin_cache.stride(-1) == 1
    assert positions.shape[0] == tokens and slot_mapping.shape[0] == tokens
    assert kv_cache.shape[-1] == width and kv_cache.dim() in (3, 4) and kv_cache.stride(-1) == 1
    assert kv_cache.dim() == 3 or kv_cache.shape[2] == 1
    assert kv_a.dtype == q_pe.dtype and kv_cache.dtype in (kv_a.dtype, torch.float8_e4m3fn), (
        f"{kv_a.dtype} activations, a {kv_cache.dtype} cache (the activations' dtype or e4m3)")
    assert kv_a.stride(-1) == 1 and q_pe.stride(-1) == 1 and norm_weight.is_contiguous()
    return rope_dim, cache_scaled(kv_cache, cache_scale, cache_scale)


def mla_rope_store_absorb(
    kv_a: torch.Tensor,
    q: torch.Tensor,
    w_uk: torch.Tensor,
    positions: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    is_neox: bool = False,
    cache_scale: float = 1.0,
) -> torch.Tensor:
    """`mla_rope_store(kv_a, q[..., Dn:], ...)` and the absorbed decode query in one
    launch: returns [T, H, L + R] = [q_nope @ w_uk | rope(q_pe)] for q [T, H, Dn + R]
    (row strides free) and w_uk [H, Dn, L] (kv_b_proj's key rows per head, a strided
    view; its last dim contiguous); q's last R columns are rotated in place as well."""
    tokens = kv_a.shape[0]
    heads, nope, rank = w_uk.shape
    rope_dim, scaled = _check_args(kv_a, q[..., nope:], positions, norm_weight, cos_sin_cache, kv_cache,
                                   slot_mapping, cache_scale)
    assert rank == norm_weight.shape[0] and q.shape[1:] == (heads, nope + rope_dim), f"q {tuple(q.shape)}"
    assert w_uk.stride(-1) == 1 and w_uk.dtype == q.dtype
    out = torch.empty(tokens, heads, rank + rope_dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    num_c = triton.cdiv(rank, _ABSORB_C)
    _mla_rope_store_absorb_kernel[(tokens, 1 + heads * num_c)](
        kv_a, q, positions, norm_weight, cos_sin_cache, kv_cache, slot_mapping, w_uk, out,
        kv_a.stride(0), q.stride(0), q.stride(1), cos_sin_cache.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        w_uk.stride(0), w_uk.stride(1), out.stride(0), out.stride(1), eps, 1.0 / cache_scale,
        KV_LORA=rank, ROPE_DIM=rope_dim, NOPE=nope, IS_NEOX=is_neox, BLOCK_SIZE=kv_cache.shape[1],
        BLOCK_L=triton.next_power_of_2(rank), BLOCK_HALF=triton.next_power_of_2(rope_dim // 2),
        BLOCK_D=triton.next_power_of_2(nope), BLOCK_C=_ABSORB_C, NUM_C=num_c, SCALED=scaled, num_warps=4,
        **launch_opts(kv_a.device),
    )
    return out


def mla_rope_store(
    kv_a: torch.Tensor,
    q_pe: torch.Tensor,
    positions: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    is_neox: bool = False,
    cache_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_a [T, L + R] <- [rms_norm(latent) * norm_weight | rope(k_pe)] in place, and those
    rows into kv_cache [blocks, block_size, L + R] (or [.., 1, L + R]) at slot_mapping [T]
    (int64, -1 = padding, not stored; an e4m3 cache takes them divided by `cache_scale`,
    saturating); q_pe [T, H, R] <- rope(q_pe) in place. L is
    norm_weight's length; cos_sin_cache [max_pos, R] holds the R/2 frequencies' cos, then
    their sin (layers/rotary.py); DeepSeek's interleaved pairs (2i, 2i + 1) unless
    `is_neox`. Row strides are free (last dims contiguous). Returns the views
    (latent [T, L], k_pe [T, R]) of kv_a.

    Under PDL the kernel reads positions, slots, cos/sin and the weight before waiting
    for the kernel launched just before it, which may write kv_a and q_pe only."""
    tokens = kv_a.shape[0]
    rank = norm_weight.shape[0]
    rope_dim, scaled = _check_args(kv_a, q_pe, positions, norm_weight, cos_sin_cache, kv_cache, slot_mapping,
                                   cache_scale)
    latent, k_pe = kv_a[:, :rank], kv_a[:, rank:]
    if tokens == 0:
        return latent, k_pe
    num_heads = q_pe.shape[1]
    block_hq = min(MAX_HEADS_PER_PROGRAM, triton.next_power_of_2(num_heads))
    _mla_rope_store_kernel[(tokens, 1 + triton.cdiv(num_heads, block_hq))](
        kv_a, q_pe, positions, norm_weight, cos_sin_cache, kv_cache, slot_mapping,
        kv_a.stride(0), q_pe.stride(0), q_pe.stride(1), cos_sin_cache.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), num_heads, eps, 1.0 / cache_scale,
        KV_LORA=rank, ROPE_DIM=rope_dim, IS_NEOX=is_neox, BLOCK_SIZE=kv_cache.shape[1],
        BLOCK_L=triton.next_power_of_2(rank), BLOCK_HALF=triton.next_power_of_2(rope_dim // 2),
        BLOCK_HQ=block_hq, SCALED=scaled, num_warps=2, **launch_opts(kv_a.device),
    )
    return latent, k_pe
