"""On CUDA: once `LLMEngine(...)` has returned, serving compiles no Triton kernel variant.
Triton's own compile hook (kernels/triton/compile_watch.py) watches a workload of mixed
prompt lengths, output lengths and sampling settings, so the decode batch falls through
every graph size. The CPU guard of the same promise is tests/test_kernel_variants.py."""

from __future__ import annotations

import random

import pytest
import torch

from agent_infer.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.sampling_params import SamplingParams
from tests.tiny_models import VOCAB, write_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> str:
    return write_tiny_model("qwen3", str(tmp_path_factory.mktemp("nocompile") / "qwen3"))


def _workload(n: int, seed: int, vocab: int = VOCAB):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 400))] for _ in range(n)]
    params = []
    for i in range(n):
        kw = {"temperature": 0.0} if i % 3 == 0 else {"temperature": 0.6, "top_p": 0.9 if i % 5 == 0 else 1.0}
        params.append(SamplingParams(max_tokens=rng.randint(1, 80), ignore_eos=True, seed=i, **kw))
    return prompts, params


SPEC = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2,
                                "prompt_lookup_min": 1}}


@pytest.mark.parametrize("options", [{}, {"enforce_eager": True}, {"mixed_batches": True}, SPEC,
                                     {"batch_invariant": True, **SPEC}],
                         ids=["graphs", "eager", "mixed", "drafts", "invariant"])
def test_no_kernel_compiled_after_start_up(qwen3_dir, options):
    from agent_infer.kernels.triton.compile_watch import CompileWatch

    engine = LLMEngine(EngineConfig(model=qwen3_dir, device="cuda", dtype="bfloat16", kv_cache_bytes=1 << 30,
                                    max_num_seqs=128, **options))
    with CompileWatch() as watch:
        for seed in range(2):  # the second wave arrives while nothing runs: a fresh start
            outs = engine.generate(*_workload(128, seed))
            assert all(not o.error for o in outs)
    assert engine.stats.max_decode_batch >= 100
    if "speculative_config" in options:  # verify steps ran, and steps that followed them
        assert engine.draft_policy.stats.num_chained_rows > 0, engine.draft_policy.stats
    assert not watch.compiles, "compiled while serving:\n" + "\n".join(c.kernel for c in watch.compiles)


def test_compile_watch_sees_a_new_variant():
    """The watch itself: a kernel launched with a block size never used before compiles."""
    from agent_infer.kernels.triton import tokens
    from agent_infer.kernels.triton.compile_watch import CompileWatch

    ids = torch.zeros(8, dtype=torch.int64, device="cuda")
    with CompileWatch() as watch:
        tokens._fill_placeholders_kernel[(1,)](ids, ids, ids, 8, BLOCK=8, PDL=False, num_warps=1)
    assert len(watch.compiles) == 1 and "_fill_placeholders_kernel" in watch.compiles[0].kernel
