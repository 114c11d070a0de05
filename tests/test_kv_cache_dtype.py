"""--kv-cache-dtype fp8: K and V cached as float8 e4m3 (scale 1, saturating), read back as
the model's dtype. On CPU this runs the PyTorch reference path; the Triton kernels' fp8
paths are checked in tests/test_triton_interpreter.py and tests/gpu/."""

from __future__ import annotations

import pytest
import torch

from agent_infer.config import ConfigError, EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.kernels import reference
from agent_infer.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea. The waves",
    "In 1969, astronauts landed on the Moon for the first time. The mission was called Apollo 11, and it was "
    "commanded by Neil Armstrong. Together with Buzz Aldrin he walked on the lunar surface while Michael Collins",
]
NEW_TOKENS = 24


def test_unknown_kv_cache_dtype_is_a_config_error(default_model_dir):
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(model=default_model_dir, kv_cache_dtype="int4")


def test_fp8_store_saturates_instead_of_overflowing():
    x = torch.tensor([1000.0, -1e6, 3.0, 0.3, -448.0, 500.0])
    out = reference.to_cache_dtype(x, torch.float8_e4m3fn)
    assert out.dtype == torch.float8_e4m3fn
    back = out.float()
    assert torch.isfinite(back).all()
    assert back.tolist() == [448.0, -448.0, 3.0, 0.3125, -448.0, 448.0]  # 0.3 rounds to 0.3125 in e4m3


def test_fp8_cache_holds_more_blocks_in_the_same_bytes(default_model_dir):
    budget = 64 << 20
    engines = {
        kind: LLMEngine(EngineConfig(model=default_model_dir, device="cpu", dtype="float32", kv_cache_dtype=kind,
                                     kv_cache_bytes=budget, warmup=False))
        for kind in ("auto", "fp8")
    }
    pools = {kind: e.runner.pool for kind, e in engines.items()}
    assert pools["auto"].dtype == torch.float32
    assert pools["fp8"].dtype == torch.float8_e4m3fn
    # fp32 -> 1 byte per value: four times the blocks, each byte budget used alike.
    assert engines["fp8"].block_manager.num_blocks == 4 * engines["auto"].block_manager.num_blocks
    assert pools["fp8"].nbytes == pools["auto"].nbytes


def test_fp8_cache_generates_close_to_the_full_precision_cache(default_model_dir, smol_engine):
    """Greedy, vLLM's closeness rule between the two caches: the tokens agree until the
    first difference, where each engine's pick is among the other's top 5 (fp8 rounding
    moves logprobs by far more than a tie, so no gap bound)."""
    fp8 = LLMEngine(EngineConfig(model=default_model_dir, device="cpu", dtype="float32", kv_cache_dtype="fp8",
                                 num_kv_blocks=512))
    prompts = [fp8.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    ours = fp8.generate(prompts, params)
    ref = smol_engine.generate(prompts, params)
    matched = []
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert len(a.token_ids) == NEW_TOKENS
        n = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), NEW_TOKENS)
        if n < NEW_TOKENS:
            x, y = a.token_ids[n], b.token_ids[n]
            assert x in dict(b.logprobs[n].top), f"prompt {i} step {n}: fp8 picked {x}, not in the fp32 cache's top 5"
            assert y in dict(a.logprobs[n].top), f"prompt {i} step {n}: fp32 picked {y}, not in the fp8 cache's top 5"
        matched.append(n)
    # Not a coin toss either: most of the greedy run agrees before any difference.
    assert sum(matched) >= NEW_TOKENS * len(PROMPTS) // 2, f"tokens matched before a difference: {matched}"
