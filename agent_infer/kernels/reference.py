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
    return rotate(x, *rotary_cos_sin(positions, cos_sin_cache, x.dtype), is_neox)


def rotary_cos_sin(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [tokens, 1, rot_dim / 2] of `positions`, for `rotate`: looked up once
    when several tensors turn by the same positions."""
    cos, sin = cos_sin_cache[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
    return cos, sin


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """`apply_rotary` with the positions' cos and sin already looked up."""
    rot_dim = 2 * cos.shape[-1]
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1) if rest.numel() else out


def fp8_weight_values(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """An fp8 weight's values in fp32: each e4m3 element times the scale of its block, or
    of its row without a block."""
    w = weight.float()
    if block is None:
        return w * scale.float().view(-1, 1)
    rows, cols = block
    s = scale.float().repeat_interleave(rows, 0)[: w.shape[0]].repeat_interleave(cols, 1)[:, : w.shape[1]]
    return w * s


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T for an fp8 weight: its values (`fp8_weight_values`) in x's dtype.
    Activations stay as they are: the weights' exact values are the format; quantizing
    activations is a kernel's choice."""
    return F.linear(x, fp8_weight_values(weight, scale, block).to(x.dtype), bias)


def fp8_mma_sums(x_fp8: torch.Tensor, w_fp8: torch.Tensor, step: int = 32, bits: int = 13, promote: int | None = 128,
                 x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                 block: tuple[int, int] | None = None, n_chunk: int = 4096) -> torch.Tensor:
    """x_fp8 [M, K] @ w_fp8 [N, K]^T in fp32 as fp8 tensor cores sum it, by a model of
    their accumulator: every `step` products are added to it at once, each term (and the
    accumulator) cut toward zero to `bits` bits below the largest exponent among them;
    every `promote` features of K (None: never) the accumulator is added to an fp32 sum
    and restarts from zero, as the kernels do to bound the loss. With scales: per token
    and group of block[1] features (x_scale [M, K / block[1]]) and per weight block
    (w_scale), each promoted sum is scaled before the add (the W8A8 GEMM's block layout);
    per token and row (block None), the fp32 sum is scaled at the end.
    benchmarks/fp8_accumulation.py measures how well it matches the kernels.

    Everything inside a promotion interval is exact in fp32: e4m3 products have at most 8
    significant bits, and the cut terms and their sums are multiples of one power of two
    spanning fewer than 24 bits (for bits <= 17)."""
    m, k = x_fp8.shape
    interval = promote or k
    assert bits <= 17, "exact in fp32 only while a step's sum spans fewer than 24 bits"
    if block is not None:
        assert interval == block[1], "the block layout promotes once per weight block's columns"
    x = x_fp8.float()
    outs = []
    for n0 in range(0, w_fp8.shape[0], n_chunk):
        w = w_fp8[n0:n0 + n_chunk].float()
        total = torch.zeros(m, w.shape[0], dtype=torch.float32, device=x.device)
        for k0 in range(0, k, interval):
            acc = torch.zeros(m, w.shape[0], dtype=torch.float32, device=x.device)
            for s in range(k0, min(k0 + interval, k), step):
                terms = x[:, None, s:s + step] * w[None, :, s:s + step]  # exact: 4-bit significands
                top = torch.maximum(torch.linalg.vector_norm(terms, float("inf"), dim=2), acc.abs())
                unit = torch.ldexp(torch.ones_like(top), torch.frexp(top).exponent - 1 - bits)
                # Whole units, summed as integers (exact), then scaled back.
                cut = torch.div(terms, unit[..., None], rounding_mode="trunc").sum(2)
                acc = (torch.div(acc, unit, rounding_mode="trunc") + cut) * unit
            if block is not None and x_scale is not None:
                kb = k0 // block[1]
                rows = w_scale[:, kb].repeat_interleave(block[0])[n0:n0 + w.shape[0]]
                acc = acc * (x_scale[:, kb, None] * rows[None, :])
            total = total + acc
        if block is None and x_scale is not None:
            total = total * (x_scale.reshape(-1, 1) * w_scale.reshape(1, -1)[:, n0:n0 + w.shape[0]])
        outs.append(total)
    return torch.cat(outs, dim=1)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Write k, v [tokens, kv_heads, head_dim] into the paged caches [blocks, block_size,
    kv_heads, head_dim] at flat slots; a slot of -1 (padding) is skipped. An fp8 cache
    stores k / k_scale and v / v_scale (its entries times the scales are K and V)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = to_cache_dtype(scaled_for_cache(k, k_scale), k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = to_cache_dtype(scaled_for_cache(v, v_scale), v_cache.dtype)


def scaled_for_cache(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale as the stores compute it: fp32 times the fp32 inverse (x itself at 1)."""
    if scale == 1.0:
        return x
    return x.float() * torch.tensor(1.0 / scale, dtype=torch.float32)


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
    return cache.index_select(0, block_table[:n]).flatten(0, 1)[:length]


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    context_lens: list[int],
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention for a ragged batch whose keys live in the paged cache.

    Sequence i has query_lens[i] new tokens, the last ones of its context_lens[i] tokens
    (the rest are cached prefix), so query j sits at position context - query_len + j.
    The cache's entries times k_scale / v_scale are K and V (see `store_kv`).
    """
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, ctx) in enumerate(zip(query_lens, context_lens)):
        qi = q[start : start + q_len].transpose(0, 1)  # [H, q_len, D]
        ki = _gather_context(k_cache, block_tables[i], ctx).transpose(0, 1).to(q.dtype)
        vi = _gather_context(v_cache, block_tables[i], ctx).transpose(0, 1).to(q.dtype)
        if q_len == ctx:  # no cached prefix: plain causal attention
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale * k_scale, enable_gqa=True)
        else:
            q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale * k_scale, enable_gqa=True)
        if v_scale != 1.0:
            o = o.float() * v_scale
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    context_lens_host: list[int] | None = None,
) -> torch.Tensor:
    """One query token per sequence, q [B, H, D], attending to its context_lens[b] cached
    tokens (the cache's entries times k_scale / v_scale are K and V), in fp32.

    One sequence whose length the host knows (`context_lens_host`) gathers exactly its
    context and attends unmasked, as transformers' own decode does; a batch gathers every
    row's table and masks what lies past each length."""
    batch = q.shape[0]
    if batch == 1 and context_lens_host is not None:
        k = _gather_context(k_cache, block_tables[0], context_lens_host[0])[None]
        v = _gather_context(v_cache, block_tables[0], context_lens_host[0])[None]
        mask = None
    else:
        k = k_cache[block_tables].flatten(1, 2)  # [B, max_blocks * block_size, Hkv, D]
        v = v_cache[block_tables].flatten(1, 2)
        mask = (torch.arange(k.shape[1], device=q.device)[None, :] < context_lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.float()[:, :, None], k.float().transpose(1, 2), v.float().transpose(1, 2), attn_mask=mask,
        scale=scale * k_scale, enable_gqa=True,
    )[:, :, 0]
    if v_scale != 1.0:
        out = out * v_scale
    return out.to(q.dtype)


