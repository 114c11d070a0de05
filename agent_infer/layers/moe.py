"""Mixture of experts: one layer's MoE MLP (`MoE`: router, routed experts, optional shared
experts), the checkpoint rules of its experts, and its parts on this rank.

Routing as transformers computes it, in fp32:
- softmax (DeepSeek-V2, Qwen3-MoE, Mixtral): top-k of the expert probabilities, either
  over all experts or within the `topk_groups` groups holding the best single expert;
- sigmoid, with DeepSeek-V3's load-balancing bias: experts are chosen by score + bias
  within the `topk_groups` groups whose two best experts score highest, and weighted by
  their unbiased scores.
The k weights are renormalised to sum to 1 when `norm_topk_prob`, then multiplied by
`routed_scaling_factor`. The maths is `kernels.reference.moe_route`; one token on a GPU
is one launch (`kernels.triton.router`).

The routed experts are split over the tensor-parallel group in one of two ways:
- `ep` (expert parallelism): each rank holds a contiguous range of whole experts and
  builds and loads only those; a token's slots for other ranks' experts add nothing here;
- `tp`: every rank holds every expert with its intermediate dimension split, like a
  tensor-parallel MLP.
Both return this rank's partial sum; the caller adds the shared experts' partial sum and
all-reduces once for the layer.

With every expert on one rank, the shared experts join the routed ones (`num_shared`):
an MLP of intermediate size S x I is S experts of size I whose outputs add up, so they
are stored after the routed experts and every token is routed to them at weight 1.0.
A decode step then streams all the experts it touches in the fused MoE's two grouped
GEMMs, instead of two more GEMVs and an add (separate GEMVs stream a small weight
well below the bandwidth the grouped GEMMs reach). Steps of more than
`FUSED_SHARED_MAX_TOKENS` tokens (prefill) run them as dense GEMMs: a shared expert's
slots are then every token, a compute-bound GEMM, where cuBLAS beats the grouped GEMM
(the measurements are in docs/PERFORMANCE.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from agent_infer.checkpoint_files import ConfigError
from agent_infer.distributed.state import ParallelState
from agent_infer.kernels import ops
from agent_infer.layers.linear import all_reduce_add_rms_norm
from agent_infer.layers.mlp import GatedMLP
from agent_infer.loader.load import WeightRule
from agent_infer.loader.weights import Weight, copy_into, materialize, narrow, shape_of
from agent_infer.quantization.fp8 import FP8, Fp8Config, dequantize, fp8_slice

MOE_PLACEMENTS = ("ep", "tp")
# Steps of up to this many tokens run the shared experts inside the fused MoE: all decode
# steps; beyond, the slots of a shared expert (one per token) make compute-bound GEMMs.
FUSED_SHARED_MAX_TOKENS = 1024


ROUTER_SCORING = ("softmax", "sigmoid")


@dataclass(frozen=True)
class RouterConfig:
    """How a token picks its experts, as options rather than per-family method names:
    scores by `scoring`; with `num_groups` > 1, the experts split into that many equal
    groups and the top k taken within the `topk_groups` best (a group scores its best
    expert under softmax, its best two under sigmoid); `correction_bias`, a learned
    per-expert bias added to the scores for the choice only; the k weights renormalised
    when `norm_topk_prob`, then times `routed_scaling_factor`. DeepSeek-V2: softmax,
    grouped or not; DeepSeek-V3: sigmoid, grouped, with the bias, renormalised;
    Qwen3-MoE and Mixtral: softmax, renormalised."""

    num_experts: int
    top_k: int
    scoring: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    correction_bias: bool = False
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in ROUTER_SCORING:
            raise ConfigError(f"router scoring must be one of {', '.join(ROUTER_SCORING)}, got {self.scoring!r}")
        if self.num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ConfigError(f"{self.num_experts} experts in {self.num_groups} groups, {self.topk_groups} of them "
                             f"chosen: the groups must be equal and the chosen ones between 1 and all")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"top_k {self.top_k} must be between 1 and the {self.num_experts} experts")


class Router(nn.Module):
    """The gate: fp32 weights (and V3's score-correction bias), replicated on every rank.
    With `num_shared`, its routing ends in the shared experts' columns (RoutedExperts)."""

    def __init__(self, hidden_size: int, cfg: RouterConfig, num_shared: int = 0):
        super().__init__()
        self.cfg, self.num_shared = cfg, num_shared
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        if cfg.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts, dtype=torch.float32),
                                                        requires_grad=False)
        elif cfg.scoring == "sigmoid":  # the sigmoid kernels add a bias: zeros
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts), persistent=False)
        else:
            self.register_parameter("e_score_correction_bias", None)

        # The fused batch-1 kernel finds its last program with this counter; one per layer
        # (its address is captured in the decode graphs), zero between calls.
        self.register_buffer("done_counter", torch.zeros(1, dtype=torch.int32), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k + S] fp32, expert ids [T, k + S]) from the fp32 logits of x."""
        c = self.cfg
        return ops.moe_route(x, self.weight, self.e_score_correction_bias, c.scoring, c.top_k, c.num_groups,
                             c.topk_groups, c.norm_topk_prob, c.routed_scaling_factor, self.done_counter,
                             self.num_shared)


class RoutedExperts(nn.Module):
    """w13 [E_local + S, 2 I_local, H] (each expert's gate rows, then its up rows) and w2
    [E_local + S, H, I_local], the S shared experts (if joined) last; `forward` gives this
    rank's partial sum over the routed slots and the shared experts. In fp8 form
    (`to_fp8`), e4m3 with fp32 scales, either one per row: w13_scale [E_local + S, 2
    I_local] and w2_scale [E_local + S, H] (a row of w2 spans the whole intermediate
    dimension, so its scale is the whole row's, on every rank and for the shared experts'
    split rows too); or the checkpoint's blocks of (rows, columns) as stored, each
    expert's matrices on their own: w13_scale [E_local + S, 2 I_local / rows, ceil(H /
    columns)] (gate's scale rows, then up's) and w2_scale [E_local + S, ceil(H / rows),
    I_local / columns] (`holds_blocks`)."""

    def __init__(
        self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, tp: ParallelState, placement: str,
        num_shared: int = 0,
    ):
        """`top_k`: the experts each token is routed to (what a step reads depends on it).
        `num_shared`: shared experts of `intermediate_size` each to hold and run with the
        routed ones (one rank only: the routed experts must all be local)."""
        super().__init__()
        self.top_k, self.num_shared = top_k, num_shared
        if placement not in MOE_PLACEMENTS:
            raise ValueError(f"MoE placement must be one of {', '.join(MOE_PLACEMENTS)}, got {placement!r}")
        self.tp, self.placement, self.num_experts = tp, placement, num_experts
        world, rank = tp.world_size, tp.rank
        assert not num_shared or world == 1, "shared experts join the routed ones on a single rank only"
        if placement == "ep":
            self.num_local = num_experts // world
            self.first = rank * self.num_local
            self.inter = intermediate_size
        else:
            self.num_local, self.first = num_experts, 0
            self.inter = intermediate_size // world
        stored = self.num_local + num_shared
        self.w13 = nn.Parameter(torch.empty(stored, 2 * self.inter, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(stored, hidden_size, self.inter), requires_grad=False)
        # Pieces by (shard, expert id); the shared experts' tensors come as one (expert None).
        pieces = [*range(self.first, self.first + self.num_local), *([None] if num_shared else [])]
        self.w13.expected_pieces = {(s, e) for s in (0, 1) for e in pieces}
        self.w2.expected_pieces = {(None, e) for e in pieces}
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader
        self.fp8: Fp8Config | None = None
        self.register_parameter("w13_scale", None)
        self.register_parameter("w2_scale", None)
        # Global expert id -> local index, -1 where another rank holds it (EP over ranks).
        if placement == "ep" and world > 1:
            expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
            expert_map[self.first : self.first + self.num_local] = torch.arange(self.num_local, dtype=torch.int32)
            self.register_buffer("expert_map", expert_map, persistent=False)
        else:
            self.expert_map = None

    def holds_blocks(self, block: tuple[int, int]) -> bool:
        """Whether this rank's experts keep a block layout's scales as stored: every slice
        the loader takes (gate and up rows stacked, a rank's or a shared expert's share
        of the intermediate dimension) starts and ends on block boundaries."""
        return self.inter % block[0] == 0 and self.inter % block[1] == 0

    def to_fp8(self, config: Fp8Config) -> None:
        """Hold the experts as e4m3 values with their scales from now on (before loading),
        one per row or per block as `config` says; the fused MoE multiplies them as they
        are. A block layout must fit this rank's experts (`holds_blocks`)."""
        if config.layout == "block" and not self.holds_blocks(config.block):
            raise ConfigError(
                f"routed experts of intermediate size {self.inter} on this rank ({self.placement} over "
                f"{self.tp.world_size}) would split the checkpoint's {config.block[0]} x {config.block[1]} fp8 "
                f"blocks (weight_block_size): the size must be a multiple of both; choose another "
                f"tensor_parallel_size or moe_parallel='ep'")
        for name in ("w13", "w2"):
            old = getattr(self, name)
            new = nn.Parameter(torch.empty(old.shape, dtype=FP8, device=old.device), requires_grad=False)
            new.weight_loader, new.expected_pieces = old.weight_loader, old.expected_pieces
            shape = old.shape[:2] if config.layout == "channel" else (old.shape[0], *config.scale_shape(*old.shape[1:]))
            scale = nn.Parameter(torch.ones(shape, device=old.device), requires_grad=False)
            scale.expected_pieces = set()  # loaded with the weight
            setattr(self, name, new)
            setattr(self, name + "_scale", scale)
        self.fp8, self.full_dtype = config, old.dtype

    @property
    def block(self) -> tuple[int, int] | None:
        """The scales' blocks (None: one per row, or not fp8)."""
        return self.fp8.block if self.fp8 is not None else None

    def finish_loading(self) -> None:
        """Without fp8 kernels on this device, or with blocks the kernels do not take
        (`fused_moe_configs.takes_blocks`), the dequantized experts in the model's dtype."""
        if self.fp8 is None or ops.fp8_kernels(self.w13.device) and ops.moe_takes_scales(self.block):
            return
        for name in ("w13", "w2"):
            w, s = getattr(self, name).data, getattr(self, name + "_scale").data
            full = torch.stack([dequantize(w[i], s[i], self.fp8, self.full_dtype) for i in range(w.shape[0])])
            setattr(self, name, nn.Parameter(full, requires_grad=False))
            setattr(self, name + "_scale", None)
        self.fp8 = None

    def _rows(self, loaded: Weight, dim: int, start: int, size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows (dim 0) or columns (dim 1) [start, start + size) of a checkpoint tensor as
        this layer holds them: (values, None), or in fp8 (values, per-row scales), a row's
        scale over the whole row (a column slice quantizes the whole rows first)."""
        if self.fp8 is None:
            return _slice(loaded, dim, start, size), None
        q, scale = fp8_slice(loaded, dim, start, size, self.fp8, self.w13.device)
        return q, scale.reshape(-1) if self.fp8.layout == "channel" else scale

    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id=None, expert_id=None) -> None:
        """One expert's gate (shard 0) or up (shard 1) projection [I, H] into w13, or its
        down projection [H, I] into w2. Another rank's expert is skipped unread. Expert
        None: the shared experts' projection ([S I, H] or [H, S I]), split into S."""
        if expert_id is None:
            self._load_shared(param, loaded, shard_id)
            return
        local = expert_id - self.first
        if not 0 <= local < self.num_local:
            return
        start = self.tp.rank * self.inter if self.placement == "tp" else 0
        if param is self.w13:
            self._put_w13(local, shard_id, *self._rows(loaded, 0, start, self.inter))
        else:
            self._put_w2(local, *self._rows(loaded, 1, start, self.inter))

    def _put_w13(self, index: int, shard_id: int, values: torch.Tensor, scale: torch.Tensor | None) -> None:
        rows = slice(shard_id * self.inter, (shard_id + 1) * self.inter)
        copy_into(self.w13.data[index, rows], values)
        if scale is not None:
            per = self.w13_scale.shape[1] // 2  # the gate's scale rows, then the up's
            copy_into(self.w13_scale.data[index, shard_id * per : (shard_id + 1) * per], scale)

    def _put_w2(self, index: int, values: torch.Tensor, scale: torch.Tensor | None) -> None:
        copy_into(self.w2.data[index], values)
        if scale is not None:
            copy_into(self.w2_scale.data[index], scale)

    def _load_shared(self, param: nn.Parameter, loaded: Weight, shard_id) -> None:
        assert self.num_shared, "shared experts' weights for experts that do not hold them"
        i = self.inter
        if param is self.w13:
            for s in range(self.num_shared):
                self._put_w13(self.num_local + s, shard_id, *self._rows(loaded, 0, s * i, i))
            return
        # Quantized (if at all) as the whole [H, S I] down projection, each shared expert
        # keeping its columns and the rows' scales (what the tensor-parallel MLP holds), or
        # its columns' blocks.
        values, scale = self._rows(loaded, 1, 0, self.num_shared * i)
        for s in range(self.num_shared):
            if self.block is not None:
                cols = i // self.block[1]
                self._put_w2(self.num_local + s, values.narrow(1, s * i, i), scale.narrow(1, s * cols, cols))
            else:
                self._put_w2(self.num_local + s, values.narrow(1, s * i, i), scale)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """weights, ids [T, k + S] (the router's, shared columns last)."""
        if not self.num_shared or x.shape[0] <= FUSED_SHARED_MAX_TOKENS:
            return ops.fused_moe(x, self.w13, self.w2, weights, ids, self.expert_map, w13_scale=self.w13_scale,
                                 w2_scale=self.w2_scale, block=self.block)
        return self.forward_shared_dense(x, weights, ids)

    def forward_shared_dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The same sum with the shared experts as dense GEMMs (the prefill form): one GEMM
        for their gate and up rows (adjacent in w13), SiLU-and-mul per expert, a batched
        GEMM for their down projections. No shape here depends on the token count but
        the rows, so no kernel specialises on it beyond what decode steps compile."""
        e, k, s = self.num_local, self.top_k, self.num_shared
        tokens, hidden = x.shape
        s13, s2, block = self.w13_scale, self.w2_scale, self.block
        y = ops.fused_moe(x, self.w13[:e], self.w2[:e], weights[:, :k], ids[:, :k], self.expert_map,
                          w13_scale=None if s13 is None else s13[:e], w2_scale=None if s2 is None else s2[:e],
                          block=block)
        w13 = self.w13[e:].reshape(s * 2 * self.inter, hidden)
        # As one [S 2I, H] weight: per-row scales as a column, block scales' rows stacked
        # alike (I is a multiple of the block's rows).
        gate_up = ops.linear(x, w13, None, None if s13 is None else s13[e:].reshape(-1, s13.shape[-1] if block else 1),
                             block)
        h = ops.silu_and_mul(gate_up.view(tokens, s, 2 * self.inter))  # [T, S, I]
        if s2 is None:
            return y + torch.bmm(h.transpose(0, 1), self.w2[e:].transpose(1, 2)).sum(dim=0)
        for j in range(s):  # fp8: one GEMM per shared expert (S is 1 or 2)
            y = y + ops.linear(h[:, j], self.w2[e + j], None, s2[e + j] if block else s2[e + j].reshape(-1, 1), block)
        return y


def _slice(loaded: Weight, dim: int, start: int, size: int) -> torch.Tensor:
    """This rank's `size` rows or columns of an expert's tensor; one that already has that
    extent is the shard itself (TP = 1, EP, or a pre-sliced checkpoint)."""
    if shape_of(loaded)[dim] == size:
        return materialize(loaded)
    return narrow(loaded, dim, start, size)


class MoE(nn.Module):
    """A mixture-of-experts MLP: the router (`gate`), the routed experts (`experts`) and
    `num_shared` shared experts of the same intermediate size, which every token uses. On
    one rank the shared experts join the routed ones (RoutedExperts); under tensor
    parallelism they are a tensor-parallel MLP (`shared_experts`). With fp8 weights
    (`use_fp8`) the experts hold e4m3 values and scales, in the checkpoint's blocks or
    one per row."""

    def __init__(self, hidden_size: int, intermediate_size: int, router: RouterConfig, num_shared: int,
                 tp: ParallelState):
        super().__init__()
        self.tp = tp
        joined = num_shared if num_shared and tp.world_size == 1 else 0
        self.gate = Router(hidden_size, router, joined)
        self.experts = RoutedExperts(router.num_experts, router.top_k, hidden_size, intermediate_size, tp,
                                     tp.moe_parallel, joined)
        self.shared_experts = (GatedMLP(hidden_size, intermediate_size * num_shared, "silu", False, tp)
                               if num_shared and not joined else None)

    def use_fp8(self, config: Fp8Config) -> bool:
        """Before loading: the experts in fp8 form (per row, or the checkpoint's blocks);
        returns whether they are. Blocks that this rank's experts cannot keep whole
        (`RoutedExperts.holds_blocks`) are refused under TP placement over several ranks,
        where the split is the user's choice; on one rank or under EP (an intermediate
        size no published checkpoint has) the experts are dequantized as they load, and
        then the shared experts under TP stay in the model's dtype too: on one rank they
        run inside the fused MoE, and every TP size computes alike."""
        experts = self.experts
        if (config.layout == "channel" or experts.holds_blocks(config.block)
                or experts.placement == "tp" and self.tp.world_size > 1):
            experts.to_fp8(config)
            return True
        if self.shared_experts is not None:
            self.shared_experts.gate_up_proj.quantizable = False
            self.shared_experts.down_proj.quantizable = False
        return False

    def forward_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(moe(x) + residual) and that sum for an RMSNorm `norm`: the routed and shared
        experts' partial sums on this rank, reduced once over the group with the add + norm."""
        weights, ids = self.gate(x)
        y = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            y = y + self.shared_experts.down_proj.partial(self.shared_experts(x))
        return all_reduce_add_rms_norm(y, residual, norm.weight, norm.eps, self.tp)


def mlp_add_norm(mlp: nn.Module, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's MLP, a `MoE` or a `GatedMLP`, with the residual add + RMSNorm
    after it: (norm(mlp(x) + residual), mlp(x) + residual)."""
    if isinstance(mlp, MoE):
        return mlp.forward_add_norm(x, residual, norm)
    return mlp.down_proj.forward_add_norm(mlp(x), residual, norm)


def expert_rules(mlp: str, gate: str, up: str, down: str, shared_joined: bool) -> tuple[WeightRule, ...]:
    """Checkpoint rules for the experts of MoE MLPs whose names match the regular
    expression `mlp` (e.g. `model\\.layers\\.\\d+\\.mlp`), each expert's projections named
    `{mlp}.experts.{e}.{gate|up|down}.weight`, into the MoE's `experts.w13` / `experts.w2`;
    shared experts (`{mlp}.shared_experts.*_proj`) into the routed stacks when they are
    joined (`shared_joined`), else into the shared MLP's merged gate_up."""
    pre = rf"(?P<pre>{mlp})"
    rules = [
        WeightRule(pre + rf"\.experts\.(?P<expert>\d+)\.(?P<shard>{gate}|{up})\.weight", "{pre}.experts.w13",
                   shards={gate: 0, up: 1}),
        WeightRule(pre + rf"\.experts\.(?P<expert>\d+)\.{down}\.weight", "{pre}.experts.w2"),
    ]
    if shared_joined:
        rules += [
            WeightRule(pre + r"\.shared_experts\.(?P<shard>gate|up)_proj\.weight", "{pre}.experts.w13",
                       shards={"gate": 0, "up": 1}),
            WeightRule(pre + r"\.shared_experts\.down_proj\.weight", "{pre}.experts.w2"),
        ]
    else:
        rules.append(WeightRule(pre + r"\.shared_experts\.(?P<shard>gate|up)_proj\.weight",
                                "{pre}.shared_experts.gate_up_proj.weight", shards={"gate": 0, "up": 1}))
    return tuple(rules)
