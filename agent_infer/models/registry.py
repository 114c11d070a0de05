"""`config.json` architectures[0] -> model class (a `models.base.CausalLM`), imported only
when used: the native family, or transformers' own class on the paged cache
(models/transformers_backend.py) as `model_impl` says (vLLM's `--model-impl`): `auto`
picks the native family where there is one, `native` refuses other architectures,
`transformers` always takes the backend."""

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


MODEL_IMPLS = ("auto", "native", "transformers")
_BACKEND = ("agent_infer.models.transformers_backend", "TransformersCausalLM")


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def model_impl_of(architecture: str, model_impl: str = "auto") -> str:
    """"native" or "transformers": what serves `architecture` under `model_impl`."""
    if model_impl not in MODEL_IMPLS:
        raise ConfigError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {model_impl!r}")
    if model_impl == "transformers" or (model_impl == "auto" and architecture not in ARCHITECTURES):
        return "transformers"
    if architecture not in ARCHITECTURES:
        raise ConfigError(
            f"unsupported architecture {architecture!r} with --model-impl native; native families: "
            f"{', '.join(supported_architectures())} (--model-impl auto or transformers serves others)"
        )
    return "native"


def resolve_model_class(architecture: str, impl: str = "native") -> type:
    """The model class for an architecture and `impl` (from model_impl_of)."""
    module, name = _BACKEND if impl == "transformers" else ARCHITECTURES[architecture]
    return getattr(importlib.import_module(module), name)
