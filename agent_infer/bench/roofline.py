"""The batch-1 decode roofline: every step reads all weights once, so tokens/s can be at
most bandwidth / bytes of weights read per token."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from agent_infer.config import ModelConfig
from agent_infer.quantization.fp8 import Fp8Config

# Device-to-device copy rates (bytes read + written over a large copy's time), measured
# once per GPU model: a roofline on that model is the same from run to run. A GPU not
# listed is measured at the start of the run (`copy_rate_tbs`).
MEASURED_COPY_TBS = {"H200": 4.26}


def gpu_bandwidth_tbs(device_name: str, measure: Callable[[], float]) -> tuple[float, str]:
    """(TB/s, where the figure comes from) for the roofline on the GPU `device_name`: the
    stored rate of its model, else `measure()`."""
    for model, tbs in MEASURED_COPY_TBS.items():
        if re.search(rf"\b{model}\b", device_name):
            return tbs, f"the {model}'s measured copy rate"
    return round(measure(), 2), f"the copy rate measured on this {device_name} before the run"


def copy_rate_tbs(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """A device-to-device copy of `nbytes` (far past any L2), best of `repeats` timed by
    CUDA events: (read + written bytes) / time, in TB/s. Needs 2 x nbytes free."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # the first copy pays for the kernel's load
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / best / 1e12


def decode_weight_params(cfg: ModelConfig, batch: int = 1) -> float:
    """Parameters read per decode step of `batch` sequences: all except the input
    embedding table, which is only gathered (one row per token); the LM head is read in
    full, tied or not. Of a mixture of experts' routed experts only those the step's
    tokens are routed to are read: E (1 - (1 - k/E)^batch) of E on average for uniform
    routing (6 of 64 at batch 1 for DeepSeek-V2-Lite, 35 at 8, 61 at 32). Counted on
    the family's own model at TP = 1, built on the meta device (no memory; the
    transformers backend's loads the checkpoint on the CPU to build itself)."""
    from agent_infer.distributed.state import SINGLE
    from agent_infer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from agent_infer.layers.moe import RoutedExperts
    from agent_infer.models.registry import resolve_model_class

    with torch.device("meta"):
        model = resolve_model_class(cfg.architecture, cfg.impl)(cfg, SINGLE, 2)
    total = sum(p.numel() for p in model.parameters())  # a tied table counts once, as the LM head
    head_weights = {id(m.weight) for m in model.modules() if isinstance(m, ParallelLMHead)}
    # Embedding tables (ours, or transformers' own in the transformers backend) are gathered.
    gathered = sum(m.weight.numel() for m in model.modules()
                   if (type(m) is VocabParallelEmbedding or isinstance(m, torch.nn.Embedding))
                   and id(m.weight) not in head_weights)
    unread = 0.0
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            per_expert = (m.w13.numel() + m.w2.numel()) / m.w13.shape[0]  # shared experts stored there are read
            unread += per_expert * (m.num_experts - experts_touched(m, batch))
    return total - gathered - unread


def experts_touched(experts, batch: int) -> float:
    """Routed experts a decode step of `batch` tokens reads, on average for uniform routing."""
    e, k = experts.num_experts, experts.top_k
    return e * (1 - (1 - k / e) ** batch)


@dataclass(frozen=True)
class Roofline:
    bytes_per_token: int  # weight bytes read by one decode step (all GPUs together) at its batch
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


def fp8_weight_params(cfg: ModelConfig, quant: Fp8Config, batch: int = 1) -> tuple[float, float]:
    """(e4m3 elements, float32 scales) a decode step of `batch` tokens reads of what fp8
    weights put in fp8: every linear layer that can be, and the routed experts the step
    touches where they take `quant`'s layout (`MoE.use_fp8`)."""
    from agent_infer.distributed.state import SINGLE
    from agent_infer.layers.moe import RoutedExperts
    from agent_infer.models.registry import resolve_model_class

    with torch.device("meta"):
        model = resolve_model_class(cfg.architecture, cfg.impl)(cfg, SINGLE, 2)
        layers = dict(model.named_modules())
        names = model.use_fp8(replace(quant, online=True), ())
    values = scales = 0.0
    for name in names:
        m = layers[name]
        if isinstance(m, RoutedExperts):
            stored = m.w13.shape[0]
            read = (experts_touched(m, batch) + stored - m.num_local) / stored  # the shared ones always
            values += (m.w13.numel() + m.w2.numel()) * read
            scales += (m.w13_scale.numel() + m.w2_scale.numel()) * read
        else:
            values += m.weight.numel()
            scales += m.weight_scale.numel()
    return values, scales


def decode_roofline(
    cfg: ModelConfig, dtype_bytes: int, bandwidth_tbs: float, tp: int = 1, batch: int = 1,
    quant: Fp8Config | None = None,
) -> Roofline:
    """The roofline of decode steps of `batch` sequences (which experts they read depends
    on it); with `quant`, the fp8 projections read one byte per weight and their scales."""
    params = decode_weight_params(cfg, batch)
    if quant is None:
        return Roofline(round(params * dtype_bytes), bandwidth_tbs, tp)
    fp8, scales = fp8_weight_params(cfg, quant, batch)
    return Roofline(round((params - fp8) * dtype_bytes + fp8 + 4 * scales), bandwidth_tbs, tp)
