"""Mixed batches (`EngineConfig.mixed_batches`): a step that prefills also carries every
running decode. Requests that arrive while others generate must get exactly the tokens
they get with prefill-only steps, synchronously and with async scheduling, and the steps
must really be mixed and stay inside the token budget."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from agent_infer.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.engine.scheduler import ScheduledBatch
from agent_infer.sampling_params import SamplingParams
from tests.scheduling import record_batches
from tests.tiny_models import VOCAB, write_tiny_model

BUDGET = 48  # tokens per step: long prompts are cut into chunks beside the decodes


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    return write_tiny_model("qwen3", str(tmp_path_factory.mktemp("mixed") / "qwen3"))


def _arrivals(seed: int = 11) -> dict[int, list[tuple[list[int], SamplingParams]]]:
    """Requests keyed by the step before which they arrive: a long prompt (chunked), short
    ones, one that shares a prefix with an earlier prompt, greedy and seeded sampling."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(40)]

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=9, ignore_eos=True)
    return {
        0: [(prompt(7), greedy), (shared + prompt(5), greedy)],
        3: [(prompt(100), greedy), (prompt(4), seeded)],
        4: [(shared + prompt(9), greedy)],
        9: [(prompt(30), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))],
    }


def _run(path: str, mixed: bool, async_scheduling: bool,
         max_tokens: int | None = None) -> tuple[list[tuple], list[ScheduledBatch]]:
    """Every request's (tokens, finish reason, logprob ids) in arrival order, and the steps
    run. `max_tokens` caps each request's (the arrivals and the mixed steps stay)."""
    eng = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=96, block_size=16,
                                 max_num_batched_tokens=BUDGET, mixed_batches=mixed,
                                 async_scheduling=async_scheduling))
    batches = record_batches(eng)
    pending = _arrivals()
    if max_tokens is not None:
        pending = {step: [(p, replace(sp, max_tokens=min(sp.max_tokens, max_tokens))) for p, sp in reqs]
                   for step, reqs in pending.items()}
    order: list[str] = []
    final: dict[str, tuple] = {}
    step = 0
    try:
        while pending or eng.has_unfinished_requests():
            for prompt, params in pending.pop(step, []):
                order.append(eng.add_request(prompt, params).request_id)
            for out in eng.step():
                if out.finished:
                    lps = [t.token_id for t in out.logprobs] if out.logprobs else None
                    final[out.request_id] = (out.token_ids, out.finish_reason, lps)
            step += 1
        assert eng.block_manager.num_used_blocks == 0
    finally:
        eng.shutdown()
    return [final[r] for r in order], batches


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_batches_give_the_same_tokens_as_prefill_only_steps(qwen3_dir, async_scheduling):
    expected, plain = _run(qwen3_dir, mixed=False, async_scheduling=async_scheduling)
    got, mixed = _run(qwen3_dir, mixed=True, async_scheduling=async_scheduling)
    assert got == expected
    assert all(b.num_decode == 0 for b in plain)
    mixed_steps = [b for b in mixed if b.is_prefill and b.num_decode]
    assert mixed_steps, "no step carried decodes and prefill together"
    for b in mixed:
        assert b.num_tokens <= BUDGET
        if b.num_decode:
            assert b.num_new_tokens[: b.num_decode] == [1] * b.num_decode and all(b.samples[: b.num_decode])
            assert len(b) > b.num_decode, "a mixed step without prefill rows"
    # Arrivals never stall the decodes: every step with prompts to compute while others
    # generate carries those decodes.
    assert len(mixed) < len(plain)
