"""Greedy fp32 output equals Hugging Face transformers token for token, with several
prompts of different lengths run together as one batch."""

from __future__ import annotations

import random

import pytest

from agent_infer.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.sampling_params import SamplingParams
from tests.hf_reference import check_greedy_close, hf_greedy, load_hf_model
from tests.tiny_models import TINY_SPECS, VOCAB

NEW_TOKENS = 40
# fp32 engines differ by summation order only (~1e-6 in logprobs); a "tie" is far below
# any real preference between two tokens.
TIE_TOL = 1e-4

SMOL_PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea. The waves",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "In 1969, astronauts landed on the Moon for the first time. The mission was called Apollo 11, and it was "
    "commanded by Neil Armstrong. Together with Buzz Aldrin he walked on the lunar surface while Michael Collins",
    "Q: What is 12 times 12?\nA:",
]


def _run_ours(engine: LLMEngine, prompts: list[list[int]]):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    outs = engine.generate(prompts, params)
    assert engine.stats.max_decode_batch >= len(prompts) or engine.stats.prefill_steps >= 1
    return outs


def _compare(engine_outs, hf_model, prompts, name):
    for i, (prompt, out) in enumerate(zip(prompts, engine_outs)):
        ref = hf_greedy(hf_model, prompt, NEW_TOKENS)
        ours_top = [dict(t.top) for t in out.logprobs]
        matched = check_greedy_close(out.token_ids, ours_top, ref, TIE_TOL, f"{name}[{i}]")
        assert len(out.token_ids) == NEW_TOKENS
        if matched < NEW_TOKENS:
            print(f"{name}[{i}]: near-tie at step {matched}, compared up to there")


def test_default_model_matches_transformers(default_model_dir):
    engine = LLMEngine(EngineConfig(model=default_model_dir, device="cpu", dtype="float32", num_kv_blocks=512))
    prompts = [engine.tokenizer.encode(p) for p in SMOL_PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts), "prompt lengths must differ"
    outs = _run_ours(engine, prompts)
    # All prompts were prefilled in one step and decoded together.
    assert engine.stats.prefill_steps == 1
    assert engine.stats.max_decode_batch == len(prompts)
    # A real model in fp32: every token must match, no tie allowance needed.
    hf = load_hf_model(default_model_dir)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        ref = hf_greedy(hf, prompt, NEW_TOKENS)
        assert out.token_ids == ref.tokens, f"prompt {i}: {out.token_ids} != {ref.tokens}"


@pytest.mark.parametrize("name", sorted(TINY_SPECS))
def test_tiny_model_matches_transformers(name, tiny_model_dirs):
    path = tiny_model_dirs[name]
    rng = random.Random(7)
    lengths = [3, 17, 31, 50, 70]  # cross block boundaries (block size 16) differently
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]
    engine = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=256, block_size=16))
    outs = _run_ours(engine, prompts)
    assert engine.stats.prefill_steps == 1 and engine.stats.max_decode_batch == len(prompts)
    _compare(outs, load_hf_model(path), prompts, name)
