"""On CUDA, bf16: DeepSeek-V2/V3 tiny checkpoints agree with transformers in the vLLM sense
(with CUDA graphs, batched and alone), graphs give eager's tokens, mixed steps and
prefix-cache hits keep them, and nothing compiles after start-up."""

from __future__ import annotations

import pytest
import torch

from agent_infer.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.sampling_params import SamplingParams
from tests.deepseek_models import DEEPSEEK_SPECS, VOCAB, write_deepseek_model
from tests.gpu.test_engine_gpu import NEW, check_logprobs_close
from tests.hf_reference import hf_greedy, load_hf_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# Tiny random MoE models are flat: in bf16 (logprob steps of ~0.03) a step's top five often
# span under 0.2 nats, and the routed experts' rounding moves a pick past the fifth. So
# these checkpoints are more peaked than the CPU tests' and the closeness rule looks at the
# top ten of 307 tokens.
DS_TOP = 10


@pytest.fixture(scope="module")
def ds_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("deepseek_gpu")
    return {name: write_deepseek_model(name, str(root / name), initializer_range=0.6) for name in DEEPSEEK_SPECS}


def _prompts(seed=3):
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 18, 33, 64)]


def _engine(path, eager=False, **kw):
    return LLMEngine(EngineConfig(model=path, device="cuda", dtype="bfloat16", enforce_eager=eager,
                                  kv_cache_bytes=1 << 30, max_num_seqs=16, **kw))


@pytest.mark.parametrize("name", sorted(DEEPSEEK_SPECS))
def test_close_to_transformers_graphs_equal_eager(name, ds_dirs):
    path = ds_dirs[name]
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=DS_TOP)
    graph_eng = _engine(path)
    batch = graph_eng.generate(prompts, params)
    alone = [graph_eng.generate([p], params)[0] for p in prompts]
    eager = _engine(path, eager=True).generate(prompts, params)
    assert [o.token_ids for o in batch] == [o.token_ids for o in eager], "graphs and eager differ"
    hf = load_hf_model(path, torch.bfloat16, "cuda")
    matched = []
    for i, p in enumerate(prompts):
        ref = hf_greedy(hf, p, NEW, top_k=DS_TOP)
        for tag, outs in (("batch", batch), ("alone", alone)):
            top = [dict(t.top) for t in outs[i].logprobs]
            matched.append(check_logprobs_close(outs[i].token_ids, top, ref, f"{name}[{i}] {tag}"))
    print(f"{name}: tokens matched before the first tolerated difference: {matched}")


def test_prefix_hits_and_mixed_steps_keep_graph_tokens(ds_dirs):
    path = ds_dirs["v3"]
    shared = _prompts(9)[3]
    prompts = [shared + p for p in _prompts(10)[:3]]
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    eng = _engine(path)
    first = [o.token_ids for o in eng.generate(prompts, params)]
    again = eng.generate(prompts, params)
    assert [o.token_ids for o in again] == first and all(o.num_cached_tokens >= 64 for o in again)
    mixed = _engine(path, mixed_batches=True, max_num_batched_tokens=32)
    assert [o.token_ids for o in mixed.generate(prompts, params)] == first


def test_no_kernel_compiled_after_start_up(ds_dirs):
    from agent_infer.kernels.triton.compile_watch import CompileWatch
    from tests.gpu.test_no_compile_after_startup import _workload

    eng = _engine(ds_dirs["v3"], max_num_seqs=128, kv_cache_bytes=2 << 30)
    with CompileWatch() as watch:
        outs = eng.generate(*_workload(96, 0, VOCAB))
    assert all(not o.error for o in outs)
    assert not watch.compiles, "compiled while serving:\n" + "\n".join(c.kernel for c in watch.compiles)
