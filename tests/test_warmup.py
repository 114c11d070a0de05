"""The start-up warm-up (engine/warmup.py; on by default, run on GPU only): its steps
cover what it promises (each prefill tile size, a mixed step when mixed batches are on),
and it leaves the engine as it found it: no request, every block free, an empty prefix
cache, zeroed counters, and the same outputs for later requests."""

from __future__ import annotations

import pytest

from agent_infer.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.engine.warmup import PROMPT_LENGTHS, warm_up
from agent_infer.sampling_params import SamplingParams
from tests.scheduling import record_batches
from tests.tiny_models import VOCAB, write_tiny_model


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    return write_tiny_model("qwen3", str(tmp_path_factory.mktemp("warmup") / "qwen3"))


def _engine(path: str, mixed: bool) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=64, block_size=16,
                                  mixed_batches=mixed))


def _generate(eng: LLMEngine) -> list[list[int]]:
    prompts = [[(5 * i + 3 * j) % VOCAB for j in range(n)] for i, n in enumerate((9, 33, 20))]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)]
    outs = eng.generate(prompts, [params[i % 2] for i in range(3)])
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("mixed", [False, True])
def test_warm_up_covers_its_variants_and_leaves_no_trace(qwen3_dir, mixed):
    eng = _engine(qwen3_dir, mixed)
    batches = record_batches(eng)
    seconds = warm_up(eng)
    assert seconds > 0
    del eng.scheduler.schedule  # back to the class's method

    # Each prompt length alone in its step (the longest query picks the prefill tile).
    prefill_lens = [b.num_tokens for b in batches if b.is_prefill and len(b) == 1 and not b.num_decode]
    for n in PROMPT_LENGTHS:
        assert n in prefill_lens, f"no prefill step of {n} tokens alone: {prefill_lens}"
    assert any(b.num_decode for b in batches) == mixed, "a mixed step exactly when mixed batches are on"
    assert any(not b.is_prefill and len(b) == 16 for b in batches), "a 16-row decode (sampling) step"

    # Nothing left behind.
    assert not eng.has_unfinished_requests() and not eng._requests
    bm = eng.block_manager
    assert bm.get_num_free_blocks() == bm.num_blocks
    assert not bm.key_to_block, "warm-up prompts must not stay in the prefix cache"
    assert bm.stats.queries == 0 and bm.stats.hits == 0
    assert eng.stats.steps == 0 and eng.stats.prompt_tokens == 0 and eng.stats.generation_tokens == 0

    assert _generate(eng) == _generate(_engine(qwen3_dir, mixed))


def test_warm_up_refuses_a_busy_engine(qwen3_dir):
    eng = _engine(qwen3_dir, False)
    eng.add_request("", SamplingParams(max_tokens=2), prompt_token_ids=[3, 4, 5])
    with pytest.raises(AssertionError, match="before the first request"):
        warm_up(eng)
