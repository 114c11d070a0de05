"""Kernel entry points. Each picks the Triton kernel for CUDA tensors (when Triton is
importable) and the PyTorch reference otherwise, so the same model code runs on CPU
and GPU. Triton is imported only when a CUDA tensor first needs it."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from agent_infer.kernels import reference


@functools.cache
def triton_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _use_triton(x):
        from agent_infer.kernels.triton import norm

        return norm.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual). The Triton version works in place:
    x receives the normalised output and residual the sum."""
    if _use_triton(x):
        from agent_infer.kernels.triton import norm

        return norm.fused_add_rms_norm(x, residual, weight, eps)
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if _use_triton(x):
        from agent_infer.kernels.triton import activation

        return activation.silu_and_mul(x)
    return reference.silu_and_mul(x)


def norm_rope_store(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
    cos_sin_cache: torch.Tensor, is_neox: bool,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q [T, H, D] and k [T, Hkv, D] (skipped when the weights are
    None), RoPE on both, then k and v into the paged caches at slot_mapping (-1 = skip;
    an fp8 cache takes k / k_scale, v / v_scale). Returns (q, k); the Triton version is
    one kernel working in place."""
    if _use_triton(q):
        from agent_infer.kernels.triton import rope_store

        return rope_store.norm_rope_store(
            positions, q, k, v, q_weight, k_weight, eps, cos_sin_cache, is_neox, k_cache, v_cache, slot_mapping,
            k_scale=k_scale, v_scale=v_scale,
        )
    if q_weight is not None:
        q, k = reference.rms_norm(q, q_weight, eps), reference.rms_norm(k, k_weight, eps)
    cos, sin = reference.rotary_cos_sin(positions, cos_sin_cache, q.dtype)
    q, k = reference.rotate(q, cos, sin, is_neox), reference.rotate(k, cos, sin, is_neox)
    reference.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q, k


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v [T, Hkv, D] into the paged caches at slot_mapping (-1 = skip; an fp8 cache
    takes k / k_scale, v / v_scale)."""
    if _use_triton(k):
        from agent_infer.kernels.triton import kv_store

        kv_store.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    reference.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def fp8_kernels(device: torch.device) -> bool:
    """Whether fp8 weights run as fp8 on `device`: the Triton kernels on a GPU of compute
    capability 8.9 or later (e4m3 conversions in hardware). Elsewhere they are dequantized
    once after loading."""
    if device.type != "cuda" or not triton_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def moe_takes_scales(block: tuple[int, int] | None) -> bool:
    """Whether the fused MoE on fp8 kernels takes e4m3 experts with these scales (per
    row: None, or per block) as they are."""
    from agent_infer.kernels.triton.fused_moe_configs import takes_blocks

    return takes_blocks(block)


def _gemv_ok(x: torch.Tensor, weight: torch.Tensor, rows: bool = False) -> bool:
    """Batch-1 projections go through the Triton GEMV (reads the weight faster than
    cuBLAS at M = 1, see docs/PERFORMANCE.md); everything else through F.linear (fp8
    weights: the W8A8 GEMM). `rows`: x's rows, each as a batch of one (`_each_row`)."""
    return (
        _use_triton(x) and x.dim() == 2 and (x.stride(-1) == 1 if rows else x.shape[0] == 1 and x.is_contiguous())
        and weight.is_contiguous() and (x.dtype == weight.dtype or weight.dtype == torch.float8_e4m3fn)
        and x.shape[1] % 16 == 0
    )


def _few_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A projection of a few 16-bit rows over a weight of their dtype on the Triton path:
    the few-row GEMV on the tensor cores, which reads the weights faster than cuBLAS at
    2-16 rows (docs/PERFORMANCE.md)."""
    if not _use_triton(x):
        return False
    from agent_infer.kernels.triton import gemv_rows_mma

    return gemv_rows_mma.takes(x, weight)


def _each_row(x: torch.Tensor, invariant_rows: int) -> bool:
    """The batch-invariant mode (EngineConfig.batch_invariant): a projection of 2 to
    `invariant_rows` rows (a decode or verify step's) computes each row exactly as a
    step of one row does, so a token's logits do not depend on what else is in its step.
    On a GPU (fp8 weights; 16- and 32-bit ones take `_invariant_gemm` first) the batch-1
    GEMV takes all the rows in one launch (a grid axis over them); elsewhere the rows go
    one by one through the batch-1 path."""
    return invariant_rows > 1 and x.dim() == 2 and 1 < x.shape[0] <= invariant_rows


def _invariant_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, invariant_rows: int) -> bool:
    """The batch-invariant mode on a GPU with 16- or 32-bit weights: a decode or verify
    step's projections of 1 to `invariant_rows` rows all run the few-row GEMV on the
    tensor cores (gemv_rows_mma.linear_rows_mma), the one-row steps too: its tile follows
    the weight's shape alone and x's rows go in 16-row tiles, so a row's sums do not
    depend on the rows beside it, and the weight is read once for a tile of them. Its
    epilogue ends a [gate; up] projection in SiLU-and-mul; the add + norm after a
    projection is the one-program-a-row kernel. fp8 weights take the batch-1 GEMV's row
    grid (`_each_row`)."""
    if not (invariant_rows > 1 and scale is None and 1 <= x.shape[0] <= invariant_rows and _use_triton(x)):
        return False
    from agent_infer.kernels.triton import gemv_rows_mma

    return gemv_rows_mma.fits(x, weight)


def _linear_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      silu_mul: bool = False) -> torch.Tensor:
    from agent_infer.kernels.triton import gemv_rows_mma

    return gemv_rows_mma.linear_rows_mma(x, weight, bias, silu_mul=silu_mul)


def _row_by_row(fn, x: torch.Tensor, *args) -> torch.Tensor:
    return torch.cat([fn(x[i:i + 1], *args) for i in range(x.shape[0])])


def _fp8_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor,
              block: tuple[int, int] | None) -> torch.Tensor:
    """x [M, K] @ the fp8 weight's values^T: activations quantized per token (and group of
    block[1] features), the W8A8 GEMM; on CPU the reference, x times the dequantized weight."""
    if _use_triton(x):
        from agent_infer.kernels.triton import fp8_gemm

        return fp8_gemm.fp8_linear(x, weight, scale, block, bias)
    return reference.fp8_linear(x, weight, scale, block, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
           invariant_rows: int = 0) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias). An fp8 weight comes with its `scale`, one per
    `block` (rows, columns) or, without a block, per row. One row takes the batch-1 GEMV,
    2-16 16-bit rows the few-row GEMV (`_few_rows`), the rest cuBLAS or the W8A8 GEMM;
    up to `invariant_rows` rows each as one row (`_invariant_gemm`, `_each_row`)."""
    if _invariant_gemm(x, weight, scale, invariant_rows):
        return _linear_invariant(x, weight, bias)
    if _each_row(x, invariant_rows):
        if _gemv_ok(x, weight, rows=True):
            from agent_infer.kernels.triton import gemv

            return gemv.linear_m1(x, weight, bias, scale=scale, block=block)
        return _row_by_row(linear, x, weight, bias, scale, block)
    if _gemv_ok(x, weight):
        from agent_infer.kernels.triton import gemv

        return gemv.linear_m1(x, weight, bias, scale=scale, block=block)
    if scale is not None:
        return _fp8_gemm(x, weight, bias, scale, block)
    if _few_rows(x, weight):
        from agent_infer.kernels.triton import gemv_rows_mma

        return gemv_rows_mma.linear_rows_mma(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                    invariant_rows: int = 0) -> torch.Tensor:
    """silu_and_mul(linear(x, weight, bias)) for a [gate | up] weight [2N, K] -> [M, N];
    one kernel on the batch-1 and few-row GEMV paths. `invariant_rows` as in `linear`."""
    if _invariant_gemm(x, weight, scale, invariant_rows):
        return _linear_invariant(x, weight, bias, silu_mul=True)
    each_row = _each_row(x, invariant_rows)
    if each_row and not _gemv_ok(x, weight, rows=True):
        return _row_by_row(linear_silu_mul, x, weight, bias, scale, block)
    if each_row or _gemv_ok(x, weight):
        from agent_infer.kernels.triton import gemv

        if gemv.fuses_scale(weight.shape[0] // 2, block):
            return gemv.linear_m1(x, weight, bias, silu_mul=True, scale=scale, block=block)
    if scale is None and not each_row and _few_rows(x, weight):  # SiLU in the few-row GEMV's epilogue
        from agent_infer.kernels.triton import gemv_rows_mma

        return gemv_rows_mma.linear_rows_mma(x, weight, bias, silu_mul=True)
    return silu_and_mul(linear(x, weight, bias, scale, block, invariant_rows))


def linear_add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, counter: torch.Tensor,
    scale: torch.Tensor | None = None, block: tuple[int, int] | None = None, invariant_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm(linear(x, weight, bias), residual, norm_weight, eps): returns
    (normed, residual). At batch 1 on the GEMV path one launch does it all (the last
    program adds and normalises, found with `counter`, an int32 [1] zero between calls);
    several rows take the add + norm kernel after the projection, one program a row (a
    last program would walk the rows one after another: gemv_rows_mma.py).
    `invariant_rows` as in `linear`; the batch-1 GEMV's row grid then takes one counter per
    row."""
    if _invariant_gemm(x, weight, scale, invariant_rows):
        return fused_add_rms_norm(_linear_invariant(x, weight, bias), residual, norm_weight, eps)
    each_row = _each_row(x, invariant_rows)
    if (_gemv_ok(x, weight, rows=each_row) and residual.dtype == x.dtype
            and (residual.stride(-1) == 1 and counter.numel() >= x.shape[0] if each_row else residual.is_contiguous())):
        from agent_infer.kernels.triton import gemv

        if weight.shape[0] <= gemv.MAX_ADD_NORM_FEATURES:
            return gemv.linear_m1_add_rms_norm(x, weight, bias, residual, norm_weight, eps, counter,
                                               scale=scale, block=block)
    if each_row:
        pairs = [linear_add_rms_norm(x[i:i + 1], weight, bias, residual[i:i + 1], norm_weight, eps, counter,
                                     scale, block) for i in range(x.shape[0])]
        normed, summed = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
        residual.copy_(summed)  # in place, as the GEMV path is
        return normed, residual
    return fused_add_rms_norm(linear(x, weight, bias, scale, block), residual, norm_weight, eps)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """First index of each row's maximum, [B] int64 (greedy sampling)."""
    if _use_triton(logits) and logits.dim() == 2 and logits.stride(-1) == 1:
        from agent_infer.kernels.triton import tokens

        return tokens.argmax(logits)
    return logits.argmax(dim=-1)


def fill_placeholders(input_ids: torch.Tensor, prev_index: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    """input_ids[i] <- prev_tokens[prev_index[i]] where prev_index[i] >= 0: input tokens
    that were sampled by the previous step and never left the device. May work in place;
    returns the result."""
    if _use_triton(input_ids) and input_ids.is_contiguous() and prev_index.is_contiguous():
        from agent_infer.kernels.triton import tokens

        return tokens.fill_placeholders(input_ids, prev_index, prev_tokens)
    return torch.where(prev_index >= 0, prev_tokens[prev_index.clamp(min=0)], input_ids)


def resolve_rows(
    input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, context_lens: torch.Tensor,
    shift: torch.Tensor, prev_index: torch.Tensor, follow: torch.Tensor, follow_k: torch.Tensor,
    block_tables: torch.Tensor, block_size: int, prev_tokens: torch.Tensor, prev_inputs: torch.Tensor,
    max_k: int,
) -> None:
    """In place, the rows of a step (decode rows first, one token each) whose sequence has a
    verify row still in flight in the previous step: row i with follow[i] = r >= 0 belongs
    to a sequence whose verify row there has follow_k[i] = k drafts (input rows r - k + 1
    .. r of that step, `prev_inputs`, checked against its samples at rows r - k .. r - 1,
    `prev_tokens`), and was placed as if all k were accepted. With a accepted, the row
    moves back by k - a: its position and context length, and its cache slot (from its
    block table row). Every row with prev_index[i] >= 0 then takes the previous step's
    sample prev_index[i] + shift (the sequence's real last token; plain placeholders have
    no shift), and shift[i] records the move (0 elsewhere). `max_k` bounds k."""
    impl = reference.resolve_rows
    if _use_triton(input_ids):
        from agent_infer.kernels.triton import tokens

        impl = tokens.resolve_rows
    impl(input_ids, positions, slots, context_lens, shift, prev_index, follow, follow_k, block_tables, block_size,
         prev_tokens, prev_inputs, max_k)


def lookup_drafts(
    input_ids: torch.Tensor, history: torch.Tensor, offsets: torch.Tensor, starts: torch.Tensor,
    slots: torch.Tensor, refs: torch.Tensor, ref_k: torch.Tensor, prev_tokens: torch.Tensor,
    prev_inputs: torch.Tensor, min_n: int, max_n: int, max_k: int,
) -> None:
    """Prompt lookup for rows drafted behind a row still in flight, in place: lookup row r
    (its first input token at starts[r], then slots[r] draft slots) belongs to a sequence
    whose known tokens are history[offsets[r]:offsets[r + 1]] and whose row in flight
    ends at sample refs[r] after ref_k[r] drafts (input rows refs[r] - ref_k[r] + 1 ..
    refs[r] of the previous step, `prev_inputs`, checked against its samples at rows
    refs[r] - ref_k[r] .. refs[r] - 1, `prev_tokens`). Its history is the known tokens,
    the drafts accepted and the sample after them; the slots take what followed the
    latest earlier occurrence of its longest matching suffix (prompt_lookup_min `min_n`
    to prompt_lookup_max `max_n` tokens), as many as there are, and keep their ids past
    that. `max_k` bounds slots and ref_k (int64 tensors, contiguous)."""
    impl = reference.lookup_drafts
    if _use_triton(input_ids):
        from agent_infer.kernels.triton import ngram

        impl = ngram.lookup_drafts
    impl(input_ids, history, offsets, starts, slots, refs, ref_k, prev_tokens, prev_inputs, min_n, max_n, max_k)


def gumbel_sample(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """argmax(logits / T - log(-log u)) per row, u hashed from (seed, step, token); T = 0: argmax."""
    if _use_triton(logits) and logits.stride(-1) == 1:
        from agent_infer.kernels.triton import sampling

        return sampling.gumbel_sample(logits, temperature, seeds, steps)
    return reference.gumbel_sample(logits, temperature, seeds, steps)


# ---- DeepSeek MLA (multi-head latent attention) ------------------------------------------


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """A reference result, copied into the caller's `out` when one is given (the Triton
    versions write there directly)."""
    if out is None:
        return result
    return out.copy_(result)


def mla_rope_store(
    kv_a: torch.Tensor, q_pe: torch.Tensor, positions: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, is_neox: bool = False,
    cache_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_a [T, L + R] <- [rms_norm(latent) | rope(k_pe)] in place and into the latent cache
    at slot_mapping (-1 = skip; an fp8 cache takes them divided by `cache_scale`); q_pe
    [T, H, R] rotated in place (interleaved pairs unless is_neox). Returns the views
    (latent [T, L], k_pe [T, R]); one kernel on the GPU."""
    if _use_triton(kv_a):
        from agent_infer.kernels.triton.mla_rope_store import mla_rope_store as triton_mla_rope_store

        return triton_mla_rope_store(kv_a, q_pe, positions, norm_weight, eps, cos_sin_cache, kv_cache, slot_mapping,
                                     is_neox, cache_scale)
    return reference.mla_rope_store(kv_a, q_pe, positions, norm_weight, eps, cos_sin_cache, kv_cache, slot_mapping,
                                    is_neox, cache_scale)


def mla_absorb_query(q: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """reference.mla_absorb_query, [q_nope @ w_uk | q_pe] [T, H, L + R] for q [T, H, Dn +
    R] and w_uk [H, Dn, L], with the batched GEMM writing its rows into the result
    (cuBLAS takes the strided output as is): only q_pe is copied, not the whole query as
    a concatenation would (at batch 256 on V2-Lite 0.5 of its 4.7 MB)."""
    heads, dn, lat = w_uk.shape
    out = q.new_empty(q.shape[0], heads, lat + q.shape[2] - dn)
    torch.bmm(q[..., :dn].transpose(0, 1), w_uk, out=out[..., :lat].transpose(0, 1))
    out[..., lat:] = q[..., dn:]
    return out


def mla_rope_store_absorb(
    kv_a: torch.Tensor, q: torch.Tensor, w_uk: torch.Tensor, positions: torch.Tensor, norm_weight: torch.Tensor,
    eps: float, cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    is_neox: bool = False, cache_scale: float = 1.0,
) -> torch.Tensor:
    """mla_rope_store with q [T, H, Dn + R] (its last R columns rotated in place), then the
    absorbed decode query [T, H, L + R] = [q_nope @ w_uk | q_pe] for w_uk [H, Dn, L].
    One kernel on the GPU for up to `ABSORB_MAX_TOKENS` tokens; beyond, the rope + store
    kernel, a batched GEMM into the result and a copy of q_pe."""
    if _use_triton(kv_a):
        from agent_infer.kernels.triton import mla_rope_store as mrs

        if q.shape[0] <= mrs.ABSORB_MAX_TOKENS:
            return mrs.mla_rope_store_absorb(kv_a, q, w_uk, positions, norm_weight, eps, cos_sin_cache, kv_cache,
                                             slot_mapping, is_neox, cache_scale)
        mla_rope_store(kv_a, q[..., w_uk.shape[1]:], positions, norm_weight, eps, cos_sin_cache, kv_cache,
                       slot_mapping, is_neox, cache_scale)
        return mla_absorb_query(q, w_uk)
    return reference.mla_rope_store_absorb(kv_a, q, w_uk, positions, norm_weight, eps, cos_sin_cache, kv_cache,
                                           slot_mapping, is_neox, cache_scale)


def mla_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
    scale: float, kv_lora_rank: int, out: torch.Tensor | None = None, counters: torch.Tensor | None = None,
    cache_scale: float = 1.0,
) -> torch.Tensor:
    """Absorbed MLA decode: q [N, H, L + R] over the latent cache -> [N, H, L] (into `out`
    when given; an fp8 cache's entries times `cache_scale` are the rows). `counters` (from
    triton.mla_decode.mla_decode_counters, allocated once by the GPU path) lets the Triton
    kernel merge its splits in one launch; the reference ignores it."""
    if _use_triton(q):
        from agent_infer.kernels.triton.mla_decode import mla_decode as triton_mla_decode

        return triton_mla_decode(q, kv_cache, block_tables, context_lens, scale, kv_lora_rank, out=out,
                                 counters=counters, cache_scale=cache_scale)
    return _into(out, reference.mla_decode(q, kv_cache, block_tables, context_lens, scale, kv_lora_rank,
                                           cache_scale))


def merge_attention_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two sets of keys from each set's output and log-sum-exp, in fp32 (see
    the reference; a few elementwise ops, on any device)."""
    return reference.merge_attention_partials(out_a, lse_a, out_b, lse_b)


def mla_prefill_attention(
    q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_query_len: int, scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ragged causal MLA prefill over materialised K/V (q_nope . k_nope + q_pe . k_pe, k_pe
    shared by the heads) -> [T, H, Dv]; sequence s's queries are the last of its keys."""
    if _use_triton(q_nope):
        from agent_infer.kernels.triton.mla_prefill import mla_prefill_attention as triton_mla_prefill

        return triton_mla_prefill(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_query_len, scale,
                                  out=out)
    return _into(out, reference.mla_prefill_attention(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k,
                                                      max_query_len, scale))


# ---- fused MoE (routed experts) ---------------------------------------------------------


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None, out: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) -> [T, D]: w13 [E_local,
    2I, D] (gate rows, then up rows), w2 [E_local, D, I], topk_weights [T, k] fp32,
    topk_ids [T, k]; expert_map [E_global] int32 (local index or -1) under EP; e4m3
    weights with one scale per row (w13_scale [E_local, 2I], w2_scale [E_local, D]) or
    per `block` of each expert's matrices (reference.fused_moe gives the shapes). The
    Triton path is graph-safe (no host sync); the reference loops over experts."""
    if _use_triton(x):
        from agent_infer.kernels.triton import fused_moe as moe

        return moe.fused_moe(x, w13, w2, topk_weights, topk_ids, expert_map, out=out, w13_scale=w13_scale,
                             w2_scale=w2_scale, block=block)
    return _into(out, reference.fused_moe(x, w13, w2, topk_weights, topk_ids, expert_map, w13_scale, w2_scale,
                                          block))


def moe_route(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scoring: str, top_k: int, num_groups: int,
    topk_groups: int, norm_topk_prob: bool, scaling: float, counter: torch.Tensor, num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE router on x [T, D] with fp32 weight [E, D] (reference.moe_route):
    (weights [T, k + num_shared] fp32, expert ids [T, k + num_shared]), the shared
    experts' columns last. On a GPU a step of up to router.FUSED_LOGITS_MAX_TOKENS
    tokens is one launch (`counter`: int32 [1], zero between calls, for one token), a
    longer one an fp32 GEMM and one launch."""
    if _use_triton(x):
        from agent_infer.kernels.triton import router

        if router.supported(x, weight):
            if x.shape[0] == 1 and x.is_contiguous():
                return router.moe_route_m1(x, weight, bias, scoring, top_k, num_groups, topk_groups, norm_topk_prob,
                                           scaling, counter, num_shared)
            return router.moe_route_rows(x, weight, bias, scoring, top_k, num_groups, topk_groups, norm_topk_prob,
                                         scaling, num_shared)
    return reference.moe_route(x, weight, bias, scoring, top_k, num_groups, topk_groups, norm_topk_prob, scaling,
                               num_shared)


def apply_token_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    """Structured outputs: ban (set to -inf) in logits row rows[r] every token whose bit in
    mask[r] (int32 words, token t at bit t % 32 of word t // 32) is 0. In place."""
    if _use_triton(logits) and logits.stride(-1) == 1 and mask.is_contiguous():
        from agent_infer.kernels.triton import tokens

        tokens.apply_token_bitmask(logits, mask, rows)
        return
    reference.apply_token_bitmask(logits, mask, rows)
