"""`config.json` architectures[0] -> model class (a `models.base.CausalLM`), imported only
when used."""

from __future__ import annotations

import importlib

from agent_infer.checkpoint_files import ConfigError

_LLAMA = ("agent_infer.models.llama", "LlamaForCausalLM")

ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
    # Text-only use of the VL checkpoints: for text tokens M-RoPE reduces to plain RoPE.
    "Qwen2VLForConditionalGeneration": _LLAMA,
    "Qwen2_5_VLForConditionalGeneration": _LLAMA,
    "DeepseekV2ForCausalLM": ("agent_infer.models.deepseek", "DeepseekForCausalLM"),
    "DeepseekV3ForCausalLM": ("agent_infer.models.deepseek", "DeepseekForCausalLM"),
    "Qwen3MoeForCausalLM": ("agent_infer.models.sparse_moe", "SparseMoeForCausalLM"),
    "MixtralForCausalLM": ("agent_infer.models.sparse_moe", "SparseMoeForCausalLM"),
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
