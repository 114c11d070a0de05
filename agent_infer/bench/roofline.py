"""The batch-1 decode roofline: every step reads all weights once, so tokens/s can be at
most bandwidth / bytes of weights read per token (DESIGN §6)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agent_infer.config import ModelConfig

DEFAULT_BANDWIDTH_TBS = 4.26  # H200 device-to-device copy, measured (DESIGN §6)


def decode_weight_params(cfg: ModelConfig) -> int:
    """Parameters read per decode step: all except the input embedding table, which is
    only gathered (one row per token). The LM head is read in full, tied or not. Counted
    on the family's own model at TP = 1, built on the meta device (no memory)."""
    from agent_infer.distributed.state import SINGLE
    from agent_infer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from agent_infer.models.registry import resolve_model_class

    with torch.device("meta"):
        model = resolve_model_class(cfg.architecture)(cfg, SINGLE, 2)
    total = sum(p.numel() for p in model.parameters())  # a tied table counts once, as the LM head
    head_weights = {id(m.weight) for m in model.modules() if isinstance(m, ParallelLMHead)}
    gathered = sum(m.weight.numel() for m in model.modules()
                   if type(m) is VocabParallelEmbedding and id(m.weight) not in head_weights)
    return total - gathered


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
