"""Tensor-parallel group state and the collectives the layers use.

The rank and size live in one `ParallelState` passed to every layer that needs it;
with `world_size == 1` every collective is the identity and no process group exists
(a single process never calls `init_process_group`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    world_size: int = 1
    # The torch.distributed group the collectives run on; None: the default group, which
    # `init_group` forms (it keeps no reference, so destroying the group ends it).
    group: Any = None
    # Replaces the plain NCCL/gloo all-reduce (e.g. a symmetric-memory one); in place.
    all_reduce_impl: Callable[[torch.Tensor], None] | None = None
    # The all-reduce of a row-parallel output fused with the residual add + RMSNorm after
    # it, in one kernel (`SymmMemAllReduceNorm`: `accepts(x, residual)`, `__call__(x,
    # residual, weight, eps)`); None, or a call it does not accept: the all-reduce above,
    # then the add + norm (`layers.linear.all_reduce_add_rms_norm`).
    all_reduce_norm_impl: Any = None
    # How a mixture of experts splits its routed experts over the group: "ep" (whole
    # experts per rank) or "tp" (every expert, intermediate dimension split).
    moe_parallel: str = "ep"

    @property
    def is_first(self) -> bool:
        return self.rank == 0


SINGLE = ParallelState()


def all_reduce_sum(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """Sum x over the TP group, in place."""
    if ps.world_size == 1:
        return x
    if ps.all_reduce_impl is not None:
        ps.all_reduce_impl(x)
    else:
        dist.all_reduce(x, group=ps.group)
    return x


def broadcast_from_first(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """Overwrite x on every rank with rank 0's x, in place. x must have the same shape and
    dtype on every rank and be contiguous. On GPUs (NCCL) the copy is ordered on the
    current stream like any kernel: no host sync."""
    if ps.world_size == 1:
        return x
    dist.broadcast(x, group=ps.group, group_src=0)
    return x


def all_gather_last_dim(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """Concatenate every rank's x along the last dimension (rank order)."""
    if ps.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(ps.world_size)]
    dist.all_gather(parts, x.contiguous(), group=ps.group)
    return torch.cat(parts, dim=-1)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator
