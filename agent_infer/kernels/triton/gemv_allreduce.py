"""Batch-1 row-parallel projection, all-reduce, residual add and RMSNorm in one launch
(tensor parallelism over symmetric memory).

The batch-1 GEMV (`gemv.row_dot`) writes this rank's partial output y into its region of
its own buffer. The last of its programs to finish (an atomic counter) then:

1. raises its flag in each peer's signal pad to this call's number (a release exchange
   at system scope: its row is visible to the peer before the flag is), and waits for
   every peer's flag in its own pad to reach the same number (acquire);
2. reads every peer's row across NVLink and sums the rows in rank order (every rank gets
   the same bits), rounds like an all-reduce, adds the residual, normalises and writes,
   as `allreduce_norm.py` does.

Against the GEMV followed by that separate kernel, this saves a launch and the copy of
y into the symmetric buffer. (Pushing the row into the peers' buffers before the flag
instead was measured slower: the system-scope release then waits for the remote stores.)

Flags hold call numbers, never reset: a rank that has passed call k may raise its flag
for k + 1 before a slow peer has looked at call k's, so a wait is for "at least k". Calls
alternate between two halves of the buffers (bit 0 of the call number), which is why one
barrier per call suffices: a rank writing call k's row into its half k mod 2 has seen
every peer's flag for call k - 1, raised after that peer's call k - 2 (the last reader
of that half) ended. Call numbers are int32 and may wrap (compared by difference).

Every call site uses its own counter (`count_ptr`: zero on entry, re-armed by the last
program); the buffers, pads and call number are shared by all call sites of one process,
which run one after another on its stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from agent_infer.kernels.triton.allreduce_norm import UNBOUNDED_SPINS, peer_ptr
from agent_infer.kernels.triton.gemv import row_config, row_dot
from agent_infer.kernels.triton.utils import launch_opts


@dataclass(frozen=True)
class PushBuffers:
    """One rank's symmetric-memory state for this kernel. All tensors live on this rank's
    device and keep their addresses (CUDA-graph safe)."""

    buffer_ptrs: torch.Tensor  # int64 [world]: every rank's buffer [2 halves, world regions, region_numel]
    pad_ptrs: torch.Tensor  # int64 [world]: every rank's signal pad, int32 [world] flags
    call: torch.Tensor  # int32 [1]: calls made so far (alike on every rank)
    error: torch.Tensor  # int32 [1]: set to 1 when a wait ran out of spins
    rank: int
    world_size: int
    region_numel: int  # the largest output row (features) a call may have
    max_spins: int = UNBOUNDED_SPINS


@triton.jit
def _wait_at_least(flag, target, max_spins, error_ptr):
    """Spin until the flag (an int32 call number, may wrap) reaches `target`; later reads
    see what its writer did before raising it."""
    v = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    spins = 0
    while ((v - target) < 0) and (spins < max_spins):
        v = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        spins += 1
    if (v - target) < 0:
        tl.store(error_ptr, 1)


@triton.jit
def _gemv_all_reduce_norm_kernel(
    x_ptr, w_ptr, b_ptr, r_ptr, nw_ptr, out_ptr, count_ptr,
    buffer_ptrs, pad_ptrs, call_ptr, error_ptr,
    N, K, swn, region, rank, max_spins, eps,
    HAS_BIAS: tl.constexpr, WORLD: tl.constexpr, PDL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    y = row_dot(x_ptr, w_ptr, b_ptr, n, n_mask, K, swn, 0, HAS_BIAS, False, PDL, BLOCK_K, dtype)
    call = tl.load(call_ptr)  # after row_dot's wait: the previous call has ended
    half = (call & 1).to(tl.int64) * WORLD * region
    own = peer_ptr(buffer_ptrs, rank, dtype) + half
    tl.store(own + rank * region + n, y.to(dtype), mask=n_mask)
    # The last program to arrive does the rest; see gemv._last_program_add_norm for why
    # a barrier stands before the one-thread release and after the one-thread acquire.
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        tl.debug_barrier()
        h = tl.arange(0, BLOCK_H)
        h_mask = h < N
        mine = tl.load(own + rank * region + h, mask=h_mask, other=0.0, cache_modifier=".cg")
        target = call + 1
        for q in tl.static_range(WORLD):
            if q != rank:
                tl.atomic_xchg(peer_ptr(pad_ptrs, q, tl.int32) + rank, target, sem="release", scope="sys")
        own_pad = peer_ptr(pad_ptrs, rank, tl.int32)
        for q in tl.static_range(WORLD):
            if q != rank:
                _wait_at_least(own_pad + q, target, max_spins, error_ptr)
        tl.debug_barrier()
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for q in tl.static_range(WORLD):
            if q == rank:
                acc += mine.to(tl.float32)
            else:
                # The peer's row, read across NVLink (.cg: never from this SM's L1).
                peer = peer_ptr(buffer_ptrs, q, dtype) + half + q * region
                acc += tl.load(peer + h, mask=h_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        r = tl.load(r_ptr + h, mask=h_mask, other=0.0)
        # Rounded twice, as the unfused path is: the all-reduce's output, then the add.
        s = (acc.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(r_ptr + h, s.to(r_ptr.dtype.element_ty), mask=h_mask)
        f = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(f * f, axis=0) / N + eps)
        f = (f * rstd).to(dtype).to(tl.float32)
        w = tl.load(nw_ptr + h, mask=h_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + h, (f * w).to(dtype), mask=h_mask)
        tl.store(call_ptr, target)
        tl.store(count_ptr, 0)  # the next launch starts after this kernel ends


def fits(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, peers: PushBuffers) -> bool:
    """Whether the kernel takes these tensors: a batch-1 GEMV whose output row fits a
    region (alike on every rank: shapes only)."""
    n, k = weight.shape
    return (
        x.dim() == 2 and x.shape == (1, k) and x.is_contiguous() and weight.is_contiguous()
        and residual.shape == (1, n) and residual.is_contiguous()
        and x.dtype == weight.dtype == residual.dtype and k % 16 == 0 and n <= peers.region_numel
    )


def gemv_all_reduce_add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
    norm_weight: torch.Tensor, eps: float, counter: torch.Tensor, peers: PushBuffers,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm(all_reduce_sum(x @ weight^T (+ bias)), residual, norm_weight,
    eps) for x [1, K] and this rank's weight shard [N, K]: returns (normed [1, N],
    residual), the residual updated in place. Every rank must make the same calls in the
    same order. `counter`: int32 [1], zero between calls, one per call site."""
    assert fits(x, weight, residual, peers), "the GEMV all-reduce does not take these tensors"
    assert norm_weight.shape == (weight.shape[0],) and norm_weight.is_contiguous()
    assert counter.dtype == torch.int32 and counter.numel() == 1
    n, k = weight.shape
    cfg = row_config(n, k, x.device)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    has_bias = bias is not None
    _gemv_all_reduce_norm_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if has_bias else out, residual, norm_weight, out, counter,
        peers.buffer_ptrs, peers.pad_ptrs, peers.call, peers.error,
        n, k, weight.stride(0), peers.region_numel, peers.rank, peers.max_spins, eps,
        HAS_BIAS=has_bias, WORLD=peers.world_size,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_H=triton.next_power_of_2(n),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_opts(x.device),
    )
    return out, residual
