"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from agent_infer.kernels import ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: rms_norm(x). With it: (rms_norm(x + residual), x + residual)."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class PendingNorm(NamedTuple):
    """A layer's input not yet computed: rms_norm(addend + residual) * weight, with the
    residual stream becoming addend + residual. A decoder layer hands it on instead of
    running the add + norm kernel when the next layer's first projection can do that work
    itself (`ops.add_norm_linear`: at batch 1 the GEMV's programs do it, one launch a layer
    fewer)."""

    addend: torch.Tensor
    residual: torch.Tensor
    weight: torch.Tensor
    eps: float

    def resolve(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normalised input, the new residual stream), by the add + norm kernel."""
        return ops.fused_add_rms_norm(self.addend, self.residual, self.weight, self.eps)
