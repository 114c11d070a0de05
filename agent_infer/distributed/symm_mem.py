"""All-reduce through PyTorch symmetric memory.

Every rank owns a buffer mapped into its peers' address spaces (over NVLink). A
one-shot all-reduce has each rank read every peer's buffer and sum (lowest latency for
small messages); a two-shot one reduce-scatters then all-gathers (less traffic for larger
ones). Both run inside CUDA graphs. Messages larger than the buffer go to NCCL.

Chosen at start: `build_all_reduce` tries symmetric memory, checks it against NCCL on
random data, and returns None (NCCL it is) if anything fails.

`SymmMemAllReduceNorm` (the default where its start-up check passes; `--all-reduce
symm_mem` turns it off) fuses the all-reduce of a row-parallel output with the residual
add + RMSNorm after it into one Triton kernel (agent_infer/kernels/triton/allreduce_norm.py),
over a symmetric-memory allocation of its own that peers write into directly (no
signal pad, no barrier: see the kernel's doc).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

ONE_SHOT_MAX_BYTES = 256 << 10  # above this two-shot moves fewer bytes per rank
BUFFER_BYTES = 8 << 20
# The fused kernel takes outputs up to FUSED_MAX_BYTES (1 MiB = 128 rows of 4096 bf16);
# larger ones (prefill chunks) take the all-reduce, then the add + norm. Its buffer holds
# two halves of one such slot per rank: 4 MiB per GPU at TP = 2.
FUSED_MAX_BYTES = 1 << 20


class SymmMemAllReduce:
    def __init__(self, group, device: torch.device, dtype: torch.dtype, buffer_bytes: int = BUFFER_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group
        self.group_name = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            enable(self.group_name)
        self.dtype = dtype
        self.buffer = symm_mem.empty(buffer_bytes // torch.tensor([], dtype=dtype).element_size(), device=device, dtype=dtype)
        symm_mem.rendezvous(self.buffer, self.group_name)
        self.max_numel = self.buffer.numel()
        ops = torch.ops.symm_mem
        self._one_shot_copy = getattr(ops, "one_shot_all_reduce_copy_out", None)

    def __call__(self, x: torch.Tensor) -> None:
        """x <- sum over ranks of x, in place."""
        n = x.numel()
        if x.dtype != self.dtype or n > self.max_numel or not x.is_contiguous():
            dist.all_reduce(x, group=self.group)
            return
        flat = x.view(-1)
        buf = self.buffer[:n]
        if n * x.element_size() <= ONE_SHOT_MAX_BYTES:
            if self._one_shot_copy is not None:
                self._one_shot_copy(buf, flat, "sum", self.group_name, flat)
            else:
                buf.copy_(flat)
                torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", self.group_name, flat)
        else:
            buf.copy_(flat)
            torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", self.group_name)
            flat.copy_(buf)


def build_all_reduce(group, device: torch.device, dtype: torch.dtype) -> SymmMemAllReduce | None:
    """A symmetric-memory all-reduce if it works here and agrees with NCCL, else None.
    Every rank must call this (it runs collectives)."""
    try:
        impl = SymmMemAllReduce(group, device, dtype)
        gen = torch.Generator(device=device).manual_seed(1234 + dist.get_rank(group))
        for numel in (4096, 4096 * 8, 4096 * 256):  # one-shot, one-shot, two-shot
            x = torch.randn(numel, device=device, dtype=dtype, generator=gen)
            ref = x.clone()
            dist.all_reduce(ref, group=group)
            impl(x)
            torch.cuda.synchronize(device)
            if not torch.allclose(x.float(), ref.float(), rtol=2e-2, atol=2e-2):
                raise RuntimeError(f"symmetric-memory all-reduce disagrees with NCCL at {numel} elements")
    except Exception as e:  # any rank failing makes every rank fall back
        log.warning("symmetric-memory all-reduce unavailable (%s: %s); using NCCL", type(e).__name__, e)
        impl = None
    return impl if _all_ranks_ok(impl is not None, group, device) else None


def _all_ranks_ok(ok: bool, group, device: torch.device) -> bool:
    """Whether every rank's start-up check passed (a collective: every rank calls it)."""
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return int(flag.item()) == 1


class SymmetricAllocation:
    """A symmetric-memory buffer of `numel` elements (an allocation of its own: the pool
    does not split segments, and PyTorch's ops never touch it), and every rank's buffer
    address as mapped on this rank."""

    def __init__(self, group, device: torch.device, dtype: torch.dtype, numel: int):
        import torch.distributed._symmetric_memory as symm_mem

        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            enable(group.group_name)
        self.buffer = symm_mem.empty(numel, device=device, dtype=dtype)
        self.handle = symm_mem.rendezvous(self.buffer, group.group_name)
        self.rank, self.world = self.handle.rank, self.handle.world_size
        # The handle's pointers are its allocations' bases; the tensor sits at the same
        # offset in each (symmetric), zero unless the allocator placed it further in.
        offset = self.buffer.data_ptr() - self.handle.buffer_ptrs[self.rank]
        if offset < 0 or offset + self.buffer.numel() * self.buffer.element_size() > self.handle.buffer_size:
            raise RuntimeError("the symmetric-memory buffer lies outside its handle's allocation")
        self.buffer_ptrs = torch.tensor([p + offset for p in self.handle.buffer_ptrs], dtype=torch.int64, device=device)