def resolve_rows(
    input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, context_lens: torch.Tensor,
    shift: torch.Tensor, prev_index: torch.Tensor, follow: torch.Tensor, follow_k: torch.Tensor,
    block_tables: torch.Tensor, block_size: int, prev_tokens: torch.Tensor, prev_inputs: torch.Tensor,
    max_k: int,
) -> None:
    """`ops.resolve_rows` in plain PyTorch, in place."""
    n = input_ids.numel()
    ref, k = follow[:n], follow_k[:n]
    follows = ref >= 0
    j = torch.arange(max_k, device=ref.device)
    at = (ref - k)[:, None] + j[None, :]
    live = follows[:, None] & (j[None, :] < k[:, None])
    at = torch.where(live, at, torch.zeros_like(at))
    match = live & (prev_tokens[at] == prev_inputs[at + 1])
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    s = torch.where(follows, accepted - k, torch.zeros_like(k))
    shift[:n] = s
    positions[:n] += s
    # Rows that move are decode rows, one token each: token i is attention row i (a mixed
    # step has fewer attention rows than tokens, its prompt chunks after them).
    rows = min(n, context_lens.numel())
    context_lens[:rows] += s[:rows].to(context_lens.dtype)
    pos = positions[:n]
    row = torch.where(follows, torch.arange(n, device=ref.device), torch.zeros_like(ref))
    block = block_tables[row, torch.where(follows, pos // block_size, torch.zeros_like(pos))].long()
    slots[:n] = torch.where(follows, block * block_size + pos % block_size, slots[:n])
    src = prev_index[:n]
    take = src >= 0
    input_ids[:] = torch.where(take, prev_tokens[torch.where(take, src + s, torch.zeros_like(src))], input_ids)


def prompt_lookup(tokens: torch.Tensor, k: int, min_n: int, max_n: int) -> torch.Tensor:
    """The up to k tokens after the latest earlier end of the longest match (min_n..max_n
    tokens) of the suffix of `tokens` (1-D); empty when there is none."""
    size = tokens.numel()
    if size <= min_n:
        return tokens[:0]
    ends = torch.arange(size - 1, device=tokens.device)
    match = torch.zeros(size - 1, dtype=torch.long, device=tokens.device)
    still = torch.ones(size - 1, dtype=torch.bool, device=tokens.device)
    for j in range(max_n):
        still = still & (ends >= j) & (tokens[(ends - j).clamp(min=0)] == tokens[size - 1 - j])
        match += still.long()
    best = int(match.max()) if size > 1 else 0
    if best == 0 or best < min_n:
        return tokens[:0]
    first = int(ends[match == best].max()) + 1
    return tokens[first : first + k]


def lookup_drafts(
    input_ids: torch.Tensor, history: torch.Tensor, offsets: torch.Tensor, starts: torch.Tensor,
    slots: torch.Tensor, refs: torch.Tensor, ref_k: torch.Tensor, prev_tokens: torch.Tensor,
    prev_inputs: torch.Tensor, min_n: int, max_n: int, max_k: int,
) -> None:
    """`ops.lookup_drafts` in plain PyTorch, in place."""
    for r in range(starts.numel()):
        k, base = int(ref_k[r]), int(refs[r] - ref_k[r])
        accepted = 0
        while accepted < k and prev_tokens[base + accepted] == prev_inputs[base + accepted + 1]:
            accepted += 1
        tokens = torch.cat([history[offsets[r] : offsets[r + 1]], prev_inputs[base + 1 : base + 1 + accepted],
                            prev_tokens[base + accepted : base + accepted + 1]])
        drafts = prompt_lookup(tokens, int(slots[r]), min_n, max_n)
        at = int(starts[r]) + 1
        input_ids[at : at + drafts.numel()] = drafts


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


# ---- DeepSeek MLA (multi-head latent attention) ------------------------------------------
#
# The latent cache holds one row of L + R values per token and layer: the RMS-normalised
# latent c_kv (L = kv_lora_rank columns), then the rotated rope key k_pe shared by all
# heads (R = qk_rope_head_dim columns). Layout [num_blocks, block_size, L + R] (the pool's
# [num_blocks, block_size, 1, L + R] works too), paged by block tables.


def _mla_rope(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """DeepSeek's rope on x [T, heads, R] as transformers' DeepseekV2 computes it: in fp32
    with fp32 cos/sin, rounded once to x's dtype. GPT-J (interleaved) pairs (2i, 2i + 1)
    rotated by frequency i keep their places in the output (V2's view_as_complex; V3's
    `apply_rotary_pos_emb_interleave` writes the same values de-interleaved, a permutation
    shared by q and k that leaves every score unchanged)."""
    return apply_rotary(positions, x.float(), cos_sin_cache.float(), is_neox).to(x.dtype)


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
    """The step's new tokens into the latent cache. kv_a [T, L + R] (kv_a_proj_with_mqa's
    output: raw latent, then the un-rotated rope key) is rewritten in place as
    [rms_norm(latent) | rope(k_pe)], and those rows go into kv_cache at slot_mapping
    (-1 = padding, not stored; an fp8 cache holds them divided by `cache_scale`); q_pe
    [T, H, R] is rotated in place. Returns the views (latent [T, L], k_pe [T, R]) of kv_a."""
    rank = norm_weight.shape[0]
    latent = rms_norm(kv_a[:, :rank], norm_weight, eps)
    k_pe = _mla_rope(positions, kv_a[:, None, rank:], cos_sin_cache, is_neox)[:, 0]
    q_pe.copy_(_mla_rope(positions, q_pe, cos_sin_cache, is_neox))
    kv_a[:, :rank] = latent
    kv_a[:, rank:] = k_pe
    keep = slot_mapping >= 0
    rows = to_cache_dtype(scaled_for_cache(kv_a[keep], cache_scale), kv_cache.dtype)
    kv_cache.view(-1, kv_cache.shape[-1])[slot_mapping[keep]] = rows
    return kv_a[:, :rank], kv_a[:, rank:]


def mla_absorb_query(q: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """The absorbed decode query [T, H, L + R]: q [T, H, Dn + R] (q_pe already rotated)
    as [q_nope @ W_UK | q_pe], w_uk [H, Dn, L] (kv_b_proj's per-head key rows)."""
    dn = w_uk.shape[1]
    q_lat = torch.bmm(q[..., :dn].transpose(0, 1), w_uk).transpose(0, 1)
    return torch.cat((q_lat, q[..., dn:]), dim=-1)


def mla_rope_store_absorb(
    kv_a: torch.Tensor, q: torch.Tensor, w_uk: torch.Tensor, positions: torch.Tensor, norm_weight: torch.Tensor,
    eps: float, cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    is_neox: bool = False, cache_scale: float = 1.0,
) -> torch.Tensor:
    """A decode step's MLA input side: mla_rope_store (q's last R columns rotated in
    place), then the absorbed query mla_absorb_query(q, w_uk) [T, H, L + R]."""
    mla_rope_store(kv_a, q[..., w_uk.shape[1]:], positions, norm_weight, eps, cos_sin_cache, kv_cache, slot_mapping,
                   is_neox, cache_scale)
    return mla_absorb_query(q, w_uk)


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    cache_scale: float = 1.0,
) -> torch.Tensor:
    """Absorbed MLA decode: q [N, H, L + R] (q_nope @ W_UK, then the rotated q_pe) scores
    every cached row over all L + R columns and averages the rows' latent parts:
    out [N, H, L] = softmax(scale * q . row) @ row[:L], a row being the cache's entry times
    `cache_scale` (an fp8 cache's). A context of 0 gives zeros. No host reads of device
    values (capturable in a CUDA graph)."""
    batch = q.shape[0]
    rows = kv_cache.reshape(*kv_cache.shape[:2], kv_cache.shape[-1])
    keys = rows[block_tables[:batch]].flatten(1, 2).float()  # [N, max_blocks * block_size, L + R]
    scores = torch.einsum("bhd,btd->bht", q.float(), keys) * (scale * cache_scale)
    valid = torch.arange(keys.shape[1], device=q.device)[None, :] < context_lens[:batch, None]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).nan_to_num(0.0)  # context 0: every score -inf
    return (torch.einsum("bht,btl->bhl", probs, keys[..., :kv_lora_rank]) * cache_scale).to(q.dtype)


def mla_prefill_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_query_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal MLA prefill over materialised keys and values: q_nope [T, H, Dn], q_pe
    [T, H, R], k_nope [Tk, H, Dn], k_pe [Tk, R] (one rope key for all heads), v [Tk, H, Dv]
    -> out [T, H, Dv]. Sequence s owns query rows cu_q[s]:cu_q[s+1] (nq of them) and key
    rows cu_k[s]:cu_k[s+1] (nk >= nq: its cached prefix, then its new tokens); query i sits
    at position nk - nq + i and sees keys 0 .. nk - nq + i. Computed in fp32: the one
    window that holds every key."""
    key_lens = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    out, _ = mla_prefill_attention_window(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k,
                                          torch.zeros_like(key_lens), key_lens, max_query_len, scale)
    return out


def mla_prefill_attention_window(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    key_start: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal MLA prefill over a window of each sequence's keys: key rows
    cu_k[s]:cu_k[s+1] sit at positions key_start[s], key_start[s] + 1, ... of a context
    of context_lens[s] tokens whose last nq are the queries (query i at position
    context_lens[s] - nq + i sees the window's keys up to that position). Returns the
    partial output [T, H, Dv] and its log-sum-exp [T, H] (fp32, natural log) for merging
    windows (`merge_attention_partials`); a query that sees none of the window's keys
    gets output 0 and log-sum-exp -inf. Computed in fp32. `max_query_len` is the kernel's
    grid bound, unused here."""
    del max_query_len
    heads = q_nope.shape[1]
    out = torch.zeros(q_nope.shape[0], heads, v.shape[-1], dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.full((q_nope.shape[0], heads), float("-inf"), dtype=torch.float32, device=q_nope.device)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    starts, ctx_lens = key_start.tolist(), context_lens.tolist()
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        nq, nk = q1 - q0, k1 - k0
        if nq == 0 or nk == 0:
            continue
        q = torch.cat((q_nope[q0:q1], q_pe[q0:q1]), dim=-1).float().transpose(0, 1)  # [H, nq, Dn + R]
        k_rope = k_pe[k0:k1, None, :].expand(-1, heads, -1)
        k = torch.cat((k_nope[k0:k1], k_rope), dim=-1).float().transpose(0, 1)  # [H, nk, Dn + R]
        scores = q @ k.transpose(1, 2) * scale
        q_pos = ctx_lens[s] - nq + torch.arange(nq, device=q.device)
        k_pos = starts[s] + torch.arange(nk, device=q.device)
        visible = k_pos[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [H, nq]; -inf where nothing is visible
        probs = torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)
        out[q0:q1] = (probs @ v[k0:k1].float().transpose(0, 1)).transpose(0, 1).to(out.dtype)
        lse[q0:q1] = row_lse.transpose(0, 1)
    return out, lse


def merge_attention_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys A and B from the attention over each: outputs [T, H, D] and
    log-sum-exps [T, H] (natural log, -inf where a part saw no key) -> the merged pair in
    fp32, so that merging many parts rounds to the model's dtype once, at the end."""
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    w_a = torch.where(finite, torch.exp(lse_a - safe), torch.zeros_like(lse))[..., None]
    w_b = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(lse))[..., None]
    return out_a.float() * w_a + out_b.float() * w_b, lse


# ---- fused MoE (routed experts) ---------------------------------------------------------


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None, w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), expert e(x) =
    silu(x @ gate_e^T) * (x @ up_e^T) @ w2[e]^T, with w13 [E_local, 2I, D] = [gate | up]
    rows and w2 [E_local, D, I]. Under EP, expert_map [E_global] gives the local index
    or -1 (that slot contributes 0). One expert at a time, in x's dtype like the dense
    MLP; the weighted sum over k in fp32 (or x's dtype when wider). e4m3 weights come
    with one scale per row (w13_scale [E, 2I], w2_scale [E, D]) or, with `block` (rows,
    columns), one per block of each expert's matrix (w13_scale [E, 2I / rows, ceil(D /
    columns)], w2_scale [E, ceil(D / rows), ceil(I / columns)]; I a multiple of rows, so
    no block mixes gate and up rows): each projection in fp32 on the weights' values
    (`fp8_weight_values`), then in x's dtype."""
    local = topk_ids.long() if expert_map is None else expert_map.long()[topk_ids.long()]
    acc = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(x.shape, dtype=acc, device=x.device)

    def project(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if scale is None:
            return F.linear(a, w)
        if block is not None:
            return F.linear(a.float(), fp8_weight_values(w, scale, block)).to(a.dtype)
        return (F.linear(a.float(), w.float()) * scale.float()).to(a.dtype)

    for e in range(w13.shape[0]):
        tok, j = torch.nonzero(local == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        s13 = None if w13_scale is None else w13_scale[e]
        s2 = None if w2_scale is None else w2_scale[e]
        y = project(silu_and_mul(project(x[tok], w13[e], s13)), w2[e], s2)
        out.index_add_(0, tok, y.to(acc) * topk_weights[tok, j].to(acc)[:, None])
    return out.to(x.dtype)


def _group_mask(group_scores: torch.Tensor, topk_groups: int, num_experts: int) -> torch.Tensor:
    """[T, E] bool: the experts of each token's `topk_groups` best groups."""
    groups = group_scores.shape[-1]
    chosen = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, chosen, 1.0)
    return mask.unsqueeze(-1).expand(-1, groups, num_experts // groups).reshape(-1, num_experts).bool()


def moe_route(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scoring: str, top_k: int, num_groups: int,
    topk_groups: int, norm_topk_prob: bool, scaling: float, num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE routing as transformers computes it, in fp32: logits = x @ weight^T (weight
    [E, D] fp32), then by `scoring`
    - softmax (DeepSeek-V2, Qwen3-MoE, Mixtral): probabilities, top-k over all experts or,
      with `num_groups` > 1, within the `topk_groups` groups holding the best single expert;
    - sigmoid (DeepSeek-V3): scores; experts chosen by score + bias (`bias`, or none) within
      the `topk_groups` groups whose two best (biased) experts score highest, weighted by
      their unbiased scores.
    The k weights renormalised to sum to 1 when `norm_topk_prob`, then times `scaling`.
    Returns (weights [T, k] fp32, expert ids [T, k] int64); with
    `num_shared` S, S more columns follow: experts E .. E + S - 1 at weight 1.0 (shared
    experts stored after the routed ones, run as experts every token is routed to)."""
    logits = F.linear(x.float(), weight)
    e, k = weight.shape[0], top_k
    if scoring == "sigmoid":
        scores = logits.sigmoid()
        choice = scores if bias is None else scores + bias
        if num_groups > 1:
            group_scores = choice.view(-1, num_groups, e // num_groups).topk(2, dim=-1)[0].sum(dim=-1)
            choice = choice.masked_fill(~_group_mask(group_scores, topk_groups, e), float("-inf"))
        ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    else:
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if num_groups > 1:
            group_scores = scores.view(-1, num_groups, e // num_groups).max(dim=-1).values
            scores = scores.masked_fill(~_group_mask(group_scores, topk_groups, e), 0.0)
        weights, ids = torch.topk(scores, k=k, dim=-1, sorted=False)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * scaling
    if num_shared:
        shared = torch.arange(e, e + num_shared, device=ids.device, dtype=ids.dtype).expand(ids.shape[0], -1)
        weights = torch.cat([weights, torch.ones(shared.shape, dtype=weights.dtype, device=weights.device)], dim=1)
        ids = torch.cat([ids, shared], dim=1)
    return weights, ids


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
