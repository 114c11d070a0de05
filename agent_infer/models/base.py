"""The contract between a model family and the engine.

A family is one module in `models/`: its config section, its layers and a `CausalLM`
subclass, registered by architecture name in `models/registry.py`. The engine builds the
model for one rank (`__init__(cfg, tp, max_pos)` creates only this rank's parameters),
loads it through the family's weight map, binds a cache view and an attention backend to
each attention layer, then calls `forward` and `compute_logits` inside a forward context
(attention/metadata.py). It never looks at heads, experts or cache contents.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from agent_infer.config import ConfigError, ModelConfig
from agent_infer.distributed.state import ParallelState
from agent_infer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from agent_infer.layers.invariance import RowInvariance
from agent_infer.layers.linear import LinearBase
from agent_infer.layers.mla import LatentAttention
from agent_infer.layers.moe import MoE
from agent_infer.layers.norm import RMSNorm
from agent_infer.loader.load import WeightMap, load_model
from agent_infer.loader.weights import Weight
from agent_infer.quantization.fp8 import Fp8Config


class CausalLM(nn.Module):
    # The family's config.json section: a frozen dataclass with `from_hf(hf: dict)`, which
    # refuses fields the family would ignore (ModelConfig.family holds the result).
    config_class: ClassVar[Any]
    # Whether decode steps may be captured in CUDA graphs (every op graph-safe).
    cuda_graphs: ClassVar[bool] = True
    # Whether that is for a decode step to show first (code this engine did not write):
    # the graphs are captured only if a decode step runs without a host sync.
    graphs_after_sync_check: ClassVar[bool] = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flattened token ids and positions [T] -> final hidden states [T, hidden]."""
        raise NotImplementedError

    def use_torch_compile(self) -> None:
        """On a GPU, unless --enforce-eager, before the first step: have torch.compile
        compile what the family wants compiled. Nothing for the native families, whose
        steps are the engine's kernels already."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] (all ranks take part; each returns the full logits)."""
        raise NotImplementedError

    @property
    def attention_layers(self) -> list[nn.Module]:
        """In layer order; each has `cache_layout`, `num_heads` (on this rank) and
        `bind(cache, backend)`."""
        raise NotImplementedError

    def weight_map(self) -> WeightMap:
        """Checkpoint names -> this model's parameters (loader/load.py)."""
        return WeightMap()

    def use_fp8(self, config: Fp8Config, stored_fp8: Iterable[str]) -> list[str]:
        """Before loading: put in fp8 form the linear layers (and MoE experts) that will
        hold fp8 weights, and return their names. Online (`config.online`), every one
        that can be; else those the checkpoint stores in e4m3 (`stored_fp8`: its tensor
        names), so what its config leaves unquantized (embeddings, norms, router gates,
        lm_head and any listed module) loads as stored. Experts take per-row or block
        scales (`MoE.use_fp8` says when they are dequantized instead)."""
        wanted: set[str] = set()
        if not config.online:
            weight_map = self.weight_map()
            targets = (weight_map.resolve(name) for name in stored_fp8)
            wanted = {t[0].rsplit(".", 1)[0] for t in targets if t is not None}
        chosen = []
        # Mixtures of experts first: whether their experts take fp8 decides their shared MLP's.
        for name, moe in self.named_modules():
            if isinstance(moe, MoE) and (config.online or f"{name}.experts" in wanted) and moe.use_fp8(config):
                chosen.append(f"{name}.experts")
        for name, layer in self.named_modules():
            if isinstance(layer, LinearBase) and layer.quantizable and (config.online or name in wanted):
                layer.to_fp8(config)
                chosen.append(name)
        return chosen

    # The batch-invariant mode's switch (use_batch_invariance); None: off.
    invariance: RowInvariance | None = None

    def use_batch_invariance(self, rows: int) -> None:
        """EngineConfig.batch_invariant: from now on, while `invariance` says a decode step
        runs, each projection of 1 to `rows` rows computes every row as a one-row step
        does (`ops.linear`'s `invariant_rows`), and the add + norm after an fp8
        projection keeps one counter per row. Mixtures of experts and latent attention (DeepSeek) are
        refused by name: their grouped GEMMs and stacked projections are shaped by the
        whole step."""
        for name, m in self.named_modules():
            if isinstance(m, (MoE, LatentAttention)):
                what = "routed experts" if isinstance(m, MoE) else "latent attention"
                raise ConfigError(f"batch_invariant covers dense models; {type(self).__name__} has {what} "
                                  f"({name}), whose kernels are shaped by the whole step")
        self.invariance = RowInvariance(rows)
        for module in self.modules():
            if isinstance(module, (LinearBase, ParallelLMHead)):
                module.invariance = self.invariance
            counter = getattr(module, "done_counter", None)
            if isinstance(counter, torch.Tensor):
                module.done_counter = torch.zeros(rows, dtype=counter.dtype, device=counter.device)

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        """Load, then let each module that has one run its `finish_loading` (innermost
        first: a layer's fp8 weight is final before its parent stacks it)."""
        load_model(self, weights, self.weight_map())
        for module in reversed(list(self.modules())):
            if module is not self and hasattr(module, "finish_loading"):
                module.finish_loading()

    @classmethod
    def check_parallel(cls, cfg: ModelConfig, tp: int, moe_parallel: str) -> None:
        """A ConfigError, naming sizes that work, when the model cannot be split `tp` ways
        (`moe_parallel`: how routed experts would be split, for families that have them);
        checked before any process starts."""

    def warmup_prompt_lengths(self) -> tuple[int, ...]:
        """Prompt lengths the start-up warm-up should also prefill alone, so that a kernel
        whose launch configuration depends on the step's token count (beyond the engine's
        own warm-up steps) compiles before serving."""
        return ()

    @classmethod
    def checkpoint_tensors(cls, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor a checkpoint of this shape holds, by its hub name, in file order
        (random-weight checkpoints are written from it)."""
        raise NotImplementedError


class DecoderStack(nn.Module):
    """The embedding, the decoder layers and the final norm. Each layer takes its input
    already normalised and the residual stream, and returns the next layer's normalised
    input and the stream (`layer(positions, x, residual, next_norm)`), so every
    row-parallel projection runs with the residual add + RMSNorm after it, and the
    embedding's all-reduce with the first layer's norm."""

    def __init__(self, embed_tokens: VocabParallelEmbedding, layers: nn.ModuleList, norm: RMSNorm):
        super().__init__()
        self.embed_tokens, self.layers, self.norm = embed_tokens, layers, norm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens.forward_norm(input_ids, self.layers[0].input_layernorm)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm in zip(self.layers, norms):
            x, residual = layer(positions, x, residual, next_norm)
        return x


class DecoderLM(CausalLM):
    """A `DecoderStack` (`model`) and a vocabulary-parallel LM head, tied to the embedding
    when the config says so; each layer's attention is `layer.self_attn.attn`."""

    def __init__(self, cfg: ModelConfig, model: DecoderStack, tp: ParallelState):
        super().__init__()
        self.config = cfg
        self.model = model
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
