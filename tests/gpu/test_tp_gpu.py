"""Tensor parallelism on 2 GPUs (bf16): TP = 2 agrees with TP = 1 on the same checkpoint
in the vLLM sense, with symmetric-memory and with NCCL all-reduce, and each rank holds
about half the weights. Set AGENT_INFER_TP_MODEL_DIR (e.g. the qwen3-8b random preset)."""

from __future__ import annotations

import gc
import os
import random

import pytest
import torch

from agent_infer.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.sampling_params import SamplingParams

MODEL = os.environ.get("AGENT_INFER_TP_MODEL_DIR")
pytestmark = [
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
    pytest.mark.skipif(not MODEL, reason="set AGENT_INFER_TP_MODEL_DIR"),
]

NEW, TOP = 24, 5


def _run(tp: int, all_reduce: str = "auto"):
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(0)
    eng = LLMEngine(EngineConfig(model=MODEL, dtype="bfloat16", tensor_parallel_size=tp, all_reduce=all_reduce,
                                 kv_cache_bytes=4 << 30, max_num_seqs=8, max_model_len=4096))
    rng = random.Random(11)
    prompts = [[rng.randrange(0, eng.model_config.vocab_size) for _ in range(n)] for n in (7, 100, 512)]
    try:
        outs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=TOP))
        mem = torch.cuda.memory_allocated(0) - base
        impl = eng.runner.tp.all_reduce_impl if tp > 1 else None
        return outs, mem, impl
    finally:
        eng.shutdown()
        del eng


def _close(a, b) -> list[int]:
    matched = []
    for x, y in zip(a, b):
        n = len(x.token_ids)
        for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)):
            if s != t:
                assert s in dict(y.logprobs[i].top) and t in dict(x.logprobs[i].top), f"step {i}: {s} vs {t}"
                n = i
                break
        matched.append(n)
    return matched


def test_tp2_matches_tp1_and_halves_the_weights():
    one, mem1, _ = _run(1)
    two, mem2, impl = _run(2, "auto")
    nccl, _, impl_nccl = _run(2, "nccl")
    assert impl_nccl is None
    print(f"all-reduce chosen by auto: {type(impl).__name__ if impl else 'NCCL'}")
    print(f"matched tokens TP2(auto) vs TP1: {_close(two, one)}; TP2(nccl) vs TP1: {_close(nccl, one)}")
    # rank 0 allocates about half of TP=1's weights (+ its 4 GiB KV budget in both cases)
    print(f"cuda:0 allocated: TP1 {mem1 / 2**30:.2f} GiB, TP2 {mem2 / 2**30:.2f} GiB")
    assert mem2 < 0.6 * mem1 + (2 << 30)
