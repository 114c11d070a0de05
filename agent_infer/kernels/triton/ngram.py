"""Prompt lookup on the device, for the rows of a step drafted behind a verify row still in
flight: only the device knows how many of that row's drafts were accepted, so the host
cannot know the text the new row's drafts must follow. Each lookup row's history is the
sequence's tokens the host knows, then the accepted drafts of the row in flight (its input
ids), then that row's sample after them; the drafts are what followed the latest earlier
occurrence of the history's longest matching suffix (`speculative.ngram.propose_ngram`,
the same result), written into the row's draft slots of the step's input ids.

One program a row: the accepted count, then a scan of the candidate ends in blocks (for
each end e, every position but the last, how many of the suffix's last MAX_N tokens match
backward from e); the longest match of at least MIN_N wins, the latest end among equals.
The reference is `kernels.reference.lookup_drafts`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agent_infer.kernels.triton.utils import launch_opts, pdl_begin

# History positions per pass of the scan: one size for every call (a constexpr that
# changed with the history would compile mid-serving).
_BLOCK = 1024
# Nor do the pointers specialise on their alignment: the row arrays are slices of one
# packed copy, their alignment changing with the row count, so the warm-up's one launch
# compiles what serving uses.
_ARGS = ["ids_ptr", "hist_ptr", "offsets_ptr", "starts_ptr", "slots_ptr", "refs_ptr", "ref_k_ptr",
         "prev_tokens_ptr", "prev_inputs_ptr"]


@triton.jit
def _token(hist, known, accepted, base, last, prev_inputs_ptr, p, mask):
    """Token p of a row's history: the host's `known` tokens (`hist`), then the `accepted`
    drafts of the row in flight (its inputs after `base`), then its sample `last`."""
    in_hist = p < known
    in_drafts = (p >= known) & (p < known + accepted)
    h = tl.load(hist + p, mask=mask & in_hist, other=0)
    d = tl.load(prev_inputs_ptr + base + 1 + (p - known), mask=mask & in_drafts, other=0)
    return tl.where(in_hist, h, tl.where(in_drafts, d, last))


@triton.jit(do_not_specialize_on_alignment=_ARGS)
def _lookup_drafts_kernel(
    ids_ptr, hist_ptr, offsets_ptr, starts_ptr, slots_ptr, refs_ptr, ref_k_ptr, prev_tokens_ptr, prev_inputs_ptr,
    MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    row = tl.program_id(0)
    lo = tl.load(offsets_ptr + row)
    # Positions in 32 bits (a history is at most a context long), pointers' offsets in 64.
    known = (tl.load(offsets_ptr + row + 1) - lo).to(tl.int32)
    hist = hist_ptr + lo
    start = tl.load(starts_ptr + row)
    num_slots = tl.load(slots_ptr + row).to(tl.int32)
    k_in = tl.load(ref_k_ptr + row).to(tl.int32)
    base = tl.load(refs_ptr + row) - k_in  # the row in flight's first input (and sample) index
    # Its drafts accepted: the leading ones its samples agree with.
    j = tl.arange(0, BLOCK_K)
    live = j < k_in
    sampled = tl.load(prev_tokens_ptr + base + j, mask=live, other=0)
    drafted = tl.load(prev_inputs_ptr + base + 1 + j, mask=live, other=0)
    accepted = tl.min(tl.where(live & (sampled != drafted), j, k_in), axis=0)
    last = tl.load(prev_tokens_ptr + base + accepted)
    size = known + accepted + 1

    best_n = 0
    best_e = -1
    if size > MIN_N:
        offs = tl.arange(0, BLOCK)
        for first in range(0, size - 1, BLOCK):
            e = first + offs
            still = e < size - 1
            m = tl.zeros([BLOCK], dtype=tl.int32)
            for i in tl.static_range(MAX_N):
                s_i = _token(hist, known, accepted, base, last, prev_inputs_ptr, size - 1 - i, i < size)
                ok = still & (e >= i)  # then size - 1 - i > e - i >= 0 too
                t = _token(hist, known, accepted, base, last, prev_inputs_ptr, tl.maximum(e - i, 0), ok)
                still = ok & (t == s_i)
                m += still.to(tl.int32)
            block_n = tl.max(m, axis=0)
            block_e = tl.max(tl.where(m == block_n, e, -1), axis=0)
            take = block_n >= best_n  # a later block's ends are later: it wins a tie
            best_e = tl.where(take & (block_n > 0), block_e, best_e)
            best_n = tl.where(take, block_n, best_n)
    hit = (best_n >= MIN_N) & (best_n > 0)
    after = best_e + 1
    n = tl.where(hit, tl.minimum(num_slots, size - after), 0)
    d = _token(hist, known, accepted, base, last, prev_inputs_ptr, tl.maximum(after + j, 0), j < n)
    tl.store(ids_ptr + start + 1 + j, d, mask=j < n)


def lookup_drafts(input_ids: torch.Tensor, history: torch.Tensor, offsets: torch.Tensor, starts: torch.Tensor,
                  slots: torch.Tensor, refs: torch.Tensor, ref_k: torch.Tensor, prev_tokens: torch.Tensor,
                  prev_inputs: torch.Tensor, min_n: int, max_n: int, max_k: int, block: int = _BLOCK) -> None:
    """`ops.lookup_drafts` (int64 tensors throughout, contiguous); `block`: history
    positions per pass (tests give small ones, to cross block edges on short histories)."""
    rows = starts.numel()
    if rows:
        _lookup_drafts_kernel[(rows,)](
            input_ids, history, offsets, starts, slots, refs, ref_k, prev_tokens, prev_inputs,
            MIN_N=min_n, MAX_N=max_n, BLOCK=block, BLOCK_K=triton.next_power_of_2(max_k),
            **launch_opts(input_ids.device),
        )
