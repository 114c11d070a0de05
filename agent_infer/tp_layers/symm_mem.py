"""All-reduce through PyTorch symmetric memory (the blueprint's custom all-reduce).

Every rank owns a buffer mapped into its peers' address spaces (over NVLink). A
one-shot all-reduce has each rank read every peer's buffer and sum (lowest latency for
small messages); a two-shot one reduce-scatters then all-gathers (less traffic for larger
ones). Both run inside CUDA graphs. Messages larger than the buffer go to NCCL.

Chosen at start: `build_all_reduce` tries symmetric memory, checks it against NCCL on
random data, and returns None (NCCL it is) if anything fails.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

ONE_SHOT_MAX_BYTES = 256 << 10  # above this two-shot moves fewer bytes per rank
BUFFER_BYTES = 8 << 20


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
        ok = torch.tensor([1], device=device)
    except Exception as e:  # any rank failing makes every rank fall back
        log.warning("symmetric-memory all-reduce unavailable (%s: %s); using NCCL", type(e).__name__, e)
        impl, ok = None, torch.tensor([0], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return impl if int(ok.item()) == 1 else None
