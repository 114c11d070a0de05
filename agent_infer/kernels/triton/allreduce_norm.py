"""One kernel for the all-reduce of a row-parallel output and the residual add + RMSNorm
that follows it (tensor parallelism over symmetric memory).

Unfused, a decode step runs an all-reduce launch and a fused_add_rms_norm launch per
row-parallel layer; here one launch does both, with the same arithmetic:

    s = sum over ranks of y        (fp32, rank order, rounded to y's dtype: what the
                                    all-reduce returns)
    residual <- s + residual       (rounded to the dtype, as fused_add_rms_norm does;
                                    or residual <- s without the add)
    y <- rms_norm(residual) * weight

Every rank owns a buffer its peers can write (PyTorch symmetric memory): two halves
(alternating from call to call, `epochs` counts the calls, see below), each with one
slot per sending rank. The data carries its own arrival flag, so there is no barrier
(the "Lamport" scheme of TensorRT-LLM's one-shot all-reduce): a buffer element that has
not arrived holds negative zero, which no sender writes (a zero is sent as +0.0: the
same sum). Program p handles rows p, p + G, ... (G programs):

1. it stores its rows of y into its slot of every peer's buffer (posted NVLink writes,
   no round trip);
2. per row, it re-reads its own slot of every peer (volatile loads: past the L1) until
   no element is -0.0, sums in rank order (every rank gets the same bits), puts -0.0
   back into what it read (so the half is ready for its next use), adds the residual,
   normalises and writes.

Why two halves suffice: a peer can start call k + 1 (and write into the other half)
while this rank still reads call k's half, but cannot reach call k + 2 (this half again)
before it has this rank's call k + 1 data, which this rank sends only once call k's
kernel, clears included, has completed (stream order; with PDL every kernel waits for its
predecessor's completion before it touches anything a predecessor may write: this one
reads only the norm weight earlier). A call uses one half throughout
(rows of different programs overlap when the row length changes), so the count is kept
per program slot (each program reads only its own: no race inside a call) and every slot
moves on at every call: each program bumps its own, program 0 those of the slots this
call leaves idle. All slots hold the same count, alike on every rank.

Compared with a flag barrier (a release compare-and-swap on each peer's flag, an
acquire spin on the own ones, then remote reads of every peer's rows), this replaces two
NVLink round trips and a system-scope fence by one posted write.

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
    epochs: torch.Tensor  # int32 [max_programs]: calls made so far (same in every slot)
    error: torch.Tensor  # int32 [1]: set to 1 when a wait ran out of spins
    rank: int
    world_size: int
    slot_numel: int  # elements of one sender's slot in one half: rows * cols must fit
    max_programs: int
    max_spins: int = UNBOUNDED_SPINS

    @property
    def buffer_numel(self) -> int:
        """Elements of each rank's buffer: two halves of one slot per rank."""
        return 2 * self.world_size * self.slot_numel


def fill_not_arrived(buffer: torch.Tensor) -> torch.Tensor:
    """Mark every element of a (fresh) buffer as not arrived: -0.0 (the sign bit alone),
    written as integers so no float path can turn it into +0.0. In place."""
    bits = 8 * buffer.element_size()
    assert bits in (16, 32), f"no not-arrived mark for {buffer.dtype}"
    buffer.view(torch.int16 if bits == 16 else torch.int32).fill_(-(2 ** (bits - 1)))
    return buffer


@triton.jit
def _peer_ptr(ptrs, q, ty: tl.constexpr):
    # Symmetric-memory buffers are 16-byte aligned (allocation granularity); saying so
    # lets the rows move as 16-byte vectors instead of one element per instruction.
    return tl.multiple_of(tl.load(ptrs + q).to(tl.pointer_type(ty)), 16)


@triton.jit
def _not_arrived(v, BITS: tl.constexpr):
    """Elements of v that still hold -0.0 (sign bit only): the slot's arrival mark."""
    if BITS == 16:
        out = v.to(tl.int16, bitcast=True) == -32768
    else:
        out = v.to(tl.int32, bitcast=True) == -2147483648
    return out


@triton.jit
def _mark_not_arrived(ptr, mask, BLOCK_N: tl.constexpr, BITS: tl.constexpr):
    """Store -0.0 as integers (a float -0.0 constant may be folded to +0.0)."""
    if BITS == 16:
        tl.store(ptr.to(tl.pointer_type(tl.int16)), tl.full([BLOCK_N], -32768, tl.int16), mask=mask)
    else:
        tl.store(ptr.to(tl.pointer_type(tl.int32)), tl.full([BLOCK_N], -2147483648, tl.int32), mask=mask)


