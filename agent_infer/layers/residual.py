"""The residual stream of a pre-norm decoder: each sublayer reads norm(stream) and adds
its output back into the stream.

Two ways to carry it, same arithmetic:
- unfused (any batch, any TP): a sublayer's output waits as `delta` until the next norm,
  which adds it and normalises in one fused add + RMSNorm kernel;
- fused (one row on the batch-1 GEMV path, TP = 1): the sublayer's output projection
  adds into the residual in its epilogue and leaves partial sums of squares, and the
  next projection normalises its input as it loads it (`ops.PendingNorm`). That takes
  both add + RMSNorm kernels out of every layer; at batch 1 a step is a chain of a few
  hundred small kernels, and each one removed saves its launch latency.
"""

from __future__ import annotations

import torch

from agent_infer.kernels import ops
from agent_infer.layers.norm import RMSNorm
from agent_infer.tp_layers.linear import RowParallelLinear


class ResidualStream:
    def __init__(self, hidden: torch.Tensor, fused: bool):
        self.residual = hidden
        self.fused = fused
        self.delta: torch.Tensor | None = None  # unfused: output not yet added
        self.sumsq: torch.Tensor | None = None  # fused: sums of squares of `residual`

    @classmethod
    def start(cls, hidden: torch.Tensor, tp_size: int) -> ResidualStream:
        """Fused when the rows suit the batch-1 GEMV and each projection's output is whole
        on this rank (TP = 1)."""
        return cls(hidden, fused=tp_size == 1 and ops.fused_row_ok(hidden))

    def normed(self, norm: RMSNorm) -> torch.Tensor | ops.PendingNorm:
        """norm(stream): the input of the next sublayer's first projection."""
        if self.sumsq is not None:
            return ops.PendingNorm(self.residual, self.sumsq, norm.weight, norm.eps)
        return self.final(norm)

    def add(self, proj: RowParallelLinear, x: torch.Tensor) -> None:
        """stream += proj(x)."""
        if self.fused:
            self.sumsq = proj.forward_add_(x, self.residual)
        else:
            self.delta = proj(x)

    def final(self, norm: RMSNorm) -> torch.Tensor:
        """norm(stream) as a tensor (the model's last norm)."""
        if self.delta is None:
            return norm(self.residual)
        x, self.residual = norm(self.delta, self.residual)
        self.delta = None
        return x
