"""The dense decoder family in one implementation: Llama, Qwen2 (q/k/v biases) and Qwen3
(per-head q_norm/k_norm), driven by config.json. Layers are tensor-parallel: merged QKV
and gate_up (column-parallel), o_proj and down_proj (row-parallel, one all-reduce each),
vocabulary-parallel embedding and LM head. Each row-parallel projection runs together
with the residual add + RMSNorm after it (`RowParallelLinear.forward_add_norm`), so its
all-reduce can be fused with them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from agent_infer.config import ConfigError, ModelConfig, refuse_unread_fields
from agent_infer.distributed.state import ParallelState
from agent_infer.layers.attention import PagedAttention
from agent_infer.layers.embedding import VocabParallelEmbedding
from agent_infer.layers.linear import QKVParallelLinear, RowParallelLinear
from agent_infer.layers.mlp import GatedMLP
from agent_infer.layers.moe import mlp_add_norm
from agent_infer.layers.norm import RMSNorm
from agent_infer.layers.rotary import RotaryEmbedding
from agent_infer.loader.load import WeightMap, WeightRule
from agent_infer.models.base import DecoderLM, DecoderStack


@dataclass(frozen=True)
class LlamaFamilyConfig:
    """The dense family's section of config.json, with the quirks its configs leave
    unsaid: Qwen2 always has q/k/v biases (and no o_proj bias), Qwen3 per-head q/k norms."""

    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    hidden_act: str

    @staticmethod
    def from_hf(hf: dict[str, Any], family: str = "Llama/Qwen2/Qwen3", reads: frozenset[str] = frozenset()
                ) -> "LlamaFamilyConfig":
        """`family` and `reads`: for a family built on this one (its name, and the
        architecture fields it reads besides these)."""
        refuse_unread_fields(hf, family, reads)
        if hf.get("use_sliding_window"):
            raise ConfigError("sliding-window attention (use_sliding_window: true) is not supported")
        model_type = hf.get("model_type", "")
        qwen2 = model_type == "qwen2" or model_type.startswith("qwen2_")
        heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
        bias = bool(hf.get("attention_bias", False))
        return LlamaFamilyConfig(
            intermediate_size=int(hf.get("intermediate_size", 4 * hidden)),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            qkv_bias=qwen2 or bias,
            o_bias=bias and not model_type.startswith("qwen2"),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type.startswith("qwen3"),
            hidden_act=hf.get("hidden_act", "silu"),
        )


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: ParallelState):
        super().__init__()
        f: LlamaFamilyConfig = cfg.family
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, f.head_dim, f.num_heads, f.num_kv_heads, f.qkv_bias, tp)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = f.head_dim
        self.o_proj = RowParallelLinear(f.num_heads * f.head_dim, cfg.hidden_size, f.o_bias, tp)
        self.q_norm = RMSNorm(f.head_dim, cfg.rms_norm_eps) if f.qk_norm else None
        self.k_norm = RMSNorm(f.head_dim, cfg.rms_norm_eps) if f.qk_norm else None
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, f.head_dim, f.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The attention output before o_proj, [tokens, heads x head_dim]."""
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        o = self.attn(positions, q, k, v, self.rotary, self.q_norm, self.k_norm)
        return o.reshape(tokens, self.num_heads * self.head_dim)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: ParallelState, mlp: nn.Module | None = None):
        """`mlp`: the layer's MLP when not the dense one (a mixture of experts)."""
        super().__init__()
        f: LlamaFamilyConfig = cfg.family
        self.self_attn = LlamaAttention(cfg, rotary, tp)
        self.mlp = mlp or GatedMLP(cfg.hidden_size, f.intermediate_size, f.hidden_act, f.mlp_bias, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, next_norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this layer's input, already normalised (input_layernorm); residual: the
        stream before that norm. Returns the next layer's normalised input (`next_norm`:
        its input_layernorm, or the model's final norm) and the updated stream. Each
        row-parallel projection is fused with the residual add + norm that follows it."""
        x = self.self_attn(positions, x)
        x, residual = self.self_attn.o_proj.forward_add_norm(x, residual, self.post_attention_layernorm)
        return mlp_add_norm(self.mlp, x, residual, next_norm)


class LlamaModel(DecoderStack):
    def __init__(self, cfg: ModelConfig, tp: ParallelState, max_pos: int,
                 make_mlp: Callable[[int], nn.Module | None] = lambda i: None):
        """`make_mlp(i)`: layer i's MLP when not the dense one (None: dense)."""
        rotary = RotaryEmbedding(cfg.family.head_dim, cfg.rope, max_pos, is_neox=True)
        super().__init__(
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp),
            nn.ModuleList(LlamaDecoderLayer(cfg, rotary, tp, make_mlp(i)) for i in range(cfg.num_layers)),
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
        )


