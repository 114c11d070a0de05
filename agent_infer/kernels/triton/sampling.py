"""Temperature sampling in one pass over the logits: the Gumbel-max form of the
exponential race, token = argmax(logits / T - log(-log u)), with u the same counter-based
hash of (seed, step, token) as the PyTorch path (agent_infer.engine.sampler). Rows with
T = 0 take the argmax. The vocabulary is split over programs so a single row still fills
the GPU; a tiny second step picks each row's winner among the splits."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agent_infer.kernels.triton.utils import launch_opts, pdl_begin

_BLOCK = 2048
_SPLIT = 8192  # vocabulary entries per program


@triton.jit
def _mix32(x):
    # x is uint32: products wrap mod 2**32 and shifts are logical, which is exactly the
    # reference's int64 arithmetic masked to 32 bits, in native 32-bit multiplies. The
    # int64 form compiled to multi-instruction 64-bit multiplies, four per vocabulary
    # entry, and made the kernel compute-bound (170 us at 256 rows of Qwen3's vocabulary).
    x = x ^ (x >> 16)
    x = x * 0x45D9F3B
    x = x ^ (x >> 16)
    x = x * 0x45D9F3B
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax_kernel(
    logits_ptr, stride, temp_ptr, seed_ptr, step_ptr, val_ptr, idx_ptr,
    vocab, num_splits,
    SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    t = tl.load(temp_ptr + row)
    greedy = t == 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / t)
    seed = tl.load(seed_ptr + row).to(tl.uint64)
    key = _mix32(seed.to(tl.uint32))  # the low word (truncation = & 0xFFFFFFFF)
    key = _mix32(key ^ (seed >> 32).to(tl.uint32))
    key = _mix32(key ^ tl.load(step_ptr + row).to(tl.uint64).to(tl.uint32))
    golden = tl.full((BLOCK,), 0x9E3779B1, tl.uint32)
    best_val = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK,), tl.int32)
    base = logits_ptr + row.to(tl.int64) * stride
    start = split * SPLIT
    for off in range(start, start + SPLIT, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        h = _mix32(key ^ (cols.to(tl.uint32) * golden))
        h = _mix32(h ^ (key >> 3))
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = tl.where(greedy, x, x * inv_t - tl.log(-tl.log(u)))
        score = tl.where(mask, score, float("-inf"))
        better = score > best_val
        best_val = tl.where(better, score, best_val)
        best_idx = tl.where(better, cols, best_idx)
    v = tl.max(best_val, axis=0)
    i = tl.min(tl.where(best_val == v, best_idx, vocab), axis=0)  # lowest index among ties
    tl.store(val_ptr + row * num_splits + split, v)
    tl.store(idx_ptr + row * num_splits + split, i.to(tl.int64))


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (any float dtype, last dim contiguous) -> sampled token ids [B] int64."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "the vocabulary dimension must be contiguous"
    splits = triton.cdiv(vocab, _SPLIT)
    vals = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, splits, dtype=torch.int64, device=logits.device)
    _gumbel_argmax_kernel[(rows, splits)](
        logits, logits.stride(0), temperature, seeds, steps, vals, idx,
        vocab, splits, SPLIT=_SPLIT, BLOCK=_BLOCK, num_warps=8, **launch_opts(logits.device),
    )
    return idx.gather(1, vals.argmax(dim=1, keepdim=True)).squeeze(1)
