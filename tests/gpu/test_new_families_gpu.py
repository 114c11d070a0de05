"""On CUDA, bf16: the native Qwen3-MoE and Mixtral (fused MoE kernels, the Triton router)
and the transformers backend (Mistral, Phi-3, OLMo 2, Granite, GPT-NeoX on the paged
cache) agree with transformers in the vLLM sense; the native families' CUDA graphs and
eager steps give the same tokens, the backend's compiled graphs and its eager steps are
both close to transformers; a backend model whose step reads a value on the host
(dynamic rotary scaling) decodes without graphs and still agrees. The mixtures' routers are made decisive, as the
DeepSeek GPU tests' are: tiny random routers nearly tie, and bf16 rounding flips them."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_engine_gpu import _engine, check_close_to_transformers
from tests.tiny_models import decisive_router

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    from tests.test_sparse_moe import SPECS, write_sparse_moe

    root = tmp_path_factory.mktemp("moe_gpu")
    # Routers made decisive: near-tied random routing flips with bf16 rounding (see decisive_router).
    return {name: decisive_router(write_sparse_moe(name, str(root / name))) for name in SPECS}


@pytest.fixture(scope="module")
def backend_dirs(tmp_path_factory):
    from tests.test_transformers_backend import SPECS, write

    root = tmp_path_factory.mktemp("backend_gpu")
    return {arch: write(arch, str(root / arch)) for arch in SPECS}


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_step2", "mixtral"])
def test_sparse_moe_close_to_transformers_graphs_and_eager(name, moe_dirs):
    assert _engine(moe_dirs[name], eager=False).runner.graphs is not None
    check_close_to_transformers(moe_dirs[name], name)


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "Phi3ForCausalLM", "Olmo2ForCausalLM", "GraniteForCausalLM",
                                  "GPTNeoXForCausalLM"])
def test_transformers_backend_close_to_transformers(arch, backend_dirs):
    engine = _engine(backend_dirs[arch], eager=False)
    assert engine.model_config.impl == "transformers" and engine.runner.graphs is not None
    check_close_to_transformers(backend_dirs[arch], arch, compiled=True)


def test_transformers_backend_step_that_syncs_decodes_eagerly(tmp_path, caplog):
    from tests.test_transformers_backend import SPECS
    from tests.tiny_models import write_hf_model

    # Dynamic NTK scaling compares the largest position with the cached length on the host.
    path = write_hf_model("MistralForCausalLM", str(tmp_path / "dynamic"), tie_word_embeddings=False,
                          **SPECS["MistralForCausalLM"], rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    engine = _engine(path, eager=False)
    assert engine.runner.graphs is None
    assert "synchronises with the host" in caplog.text
    check_close_to_transformers(path, "mistral-dynamic-rope", compiled=True)
