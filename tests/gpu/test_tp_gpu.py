"""Tensor parallelism on 2 GPUs (bf16): TP = 2 (async scheduling: decode inputs resolved
on each GPU from rank 0's NCCL token broadcast, graphs included) agrees with TP = 1 on the
same checkpoint in the vLLM sense, with symmetric-memory and with NCCL all-reduce; async
and synchronous TP = 2 give identical results; each rank holds about half the weights.
Set AGENT_INFER_TP_MODEL_DIR (e.g. the qwen3-8b random preset)."""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys

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


def _engine(tp: int, all_reduce: str = "auto", **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=MODEL, dtype="bfloat16", tensor_parallel_size=tp, all_reduce=all_reduce,
                                  kv_cache_bytes=4 << 30, max_num_seqs=8, max_model_len=4096, **kw))


def _prompts(eng: LLMEngine) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(0, eng.model_config.vocab_size) for _ in range(n)] for n in (7, 100, 512)]


# Each configuration runs in a fresh process: tearing a process group down after
# symmetric-memory use can outlast destroy_group's bound, and a process holds one TP
# engine at a time.
_CHILD = """
import json, os, sys, torch
from tests.gpu import test_tp_gpu as t
tp, all_reduce = int(sys.argv[1]), sys.argv[2]
base = torch.cuda.memory_allocated(0)
eng = t._engine(tp, all_reduce)
try:
    assert eng.async_scheduling  # TP = 2 included: placeholders come from the token broadcast
    params = t.SamplingParams(temperature=0.0, max_tokens=t.NEW, ignore_eos=True, logprobs=t.TOP)
    outs = eng.generate(t._prompts(eng), params)
    alone = [eng.generate([p], params)[0] for p in t._prompts(eng)]  # batch 1: the GEMV path
    impl = eng.runner.tp.all_reduce_impl if tp > 1 else None
    fused = eng.runner.tp.all_reduce_norm_impl if tp > 1 else None
    result = {
        "fused_error": int(fused.peers.error.item()) if fused is not None else None,
        "tokens": [o.token_ids for o in outs],
        "top": [[[list(p) for p in lp.top] for lp in o.logprobs] for o in outs],
        "alone_tokens": [o.token_ids for o in alone],
        "alone_top": [[[list(p) for p in lp.top] for lp in o.logprobs] for o in alone],
        "mem": torch.cuda.memory_allocated(0) - base,
        "impl": type(impl).__name__ if impl is not None else None,
    }
finally:
    eng.shutdown()
print("RESULT " + json.dumps(result), flush=True)
os._exit(0)  # like the CLI after TP runs: no interpreter teardown of the process group
"""


def _run(tp: int, all_reduce: str = "auto") -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", _CHILD, str(tp), all_reduce], capture_output=True, text=True,
                       timeout=300, cwd=root, env=env)
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"TP={tp} {all_reduce} (rc {r.returncode}):\n{r.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _close(a: dict, b: dict, run: str = "") -> list[int]:
    """Tokens matched before the first difference, per prompt; a difference must be a
    near-tie (each pick in the other's top-k, vLLM's rule). run="alone_": the prompts
    generated one at a time (batch-1 decode)."""
    matched = []
    for xs, ys, x_top, y_top in zip(a[run + "tokens"], b[run + "tokens"], a[run + "top"], b[run + "top"]):
        n = len(xs)
        for i, (s, t) in enumerate(zip(xs, ys)):
            if s != t:
                assert s in {p[0] for p in y_top[i]} and t in {p[0] for p in x_top[i]}, f"step {i}: {s} vs {t}"
                n = i
                break
        matched.append(n)
    return matched


def test_tp2_matches_tp1_and_halves_the_weights():
    one, two, nccl = _run(1), _run(2, "auto"), _run(2, "nccl")
    mem1, mem2 = one["mem"], two["mem"]
    assert nccl["impl"] is None
    print(f"all-reduce chosen by auto: {two['impl'] or 'NCCL'}")
    print(f"matched tokens TP2(auto) vs TP1: {_close(two, one)}; TP2(nccl) vs TP1: {_close(nccl, one)}")
    # rank 0 allocates about half of TP=1's weights (+ its 4 GiB KV budget in both cases)
    print(f"cuda:0 allocated: TP1 {mem1 / 2**30:.2f} GiB, TP2 {mem2 / 2**30:.2f} GiB")
    assert mem2 < 0.6 * mem1 + (2 << 30)


def test_tp2_async_equals_tp2_sync():
    """One TP = 2 engine (same kernels, same graphs), stepped async then synchronously: a
    worker that read a wrong or stale token (a broadcast ordered wrongly on its stream)
    would change its KV shard and so every later token. Prefix caching is off so the
    second pass runs the very same batches."""
    gc.collect()
    torch.cuda.empty_cache()
    eng = _engine(2, enable_prefix_caching=False)
    try:
        prompts = _prompts(eng)
        params = [
            SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=TOP),
            SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=NEW, ignore_eos=True, logprobs=TOP),
            SamplingParams(temperature=1.0, seed=6, max_tokens=NEW // 2, ignore_eos=True),
        ]
        assert eng.async_scheduling
        fast = eng.generate(prompts, params)
        eng.async_scheduling = False
        slow = eng.generate(prompts, params)
    finally:
        eng.shutdown()
        del eng
    for x, y in zip(fast, slow):
        assert x.token_ids == y.token_ids
        for lx, ly in zip(x.logprobs or [], y.logprobs or []):
            assert abs(lx.logprob - ly.logprob) < 1e-3


def test_tp2_fused_all_reduce_norm_matches_tp1():
    """--all-reduce symm_mem_fused (the row-parallel all-reduces folded into the RMSNorms
    after them; CUDA graphs included; batched and batch 1) against TP = 1
    and against plain symmetric memory, in the vLLM sense: tokens match until a near-tie."""
    one, plain, fused = _run(1), _run(2, "symm_mem"), _run(2, "symm_mem_fused")
    assert fused["fused_error"] == 0, "a barrier wait of the fused kernel ran out of spins"
    print(f"matched tokens TP2(fused) vs TP1: {_close(fused, one)}; vs TP2(symm_mem): {_close(fused, plain)}")
    # Batch 1: the Triton GEMV, then the fused kernel on one row.
    print(f"alone (batch 1): vs TP1: {_close(fused, one, 'alone_')}; vs TP2(symm_mem): {_close(fused, plain, 'alone_')}")
