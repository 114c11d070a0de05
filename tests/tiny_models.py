"""Tiny random checkpoints of each supported family, written by transformers itself.

Shapes are odd on purpose: a single KV head, head_dim 64 and 128 that differ from
hidden/heads, tied and untied embeddings, YaRN and Llama-3 RoPE scaling. The initializer
range is large so logits are peaked: random weights with the default 0.02 give nearly
flat distributions where greedy picks are decided by rounding noise.
"""

from __future__ import annotations

import os

import torch

VOCAB = 503  # prime, so no accidental alignment with block or tile sizes

TINY_SPECS: dict[str, dict] = {
    # 4 query heads share 1 KV head; head_dim 64 != hidden / heads; tied embeddings; YaRN.
    "qwen3": dict(
        arch="Qwen3ForCausalLM", hidden_size=96, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    ),
    # Qwen2: q/k/v biases, head_dim 128 = hidden / heads, untied.
    "qwen2": dict(
        arch="Qwen2ForCausalLM", hidden_size=256, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False,
    ),
    # Llama: head_dim 128 with hidden 64, GQA 4:2, Llama-3 RoPE scaling, untied.
    "llama": dict(
        arch="LlamaForCausalLM", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    # Qwen3 with 1 KV head, head_dim 128 and untied head: the TP replication case.
    "qwen3_untied": dict(
        arch="Qwen3ForCausalLM", hidden_size=128, intermediate_size=224, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=128, tie_word_embeddings=False,
    ),
}


def write_tiny_model(name: str, path: str, seed: int = 0, initializer_range: float = 0.25) -> str:
    import transformers

    spec = dict(TINY_SPECS[name])
    arch = spec.pop("arch")
    rope_scaling = spec.pop("rope_scaling", None)
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(
        vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-6,
        initializer_range=initializer_range, bos_token_id=1, eos_token_id=2, **spec,
    )
    if rope_scaling is not None:
        theta = getattr(config, "rope_theta", None) or (config.rope_parameters or {}).get("rope_theta", 10000.0)
        if hasattr(config, "rope_parameters"):
            config.rope_parameters = {"rope_theta": theta, **rope_scaling}
        else:
            config.rope_scaling = rope_scaling
    return _save_random(arch, config, path, seed)


def write_hf_model(arch: str, path: str, seed: int = 0, initializer_range: float = 0.25, **spec) -> str:
    """A random checkpoint of transformers' `arch` with config fields `spec` (the tiny
    vocabulary, EOS 2), written by transformers itself, norms randomised."""
    import transformers

    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(
        vocab_size=VOCAB, max_position_embeddings=512, initializer_range=initializer_range, bos_token_id=1,
        eos_token_id=2, **spec)
    return _save_random(arch, config, path, seed)


def _save_random(arch: str, config, path: str, seed: int) -> str:
    """transformers' `arch` built from `config` with seeded random weights (norms too), in fp32, saved at `path`."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(torch.float32)
    _randomise_norms(model)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _randomise_norms(model: torch.nn.Module) -> None:
    """Norm weights start at ones; random ones catch a loader that forgets them (FM-003)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)


def decisive_router(path: str, factor: float = 8.0) -> str:
    """Scale the router (gate) weights of the mixture-of-experts checkpoint at `path` by
    `factor`, in place. Tiny random routers nearly tie between experts, and in bf16 such a
    tie flips with rounding and moves the next token by a nat or more (transformers' own
    bf16 run departs from its fp32 run the same way); bf16 closeness checks need routing
    that rounding does not decide."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    for name in state:
        if name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")):
            state[name] = state[name] * factor
    save_file(state, file, metadata={"format": "pt"})
    return path
