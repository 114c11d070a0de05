"""`config.json` architectures[0] -> model class, imported only when used."""

from __future__ import annotations

import importlib

from agent_infer.config import ConfigError

_DENSE = ("agent_infer.models.qwen", "DenseForCausalLM")

ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": _DENSE,
    "Qwen2ForCausalLM": _DENSE,
    "Qwen3ForCausalLM": _DENSE,
    # Text-only use of the VL checkpoints: for text tokens M-RoPE reduces to plain RoPE.
    "Qwen2VLForConditionalGeneration": _DENSE,
    "Qwen2_5_VLForConditionalGeneration": _DENSE,
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def resolve_model_class(architecture: str) -> type:
    try:
        module, name = ARCHITECTURES[architecture]
    except KeyError:
        raise ConfigError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        ) from None
    return getattr(importlib.import_module(module), name)
