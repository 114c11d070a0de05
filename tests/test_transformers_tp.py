"""Tensor parallelism through the transformers backend, from each architecture's own
published split (`base_model_tp_plan`): TP = 2 over gloo gives TP = 1's tokens and fp32
logprobs for heads split by rank (Mistral, GPT-NeoX's fused qkv), for projections
gathered whole (Phi-3's fused qkv and gate_up, OLMo 2's norms over all heads), with
prompts prefilled in chunks and a prefix hit; sizes that cannot split are refused by
name before any process starts."""

from __future__ import annotations

import pytest

from agent_infer.config import ConfigError, EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from agent_infer.layers.linear import ColumnParallelLinear, RowParallelLinear
from agent_infer.sampling_params import SamplingParams
from tests.test_tensor_parallel import assert_same
from tests.test_transformers_backend import write
from tests.tiny_models import write_hf_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=20)
SHARED = list(range(40, 76))
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [300, 12, 13], SHARED + [7], list(range(100, 141))]
# KV heads a rank caches at TP 2: split by heads, or every head (q/k/v gathered whole).
KV_HEADS_AT_TP2 = {"MistralForCausalLM": 1, "GPTNeoXForCausalLM": 2, "Phi3ForCausalLM": 2, "Olmo2ForCausalLM": 4}


def _engine(path: str, tp: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=128, block_size=16,
                                  max_num_batched_tokens=24, tensor_parallel_size=tp, model_impl="transformers"))


def _run(path: str, tp: int, check=None):
    eng = _engine(path, tp)
    try:
        if check is not None:
            check(eng.runner.model)
        outs = eng.generate(PROMPTS, PARAMS)
        again = eng.generate([SHARED + [9, 4]], PARAMS)[0]
        assert again.num_cached_tokens == 32
        return outs + [again]
    finally:
        eng.shutdown()


@pytest.mark.parametrize("arch", list(KV_HEADS_AT_TP2))
def test_two_ranks_give_one_ranks_tokens(tmp_path, arch):
    path = write(arch, str(tmp_path / arch))

    def split_as_published(model):
        assert [a.num_kv_heads for a in model.attention_layers] == [KV_HEADS_AT_TP2[arch]] * 2
        layers = list(model.hf.base_model.modules())
        assert sum(isinstance(m, ColumnParallelLinear) for m in layers) >= 2  # attention's and the MLP's
        assert sum(isinstance(m, RowParallelLinear) for m in layers) == 4  # o_proj and down_proj, 2 layers
        assert isinstance(model.hf.get_input_embeddings(), VocabParallelEmbedding)
        assert isinstance(model.hf.get_output_embeddings(), ParallelLMHead)

    assert_same(_run(path, 2, split_as_published), _run(path, 1))


def test_sizes_that_cannot_split_are_refused_by_name(tmp_path):
    granite = write("GraniteForCausalLM", str(tmp_path / "granite"))  # 6 heads, 3 KV heads
    with pytest.raises(ConfigError, match="3 KV heads do not divide by --tp 2"):
        _engine(granite, 2)
    olmo = write("Olmo2ForCausalLM", str(tmp_path / "olmo"))  # intermediate 80
    with pytest.raises(ConfigError, match=r"layers\.0\.mlp\.gate_proj has 80 output features, not divisible by --tp 3"):
        _engine(olmo, 3)
    persimmon = write_hf_model("PersimmonForCausalLM", str(tmp_path / "persimmon"), hidden_size=32,
                               intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(ConfigError, match="has none, so it runs on one rank"):
        _engine(persimmon, 2)
