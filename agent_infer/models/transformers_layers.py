"""The engine's layers in place of transformers' own, in a model the transformers backend
built: its linear layers (the batch-1 GEMV, fp32 accumulation like the native families),
its RMSNorms where they compute the engine's RMSNorm, and, over several ranks, the split
transformers publishes with each architecture (its config's `base_model_tp_plan`:
module-name patterns, relative to the base model with `*` for a layer index, mapped to a
style).

The styles served, on the engine's parallel layers (layers/linear.py):
- `colwise`: the output features split over ranks; the output stays split (attention
  heads, or the MLP's intermediate features for the next `rowwise` layer);
- `rowwise`: the input features split; the partial outputs all-reduced, the bias once;
- `colwise_gather_output`: `colwise`, then the output gathered whole on every rank;
- `rowwise_split_input`: the whole input's slice for this rank, then `rowwise`;
- `embedding_rowwise` / `embedding_colwise` and `replicated_*`: nothing to do here; the
  input embedding is split by vocabulary rows whenever it is a plain `nn.Embedding`
  (every rank's rows, the others' zero, all-reduced: exact), and so is the LM head.

Any other style is refused by name. An attention module one of whose projections is
`rowwise` computes only its rank's heads (q/k/v split by heads), so the paged cache holds
`num_kv_heads / tp` heads a rank; otherwise (q/k/v gathered whole, as OLMo 2's norms over
all heads need) every rank attends over all heads.

The split is planned on the model's structure alone (`plan_split`), so a size that does
not divide a layer is refused, naming it, before any process starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn
from torch import library as custom_ops

from agent_infer.config import ConfigError
from agent_infer.distributed.state import ParallelState, all_gather_last_dim
from agent_infer.kernels import ops, reference
from agent_infer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from agent_infer.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

COLUMN = ("colwise", "colwise_gather_output")
ROW = ("rowwise", "rowwise_split_input")
# Nothing to split: norms kept whole, and embeddings (split below whenever they can be).
KEPT = ("embedding_rowwise", "embedding_colwise", "replicated_with_grad_allreduce", "replicate")


@dataclass(frozen=True)
class SplitPlan:
    """What a model's split looks like on one rank: each linear layer to split and its
    style (module names relative to the base model), and the attention modules whose
    heads are split (the others attend over all heads on every rank)."""

    linears: dict[str, str]
    split_heads: frozenset[str]


def tp_plan_of(model: nn.Module) -> dict[str, str] | None:
    """The architecture's published split: its config's `base_model_tp_plan`."""
    return getattr(model.config, "base_model_tp_plan", None) or None


def _pattern(key: str) -> re.Pattern:
    return re.compile(re.escape(key).replace(r"\*", r"\d+"))


def plan_split(base_model: nn.Module, plan: dict[str, str], attention_names: list[str], tp: int,
               num_heads: int, num_kv_heads: int, architecture: str) -> SplitPlan:
    """Match `plan` against `base_model`'s modules (its real ones or a meta-device copy)
    and check that `tp` divides every split it implies: a ConfigError naming the layer,
    style or head count that does not."""
    unknown = sorted({s for s in plan.values() if s not in COLUMN + ROW + KEPT})
    if unknown:
        raise ConfigError(f"{architecture}'s tensor-parallel plan uses {', '.join(unknown)}, which the "
                          f"transformers backend does not split; serve it with --tp 1")
    patterns = [(_pattern(key), style) for key, style in plan.items() if style in COLUMN + ROW]
    linears: dict[str, str] = {}
    for name, module in base_model.named_modules():
        style = next((s for p, s in patterns if p.fullmatch(name)), None)
        if style is None:
            continue
        if type(module) is not nn.Linear:
            raise ConfigError(f"{architecture}: {name} is a {type(module).__name__}, not a linear layer; its "
                              f"tensor-parallel plan cannot be applied here (serve it with --tp 1)")
        dim = 0 if style in COLUMN else 1
        if module.weight.shape[dim] % tp:
            what = "output" if dim == 0 else "input"
            raise ConfigError(f"{architecture}: {name} has {module.weight.shape[dim]} {what} features, not "
                              f"divisible by --tp {tp}")
        linears[name] = style
    split_heads = frozenset(a for a in attention_names
                            if any(s == "rowwise" and n.startswith(a + ".") for n, s in linears.items()))
    if split_heads:
        for count, what in ((num_heads, "attention heads"), (num_kv_heads, "KV heads")):
            if count % tp:
                works = [d for d in range(1, num_kv_heads + 1) if num_heads % d == 0 and num_kv_heads % d == 0]
                raise ConfigError(f"{architecture}: {count} {what} do not divide by --tp {tp} (its plan splits "
                                  f"attention by heads); sizes the heads allow: {works}")
    return SplitPlan(linears, split_heads)


class _ColumnLinear(ColumnParallelLinear):
    """A transformers `nn.Linear` as a column-parallel layer: [..., K] -> [..., N / tp],
    or the whole [..., N] gathered (`colwise_gather_output`)."""

    def __init__(self, linear: nn.Linear, tp: ParallelState, gather: bool):
        super().__init__(linear.in_features, linear.out_features, linear.bias is not None, tp)
        self.gather = gather

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x.reshape(-1, x.shape[-1]), self.bias)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return all_gather_last_dim(y, self.tp) if self.gather else y


class _RowLinear(RowParallelLinear):
    """A transformers `nn.Linear` as a row-parallel layer: this rank's [..., K / tp] (or
    its slice of the whole [..., K], `rowwise_split_input`) -> [..., N], all-reduced."""

    def __init__(self, linear: nn.Linear, tp: ParallelState, split_input: bool):
        super().__init__(linear.in_features, linear.out_features, linear.bias is not None, tp)
        self.split_input = split_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_input:
            x = x.narrow(-1, self.tp.rank * self.in_per_rank, self.in_per_rank)
        y = super().forward(x.reshape(-1, x.shape[-1]))
        return y.view(*x.shape[:-1], y.shape[-1])


# torch names a custom operator "library::name"; the library is this package.
_LINEAR = __name__.split(".")[0] + "::linear"


# The engine's linear path as an operator torch.compile keeps whole (the model around
# it is compiled on a GPU: models/transformers_backend.py): one node in the graph, where
# tracing into its launchers would break it.
@custom_ops.custom_op(_LINEAR, mutates_args=(), schema="(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return ops.linear(x, weight, bias)


@_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


class _WholeLinear(ReplicatedLinear):
    """A transformers `nn.Linear` kept whole on every rank, on the engine's linear path."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear.in_features, linear.out_features, linear.bias is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _linear_op(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
        return y.view(*x.shape[:-1], y.shape[-1])


