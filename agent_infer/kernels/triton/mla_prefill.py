"""DeepSeek MLA prefill attention: ragged, causal, over keys and values the caller has
materialised (up-projected from the latent through kv_b_proj), without reading the cache.

MLA heads score with two parts: q_nope . k_nope over qk_nope_head_dim (Dn, 128 in the
released models) plus q_pe . k_pe over qk_rope_head_dim (R, 64), where k_pe is one rope
key shared by every head; values have their own width (Dv, 128). Keeping the parts as two
dots keeps both widths powers of two (a 192-wide head would be padded to 256) and reads
k_pe once per key, not once per head.

Grid (query tiles, sequences, heads); the tile count comes from the host's
max_query_len, and tiles past a sequence's own query count exit at once. Each program
runs an online softmax (exp2, fp32 state) over the key tiles: those wholly before its
first query unmasked, then the diagonal band with the causal mask. Prefill runs eagerly
(not in CUDA graphs), so the grid may depend on host integers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from agent_infer.kernels.triton.utils import dot_precision

_LOG2E = 1.4426950408889634
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _attend(
    acc, m_i, l_i, q_nope, q_pe, q_pos,
    kn_ptr, kp_ptr, v_ptr, skn_t, skp_t, sv_t, lo, hi, dn, r, dv, qk_scale,
    NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, EMPTY_ROWS: tl.constexpr = False,
):
    """Key rows lo..hi (kn_ptr / kp_ptr / v_ptr point at the sequence's first key of this
    head) folded into the running softmax state; CAUSAL masks keys after each query.
    EMPTY_ROWS: a row may have seen no key yet (a window past its position), so its
    running maximum may still be -inf (kept out of the exponents: no inf - inf)."""
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kmask = kpos < hi
        krow = kpos.to(tl.int64)
        kn_ptrs = kn_ptr + krow[:, None] * skn_t + dn[None, :]
        kp_ptrs = kp_ptr + krow[:, None] * skp_t + r[None, :]
        v_ptrs = v_ptr + krow[:, None] * sv_t + dv[None, :]
        # Only the band's last tile can run past `hi`: the full tiles before the band end
        # on a tile boundary, so at the real models' widths (no padded columns) they load
        # without masks.
        if CAUSAL or BLOCK_DN != NOPE or BLOCK_R != ROPE or BLOCK_DV != VDIM:
            k_nope = tl.load(kn_ptrs, mask=kmask[:, None] & (dn < NOPE)[None, :], other=0.0)
            k_pe = tl.load(kp_ptrs, mask=kmask[:, None] & (r < ROPE)[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=kmask[:, None] & (dv < VDIM)[None, :], other=0.0)
        else:
            k_nope = tl.load(kn_ptrs)
            k_pe = tl.load(kp_ptrs)
            v = tl.load(v_ptrs)
        s = tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)
        s = tl.dot(q_nope, tl.trans(k_nope), acc=s, input_precision=PRECISION) * qk_scale
        if CAUSAL:
            visible = (kpos[None, :] <= q_pos[:, None]) & kmask[None, :]
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = m_new
        if EMPTY_ROWS:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _mla_prefill_kernel(
    qn_ptr, qp_ptr, kn_ptr, kp_ptr, v_ptr, out_ptr, cuq_ptr, cuk_ptr, kstart_ptr, ctx_ptr, lse_ptr,
    sqn_t, sqn_h, sqp_t, sqp_h, skn_t, skn_h, skp_t, sv_t, sv_h, so_t, so_h, slse_t, qk_scale,
    NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """WINDOW: the keys are a window of the context (kstart_ptr: each sequence's first key
    position, ctx_ptr: its context length); every tile is masked, rows that see no key
    get 0, and the log-sum-exp goes to lse_ptr for merging windows."""
    # Reversed so the longest (last) query tiles of the causal triangle start first.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    q_start = tl.load(cuq_ptr + seq)
    q_len = tl.load(cuq_ptr + seq + 1) - q_start
    m0 = pid_m * BLOCK_M
    if m0 < q_len:
        k_start = tl.load(cuk_ptr + seq).to(tl.int64)
        num_keys = tl.load(cuk_ptr + seq + 1) - k_start
        if WINDOW:  # the first query's position relative to the window's first key
            prefix = tl.load(ctx_ptr + seq) - q_len - tl.load(kstart_ptr + seq)
        else:
            prefix = num_keys - q_len  # keys before the first query
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        q_rows = (q_start + rows).to(tl.int64)
        dn = tl.arange(0, BLOCK_DN)
        r = tl.arange(0, BLOCK_R)
        dv = tl.arange(0, BLOCK_DV)
        q_nope = tl.load(qn_ptr + q_rows[:, None] * sqn_t + head * sqn_h + dn[None, :],
                         mask=row_mask[:, None] & (dn < NOPE)[None, :], other=0.0)
        q_pe = tl.load(qp_ptr + q_rows[:, None] * sqp_t + head * sqp_h + r[None, :],
                       mask=row_mask[:, None] & (r < ROPE)[None, :], other=0.0)
        q_pos = prefix + rows
        kn_base = kn_ptr + k_start * skn_t + head * skn_h
        kp_base = kp_ptr + k_start * skp_t
        v_base = v_ptr + k_start * sv_t + head * sv_h

        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        last_pos = prefix + tl.minimum(m0 + BLOCK_M, q_len) - 1
        if WINDOW:
            # The window's keys up to the tile's last query, all through the causal mask
            # (the window may end anywhere, before or inside the queries).
            acc, m_i, l_i = _attend(
                acc, m_i, l_i, q_nope, q_pe, q_pos, kn_base, kp_base, v_base, skn_t, skp_t, sv_t,
                0, tl.maximum(tl.minimum(last_pos + 1, num_keys), 0), dn, r, dv, qk_scale,
                NOPE, ROPE, VDIM, BLOCK_N, BLOCK_DN, BLOCK_R, BLOCK_DV, True, PRECISION, True,
            )
            seen = l_i > 0.0
            out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
            lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * _LN2, float("-inf"))
            tl.store(lse_ptr + q_rows * slse_t + head, lse, mask=row_mask)
        else:
            # Keys before the tile's first query position are visible to every row.
            full_end = ((prefix + m0) // BLOCK_N) * BLOCK_N
            acc, m_i, l_i = _attend(
                acc, m_i, l_i, q_nope, q_pe, q_pos, kn_base, kp_base, v_base, skn_t, skp_t, sv_t,
                0, full_end, dn, r, dv, qk_scale,
                NOPE, ROPE, VDIM, BLOCK_N, BLOCK_DN, BLOCK_R, BLOCK_DV, False, PRECISION,
            )
            acc, m_i, l_i = _attend(
                acc, m_i, l_i, q_nope, q_pe, q_pos, kn_base, kp_base, v_base, skn_t, skp_t, sv_t,
                full_end, last_pos + 1, dn, r, dv, qk_scale,
                NOPE, ROPE, VDIM, BLOCK_N, BLOCK_DN, BLOCK_R, BLOCK_DV, True, PRECISION,
            )
            out = acc / l_i[:, None]  # every row sees at least key `full_end`
        tl.store(out_ptr + q_rows[:, None] * so_t + head * so_h + dv[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & (dv < VDIM)[None, :])


@dataclass(frozen=True)
class MlaPrefillConfig:
    block_m: int  # query rows per program (capped by the batch's max_query_len)
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int


def default_config(dtype: torch.dtype, window: bool = False) -> MlaPrefillConfig:
    """A 64-key tile of Dn + R + Dv = 320 bf16 values per key is 40 KB a stage. fp32 runs
    its dots on FMA units (ieee): 64 x 32 tiles spilled 7 KB a thread on sm_90, 32 x 32
    over 8 warps fits, and in window mode (its masks and log-sum-exp) 16 x 32 does
    (tests/test_mla_compile.py). benchmarks/mla_kernels.py sweeps the 16-bit alternatives."""
    if dtype == torch.float32:
        return MlaPrefillConfig(16 if window else 32, 32, 8, 1)
    return MlaPrefillConfig(64, 64, 4, 2)


def _pad(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


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
    out: torch.Tensor | None = None,
    config: MlaPrefillConfig | None = None,
) -> torch.Tensor:
    """q_nope [T, H, Dn], q_pe [T, H, R], k_nope [Tk, H, Dn], k_pe [Tk, R] (one rope key
    for all heads), v [Tk, H, Dv] -> out [T, H, Dv]; every last dim contiguous, rows and
    heads strided as they come (views of the q / kv_b projections are fine).

    Sequence s owns query rows cu_seqlens_q[s]:cu_seqlens_q[s+1] (nq) and key rows
    cu_seqlens_k[s]:cu_seqlens_k[s+1] (nk >= nq: its cached prefix, then its new tokens);
    query i sits at position nk - nq + i and sees keys 0 .. nk - nq + i. max_query_len
    (a host int, at least every nq) sizes the grid. Rows outside cu_seqlens_q are left
    unwritten (in `out` when given)."""
    out, _ = _launch(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, None, None, max_query_len, scale,
                     out, config)
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
    config: MlaPrefillConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `mla_prefill_attention`, over a window of each sequence's keys: key rows
    cu_k[s]:cu_k[s+1] sit at positions key_start[s], ... (int32) of a context of
    context_lens[s] (int32) tokens whose last nq are the queries. Returns (out [T, H, Dv],
    lse [T, H] fp32, natural log): rows that see none of the window's keys get 0 and -inf
    (`reference.mla_prefill_attention_window` is the reference)."""
    assert key_start.dtype == torch.int32 and context_lens.dtype == torch.int32
    return _launch(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, key_start, context_lens,
                   max_query_len, scale, None, config)


