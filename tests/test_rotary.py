"""RoPE tables equal transformers' for every scaling type we support, and the
rotation styles are what their names say."""

from __future__ import annotations

import pytest
import torch

from agent_infer.config import RopeConfig
from agent_infer.kernels.reference import apply_rotary
from agent_infer.layers.rotary import build_cos_sin_cache

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn_mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 0.707,
                    "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
}


@pytest.mark.parametrize("name", sorted(ROPES))
def test_cos_sin_match_transformers(name):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = ROPES[name]
    head_dim, max_pos = 64, 512
    hf_cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=max_pos,
                         rope_parameters=dict(params))
    rope_type = params["rope_type"]
    if rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        inv_freq, scale = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu")
    pos = torch.arange(max_pos, dtype=torch.float32)
    freqs = (inv_freq[None, :, None].float() @ pos[None, None, :]).transpose(1, 2)[0]
    ours = build_cos_sin_cache(RopeConfig.from_hf({"rope_parameters": params, "max_position_embeddings": max_pos}),
                               head_dim, max_pos, torch.device("cpu"))
    assert torch.equal(ours[:, : head_dim // 2], freqs.cos() * scale)
    assert torch.equal(ours[:, head_dim // 2 :], freqs.sin() * scale)


def test_neox_and_gptj_pairings():
    d = 8
    cache = build_cos_sin_cache(RopeConfig(), d, 16, torch.device("cpu"))
    x = torch.randn(3, 2, d)
    pos = torch.tensor([0, 5, 9])
    neox = apply_rotary(pos, x, cache, is_neox=True)
    gptj = apply_rotary(pos, x, cache, is_neox=False)
    assert torch.equal(neox[0], x[0]) and torch.equal(gptj[0], x[0])  # position 0: identity
    cos, sin = cache[5, : d // 2], cache[5, d // 2 :]
    # Neox rotates the pair (i, i + d/2); GPT-J the pair (2i, 2i + 1).
    assert torch.allclose(neox[1, 0, 1], x[1, 0, 1] * cos[1] - x[1, 0, 5] * sin[1])
    assert torch.allclose(gptj[1, 0, 2], x[1, 0, 2] * cos[1] - x[1, 0, 3] * sin[1])
    # Rotations keep norms.
    assert torch.allclose(neox.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.allclose(gptj.norm(dim=-1), x.norm(dim=-1), atol=1e-5)


def test_partial_rotary_leaves_the_tail():
    cache = build_cos_sin_cache(RopeConfig(), 4, 16, torch.device("cpu"))
    x = torch.randn(2, 1, 8)
    out = apply_rotary(torch.tensor([3, 7]), x, cache, is_neox=True)
    assert torch.equal(out[..., 4:], x[..., 4:]) and not torch.equal(out[..., :4], x[..., :4])


def test_rope_store_heads_per_program():
    """The fused RoPE + KV write takes one head per program for small batches and, from
    GROUP_FROM_TOKENS tokens on, the largest power-of-two group dividing both head counts
    (never mixing q and k heads, at most MAX_HEADS_PER_PROGRAM); the start-up warm-up's
    longest prompt reaches that size, so eager engines compile the grouped form there too."""
    rope_store = pytest.importorskip("agent_infer.kernels.triton.rope_store")
    from agent_infer.engine.warmup import PROMPT_LENGTHS

    g = rope_store.GROUP_FROM_TOKENS
    assert rope_store.heads_per_program(1, 32, 8) == rope_store.heads_per_program(g - 1, 32, 8) == 1
    assert rope_store.heads_per_program(g, 32, 8) == 8  # Qwen3-8B
    assert rope_store.heads_per_program(4096, 16, 4) == 4  # Qwen3-8B at TP = 2
    assert rope_store.heads_per_program(4096, 64, 16) == rope_store.MAX_HEADS_PER_PROGRAM == 8
    assert rope_store.heads_per_program(4096, 9, 3) == 1  # SmolLM2-135M: 9 q, 3 KV heads
    assert rope_store.heads_per_program(4096, 12, 6) == 2
    assert max(PROMPT_LENGTHS) >= g