class _RMSNorm(nn.Module):
    """A transformers RMSNorm that computes weight x x / rms(x), on the engine's kernel."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # Traced as plain tensor operations: the compiler fuses them with the residual
            # add before, one kernel where the engine's would be a second.
            return reference.rms_norm(x, self.weight, self.eps)
        return ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)


def _engine_norm(module: nn.Module) -> _RMSNorm | None:
    """The engine's RMSNorm for a transformers norm module, if it computes the same thing
    (checked on a random input: Gemma's 1 + weight, a bias or a norm over another axis
    does not), else None."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, float):
        return None
    norm = _RMSNorm(weight.data, eps)
    x = torch.randn(3, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    with torch.no_grad():
        try:
            theirs = module(x)
        except Exception:  # a norm that takes other inputs is not one to replace
            return None
        ours = norm(x)
    same = (isinstance(theirs, torch.Tensor) and theirs.shape == ours.shape
            and torch.allclose(theirs.float(), ours.float(), rtol=2e-2 if weight.element_size() < 4 else 1e-5,
                               atol=1e-6))
    return norm if same else None


def _engine_linear(linear: nn.Linear, style: str | None, tp: ParallelState) -> nn.Module:
    """The engine's layer for `linear`: this rank's part of it under a split `style`, else
    the whole of it; loaded from `linear`'s tensors."""
    if style is None:
        layer = _WholeLinear(linear)
    elif style in COLUMN:
        layer = _ColumnLinear(linear, tp, gather=style == "colwise_gather_output")
    else:
        layer = _RowLinear(linear, tp, split_input=style == "rowwise_split_input")
    layer.weight_loader(layer.weight, linear.weight.data)
    if linear.bias is not None:
        layer.bias.weight_loader(layer.bias, linear.bias.data)
    return layer


def _replace(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def use_engine_layers(hf: nn.Module, split: SplitPlan | None, tp: ParallelState) -> None:
    """Replace, in the loaded transformers model `hf` (on the CPU), every linear layer of
    its base model by the engine's (this rank's part of it where `split` says), RMSNorms
    by the engine's where they compute the same, the LM head by the engine's
    vocabulary-parallel one when it is a bias-free linear layer, and over several ranks a
    plain input embedding by a vocabulary-parallel one (sharing one weight when tied)."""
    base = hf.base_model
    for name, module in list(base.named_modules()):
        if type(module) is nn.Linear:
            style = split.linears.get(name) if split is not None else None
            _replace(base, name, _engine_linear(module, style, tp))
        elif type(module).__name__.endswith("RMSNorm") and (norm := _engine_norm(module)) is not None:
            _replace(base, name, norm)
    embed, head = hf.get_input_embeddings(), hf.get_output_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    if tp.world_size > 1 and type(embed) is nn.Embedding:
        sharded = VocabParallelEmbedding(embed.num_embeddings, embed.embedding_dim, tp)
        sharded.weight_loader(sharded.weight, embed.weight.data)
        hf.set_input_embeddings(sharded)
    if type(head) is nn.Linear and head.bias is None:
        engine_head = ParallelLMHead(head.out_features, head.in_features, tp)
        embed = hf.get_input_embeddings()
        if tied and (tp.world_size == 1 or isinstance(embed, VocabParallelEmbedding)):
            engine_head.weight = embed.weight  # the same rows of the same tensor
        else:
            engine_head.weight_loader(engine_head.weight, head.weight.data)
        hf.set_output_embeddings(engine_head)
