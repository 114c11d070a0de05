"""RMSNorm, optionally fused with the residual add that precedes it, and (tensor
parallelism) with the all-reduce of the row-parallel output that precedes that."""

from __future__ import annotations

import torch
from torch import nn

from agent_infer.kernels import ops
from agent_infer.tp_layers.distributed import ParallelState, all_reduce_sum


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, reduce_over: ParallelState | None = None):
        """`reduce_over`: forward(x, residual) gets x as this rank's partial sum of a
        row-parallel output that was left unreduced (`ParallelState.reduce_in_norm`) and
        sums it over the group first. The plain form, forward(x), never reduces: it is the
        first layer's norm, whose x comes whole from the embedding."""
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.reduce_over = reduce_over if reduce_over is not None and reduce_over.world_size > 1 else None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: rms_norm(x). With it: (rms_norm(x + residual), x + residual)."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        if self.reduce_over is not None:
            return all_reduce_add_rms_norm(x, residual, self.weight, self.eps, self.reduce_over)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


def all_reduce_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, tp: ParallelState
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm(sum of x over the group, residual): one kernel where the group
    has a fused implementation that takes these tensors, else the all-reduce then the
    add + norm. Same results either way (the fused kernel rounds like the two steps)."""
    impl = tp.all_reduce_norm_impl
    if impl is not None and impl.accepts(x, residual):
        return impl(x, residual, weight, eps)
    return ops.fused_add_rms_norm(all_reduce_sum(x, tp), residual, weight, eps)
