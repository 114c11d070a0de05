"""One kernel for the all-reduce of a row-parallel output and the residual add + RMSNorm
that follows it (tensor parallelism over symmetric memory).

Unfused, a decode step runs an all-reduce launch and a fused_add_rms_norm launch per
row-parallel layer; here one launch does both, with the same arithmetic:

    s = sum over ranks of y        (fp32, rank order, rounded to y's dtype: what the
                                    all-reduce returns)
    residual <- s + residual       (rounded to the dtype, as fused_add_rms_norm does)
    y <- rms_norm(residual) * weight

Every rank owns a buffer its peers can read (PyTorch symmetric memory) and a signal pad
of uint32 flags its peers can write. Program p handles rows p, p + G, ... (G programs):

1. it copies its rows of y into one half of its own buffer (halves alternate from call
   to call: `epochs` counts the calls, see below);
2. barrier with program p of every peer: it sets the flag (p, own rank) in each peer's
   pad from 0 to 1 (compare-and-swap, release, system scope; it spins while the flag is
   still 1 from the previous call, not yet consumed) and consumes the flags (p, peer) in
   its own pad from 1 back to 0 (compare-and-swap, acquire, system scope); the pads end
   every call at zero, so the barrier is reusable across calls and CUDA-graph replays;
3. it sums those rows of every rank's buffer in rank order (every rank gets the same
   bits), adds the residual, normalises and writes.

No second barrier: a rank starting call k has passed call k-1's barrier, so every peer
had started call k-1 and so finished call k-2 (stream order); the only reads of this
rank's buffer still in flight are call k-1's, of the half it wrote, and call k writes the
other half. A call uses one half throughout (rows of different programs overlap when
the row length changes), so the count is kept per program slot (each program reads only
its own: no race inside a call) and every slot moves on at every call: each program
bumps its own, program 0 those of the slots this call leaves idle. All slots hold the
same count, alike on every rank.

`max_spins` bounds each wait: past it the kernel sets `error[0]` and goes on (wrong
results, no hang). The engine runs with 2**31 - 1 (tens of minutes: a peer may be busy
compiling a kernel); tests pass a small bound so a protocol bug fails instead of hanging
the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from agent_infer.kernels.triton.utils import launch_opts, pdl_begin

UNBOUNDED_SPINS = 2**31 - 1


@dataclass(frozen=True)
class PeerBuffers:
    """What the kernel needs of one rank's symmetric-memory state. All tensors live on
    this rank's device and keep their addresses (CUDA-graph safe)."""

    buffer_ptrs: torch.Tensor  # int64 [world]: every rank's buffer, as mapped here
    pad_ptrs: torch.Tensor  # int64 [world]: every rank's signal pad (uint32 flags)
    epochs: torch.Tensor  # int32 [max_programs]: calls made so far (same in every slot)
    error: torch.Tensor  # int32 [1]: set to 1 when a wait ran out of spins
    rank: int
    world_size: int
    half_numel: int  # elements in one half of each buffer: rows * cols must fit
    max_programs: int  # <= pad slots / world (one flag per (program, rank))
    max_spins: int = UNBOUNDED_SPINS


@triton.jit
def _peer_ptr(ptrs, q, ty: tl.constexpr):
    return tl.load(ptrs + q).to(tl.pointer_type(ty))


@triton.jit
def _put_flag(flag, max_spins, error_ptr):
    """0 -> 1 on a peer's flag, ordering this program's earlier writes before it."""
    done = tl.atomic_cas(flag, 0, 1, sem="release", scope="sys") == 0
    spins = 0
    while (not done) and (spins < max_spins):
        done = tl.atomic_cas(flag, 0, 1, sem="release", scope="sys") == 0
        spins += 1
    if not done:
        tl.store(error_ptr, 1)


@triton.jit
def _take_flag(flag, max_spins, error_ptr):
    """Wait for 1 on an own flag and reset it to 0; later reads see the peer's writes."""
    done = tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys") == 1
    spins = 0
    while (not done) and (spins < max_spins):
        done = tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys") == 1
        spins += 1
    if not done:
        tl.store(error_ptr, 1)