# Checkpoint names of the merged projections: q/k/v into qkv_proj, gate/up into gate_up_proj.
_RULES = (
    WeightRule(r"(?P<pre>.+)\.self_attn\.(?P<shard>q|k|v)_proj\.(?P<kind>weight|bias)", "{pre}.self_attn.qkv_proj.{kind}"),
    WeightRule(r"(?P<pre>.+)\.mlp\.(?P<shard>gate|up)_proj\.(?P<kind>weight|bias)", "{pre}.mlp.gate_up_proj.{kind}",
               shards={"gate": 0, "up": 1}),
    # An fp8 KV cache's scales (compressed-tensors' kv_cache_scheme) belong to the paged attention.
    WeightRule(r"(?P<pre>.+)\.self_attn\.(?P<which>k|v)_scale", "{pre}.self_attn.attn.{which}_scale"),
)
# The language model of the VL checkpoints under our names; their vision tower loads nowhere.
_RENAMES = (
    (r"^model\.language_model\.", "model."),
    (r"^language_model\.model\.", "model."),
    (r"^language_model\.lm_head\.", "lm_head."),
)
_SKIP = (r"(model\.)?visual\..*", r".*\.rotary_emb\.inv_freq")


class LlamaForCausalLM(DecoderLM):
    config_class = LlamaFamilyConfig

    def __init__(self, cfg: ModelConfig, tp: ParallelState, max_pos: int):
        super().__init__(cfg, LlamaModel(cfg, tp, max_pos), tp)

    def weight_map(self) -> WeightMap:
        skip = _SKIP + ((r"lm_head\.weight",) if self.config.tie_word_embeddings else ())
        return WeightMap(rules=_RULES, skip=skip, renames=_RENAMES)

    @classmethod
    def check_parallel(cls, cfg: ModelConfig, tp: int, moe_parallel: str) -> None:
        """Query heads split evenly; KV heads split evenly too, or each replicated over
        `tp / kv` ranks when there are fewer than ranks."""
        if tp == 1:
            return
        heads, kv = cfg.family.num_heads, cfg.family.num_kv_heads
        works = [d for d in range(1, heads + 1) if heads % d == 0 and (kv % d == 0 or d % kv == 0)]
        if heads % tp or (tp <= kv and kv % tp) or (tp > kv and tp % kv):
            raise ConfigError(
                f"tensor-parallel size {tp} does not divide this model ({heads} attention heads, {kv} KV heads); "
                f"sizes that work: {works}"
            )

    @classmethod
    def checkpoint_tensors(cls, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
        f: LlamaFamilyConfig = cfg.family
        h, q, kv, inter = cfg.hidden_size, f.num_heads * f.head_dim, f.num_kv_heads * f.head_dim, f.intermediate_size
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (cfg.vocab_size, h))]
        for i in range(cfg.num_layers):
            pre = f"model.layers.{i}."
            out += [(pre + "input_layernorm.weight", (h,))]
            out += [(pre + f"self_attn.{p}_proj.weight", (n, h)) for p, n in (("q", q), ("k", kv), ("v", kv))]
            if f.qkv_bias:
                out += [(pre + f"self_attn.{p}_proj.bias", (n,)) for p, n in (("q", q), ("k", kv), ("v", kv))]
            if f.qk_norm:
                out += [(pre + "self_attn.q_norm.weight", (f.head_dim,)), (pre + "self_attn.k_norm.weight", (f.head_dim,))]
            out += [(pre + "self_attn.o_proj.weight", (h, q))]
            if f.o_bias:
                out += [(pre + "self_attn.o_proj.bias", (h,))]
            out += [
                (pre + "post_attention_layernorm.weight", (h,)),
                (pre + "mlp.gate_proj.weight", (inter, h)),
                (pre + "mlp.up_proj.weight", (inter, h)),
                (pre + "mlp.down_proj.weight", (h, inter)),
            ]
            if f.mlp_bias:
                out += [(pre + "mlp.gate_proj.bias", (inter,)), (pre + "mlp.up_proj.bias", (inter,)),
                        (pre + "mlp.down_proj.bias", (h,))]
        out.append(("model.norm.weight", (h,)))
        if not cfg.tie_word_embeddings:
            out.append(("lm_head.weight", (cfg.vocab_size, h)))
        return out
