"""Qwen3-MoE and Mixtral, natively: the dense family's attention with `layers/moe.py`'s MoE
MLP. fp32 greedy tokens equal transformers' on tiny random checkpoints written by
transformers itself (odd shapes: head_dim != hidden / heads, dense layers among sparse
ones, renormalised and plain top-k), batched; tensor parallelism over 2 and 3 ranks, with
the experts split by expert (EP) or by their intermediate size (TP), gives one rank's
tokens."""

from __future__ import annotations

import random

import pytest

from agent_infer.config import ConfigError, EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.layers.moe import MoE
from agent_infer.sampling_params import SamplingParams
from tests.hf_reference import check_greedy_close, hf_greedy, load_hf_model
from tests.tiny_models import VOCAB, write_hf_model

NEW_TOKENS = 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
_ATTENTION = dict(hidden_size=48, num_attention_heads=6, head_dim=20, num_hidden_layers=3)
SPECS = {
    # Renormalised top-2 of 6, layer 1 dense (mlp_only_layers).
    # One KV head: replicated over 2 or 3 ranks.
    "qwen3_moe": dict(arch="Qwen3MoeForCausalLM", **_ATTENTION, num_key_value_heads=1, intermediate_size=72, moe_intermediate_size=30,
                      num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1]),
    # Plain top-3 of 6 on every second layer (decoder_sparse_step 2).
    "qwen3_moe_step2": dict(arch="Qwen3MoeForCausalLM", **_ATTENTION, num_key_value_heads=3, intermediate_size=72, moe_intermediate_size=30,
                            num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2),
    # Every layer sparse, softmax over the top-2 logits; untied head.
    "mixtral": dict(arch="MixtralForCausalLM", **_ATTENTION, num_key_value_heads=3, intermediate_size=30, num_local_experts=6,
                    num_experts_per_tok=2, tie_word_embeddings=False),
}


def write_sparse_moe(name: str, path: str, seed: int = 0) -> str:
    spec = dict(SPECS[name])
    return write_hf_model(spec.pop("arch"), path, seed, rms_norm_eps=1e-6, **spec)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("sparse_moe")
    return {name: write_sparse_moe(name, str(root / name)) for name in SPECS}


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 23, 41)]


def _engine(path: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=128, block_size=16, **kw))


@pytest.mark.parametrize("name", list(SPECS))
def test_equals_transformers(checkpoints, name):
    engine = _engine(checkpoints[name])
    layers = engine.runner.model.model.layers
    sparse = [isinstance(layer.mlp, MoE) for layer in layers]
    assert sparse == {"qwen3_moe": [True, False, True], "qwen3_moe_step2": [False, True, False],
                      "mixtral": [True, True, True]}[name]
    prompts = _prompts()
    outs = engine.generate(prompts, PARAMS)
    hf = load_hf_model(checkpoints[name])
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        ref = hf_greedy(hf, prompt, NEW_TOKENS)
        check_greedy_close(out.token_ids, [dict(t.top) for t in out.logprobs], ref, 1e-4, f"{name}[{i}]")


@pytest.mark.parametrize("tp,moe_parallel", [(2, "ep"), (2, "tp"), (3, "ep"), (3, "tp")])
def test_tensor_parallel_equals_one_rank(checkpoints, tp, moe_parallel):
    path = checkpoints["qwen3_moe"]
    prompts = _prompts()
    one = _engine(path, async_scheduling=False).generate(prompts, PARAMS)
    many = _engine(path, tensor_parallel_size=tp, moe_parallel=moe_parallel)
    try:
        got = many.generate(prompts, PARAMS)
    finally:
        many.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in one]
    assert all(abs(a.logprob - b.logprob) < 1e-3 for o, p in zip(got, one) for a, b in zip(o.logprobs, p.logprobs))


def test_mixtral_splits_over_three_ranks(checkpoints):
    path = checkpoints["mixtral"]
    prompts = _prompts()
    one = _engine(path, async_scheduling=False).generate(prompts, PARAMS)
    three = _engine(path, tensor_parallel_size=3)
    try:
        assert [o.token_ids for o in three.generate(prompts, PARAMS)] == [o.token_ids for o in one]
    finally:
        three.shutdown()


def test_a_size_that_does_not_divide_the_experts_is_refused(checkpoints):
    """The 6 heads do not split over 4 ranks; with heads that do, neither do the 6
    experts (EP) nor their 30-wide intermediate dimension (TP experts)."""
    from dataclasses import replace

    from agent_infer.config import ModelConfig
    from agent_infer.models.sparse_moe import SparseMoeForCausalLM

    with pytest.raises(ConfigError, match="tensor-parallel size 4 does not divide"):
        _engine(checkpoints["qwen3_moe"], tensor_parallel_size=4)
    cfg = ModelConfig.from_hf(checkpoints["qwen3_moe"])
    wide = replace(cfg, family=replace(cfg.family, num_heads=12, num_kv_heads=4))
    with pytest.raises(ConfigError, match="30 routed experts' intermediate size"):
        SparseMoeForCausalLM.check_parallel(wide, 4, "tp")
    with pytest.raises(ConfigError, match="6 routed experts"):
        SparseMoeForCausalLM.check_parallel(wide, 4, "ep")
