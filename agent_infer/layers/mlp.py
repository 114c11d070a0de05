"""The gated MLP (SwiGLU) with tensor parallelism: gate and up in one column-parallel
GEMM, down row-parallel. The dense decoders' MLP and DeepSeek's dense and shared experts."""

from __future__ import annotations

import torch
from torch import nn

from agent_infer.distributed.state import ParallelState
from agent_infer.layers.activation import SiluAndMul, get_act_and_mul
from agent_infer.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool, tp: ParallelState):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, tp)
        self.act = get_act_and_mul(hidden_act)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate) * up, the input of down_proj (which the caller runs with the residual
        add + norm after it)."""
        if isinstance(self.act, SiluAndMul):
            return self.gate_up_proj.forward_silu_mul(x)
        return self.act(self.gate_up_proj(x))
