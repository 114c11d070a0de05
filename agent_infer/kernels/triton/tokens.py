"""The small per-step kernels over token ids around a decode step: the greedy argmax of
the logits, resolving placeholder inputs to the previous step's samples, and positioning
the rows of sequences whose verify row is still in flight by how many drafts it accepted.

At batch 1 each runs once per step on the critical path, so launch count and latency
matter more than bandwidth: torch's argmax reduces a 151,936-entry row in one block
(~9 µs on an H200), and torch.where over the placeholders is four kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agent_infer.kernels.triton.utils import launch_opts, pdl_begin

_SPLIT = 8192  # vocabulary entries per program of the first argmax pass
_BLOCK = 2048
# Ids per program of the placeholder fill. One size for every call: a block sized to the
# call would be a constexpr that changes with the decode batch, and each new value a
# compilation in the middle of serving (1-2 s each on an H200, docs/PERFORMANCE.md).
_FILL_BLOCK = 1024


@triton.jit
def _argmax_split_kernel(
    logits_ptr, stride, val_ptr, idx_ptr, vocab, num_splits,
    SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride
    best_val = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK,), tl.int32)
    start = split * SPLIT
    for off in range(start, start + SPLIT, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        better = x > best_val  # strict: the earlier column keeps a tie
        best_val = tl.where(better, x, best_val)
        best_idx = tl.where(better, cols, best_idx)
    v = tl.max(best_val, axis=0)
    i = tl.min(tl.where(best_val == v, best_idx, vocab), axis=0)
    tl.store(val_ptr + row * num_splits + split, v)
    tl.store(idx_ptr + row * num_splits + split, i)


@triton.jit
def _argmax_merge_kernel(val_ptr, idx_ptr, out_ptr, vocab, num_splits, S: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    row = tl.program_id(0)
    s = tl.arange(0, S)
    mask = s < num_splits
    vals = tl.load(val_ptr + row * num_splits + s, mask=mask, other=float("-inf"))
    idx = tl.load(idx_ptr + row * num_splits + s, mask=mask, other=vocab)
    v = tl.max(vals, axis=0)
    i = tl.min(tl.where(vals == v, idx, vocab), axis=0)
    tl.store(out_ptr + row, i.to(tl.int64))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (last dim contiguous) -> the first index of each row's maximum, [B]
    int64, as torch.argmax(dim=-1) for rows without NaN. Two launches: each program
    reduces an 8192-entry slice, then one program per row picks among the slices."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "the vocabulary dimension must be contiguous"
    splits = triton.cdiv(vocab, _SPLIT)
    vals = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    opts = launch_opts(logits.device)
    _argmax_split_kernel[(rows, splits)](
        logits, logits.stride(0), vals, idx, vocab, splits, SPLIT=_SPLIT, BLOCK=_BLOCK, num_warps=8, **opts,
    )
    _argmax_merge_kernel[(rows,)](vals, idx, out, vocab, splits, S=triton.next_power_of_2(splits), num_warps=1, **opts)
    return out


# n changes every step: not specialised, so its value never picks a new compiled variant.
@triton.jit(do_not_specialize=["n"])
def _fill_placeholders_kernel(ids_ptr, prev_index_ptr, prev_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    src = tl.load(prev_index_ptr + i, mask=mask, other=-1)
    take = mask & (src >= 0)
    token = tl.load(prev_ptr + tl.where(take, src, 0), mask=take)
    tl.store(ids_ptr + i, token, mask=take)


def fill_placeholders(input_ids: torch.Tensor, prev_index: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    """In place: input_ids[i] <- prev_tokens[prev_index[i]] where prev_index[i] >= 0 (all
    int64, contiguous). One launch. Returns input_ids."""
    n = input_ids.numel()
    assert prev_index.numel() == n and input_ids.is_contiguous() and prev_index.is_contiguous()
    assert input_ids.dtype == prev_tokens.dtype == torch.int64
    if n:
        _fill_placeholders_kernel[(triton.cdiv(n, _FILL_BLOCK),)](
            input_ids, prev_index, prev_tokens, n, BLOCK=_FILL_BLOCK, num_warps=4, **launch_opts(input_ids.device),
        )
    return input_ids


# One variant per MAX_K (the config's): nothing else specialised, neither the row count
# and table width, which change every step, nor the pointers, whose alignment does with
# the graph size (the staging rows of a one-row graph start 8 bytes apart), so that the
# warm-up's one launch compiles what serving uses.
_RESOLVE_ARGS = ["ids_ptr", "pos_ptr", "slot_ptr", "ctx_ptr", "shift_ptr", "prev_index_ptr", "follow_ptr",
                 "follow_k_ptr", "table_ptr", "table_stride", "prev_tok_ptr", "prev_in_ptr", "n", "block_size"]


@triton.jit(do_not_specialize=["n", "table_stride", "block_size"], do_not_specialize_on_alignment=_RESOLVE_ARGS)
def _resolve_rows_kernel(
    ids_ptr, pos_ptr, slot_ptr, ctx_ptr, shift_ptr, prev_index_ptr, follow_ptr, follow_k_ptr,
    table_ptr, table_stride, prev_tok_ptr, prev_in_ptr, n, block_size,
    BLOCK: tl.constexpr, MAX_K: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    ref = tl.load(follow_ptr + i, mask=mask, other=-1)
    k = tl.load(follow_k_ptr + i, mask=mask, other=0)
    follows = mask & (ref >= 0)
    # The verify row's drafts sit at input rows ref - k + 1 .. ref, the samples they are
    # checked against at rows ref - k .. ref - 1: count the leading matches.
    alive = follows
    accepted = tl.zeros((BLOCK,), tl.int64)
    for j in tl.static_range(MAX_K):
        live = alive & (j < k)
        at = tl.where(live, ref - k + j, 0)
        sampled = tl.load(prev_tok_ptr + at, mask=live, other=0)
        draft = tl.load(prev_in_ptr + at + 1, mask=live, other=-1)
        alive = live & (sampled == draft)
        accepted += alive.to(tl.int64)
    shift = tl.where(follows, accepted - k, 0)
    pos = tl.load(pos_ptr + i, mask=follows, other=0) + shift
    tl.store(pos_ptr + i, pos, mask=follows)
    ctx = tl.load(ctx_ptr + i, mask=follows, other=0)
    tl.store(ctx_ptr + i, ctx + shift.to(tl.int32), mask=follows)
    block = tl.load(table_ptr + i.to(tl.int64) * table_stride + pos // block_size, mask=follows, other=0)
    tl.store(slot_ptr + i, block.to(tl.int64) * block_size + pos % block_size, mask=follows)
    src = tl.load(prev_index_ptr + i, mask=mask, other=-1)
    take = mask & (src >= 0)
    token = tl.load(prev_tok_ptr + tl.where(take, src + shift, 0), mask=take)
    tl.store(ids_ptr + i, token, mask=take)
    tl.store(shift_ptr + i, shift, mask=mask)


def resolve_rows(
    input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, context_lens: torch.Tensor,
    shift: torch.Tensor, prev_index: torch.Tensor, follow: torch.Tensor, follow_k: torch.Tensor,
    block_tables: torch.Tensor, block_size: int, prev_tokens: torch.Tensor, prev_inputs: torch.Tensor,
    max_k: int,
) -> None:
    """In place, one launch: `ops.resolve_rows` (which documents it) on contiguous int64
    rows (context lengths int32, block tables int32 [rows, width] with unit column stride)."""
    n = input_ids.numel()
    for t in (positions, slots, shift, prev_index, follow, follow_k):
        assert t.numel() >= n and t.is_contiguous() and t.dtype == torch.int64
    assert context_lens.dtype == torch.int32 and block_tables.stride(1) == 1
    if n:
        _resolve_rows_kernel[(triton.cdiv(n, _FILL_BLOCK),)](
            input_ids, positions, slots, context_lens, shift, prev_index, follow, follow_k,
            block_tables, block_tables.stride(0), prev_tokens, prev_inputs, n, block_size,
            BLOCK=_FILL_BLOCK, MAX_K=max_k, num_warps=4, **launch_opts(input_ids.device),
        )


_MASK_BLOCK = 4096


@triton.jit
def _apply_bitmask_kernel(logits_ptr, stride, mask_ptr, words, rows_ptr, vocab, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = tl.load(rows_ptr + r)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    word = cols // 32
    w = tl.load(mask_ptr + r.to(tl.int64) * words + word, mask=inside & (word < words), other=0)
    banned = ((w >> (cols % 32)) & 1) == 0
    ninf = tl.full((BLOCK,), float("-inf"), logits_ptr.dtype.element_ty)
    # Write-only: allowed entries are left alone, so a row costs V/8 bytes read and the
    # banned entries written.
    tl.store(logits_ptr + row.to(tl.int64) * stride + cols, ninf, mask=inside & banned)


def apply_token_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits[rows[r], t] = -inf where bit t of mask[r] is 0 (int32 words, LSB first);
    tokens beyond the mask's 32 * words are banned too. In place."""
    num_rows, words = mask.shape
    vocab = logits.shape[1]
    if num_rows == 0:
        return
    grid = (num_rows, triton.cdiv(vocab, _MASK_BLOCK))
    _apply_bitmask_kernel[grid](logits, logits.stride(0), mask, words, rows, vocab, BLOCK=_MASK_BLOCK)
