"""The batch-1 decode roofline: every step reads all weights once, so tokens/s can be at
most bandwidth / bytes of weights read per token (DESIGN §6)."""

from __future__ import annotations

from dataclasses import dataclass

from agent_infer.config import ModelConfig

DEFAULT_BANDWIDTH_TBS = 4.26  # H200 device-to-device copy, measured (DESIGN §6)


def decode_weight_params(cfg: ModelConfig) -> int:
    """Parameters read per decode step: all except the input embedding table, which is
    only gathered (one row per token). The LM head is read in full, tied or not."""
    h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    attn = h * q + 2 * h * kv + q * h
    if cfg.qkv_bias:
        attn += q + 2 * kv
    if cfg.o_bias:
        attn += h
    if cfg.qk_norm:
        attn += 2 * cfg.head_dim
    mlp = 3 * h * i + (2 * i + h if cfg.mlp_bias else 0)
    per_layer = attn + mlp + 2 * h  # + input and post-attention norms
    return cfg.num_layers * per_layer + h + cfg.vocab_size * h  # + final norm + LM head


@dataclass(frozen=True)
class Roofline:
    bytes_per_token: int  # weight bytes read by one decode step (all GPUs together)
    bandwidth_tbs: float  # per GPU
    tp: int

    @property
    def step_seconds(self) -> float:
        # Under TP each GPU reads its 1/tp share of the weights in parallel.
        return self.bytes_per_token / (self.bandwidth_tbs * 1e12 * self.tp)

    def tokens_per_second(self, batch: int = 1) -> float:
        """Upper bound on decode tokens/s of `batch` sequences together (each step serves
        all of them with one read of the weights; KV reads and compute are ignored)."""
        return batch / self.step_seconds


def decode_roofline(cfg: ModelConfig, dtype_bytes: int, bandwidth_tbs: float = DEFAULT_BANDWIDTH_TBS, tp: int = 1) -> Roofline:
    return Roofline(decode_weight_params(cfg) * dtype_bytes, bandwidth_tbs, tp)
