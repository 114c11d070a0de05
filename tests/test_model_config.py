"""config.json by family: a shared core, and the family's own section, which refuses what
the family would silently ignore."""

from __future__ import annotations

import json

import pytest

from agent_infer.config import ConfigError, ModelConfig
from agent_infer.models.llama import LlamaFamilyConfig

QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512,
    "vocab_size": 1000, "rope_theta": 1e6, "torch_dtype": "bfloat16", "eos_token_id": 2,
}


def test_core_and_family_sections():
    cfg = ModelConfig.from_dict(QWEN3, "/models/q3")
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.eos_token_ids) == (256, 2, 1000, (2,))
    assert isinstance(cfg.family, LlamaFamilyConfig)
    assert (cfg.family.num_heads, cfg.family.num_kv_heads, cfg.family.head_dim) == (4, 2, 64)
    assert cfg.family.qk_norm and not cfg.family.qkv_bias
    qwen2 = ModelConfig.from_dict({**QWEN3, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    assert qwen2.family.qkv_bias and not qwen2.family.o_bias and not qwen2.family.qk_norm


def test_a_deepseek_config_under_a_dense_name_is_refused_naming_the_fields():
    """DeepSeek-V2-Lite's fields under Qwen3's name would otherwise parse as 16 KV heads of
    128 and size a wrong cache."""
    lite = {**QWEN3, "num_attention_heads": 16, "num_key_value_heads": 16, "hidden_size": 2048, "head_dim": None,
            "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
            "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
            "moe_intermediate_size": 1408, "norm_topk_prob": False}
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(lite, "/models/lite")
    msg = str(e.value)
    for name in ("kv_lora_rank", "n_routed_experts", "n_shared_experts", "qk_rope_head_dim", "moe_intermediate_size"):
        assert name in msg
    assert "q_lora_rank" not in msg and "norm_topk_prob" not in msg  # null / false set nothing
    assert "Llama/Qwen2/Qwen3" in msg and "\n" not in msg


def test_sliding_window_is_refused_only_when_on():
    off = ModelConfig.from_dict({**QWEN3, "use_sliding_window": False, "sliding_window": 4096})
    assert off.family == ModelConfig.from_dict(QWEN3).family  # an unused window changes nothing
    with pytest.raises(ConfigError, match="sliding-window"):
        ModelConfig.from_dict({**QWEN3, "use_sliding_window": True, "sliding_window": 4096})


def test_config_json_that_is_not_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text('{architectures: ["Qwen3ForCausalLM"]}')
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(str(tmp_path))
    msg = str(e.value)
    assert str(tmp_path / "config.json") in msg and "not valid JSON" in msg and "line 1 column 2" in msg
    (tmp_path / "config.json").write_text(json.dumps(["a list"]))
    with pytest.raises(ConfigError, match="JSON list, not an object"):
        ModelConfig.from_hf(str(tmp_path))


def test_config_missing_a_core_field_names_it(tmp_path):
    cfg = dict(QWEN3)
    del cfg["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"config.json lacks 'vocab_size'"):
        ModelConfig.from_hf(str(tmp_path))
