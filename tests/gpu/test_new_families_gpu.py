"""On CUDA, bf16: the native Qwen3-MoE and Mixtral (fused MoE kernels, the Triton router)
and the transformers backend (Mistral, Phi-3, OLMo 2, Granite, GPT-NeoX on the paged
cache) agree with transformers in the vLLM sense; the native families' CUDA graphs and
eager steps give the same tokens."""

from __future__ import annotations

import pytest
import torch

from agent_infer.sampling_params import SamplingParams
from tests.gpu.test_engine_gpu import NEW, TOP, _engine, _matched_with_transformers, _prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    from tests.test_sparse_moe import SPECS, write_sparse_moe

    root = tmp_path_factory.mktemp("moe_gpu")
    return {name: write_sparse_moe(name, str(root / name)) for name in SPECS}


@pytest.fixture(scope="module")
def backend_dirs(tmp_path_factory):
    from tests.test_transformers_backend import SPECS, write

    root = tmp_path_factory.mktemp("backend_gpu")
    return {arch: write(arch, str(root / arch)) for arch in SPECS}


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_step2", "mixtral"])
def test_sparse_moe_close_to_transformers_graphs_and_eager(name, moe_dirs):
    path = moe_dirs[name]
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=TOP)
    graph_eng = _engine(path, eager=False)
    graph_outs = graph_eng.generate(prompts, params)
    single_outs = [graph_eng.generate([p], params)[0] for p in prompts]
    eager_outs = _engine(path, eager=True).generate(prompts, params)
    assert [o.token_ids for o in graph_outs] == [o.token_ids for o in eager_outs], "graphs and eager differ"
    matched = _matched_with_transformers(path, prompts, {"batch": graph_outs, "alone": single_outs}, name)
    print(f"{name}: tokens matched before first (tolerated) difference, batched/alone: {matched}")


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "Phi3ForCausalLM", "Olmo2ForCausalLM", "GraniteForCausalLM",
                                  "GPTNeoXForCausalLM"])
def test_transformers_backend_close_to_transformers(arch, backend_dirs):
    path = backend_dirs[arch]
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=TOP)
    engine = _engine(path, eager=False)
    assert engine.model_config.impl == "transformers" and engine.runner.graphs is None
    outs = engine.generate(prompts, params)
    single = [engine.generate([p], params)[0] for p in prompts]
    matched = _matched_with_transformers(path, prompts, {"batch": outs, "alone": single}, arch)
    print(f"{arch}: tokens matched before first (tolerated) difference, batched/alone: {matched}")