def _launch(q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, key_start, context_lens, max_query_len,
            scale, out, config) -> tuple[torch.Tensor, torch.Tensor | None]:
    tokens, num_heads, nope = q_nope.shape
    rope = q_pe.shape[-1]
    vdim = v.shape[-1]
    assert q_pe.shape == (tokens, num_heads, rope) and k_nope.shape[1:] == (num_heads, nope)
    assert k_pe.dim() == 2 and k_pe.shape == (k_nope.shape[0], rope) and v.shape[:2] == k_nope.shape[:2]
    assert q_nope.dtype == q_pe.dtype == k_nope.dtype == k_pe.dtype == v.dtype
    for x in (q_nope, q_pe, k_nope, k_pe, v):
        assert x.stride(-1) == 1, "last dims must be contiguous"
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    assert cu_seqlens_q.shape == cu_seqlens_k.shape
    if out is None:
        out = torch.empty((tokens, num_heads, vdim), dtype=q_nope.dtype, device=q_nope.device)
    assert out.shape == (tokens, num_heads, vdim) and out.dtype == q_nope.dtype and out.stride(-1) == 1
    window = key_start is not None
    lse = torch.empty((tokens, num_heads), dtype=torch.float32, device=q_nope.device) if window else None
    num_seqs = cu_seqlens_q.shape[0] - 1
    if tokens == 0 or num_seqs <= 0 or max_query_len <= 0:
        return out, lse
    cfg = config or default_config(q_nope.dtype, window)
    block_m = max(16, min(cfg.block_m, triton.next_power_of_2(max_query_len)))
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _mla_prefill_kernel[grid](
        q_nope, q_pe, k_nope, k_pe, v, out, cu_seqlens_q, cu_seqlens_k,
        key_start if window else cu_seqlens_q, context_lens if window else cu_seqlens_q, lse if window else out,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        k_nope.stride(0), k_nope.stride(1), k_pe.stride(0), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0) if window else 0, scale * _LOG2E,
        NOPE=nope, ROPE=rope, VDIM=vdim, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        BLOCK_DN=_pad(nope), BLOCK_R=_pad(rope), BLOCK_DV=_pad(vdim), PRECISION=dot_precision(q_nope.dtype),
        WINDOW=window, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse
