"""Tiny random DeepSeek-V2/V3 checkpoints written by transformers' own classes, with odd
shapes on purpose: 3 heads, v_head_dim != qk_nope_head_dim, latent and rope widths that
are not powers of two, a dense first layer, YaRN with mscale != 1, each routing scheme.
`hub_spelling=True` rewrites config.json the way the hub ships it (transformers 4.x
keys: `rope_scaling` with `"type": "yarn"`, `rope_theta` at the top level)."""

from __future__ import annotations

import json
import os

import torch

VOCAB = 307

_BASE = dict(
    vocab_size=VOCAB, hidden_size=42, intermediate_size=56, moe_intermediate_size=20, num_hidden_layers=3,
    num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8,
    v_head_dim=10, n_routed_experts=6, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
    max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
         "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.8}

DEEPSEEK_SPECS: dict[str, dict] = {
    # V2-Lite-like: no q low-rank, greedy softmax routing, YaRN.
    "v2_lite": dict(arch="DeepseekV2ForCausalLM", q_lora_rank=None, topk_method="greedy", rope=_YARN),
    # V2: q low-rank, group-limited routing (3 groups, best 2), top-3, scaled weights.
    "v2_grouped": dict(arch="DeepseekV2ForCausalLM", q_lora_rank=16, topk_method="group_limited_greedy", n_group=3,
                       topk_group=2, num_experts_per_tok=3, routed_scaling_factor=1.7, rope=_YARN),
    # V3: sigmoid + correction bias, grouped (2 groups, best 1), renormalised, scaled.
    "v3": dict(arch="DeepseekV3ForCausalLM", q_lora_rank=16, n_group=2, topk_group=1, norm_topk_prob=True,
               routed_scaling_factor=2.5, rope=_YARN),
    # V3 without renormalisation, plain RoPE, two dense layers, 8 experts of top-3.
    "v3_plain": dict(arch="DeepseekV3ForCausalLM", q_lora_rank=16, n_group=4, topk_group=2, norm_topk_prob=False,
                     routed_scaling_factor=1.3, n_routed_experts=8, num_experts_per_tok=3, first_k_dense_replace=2,
                     num_hidden_layers=4, rope=None),
}


def write_deepseek_model(name: str, path: str, seed: int = 0, hub_spelling: bool = False,
                         initializer_range: float = 0.3, **overrides) -> str:
    """`overrides`: config fields over the named spec's (e.g. sizes that divide by a TP size)."""
    import transformers

    spec = {**_BASE, **DEEPSEEK_SPECS[name], **overrides}
    arch, rope = spec.pop("arch"), spec.pop("rope")
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(initializer_range=initializer_range, **spec)
    config.rope_parameters = {"rope_theta": 10000.0, **(rope or {"rope_type": "default"})}
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # norms left at ones would hide a loader that forgets them
        for pname, b in model.named_buffers():
            if pname.endswith("e_score_correction_bias"):
                b.uniform_(-0.5, 0.5)  # a non-zero bias changes which experts win
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if hub_spelling:
        _to_hub_spelling(path)
    return path


def _to_hub_spelling(path: str) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    if kind != "default":
        cfg["rope_scaling"] = {"type": kind, **rope}
    for key in ("qk_head_dim", "head_dim", "dtype"):
        cfg.pop(key, None)
    cfg["torch_dtype"] = "float32"
    cfg.setdefault("moe_layer_freq", 1)
    cfg.setdefault("scoring_func", "sigmoid" if cfg["architectures"][0].endswith("V3ForCausalLM") else "softmax")
    with open(file, "w") as f:
        json.dump(cfg, f, indent=2)
