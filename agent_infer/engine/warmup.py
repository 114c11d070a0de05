"""Start-up warm-up: a few made-up requests through the normal path before the first
real one, so that what a step compiles on first use (Triton kernel variants: prefill tile
sizes chosen by the longest query, element-wise kernels specialised on a token count of
1 or a multiple of 16, the few-row GEMV of two-row steps, the sampling kernel, mixed
steps, where decode steps run outside CUDA graphs the decode kernel's variants by batch
size, and the kernel that moves rows behind a verify step) is compiled at start-up and
not while clients wait: with a cold Triton cache each new variant stalls its step by one
to two seconds on an H200 (docs/PERFORMANCE.md).
tests/test_kernel_variants.py checks on CPU that no serving step needs a variant these
steps did not compile.

The engine is left as it was: no request, every block free, the prefix cache and every
counter empty. Tensor-parallel workers follow these steps like any other.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from agent_infer.config import EngineConfig, ModelConfig
from agent_infer.engine.model_runner import ModelRunner
from agent_infer.sampling_params import SamplingParams


class LLMEngine(Protocol):
    """What the warm-up drives (engine/llm_engine.py's LLMEngine, which imports this
    module): requests in, steps, and its runner and configs to size them."""

    config: EngineConfig
    model_config: ModelConfig
    runner: ModelRunner
    max_model_len: int

    def add_request(self, prompt: Any, params: SamplingParams, request_id: str | None = None,
                    prompt_token_ids: list[int] | None = None) -> Any: ...

    def step(self) -> list: ...

    def has_unfinished_requests(self) -> bool: ...

    @property
    def num_waiting(self) -> int: ...

    def reset_history(self) -> None: ...

# One request at a time, so each step's longest query picks another prefill tile
# (16, 32, 64 rows, and 128 where a configuration takes that many) and the token count is
# 1, "other" or a multiple of 16.
PROMPT_LENGTHS = (1, 17, 48, 129)
# Then a wave of this many sampled requests, one arriving a step late: sampling over
# 15 and 16 rows, and a mixed step when mixed batches are on.
WAVE = 16


def _decode_step_of(engine: LLMEngine, rows: int, arrival: bool, add) -> None:
    """Queue `rows` one-token requests, prefill them, then launch one step in which they
    all decode: plain, or with a prompt arriving (`arrival`: a mixed step when mixed
    batches are on). `add(prompt_len, params, k)` queues request k."""
    for k in range(rows):
        add(1, SamplingParams(max_tokens=3 if arrival else 2, temperature=0.0, ignore_eos=True), k)
    while engine.num_waiting:
        engine.step()  # the prefill (several steps if the token budget is smaller than `rows`)
    if arrival:
        add(16, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), rows)
    engine.step()


def warm_up(engine: LLMEngine) -> float:
    """Run the warm-up requests to completion and reset the engine's state; returns the
    seconds it took. Call before any real request."""
    assert not engine.has_unfinished_requests(), "warm up before the first request"
    t0 = time.perf_counter()
    vocab = engine.model_config.vocab_size
    room = engine.max_model_len - 3  # prompt + up to 3 new tokens must fit
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    # Temperature alone samples the model's logits; with top-p, masked float32 ones.
    sampled = SamplingParams(max_tokens=3, temperature=1.0, seed=0, ignore_eos=True)
    nucleus = SamplingParams(max_tokens=3, temperature=1.0, top_p=0.9, seed=0, ignore_eos=True)

    def prompt(n: int, salt: int) -> list[int]:
        return [(salt * 7919 + 31 * i + 1) % vocab for i in range(max(1, min(n, room)))]

    def add(n: int, params: SamplingParams, salt: int) -> None:
        engine.add_request("", params, request_id=f"warm-up-{salt}", prompt_token_ids=prompt(n, salt))

    def drain() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    for salt, n in enumerate(PROMPT_LENGTHS):
        add(n, sampled if salt % 2 else greedy, salt)
        drain()
    # Two one-token prompts prefilled in one step: every projection and the LM head over
    # two rows, which take a kernel of their own (ops.linear's few-row GEMV). In the
    # batch-invariant mode a prefill step takes one prompt, so its two-row prefill is a
    # two-token prompt (its LM head has one row).
    salt = len(PROMPT_LENGTHS)
    if engine.config.batch_invariant:
        add(2, greedy, salt)
    else:
        add(1, greedy, salt)
        add(1, greedy, salt + 1)
    drain()
    salt += 2
    # Steps of the token counts the model asks for, up to the step budget: one prompt, or
    # several prompts prefilled together where one cannot hold that many tokens.
    budget = engine.config.max_num_batched_tokens
    for n in sorted({min(n, budget) for n in engine.runner.model.warmup_prompt_lengths()} - set(PROMPT_LENGTHS)):
        parts = min(-(-n // room), engine.config.max_num_seqs)
        for k in range(parts):
            add(n // parts + (k < n % parts), greedy, salt)
            salt += 1
        drain()
    base = salt
    for i in range(WAVE - 1):
        add(16, nucleus, base + i)
    engine.step()
    add(16, nucleus, base + WAVE)
    drain()

    plain, mixed = engine.runner.eager_decode_batches()
    salt = base + WAVE + 1
    for rows, arrival in [(r, False) for r in plain] + [(r, True) for r in mixed]:
        _decode_step_of(engine, rows, arrival, lambda n, p, k: add(n, p, salt + k))
        salt += rows + 1
        drain()

    engine.runner.compile_row_moves()
    engine.reset_history()
    return time.perf_counter() - t0