@triton.jit
def _barrier_with_peers(pad_ptrs, slot, rank, max_spins, error_ptr, WORLD: tl.constexpr):
    """Program `slot // WORLD` meets the same program on every peer (see the module doc)."""
    # Every thread's buffer writes precede the (single-thread) release below.
    tl.debug_barrier()
    for q in tl.static_range(WORLD):
        if q != rank:
            _put_flag(_peer_ptr(pad_ptrs, q, tl.int32) + slot + rank, max_spins, error_ptr)
    own = _peer_ptr(pad_ptrs, rank, tl.int32) + slot
    for q in tl.static_range(WORLD):
        if q != rank:
            _take_flag(own + q, max_spins, error_ptr)
    # Every thread's peer reads follow the (single-thread) acquire above.
    tl.debug_barrier()


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    y_ptr, r_ptr, w_ptr,
    buffer_ptrs, pad_ptrs, epochs_ptr, error_ptr,
    n_rows, n_cols, stride_y, stride_r,
    half_numel, n_slots, rank, max_spins, eps,
    WORLD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SLOTS: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    dtype = y_ptr.dtype.element_ty

    epoch = tl.load(epochs_ptr + pid)
    # Bit 0, not `% 2`: the int32 count wraps negative after 2**31 calls (about a day of
    # batch-1 decode at TP = 2), and a negative remainder would index before the buffer.
    half = (epoch & 1).to(tl.int64) * half_numel
    own = _peer_ptr(buffer_ptrs, rank, dtype) + half
    for row in range(pid, n_rows, n_progs):
        y = tl.load(y_ptr + row * stride_y + cols, mask=cmask, other=0.0)
        tl.store(own + row * n_cols + cols, y, mask=cmask)

    _barrier_with_peers(pad_ptrs, pid * WORLD, rank, max_spins, error_ptr, WORLD)

    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    for row in range(pid, n_rows, n_progs):
        offs = half + row * n_cols + cols
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for q in tl.static_range(WORLD):
            acc += tl.load(_peer_ptr(buffer_ptrs, q, dtype) + offs, mask=cmask, other=0.0).to(tl.float32)
        r_offs = row * stride_r + cols
        r = tl.load(r_ptr + r_offs, mask=cmask, other=0.0)
        # Rounded twice, as the unfused path is: the all-reduce's output, then the add.
        s = (acc.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(r_ptr + r_offs, s.to(r_ptr.dtype.element_ty), mask=cmask)
        h = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
        h = (h * rstd).to(dtype).to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, (h * w).to(dtype), mask=cmask)

    tl.store(epochs_ptr + pid, epoch + 1)
    if pid == 0:
        slots = tl.arange(0, BLOCK_SLOTS)
        idle = (slots >= n_progs) & (slots < n_slots)
        tl.store(epochs_ptr + slots, tl.zeros([BLOCK_SLOTS], dtype=tl.int32) + epoch + 1, mask=idle)


def fits(x: torch.Tensor, residual: torch.Tensor, peers: PeerBuffers) -> bool:
    """Whether the fused kernel takes these tensors (else: all-reduce, then add + norm)."""
    return (
        x.dim() == 2
        and residual.shape == x.shape
        and x.stride(-1) == 1
        and residual.stride(-1) == 1
        and x.shape[0] * x.shape[1] <= peers.half_numel
    )


def all_reduce_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, peers: PeerBuffers
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, like fused_add_rms_norm after an all-reduce of x: residual <- sum over
    ranks of x + residual, x <- rms_norm(residual) * weight. Returns (x, residual). Every
    rank must call it with the same shapes, in the same order as its other calls."""
    assert fits(x, residual, peers), f"x {tuple(x.shape)} does not fit the fused all-reduce buffer"
    n_rows, n_cols = x.shape
    # Offsets are int32 in the kernel.
    assert max(x.stride(0), residual.stride(0)) * n_rows < 2**31 and 2 * peers.half_numel < 2**31
    assert weight.shape == (n_cols,) and weight.is_contiguous(), "weight must be a contiguous [N] vector"
    assert peers.epochs.numel() == peers.max_programs
    if n_rows == 0:
        return x, residual  # no launch on any rank: the call counts stay in step
    block_n = triton.next_power_of_2(n_cols)
    num_warps = 4 if block_n <= 1024 else (8 if block_n <= 4096 else 16)
    grid = (min(n_rows, peers.max_programs),)
    _all_reduce_add_rms_norm_kernel[grid](
        x, residual, weight,
        peers.buffer_ptrs, peers.pad_ptrs, peers.epochs, peers.error,
        n_rows, n_cols, x.stride(0), residual.stride(0),
        peers.half_numel, peers.max_programs, peers.rank, peers.max_spins, eps,
        WORLD=peers.world_size, BLOCK_N=block_n, BLOCK_SLOTS=triton.next_power_of_2(peers.max_programs),
        num_warps=num_warps, **launch_opts(x.device),
    )
    return x, residual
