"""Gated activations."""

from __future__ import annotations

import torch
from torch import nn

from agent_infer.kernels import ops


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)


def get_act_and_mul(name: str) -> nn.Module:
    if name in ("silu", "swish"):
        return SiluAndMul()
    raise ValueError(f"activation {name!r} is not supported (supported: silu)")
