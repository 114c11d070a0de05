"""Tensor-parallel linear layers. Each parameter carries a `weight_loader(param, loaded,
shard_id=None, expert_id=None)` (loader/load.py) that takes the checkpoint's full tensor
(or a lazy handle to it) and copies in the part this rank owns. A tensor that already
has the shard's shape was sliced before and is copied as is, never
sliced twice. Merged projections list their shards in `expected_pieces`, so a checkpoint
that lacks one fails to load.

Any of them can hold its weight in fp8 (`to_fp8`, before loading): e4m3 values and a
float32 `weight_scale` per block or per row (quantization/fp8.py). An fp8 checkpoint's
values are copied as stored; a full-precision one is quantized piece by piece as it
loads. Every piece (a rank's slice, a merged projection's part) must then cover whole
blocks, else loading stops naming the weight. Where there are no fp8 kernels (CPU) the
weight is dequantized once after loading: the model runs the format's exact values."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from agent_infer.distributed.state import ParallelState, all_reduce_sum, divide
from agent_infer.kernels import ops
from agent_infer.layers.invariance import RowInvariance, invariant_rows
from agent_infer.loader.weights import Weight, copy_into, materialize, narrow, shape_of
from agent_infer.quantization.fp8 import FP8, Fp8Config, check_block_slice, dequantize, fp8_slice


def _shard(loaded: Weight, dim: int, start: int, size: int) -> torch.Tensor:
    """This rank's `size` rows (dim 0) or columns (dim 1) starting at `start`. A tensor
    whose extent is already `size` is the shard itself: a pre-sliced checkpoint, tp = 1,
    or a replicated KV head."""
    if shape_of(loaded)[dim] == size:
        return materialize(loaded)
    return narrow(loaded, dim, start, size)


class LinearBase(nn.Module):
    """What the linear layers share: `weight` [N, K] (this rank's part), an optional
    bias, and the fp8 form of the weight (`to_fp8`)."""

    # False for a layer whose weight another module reads in the model's dtype (MLA's
    # kv_b_proj, absorbed into the attention): it stays in full precision.
    quantizable = True
    # The batch-invariant mode's switch (CausalLM.use_batch_invariance); None: off.
    invariance: RowInvariance | None = None

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.fp8: Fp8Config | None = None
        self.register_parameter("weight_scale", None)

    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id=None, expert_id=None) -> None:
        raise NotImplementedError

    def to_fp8(self, config: Fp8Config) -> None:
        """Hold the weight as e4m3 values and their scales from now on (before loading)."""
        old = self.weight
        weight = nn.Parameter(torch.empty(old.shape, dtype=FP8, device=old.device), requires_grad=False)
        weight.weight_loader = old.weight_loader
        if hasattr(old, "expected_pieces"):
            weight.expected_pieces = old.expected_pieces
        scale = nn.Parameter(torch.ones(config.scale_shape(*old.shape), device=old.device), requires_grad=False)
        scale.expected_pieces = set()  # loaded with the weight, never on its own
        self.weight, self.weight_scale, self.fp8 = weight, scale, config
        self.full_dtype = old.dtype

    def finish_loading(self) -> None:
        """Without fp8 kernels on this device, the dequantized weight in the model's dtype."""
        if self.fp8 is not None and not ops.fp8_kernels(self.weight.device):
            full = dequantize(self.weight.data, self.weight_scale.data, self.fp8, self.full_dtype)
            self.weight = nn.Parameter(full, requires_grad=False)
            self.weight_scale, self.fp8 = None, None

    @property
    def block(self) -> tuple[int, int] | None:
        return self.fp8.block if self.fp8 is not None else None

    def _load(self, param: nn.Parameter, loaded: Weight, dim: int, start: int, size: int, offset: int = 0) -> None:
        """Copy rows (dim 0) or columns (dim 1) [start, start + size) of the checkpoint
        tensor into `param`, a row slice at `offset` (merged projections' parts stack by
        rows); a column slice fills the whole parameter."""
        if param is not self.weight or self.fp8 is None:
            part = _shard(loaded, dim, start, size)
            copy_into(param.data if dim == 1 else param.data.narrow(0, offset, part.shape[0]), part)
            return
        cfg = self.fp8
        if dim == 0:  # the part's place in this weight's block grid
            check_block_slice(cfg, tuple(param.shape), 0, offset, size, "share")
        q, scale = fp8_slice(loaded, dim, start, size, cfg, param.device)
        if dim == 1:
            copy_into(param, q)
            copy_into(self.weight_scale, scale.view(self.weight_scale.shape))
            return
        copy_into(param.data.narrow(0, offset, size), q)
        rows = cfg.block[0] if cfg.layout == "block" else 1
        scale_rows = self.weight_scale.data.narrow(0, offset // rows, scale.shape[0])
        copy_into(scale_rows, scale.view(-1, self.weight_scale.shape[1]))

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return ops.linear(x, self.weight, bias, self.weight_scale, self.block, invariant_rows(self.invariance))


class ReplicatedLinear(LinearBase):
    """y = x W^T with the whole W on every rank (DeepSeek's q_a and kv_a projections: small,
    and every rank needs their full output)."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__(out_features, in_features)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id=None, expert_id=None) -> None:
        self._load(param, loaded, 0, 0, param.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


class StackedWeights(NamedTuple):
    """Several projections of one input as consecutive rows of one weight (and scale)."""

    weight: torch.Tensor
    scale: torch.Tensor | None
    block: tuple[int, int] | None
    splits: tuple[int, ...]  # each projection's output features, in order

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return ops.linear(x, self.weight, None, self.scale, self.block).split(self.splits, dim=-1)


def _cat_into(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One tensor of `tensors`' rows, each of them then a view of its rows in it."""
    stacked = torch.cat(tensors)
    row = 0
    for t in tensors:
        t.data = stacked[row : row + t.shape[0]]
        row += t.shape[0]
    return stacked


def stack_weights(*layers: LinearBase) -> StackedWeights | None:
    """After loading: make the weights (and fp8 scales) of `layers`, one input, no bias,
    consecutive rows of one tensor, each layer's weight a view of its rows, so a step
    runs them all in one GEMV or GEMM launch. None, with nothing changed, when a layer
    has a bias, the layers differ in format, or an fp8 layer but the last ends inside
    a block of rows."""
    fp8 = layers[0].fp8
    if any(getattr(layer, "bias", None) is not None or layer.fp8 != fp8 for layer in layers):
        return None
    if fp8 is not None and fp8.layout == "block" and any(l.weight.shape[0] % fp8.block[0] for l in layers[:-1]):
        return None
    weight = _cat_into([layer.weight for layer in layers])
    scale = _cat_into([layer.weight_scale for layer in layers]) if fp8 is not None else None
    return StackedWeights(weight, scale, layers[0].block, tuple(layer.weight.shape[0] for layer in layers))


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W's output rows split over ranks; each rank returns its slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: ParallelState):
        self.out_per_rank = divide(out_features, tp.world_size, "output features")
        super().__init__(self.out_per_rank, in_features)
        self.tp = tp
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id=None, expert_id=None) -> None:
        size = param.shape[0]
        self._load(param, loaded, 0, self.tp.rank * size, size)

    def _expect(self, shards) -> None:
        for p in self.parameters(recurse=False):
            p.expected_pieces = {(s, None) for s in shards}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)


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
        self._load(param, loaded, 0, self.tp.rank * size, size, offset)

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a [gate | up] projection, fused into the GEMM at batch 1."""
        assert len(self.out_sizes) == 2 and self.out_sizes[0] == self.out_sizes[1]
        return ops.linear_silu_mul(x, self.weight, self.bias, self.weight_scale, self.block,
                                   invariant_rows(self.invariance))


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
        self._load(param, loaded, 0, start, size, offset)


class RowParallelLinear(LinearBase):
    """y = x W^T with W's input columns split over ranks; partial sums are all-reduced.
    The bias is added once (rank 0) before the reduction."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: ParallelState):
        self.in_per_rank = divide(in_features, tp.world_size, "input features")
        super().__init__(out_features, self.in_per_rank)
        self.tp = tp
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
        self._load(param, loaded, 1, self.tp.rank * size, size)

    def bias_loader(self, param: nn.Parameter, loaded: Weight, shard_id=None, expert_id=None) -> None:
        copy_into(param, materialize(loaded))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(self.partial(x), self.tp)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of y, not yet reduced (the bias on rank 0 only)."""
        return self._linear(x, self.bias if self.tp.rank == 0 else None)

    def forward_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(self(x), residual) for an RMSNorm `norm`: (rms_norm(y + residual), y +
        residual), y the all-reduced output. Unsharded (tp = 1) at batch 1 on a GPU this is
        one kernel: the GEMV's last program does the add and the norm, saving a dependent
        launch per call. Sharded, the all-reduce joins the add + norm instead
        (`all_reduce_add_rms_norm`)."""
        if self.tp.world_size == 1:
            return ops.linear_add_rms_norm(x, self.weight, self.bias, residual, norm.weight, norm.eps, self.done_counter,
                                           self.weight_scale, self.block, invariant_rows(self.invariance))
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