@triton.jit
def _wait_for_row(ptr, mask, max_spins, error_ptr, BITS: tl.constexpr):
    """Re-read a peer's row in the own buffer until every element has arrived."""
    v = tl.load(ptr, mask=mask, other=0.0, volatile=True)
    missing = tl.sum((_not_arrived(v, BITS) & mask).to(tl.int32), axis=0)
    spins = 0
    while (missing > 0) and (spins < max_spins):
        v = tl.load(ptr, mask=mask, other=0.0, volatile=True)
        missing = tl.sum((_not_arrived(v, BITS) & mask).to(tl.int32), axis=0)
        spins += 1
    if missing > 0:
        tl.store(error_ptr, 1)
    return v


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    y_ptr, r_ptr, w_ptr,
    buffer_ptrs, epochs_ptr, error_ptr,
    n_rows, n_cols, stride_y, stride_r,
    slot_numel, n_slots, rank, max_spins, eps,
    WORLD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SLOTS: tl.constexpr, BITS: tl.constexpr,
    ADD: tl.constexpr, PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < n_cols
    dtype = y_ptr.dtype.element_ty

    # The norm weight is a constant: read before the PDL wait, overlapping the
    # predecessor. The call count is not: the predecessor may be this kernel's previous
    # call (two calls back to back), still to write it.
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    pdl_begin(PDL)
    epoch = tl.load(epochs_ptr + pid)
    # Bit 0, not `% 2`: the int32 count wraps negative after 2**31 calls (about a day of
    # batch-1 decode at TP = 2), and a negative remainder would index before the buffer.
    half = (epoch & 1).to(tl.int64) * (WORLD * slot_numel)
    sent = half + rank * slot_numel  # this rank's slot, in every peer's buffer
    for row in range(pid, n_rows, n_progs):
        y = tl.load(y_ptr + row * stride_y + cols, mask=cmask, other=0.0).to(tl.float32)
        y = tl.where(y == 0.0, 0.0, y).to(dtype)  # -0.0 is the not-arrived mark
        for q in tl.static_range(WORLD):
            if q != rank:
                tl.store(_peer_ptr(buffer_ptrs, q, dtype) + sent + row * n_cols + cols, y, mask=cmask)

    own = _peer_ptr(buffer_ptrs, rank, dtype) + half
    for row in range(pid, n_rows, n_progs):
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for q in tl.static_range(WORLD):
            if q == rank:
                v = tl.load(y_ptr + row * stride_y + cols, mask=cmask, other=0.0)
            else:
                slot = own + q * slot_numel + row * n_cols + cols
                v = _wait_for_row(slot, cmask, max_spins, error_ptr, BITS)
                _mark_not_arrived(slot, cmask, BLOCK_N, BITS)
            acc += v.to(tl.float32)
        r_offs = row * stride_r + cols
        if ADD:
            r = tl.load(r_ptr + r_offs, mask=cmask, other=0.0)
            # Rounded twice, as the unfused path is: the all-reduce's output, then the add.
            s = (acc.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)
        else:
            s = acc.to(dtype)
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
        and x.element_size() in (2, 4)
        and x.shape[0] * x.shape[1] <= peers.slot_numel
    )


def all_reduce_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, peers: PeerBuffers,
    add: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, like fused_add_rms_norm after an all-reduce of x: residual <- sum over
    ranks of x + residual, x <- rms_norm(residual) * weight. Returns (x, residual). With
    add=False, residual is only written: residual <- sum over ranks of x (a first layer,
    whose stream starts at the embedding). Every rank must call it with the same shapes,
    in the same order as its other calls."""
    assert fits(x, residual, peers), f"x {tuple(x.shape)} does not fit the fused all-reduce buffer"
    n_rows, n_cols = x.shape
    # Offsets are int32 in the kernel, but for the half's.
    assert max(x.stride(0), residual.stride(0)) * n_rows < 2**31 and peers.buffer_numel < 2**31
    assert weight.shape == (n_cols,) and weight.is_contiguous(), "weight must be a contiguous [N] vector"
    assert peers.epochs.numel() == peers.max_programs
    if n_rows == 0:
        return x, residual  # no launch on any rank: the call counts stay in step
    block_n = triton.next_power_of_2(n_cols)
    num_warps = 4 if block_n <= 1024 else (8 if block_n <= 4096 else 16)
    grid = (min(n_rows, peers.max_programs),)
    _all_reduce_add_rms_norm_kernel[grid](
        x, residual, weight,
        peers.buffer_ptrs, peers.epochs, peers.error,
        n_rows, n_cols, x.stride(0), residual.stride(0),
        peers.slot_numel, peers.max_programs, peers.rank, peers.max_spins, eps,
        WORLD=peers.world_size, BLOCK_N=block_n, BLOCK_SLOTS=triton.next_power_of_2(peers.max_programs),
        BITS=8 * x.element_size(), ADD=add, num_warps=num_warps, **launch_opts(x.device),
    )
    return x, residual
