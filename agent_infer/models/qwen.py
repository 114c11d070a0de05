"""The dense decoder family in one implementation: Llama, Qwen2 (q/k/v biases) and Qwen3
(per-head q_norm/k_norm), driven by config.json. Layers are tensor-parallel: merged QKV
and gate_up (column-parallel), o_proj and down_proj (row-parallel, one all-reduce each),
vocabulary-parallel embedding and LM head. Each row-parallel projection runs together
with the residual add + RMSNorm after it (`RowParallelLinear.forward_add_norm`), so its
all-reduce can be fused with them."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from agent_infer.config import ModelConfig
from agent_infer.layers.activation import SiluAndMul, get_act_and_mul
from agent_infer.layers.attention import Attention
from agent_infer.layers.norm import RMSNorm
from agent_infer.layers.rotary import RotaryEmbedding
from agent_infer.loader.weights import Weight, copy_into, materialize
from agent_infer.tp_layers.distributed import ParallelState
from agent_infer.tp_layers.embedding import ParallelLMHead, VocabParallelEmbedding
from agent_infer.tp_layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear


class DenseAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: ParallelState):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, tp)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(positions, x))

    def attend(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The attention output before o_proj, [tokens, heads x head_dim]."""
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        o = self.attn.forward_with_rope(positions, q, k, v, self.rotary, self.q_norm, self.k_norm)
        return o.reshape(tokens, self.num_heads * self.head_dim)


class DenseMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: ParallelState):
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [size, size], cfg.mlp_bias, tp)
        self.act = get_act_and_mul(cfg.hidden_act)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, cfg.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activate(x))

    def activate(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate) * up, the input of down_proj."""
        if isinstance(self.act, SiluAndMul):
            return self.gate_up_proj.forward_silu_mul(x)
        return self.act(self.gate_up_proj(x))


class DenseDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, tp: ParallelState):
        super().__init__()
        self.self_attn = DenseAttention(cfg, rotary, tp)
        self.mlp = DenseMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, next_norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this layer's input, already normalised (input_layernorm); residual: the
        stream before that norm. Returns the next layer's normalised input (`next_norm`:
        its input_layernorm, or the model's final norm) and the updated stream. Each
        row-parallel projection is fused with the residual add + norm that follows it."""
        x = self.self_attn.attend(positions, x)
        x, residual = self.self_attn.o_proj.forward_add_norm(x, residual, self.post_attention_layernorm)
        x = self.mlp.activate(x)
        return self.mlp.down_proj.forward_add_norm(x, residual, next_norm)


class DenseModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: ParallelState, max_pos: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, max_pos, is_neox=True)
        self.layers = nn.ModuleList(DenseDecoderLayer(cfg, rotary, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens.forward_norm(input_ids, self.layers[0].input_layernorm)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm in zip(self.layers, norms):
            x, residual = layer(positions, x, residual, next_norm)
        return x


class DenseForCausalLM(nn.Module):
    """Checkpoint-name mapping of the merged projections: HF name -> (our parameter, shard)."""

    stacked_params = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, cfg: ModelConfig, tp: ParallelState, max_pos: int):
        super().__init__()
        self.config = cfg
        self.model = DenseModel(cfg, tp, max_pos)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def attention_layers(self) -> list:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, w in weights:
            name = _normalise_name(name)
            if name is None or "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            for param_name, hf_name, shard in self.stacked_params:
                if f".{hf_name}." in name:
                    target = name.replace(f".{hf_name}.", f".{param_name}.")
                    if target not in params:
                        raise KeyError(f"checkpoint weight {name} has no parameter {target}")
                    params[target].weight_loader(params[target], w, shard)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise KeyError(f"checkpoint weight {name} matches no parameter of {type(self).__name__}")
                param = params[name]
                loader = getattr(param, "weight_loader", None)
                if loader is None:
                    copy_into(param, materialize(w), name)
                else:
                    loader(param, w)
                loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            # A norm weight left at its initial ones is a silent accuracy bug (blueprint FM-003).
            shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
            raise ValueError(f"checkpoint lacks {len(missing)} weights the model needs: {shown}")


def _normalise_name(name: str) -> str | None:
    """Map the names of VL checkpoints' language model onto ours; drop vision weights."""
    if name.startswith(("visual.", "model.visual.")):
        return None
    return name.replace("model.language_model.", "model.").replace("language_model.model.", "model.").replace(
        "language_model.lm_head.", "lm_head."
    )
