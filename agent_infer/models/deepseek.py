"""DeepSeek-V2 and V3: multi-head latent attention (layers/mla.py) and a mixture of experts
(layers/moe.py) after the first `first_k_dense_replace` dense layers.

Tensor parallelism, hybrid: q_a_proj and kv_a_proj_with_mqa are
replicated, q_proj / q_b_proj and kv_b_proj split by heads, o_proj row-parallel; the
latent cache is whole on every rank. The dense layers and the shared experts are
tensor-parallel MLPs; the routed experts are split by expert (EP, each rank builds and
loads only its own) or by their intermediate dimension (`--moe-parallel tp`). A MoE
layer's routed and shared partial sums meet in one all-reduce, joined with the residual
add + RMSNorm after it. On one rank the shared experts run inside the fused MoE, as
experts every token is routed to (layers/moe.py).

The routers, the rotary layout and the softmax scale follow transformers'
DeepseekV2/V3 classes: softmax routing, greedy or group-limited (V2), or sigmoid with a
correction bias and grouped top-k (V3); DeepSeek's interleaved RoPE (V3's
`rope_interleave: false` is the half-split one) with YaRN; the softmax scale
(qk_nope + qk_rope)^-0.5 x mscale(factor, mscale_all_dim)^2.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from agent_infer.config import ConfigError, ModelConfig, RopeConfig
from agent_infer.distributed.state import ParallelState
from agent_infer.layers.embedding import VocabParallelEmbedding
from agent_infer.layers.linear import (
    ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, StackedWeights, stack_weights,
)
from agent_infer.layers.mla import LatentAttention
from agent_infer.layers.mlp import GatedMLP
from agent_infer.layers.moe import MoE, RouterConfig, expert_rules, mlp_add_norm
from agent_infer.layers.norm import RMSNorm
from agent_infer.layers.rotary import RotaryEmbedding, yarn_mscale
from agent_infer.loader.load import WeightMap, WeightRule
from agent_infer.models.base import DecoderLM, DecoderStack
from agent_infer.models.deepseek_mtp import MTP_SHARED, DeepseekMTP, mtp_weight_renames

log = logging.getLogger(__name__)

_V3 = "DeepseekV3ForCausalLM"
_METHODS = {"DeepseekV2ForCausalLM": ("greedy", "group_limited_greedy"), _V3: ("noaux_tc",)}
_SCORING = {"DeepseekV2ForCausalLM": "softmax", _V3: "sigmoid"}
# The low-rank norms of q and kv: transformers and DeepSeek's own code build them with
# RMSNorm's default epsilon, not the config's rms_norm_eps.
LORA_NORM_EPS = 1e-6


@dataclass(frozen=True)
class DeepseekFamilyConfig:
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int  # the dense layers' MLP
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    router: RouterConfig
    attention_bias: bool
    rope_interleave: bool
    num_nextn_predict_layers: int

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @staticmethod
    def from_hf(hf: dict[str, Any]) -> "DeepseekFamilyConfig":
        arch = (hf.get("architectures") or [""])[0]
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {hf['hidden_act']!r} is not supported for DeepSeek (silu only)")
        scoring = hf.get("scoring_func") or _SCORING[arch]
        if scoring != _SCORING[arch]:
            raise ConfigError(f"{arch} with scoring_func {scoring!r} is not supported ({_SCORING[arch]} only)")
        method = hf.get("topk_method") or _METHODS[arch][0]
        if method not in _METHODS[arch]:
            raise ConfigError(f"{arch} with topk_method {method!r} is not supported; supported: {', '.join(_METHODS[arch])}")
        experts = int(hf["n_routed_experts"])
        groups = int(hf.get("n_group") or 1)
        if experts % groups:
            raise ConfigError(f"n_routed_experts {experts} does not divide into n_group {groups} groups")
        if method == "greedy":
            groups = 1
        heads = int(hf["num_attention_heads"])
        if int(hf.get("num_key_value_heads") or heads) != heads:
            raise ConfigError("DeepSeek MLA needs num_key_value_heads == num_attention_heads")
        return DeepseekFamilyConfig(
            num_heads=heads,
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
            intermediate_size=int(hf["intermediate_size"]),
            moe_intermediate_size=int(hf["moe_intermediate_size"]),
            n_routed_experts=experts,
            n_shared_experts=int(hf.get("n_shared_experts") or 0),
            first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(hf.get("moe_layer_freq") or 1),
            router=RouterConfig(
                num_experts=experts,
                top_k=int(hf["num_experts_per_tok"]),
                scoring=scoring,
                num_groups=groups,
                topk_groups=int(hf.get("topk_group") or groups) if method != "greedy" else 1,
                correction_bias=method == "noaux_tc",
                # transformers' DeepseekV2 router never renormalises; V3's does when asked.
                norm_topk_prob=bool(hf.get("norm_topk_prob")) and arch == _V3,
                routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
            ),
            attention_bias=bool(hf.get("attention_bias", False)),
            rope_interleave=bool(hf.get("rope_interleave", True)),
            num_nextn_predict_layers=int(hf.get("num_nextn_predict_layers") or 0),
        )


def softmax_scale(f: DeepseekFamilyConfig, rope: RopeConfig) -> float:
    """(qk_nope + qk_rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN: the
    scale the rotary's cos/sin do not already carry."""
    scale = (f.qk_nope_head_dim + f.qk_rope_head_dim) ** -0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale *= m * m
    return scale


class DeepseekAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: ParallelState):
        super().__init__()
        f: DeepseekFamilyConfig = cfg.family
        qk = f.qk_nope_head_dim + f.qk_rope_head_dim
        h = cfg.hidden_size
        if f.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, f.num_heads * qk, False, tp)
        else:
            self.q_a_proj = ReplicatedLinear(h, f.q_lora_rank, f.attention_bias)
            self.q_a_layernorm = RMSNorm(f.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(f.q_lora_rank, f.num_heads * qk, False, tp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, f.kv_lora_rank + f.qk_rope_head_dim, f.attention_bias)
        self.kv_a_layernorm = RMSNorm(f.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(f.kv_lora_rank, f.num_heads * (f.qk_nope_head_dim + f.v_head_dim), False, tp)
        self.o_proj = RowParallelLinear(f.num_heads * f.v_head_dim, h, f.attention_bias, tp)
        self.num_heads = f.num_heads // tp.world_size
        self.qk = qk
        self.rotary = rotary
        self.attn = LatentAttention(self.num_heads, f.kv_lora_rank, f.qk_nope_head_dim, f.qk_rope_head_dim,
                                    f.v_head_dim, softmax_scale(f, cfg.rope))
        # MLA absorbs kv_b_proj's weight into the attention: it stays in the model's dtype.
        self.kv_b_proj.quantizable = False
        self.x_proj: StackedWeights | None = None  # stacked after loading (finish_loading)

    def finish_loading(self) -> None:
        """x's two projections (q_proj or q_a_proj, and kv_a_proj_with_mqa) as rows of one
        weight: one GEMV or GEMM launch for both (None when they carry biases)."""
        first = self.q_proj if hasattr(self, "q_proj") else self.q_a_proj
        self.x_proj = stack_weights(first, self.kv_a_proj_with_mqa)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The attention output before o_proj, [tokens, heads x v_head_dim]."""
        lora = not hasattr(self, "q_proj")
        if self.x_proj is not None:
            q, kv_a = self.x_proj(x)
        else:
            q = self.q_a_proj(x) if lora else self.q_proj(x)
            kv_a = self.kv_a_proj_with_mqa(x)
        if lora:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(x.shape[0], self.num_heads, self.qk)
        return self.attn(positions, q, kv_a, self.kv_a_layernorm, self.rotary, self.kv_b_proj.weight)


def shared_experts_join(f: DeepseekFamilyConfig, tp: ParallelState) -> bool:
    """Whether the shared experts are stored and run with the routed ones: on a single
    rank, where every routed expert is local (under EP or TP the shared experts are a
    tensor-parallel MLP)."""
    return f.n_shared_experts > 0 and tp.world_size == 1


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, tp: ParallelState):
        super().__init__()
        f: DeepseekFamilyConfig = cfg.family
        self.self_attn = DeepseekAttention(cfg, rotary, tp)
        if f.is_moe_layer(i):
            self.mlp = MoE(cfg.hidden_size, f.moe_intermediate_size, f.router, f.n_shared_experts, tp)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, f.intermediate_size, "silu", False, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, next_norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As the dense decoder layer: x normalised, residual the stream; returns the next
        layer's normalised input and the stream."""
        x = self.self_attn(positions, x)
        x, residual = self.self_attn.o_proj.forward_add_norm(x, residual, self.post_attention_layernorm)
        return mlp_add_norm(self.mlp, x, residual, next_norm)


class DeepseekModel(DecoderStack):
    def __init__(self, cfg: ModelConfig, tp: ParallelState, max_pos: int):
        f: DeepseekFamilyConfig = cfg.family
        rotary = RotaryEmbedding(f.qk_rope_head_dim, cfg.rope, max_pos, is_neox=not f.rope_interleave)
        super().__init__(
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp),
            nn.ModuleList(DeepseekDecoderLayer(cfg, i, rotary, tp) for i in range(cfg.num_layers)),
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
        )


# Decoder layers' MLPs: the main stack's, and the MTP layer's (loaded as `mtp.block`).
_MLP = r"(?:model\.layers\.\d+|mtp\.block)\.mlp"
# The dense layers' gate and up into their merged projection; the experts' rules are MoE's.
_DENSE_RULES = (
    WeightRule(rf"(?P<pre>{_MLP})\.(?P<shard>gate|up)_proj\.weight", "{pre}.gate_up_proj.weight",
               shards={"gate": 0, "up": 1}),
)


class DeepseekForCausalLM(DecoderLM):
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM."""

    config_class = DeepseekFamilyConfig

    def __init__(self, cfg: ModelConfig, tp: ParallelState, max_pos: int):
        super().__init__(cfg, DeepseekModel(cfg, tp, max_pos), tp)
        self.shared_joined = shared_experts_join(cfg.family, tp)
        self.tp = tp
        self.mtp: DeepseekMTP | None = None

    @property
    def num_draft_layers(self) -> int:
        return self.config.family.num_nextn_predict_layers

    def enable_draft_layer(self) -> None:
        """Build the first multi-token-prediction layer (loaded, not skipped), whose
        attention joins `attention_layers` last (a latent cache of its own)."""
        cfg = self.config
        rotary = self.model.layers[0].self_attn.rotary
        self.mtp = DeepseekMTP(cfg, DeepseekDecoderLayer(cfg, cfg.num_layers, rotary, self.tp))

    @property
    def attention_layers(self) -> list[nn.Module]:
        main = super().attention_layers
        return main if self.mtp is None else main + [self.mtp.block.self_attn.attn]

    def draft_hidden(self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The MTP layer at positions p given t_{p+1} and the main model's h_p; its output
        goes through `compute_logits` for t_{p+2}."""
        return self.mtp(self.model.embed_tokens(next_ids), hidden, positions)

    def weight_map(self) -> WeightMap:
        cfg, f = self.config, self.config.family
        skip = [r".*\.rotary_emb\.inv_freq"]
        if cfg.tie_word_embeddings:
            skip.append(r"lm_head\.weight")
        rules = expert_rules(_MLP, "gate_proj", "up_proj", "down_proj", self.shared_joined)
        if self.mtp is not None:
            later = "|".join(str(cfg.num_layers + i) for i in range(1, f.num_nextn_predict_layers))
            skip += list(MTP_SHARED) + ([rf"model\.layers\.({later})\..*"] if later else [])
            return WeightMap(rules=rules + _DENSE_RULES, skip=tuple(skip),
                             renames=mtp_weight_renames(cfg.num_layers))
        if f.num_nextn_predict_layers:
            # V3's multi-token-prediction layers follow the decoder layers; only
            # speculative decoding with method mtp runs them.
            first = cfg.num_layers
            mtp = "|".join(str(first + i) for i in range(f.num_nextn_predict_layers))
            skip.append(rf"model\.layers\.({mtp})\..*")
            log.info("skipping %d multi-token-prediction layer(s) (model.layers.%d...) at load: no "
                     "--speculative-config with method mtp", f.num_nextn_predict_layers, first)
        return WeightMap(rules=rules + _DENSE_RULES, skip=tuple(skip))

    def warmup_prompt_lengths(self) -> tuple[int, ...]:
        """Steps of every power of two of tokens (the warm-up caps them at the step
        budget): one per bucket of the fused-MoE tile table, whose tiles are their own
        compiled kernels, and the alignment's tile widths, which follow the slot count up
        to a power of two."""
        return tuple(2**i for i in range(16))

    @classmethod
    def check_parallel(cls, cfg: ModelConfig, tp: int, moe_parallel: str) -> None:
        """Heads split evenly over the ranks; the routed experts too (EP), or their
        intermediate size (TP experts); the dense and shared MLPs' intermediate sizes."""
        if tp == 1:
            return
        f: DeepseekFamilyConfig = cfg.family
        sizes = {"attention heads": f.num_heads, "dense MLP intermediate size": f.intermediate_size}
        if f.n_shared_experts:
            sizes["shared experts' intermediate size"] = f.moe_intermediate_size * f.n_shared_experts
        if moe_parallel == "ep":
            sizes["routed experts"] = f.n_routed_experts
        else:
            sizes["routed experts' intermediate size"] = f.moe_intermediate_size
        bad = {k: v for k, v in sizes.items() if v % tp}
        if bad:
            works = [d for d in range(1, f.num_heads + 1) if all(v % d == 0 for v in sizes.values())]
            what = ", ".join(f"{v} {k}" for k, v in bad.items())
            raise ConfigError(f"tensor-parallel size {tp} does not divide this model's {what} "
                              f"(--moe-parallel {moe_parallel}); sizes that work: {works}")

    @classmethod
    def checkpoint_tensors(cls, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
        f: DeepseekFamilyConfig = cfg.family
        h, qk = cfg.hidden_size, f.qk_nope_head_dim + f.qk_rope_head_dim
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (cfg.vocab_size, h))]

        def mlp(pre: str, inter: int) -> list[tuple[str, tuple[int, ...]]]:
            return [(pre + "gate_proj.weight", (inter, h)), (pre + "up_proj.weight", (inter, h)),
                    (pre + "down_proj.weight", (h, inter))]

        def layer(i: int) -> list[tuple[str, tuple[int, ...]]]:
            out: list[tuple[str, tuple[int, ...]]] = []
            pre = f"model.layers.{i}."
            out.append((pre + "input_layernorm.weight", (h,)))
            a = pre + "self_attn."
            if f.q_lora_rank is None:
                out.append((a + "q_proj.weight", (f.num_heads * qk, h)))
            else:
                out += [(a + "q_a_proj.weight", (f.q_lora_rank, h)), (a + "q_a_layernorm.weight", (f.q_lora_rank,)),
                        (a + "q_b_proj.weight", (f.num_heads * qk, f.q_lora_rank))]
            out += [(a + "kv_a_proj_with_mqa.weight", (f.kv_lora_rank + f.qk_rope_head_dim, h)),
                    (a + "kv_a_layernorm.weight", (f.kv_lora_rank,)),
                    (a + "kv_b_proj.weight", (f.num_heads * (f.qk_nope_head_dim + f.v_head_dim), f.kv_lora_rank)),
                    (a + "o_proj.weight", (h, f.num_heads * f.v_head_dim))]
            if f.attention_bias:
                out += [(a + "kv_a_proj_with_mqa.bias", (f.kv_lora_rank + f.qk_rope_head_dim,)), (a + "o_proj.bias", (h,))]
                if f.q_lora_rank is not None:
                    out.append((a + "q_a_proj.bias", (f.q_lora_rank,)))
            out.append((pre + "post_attention_layernorm.weight", (h,)))
            if not f.is_moe_layer(i):
                return out + mlp(pre + "mlp.", f.intermediate_size)
            out.append((pre + "mlp.gate.weight", (f.n_routed_experts, h)))
            if f.router.correction_bias:
                out.append((pre + "mlp.gate.e_score_correction_bias", (f.n_routed_experts,)))
            for e in range(f.n_routed_experts):
                out += mlp(pre + f"mlp.experts.{e}.", f.moe_intermediate_size)
            if f.n_shared_experts:
                out += mlp(pre + "mlp.shared_experts.", f.moe_intermediate_size * f.n_shared_experts)
            return out

        for i in range(cfg.num_layers):
            out += layer(i)
        out.append(("model.norm.weight", (h,)))
        if not cfg.tie_word_embeddings:
            out.append(("lm_head.weight", (cfg.vocab_size, h)))
        for i in range(cfg.num_layers, cfg.num_layers + f.num_nextn_predict_layers):  # V3's MTP layers
            pre = f"model.layers.{i}."
            out += [(pre + "embed_tokens.weight", (cfg.vocab_size, h)), (pre + "enorm.weight", (h,)),
                    (pre + "hnorm.weight", (h,)), (pre + "eh_proj.weight", (h, 2 * h))]
            out += layer(i)
            out += [(pre + "shared_head.norm.weight", (h,)), (pre + "shared_head.head.weight", (cfg.vocab_size, h))]
        return out
