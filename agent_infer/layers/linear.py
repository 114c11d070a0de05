"""Tensor-parallel linear layers. Each parameter carries a `weight_loader(param, loaded,
shard_id=None, expert_id=None)` (loader/load.py) that takes the checkpoint's full tensor
(or a lazy handle to it) and copies in the part this rank owns. A tensor that already
has the shard's shape was sliced before and is copied as is, never
sliced twice. Merged projections list their shards in `expected_pieces`, so a checkpoint
that lacks one fails to load."""

from __future__ import annotations

import torch
from torch import nn

from agent_infer.distributed.state import ParallelState, all_reduce_sum, divide
from agent_infer.kernels import ops
from agent_infer.loader.weights import Weight, copy_into, materialize, narrow, shape_of


def _shard(loaded: Weight, dim: int, start: int, size: int) -> torch.Tensor:
    """This rank's `size` rows (dim 0) or columns (dim 1) starting at `start`. A tensor
    whose extent is already `size` is the shard itself: a pre-sliced checkpoint, tp = 1,
    or a replicated KV head."""
    if shape_of(loaded)[dim] == size:
        return materialize(loaded)
    return narrow(loaded, dim, start, size)


class ReplicatedLinear(nn.Module):
    """y = x W^T with the whole W on every rank (DeepSeek's q_a and kv_a projections: small,
    and every rank needs their full output)."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id=None, expert_id=None) -> None:
        copy_into(param, materialize(loaded))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


def stack_weights(*layers: nn.Module) -> torch.Tensor | None:
    """Make the weights of `layers` (one input, no bias) consecutive rows of one [sum N, K]
    tensor, each layer's weight a view of its rows (loading fills them as before), and
    return it: a step then runs them all in one GEMV or GEMM launch. None, with nothing
    changed, when a layer has a bias."""
    if any(getattr(layer, "bias", None) is not None for layer in layers):
        return None
    weights = [layer.weight for layer in layers]
    stacked = torch.empty(sum(w.shape[0] for w in weights), weights[0].shape[1], dtype=weights[0].dtype,
                          device=weights[0].device)
    row = 0
    for w in weights:
        w.data = stacked[row : row + w.shape[0]]
        row += w.shape[0]
    return stacked


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split over ranks; each rank returns its slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: ParallelState):
        super().__init__()
        self.tp = tp
        self.out_per_rank = divide(out_features, tp.world_size, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id=None, expert_id=None) -> None:
        size = param.shape[0]
        copy_into(param, _shard(loaded, 0, self.tp.rank * size, size))

    def _expect(self, shards) -> None:
        for p in self.parameters(recurse=False):
            p.expected_pieces = {(s, None) for s in shards}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one GEMM (gate_up):
    shard i of every rank holds that rank's slice of projection i."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: ParallelState):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias, tp)
        self._expect(range(len(out_sizes)))

    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id: int, expert_id=None) -> None:
        size = divide(self.out_sizes[shard_id], self.tp.world_size, f"projection {shard_id}")
        offset = sum(self.out_sizes[:shard_id]) // self.tp.world_size
        part = _shard(loaded, 0, self.tp.rank * size, size)
        copy_into(param.data.narrow(0, offset, size), part)

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a [gate | up] projection, fused into the GEMM at batch 1."""
        assert len(self.out_sizes) == 2 and self.out_sizes[0] == self.out_sizes[1]
        return ops.linear_silu_mul(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Merged q/k/v projection. Query heads are split over ranks; KV heads too when there
    are at least as many as ranks, else each rank keeps one KV head shared by
    `tp / num_kv_heads` ranks (replication)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, tp: ParallelState):
        world = tp.world_size
        if num_heads % world:
            options = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
            raise ValueError(
                f"{num_heads} attention heads do not divide by tensor-parallel size {world}; "
                f"sizes that work: {options}"
            )
        if world > num_kv_heads and world % num_kv_heads:
            raise ValueError(
                f"tensor-parallel size {world} is neither a divisor nor a multiple of the {num_kv_heads} KV heads"
            )
        if world <= num_kv_heads and num_kv_heads % world:
            raise ValueError(f"{num_kv_heads} KV heads do not divide by tensor-parallel size {world}")
        self.head_dim = head_dim
        self.num_heads = num_heads // world
        self.num_kv_heads = max(1, num_kv_heads // world)
        self.kv_replicas = max(1, world // num_kv_heads)
        total = (self.num_heads + 2 * self.num_kv_heads) * head_dim * world
        super().__init__(hidden_size, total, bias, tp)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self._expect(("q", "k", "v"))

    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id: str, expert_id=None) -> None:
        rank = self.tp.rank
        if shard_id == "q":
            offset, size, start = 0, self.q_size, rank * self.q_size
        else:
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size = self.kv_size
            start = (rank // self.kv_replicas) * self.kv_size
        part = _shard(loaded, 0, start, size)
        copy_into(param.data.narrow(0, offset, size), part)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split over ranks; partial sums are all-reduced.
    The bias is added once (rank 0) before the reduction."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: ParallelState):
        super().__init__()
        self.tp = tp
        self.in_per_rank = divide(in_features, tp.world_size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.bias_loader
        else:
            self.register_parameter("bias", None)
        if tp.world_size == 1:
            # forward_add_norm's kernel finds its last program with this counter; one per
            # layer (its address is captured in the decode graphs), zero between calls.
            self.register_buffer("done_counter", torch.zeros(1, dtype=torch.int32), persistent=False)

    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id=None, expert_id=None) -> None:
        size = param.shape[1]
        copy_into(param, _shard(loaded, 1, self.tp.rank * size, size))

    def bias_loader(self, param: nn.Parameter, loaded: Weight, shard_id=None, expert_id=None) -> None:
        copy_into(param, materialize(loaded))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(self.partial(x), self.tp)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of y, not yet reduced (the bias on rank 0 only)."""
        return ops.linear(x, self.weight, self.bias if self.tp.rank == 0 else None)

    def forward_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(self(x), residual) for an RMSNorm `norm`: (rms_norm(y + residual), y +
        residual), y the all-reduced output. Unsharded (tp = 1) at batch 1 on a GPU this is
        one kernel: the GEMV's last program does the add and the norm, saving a dependent
        launch per call. Sharded, the all-reduce joins the add + norm instead
        (`all_reduce_add_rms_norm`)."""
        if self.tp.world_size == 1:
            return ops.linear_add_rms_norm(x, self.weight, self.bias, residual, norm.weight, norm.eps, self.done_counter)
        return all_reduce_add_rms_norm(self.partial(x), residual, norm.weight, norm.eps, self.tp)


def all_reduce_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, tp: ParallelState
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm(sum of x over the group, residual): one kernel where the group
    has a fused implementation that takes these tensors (`ParallelState.all_reduce_norm_impl`),
    else the all-reduce then the add + norm. Same results either way (the fused kernel
    rounds like the two steps)."""
    impl = tp.all_reduce_norm_impl
    if impl is not None and impl.accepts(x, residual):
        return impl(x, residual, weight, eps)
    return ops.fused_add_rms_norm(all_reduce_sum(x, tp), residual, weight, eps)


def all_reduce_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, tp: ParallelState) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s), s) for s the sum of x over the group: the start of the residual
    stream and the first layer's input. One kernel where the fused implementation takes
    the tensors (x is overwritten), else the all-reduce then the norm; same results."""
    impl = tp.all_reduce_norm_impl
    # The residual it writes is a new tensor laid out like x, so x stands in for it here.
    if impl is not None and impl.accepts(x, x):
        return impl(x, torch.empty_like(x), weight, eps, add=False)
    summed = all_reduce_sum(x, tp)
    return ops.rms_norm(summed, weight, eps), summed
