"""Plain-PyTorch versions of every kernel: the CPU path, and the reference the Triton
kernels are tested against. They follow Hugging Face's arithmetic order so fp32 runs
match transformers token for token."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual; returns (rms_norm(residual), residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def apply_rotary(
    positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> torch.Tensor:
    """Rotate the first `rot_dim` features of x [tokens, heads, head_dim].

    cos_sin_cache is [max_pos, rot_dim]: cos of the rot_dim/2 frequencies, then sin.
    Neox style pairs feature i with i + rot_dim/2; GPT-J style pairs 2i with 2i+1.
    """
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].to(x.dtype).unsqueeze(1).chunk(2, dim=-1)
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1) if rest.numel() else out


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [tokens, kv_heads, head_dim] into the paged caches [blocks, block_size,
    kv_heads, head_dim] at flat slots; a slot of -1 (padding) is skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = to_cache_dtype(k[keep], k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = to_cache_dtype(v[keep], v_cache.dtype)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache entry. An fp8 cache saturates at its largest finite value (e4m3 has
    no infinity); the clamp makes that explicit rather than left to the cast's overflow
    rule, as the Triton stores do."""
    if dtype.itemsize == 1 and dtype.is_floating_point:
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    block_size = cache.shape[1]
    n = (length + block_size - 1) // block_size
    return cache[block_table[:n]].flatten(0, 1)[:length]


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    context_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention for a ragged batch whose keys live in the paged cache.

    Sequence i has query_lens[i] new tokens, the last ones of its context_lens[i] tokens
    (the rest are cached prefix), so query j sits at position context - query_len + j.
    """
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, ctx) in enumerate(zip(query_lens, context_lens)):
        qi = q[start : start + q_len].transpose(0, 1)  # [H, q_len, D]
        ki = _gather_context(k_cache, block_tables[i], ctx).transpose(0, 1).to(q.dtype)
        vi = _gather_context(v_cache, block_tables[i], ctx).transpose(0, 1).to(q.dtype)
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence, q [B, H, D], attending to its context_lens[b] cached tokens."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k = k_cache[block_tables].flatten(1, 2)  # [B, max_blocks * block_size, Hkv, D]
    v = v_cache[block_tables].flatten(1, 2)
    group = num_heads // num_kv_heads
    qg = q.view(batch, num_kv_heads, group, head_dim).float()
    scores = torch.einsum("bhgd,bthd->bhgt", qg, k.float()) * scale
    valid = torch.arange(k.shape[1], device=q.device)[None, :] < context_lens[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.einsum("bhgt,bthd->bhgd", probs, v.float())
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser on int64 tensors holding values < 2**32. Products stay
    below 2**63 (multiplier < 2**31), so no signed overflow on any backend."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _M32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u in (0, 1), [batch, vocab], a pure function of (seed, step, token)."""
    key = _mix32(seeds & _M32)
    key = _mix32(key ^ ((seeds >> 32) & _M32))
    key = _mix32(key ^ (steps & _M32))
    tokens = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    h = _mix32(key[:, None] ^ ((tokens * 0x9E3779B1) & _M32)[None, :])
    h = _mix32(h ^ (key[:, None] >> 3))
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def gumbel_sample(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """Sample row b from softmax(logits[b] / T[b]) as argmax(logits / T - log(-log u));
    rows with T = 0 take the argmax."""
    x = logits.float()
    greedy = temperature == 0.0
    inv_t = torch.where(greedy, torch.ones_like(temperature), 1.0 / temperature)
    noise = -torch.log(-torch.log(uniform_noise(seeds, steps, x.shape[-1])))
    score = torch.where(greedy[:, None], x, x * inv_t[:, None] + noise)
    # A banned token (-inf) whose noise rounds to +inf scores NaN; argmax would take it,
    # the Triton kernel never does (NaN > best is false): match the kernel.
    score = score.masked_fill(score.isnan(), float("-inf"))
    return score.argmax(dim=-1)


def apply_token_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits[rows[r], t] = -inf where bit t of mask[r] (int32 words, LSB first) is 0;
    tokens beyond 32 * words are banned too. In place."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, device=mask.device, dtype=torch.int32)
    bits = ((mask[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()
    if bits.shape[1] < vocab:
        bits = torch.nn.functional.pad(bits, (0, vocab - bits.shape[1]), value=False)
    sub = logits[rows]
    logits[rows] = sub.masked_fill(~bits, float("-inf"))
