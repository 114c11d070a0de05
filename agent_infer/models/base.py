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

from agent_infer.config import ModelConfig
from agent_infer.loader.load import WeightMap, load_model
from agent_infer.loader.weights import Weight


class CausalLM(nn.Module):
    # The family's config.json section: a frozen dataclass with `from_hf(hf: dict)`, which
    # refuses fields the family would ignore (ModelConfig.family holds the result).
    config_class: ClassVar[Any]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flattened token ids and positions [T] -> final hidden states [T, hidden]."""
        raise NotImplementedError

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

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> None:
        load_model(self, weights, self.weight_map())

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
