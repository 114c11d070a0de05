"""Vocabulary-parallel embedding and LM head: each rank owns a contiguous range of
token rows (the vocabulary padded up to a multiple of the TP size)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from agent_infer.distributed.state import ParallelState, all_gather_last_dim, all_reduce_sum
from agent_infer.kernels import ops
from agent_infer.layers.invariance import RowInvariance, invariant_rows
from agent_infer.layers.linear import all_reduce_rms_norm
from agent_infer.loader.weights import Weight, copy_into, narrow, shape_of


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: ParallelState):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.world_size)
        self.start = tp.rank * self.rows_per_rank
        self.end = min(vocab_size, self.start + self.rows_per_rank)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id=None, expert_id=None) -> None:
        rows = self.end - self.start
        full = shape_of(loaded)[0]
        if full == self.rows_per_rank and self.tp.world_size > 1:
            part = narrow(loaded, 0, 0, rows)  # pre-sliced (and padded) shard
        else:
            if full != self.vocab_size:
                raise ValueError(f"embedding has {full} rows, config says vocab_size {self.vocab_size}")
            part = narrow(loaded, 0, self.start, rows)
        param.data[rows:].zero_()  # padding rows of the last rank
        copy_into(param.data[:rows], part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(self.partial(input_ids), self.tp)

    def forward_norm(self, input_ids: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(e), e) for e = self(input_ids) and an RMSNorm `norm`: the first layer's
        input and the residual stream. Sharded, the all-reduce joins the norm
        (`all_reduce_rms_norm`): one kernel instead of two at batch 1."""
        if self.tp.world_size == 1:
            e = self.partial(input_ids)
            return norm(e), e
        return all_reduce_rms_norm(self.partial(input_ids), norm.weight, norm.eps, self.tp)

    def partial(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows of this rank's vocabulary range; zeros for the other tokens."""
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        return y.masked_fill_(outside.unsqueeze(-1), 0)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocabulary rows, gathered over ranks. With tied embeddings
    the model points `weight` at the embedding's parameter."""

    # As LinearBase.invariance.
    invariance: RowInvariance | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = ops.linear(hidden, self.weight, invariant_rows=invariant_rows(self.invariance))
        if self.tp.world_size > 1:
            logits = all_gather_last_dim(logits, self.tp)
        return logits[..., : self.vocab_size]