class SymmMemAllReduceNorm:
    """All-reduce + residual add + RMSNorm in one kernel; see the module doc. `accepts`
    says whether a call fits (dtype, 2-D rows, size); the caller falls back otherwise,
    the same way on every rank (the decision depends on shapes only)."""

    def __init__(
        self, group, device: torch.device, dtype: torch.dtype,
        max_bytes: int = FUSED_MAX_BYTES, max_spins: int | None = None,
    ):
        from agent_infer.kernels.triton.allreduce_norm import UNBOUNDED_SPINS, PeerBuffers, fill_not_arrived
        from agent_infer.kernels.triton.utils import num_sms

        self.group = group
        self.dtype = dtype
        slot_numel = max_bytes // torch.tensor([], dtype=dtype).element_size()
        world = dist.get_world_size(group)
        mem = SymmetricAllocation(group, device, dtype, 2 * world * slot_numel)
        if any(p % 16 for p in mem.buffer_ptrs.tolist()):  # the kernel moves 16-byte vectors
            raise RuntimeError("a symmetric-memory buffer is not 16-byte aligned")
        max_programs = num_sms(device)
        fill_not_arrived(mem.buffer)
        self.buffer = mem.buffer
        self.peers = PeerBuffers(
            buffer_ptrs=mem.buffer_ptrs,
            epochs=torch.zeros(max_programs, dtype=torch.int32, device=device),
            error=torch.zeros(1, dtype=torch.int32, device=device),
            rank=mem.rank,
            world_size=mem.world,
            slot_numel=slot_numel,
            max_programs=max_programs,
            max_spins=UNBOUNDED_SPINS if max_spins is None else max_spins,
        )
        # Held for the lifetime of the peer mappings whose addresses the kernel uses.
        self._memory = mem
        # Every buffer is marked not-arrived before any rank's first call.
        torch.cuda.synchronize(device)
        dist.barrier(group=group)

    def accepts(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        from agent_infer.kernels.triton.allreduce_norm import fits

        return (
            x.dtype == self.dtype and residual.dtype == self.dtype and x.is_cuda
            and fits(x, residual, self.peers)
        )

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, add: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In place: residual <- sum over ranks of x (+ residual if `add`); x <-
        rms_norm(residual)."""
        from agent_infer.kernels.triton.allreduce_norm import all_reduce_add_rms_norm

        return all_reduce_add_rms_norm(x, residual, weight, eps, self.peers, add)

    def with_spin_limit(self, max_spins: int) -> None:
        """Bound (or, with UNBOUNDED_SPINS, unbound) each wait for a peer's rows from the next call on."""
        from dataclasses import replace

        self.peers = replace(self.peers, max_spins=max_spins)


def build_all_reduce_norm(group, device: torch.device, dtype: torch.dtype) -> SymmMemAllReduceNorm | None:
    """The fused all-reduce + add + RMSNorm if it works here and agrees with NCCL followed
    by the reference add + norm, else None. Every rank must call this (collectives)."""
    from agent_infer.kernels import reference
    from agent_infer.kernels.triton.allreduce_norm import UNBOUNDED_SPINS

    try:
        impl = SymmMemAllReduceNorm(group, device, dtype)
        impl.with_spin_limit(1 << 24)  # a broken exchange fails the check (seconds) instead of hanging
        rank = dist.get_rank(group)
        gen = torch.Generator(device=device).manual_seed(4321)
        problems = []  # every rank runs every check (collectives in step), then they agree
        for rows, cols, add in ((1, 4096, True), (5, 4096, True), (3, 1000, True), (64, 4096, True),
                                (1, 4096, False), (4, 4096, False), (1, 4096, True)):
            # residual and weight alike on every rank (same seed); x differs per rank
            residual = torch.randn(rows, cols, device=device, dtype=dtype, generator=gen)
            weight = torch.rand(cols, device=device, dtype=dtype, generator=gen) + 0.5
            x = torch.randn(rows, cols, device=device, dtype=dtype, generator=gen) + rank
            ref_sum = x.clone()
            dist.all_reduce(ref_sum, group=group)
            if add:
                ref_out, ref_res = reference.fused_add_rms_norm(ref_sum, residual.clone(), weight, 1e-6)
            else:
                ref_out, ref_res = reference.rms_norm(ref_sum, weight, 1e-6), ref_sum
            if not impl.accepts(x, residual):
                raise RuntimeError(f"the fused kernel refuses a {rows} x {cols} check")  # alike on every rank
            out, res = impl(x, residual, weight, 1e-6, add)
            for got, ref, what in ((res, ref_res, "residual"), (out, ref_out, "output")):
                if not torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=2e-2):
                    problems.append(f"the {what} disagrees with NCCL (+ add) + norm at {rows} x {cols}")
        if impl.peers.error.item():
            problems.append("a wait for a peer's rows timed out")
        if problems:
            raise RuntimeError("; ".join(problems))
        impl.with_spin_limit(UNBOUNDED_SPINS)
    except Exception as e:  # any rank failing makes every rank fall back
        log.warning("fused all-reduce + RMSNorm unavailable (%s: %s)", type(e).__name__, e)
        impl = None
    return impl if _all_ranks_ok(impl is not None, group, device) else None
