"""The transformers backend (`--model-impl transformers`; `auto` for architectures without a
native family): transformers' own model classes on the paged cache. fp32 greedy tokens
equal transformers' own generation for five architectures that have no native family,
on tiny random checkpoints written by transformers (odd shapes), batched, with prefix
hits and prompts prefilled in chunks; what it cannot serve is refused by name."""

from __future__ import annotations

import json
import os
import random

import pytest

from agent_infer.config import ConfigError, EngineConfig, ModelConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.sampling_params import SamplingParams
from tests.hf_reference import check_greedy_close, hf_greedy, load_hf_model
from tests.tiny_models import VOCAB, write_hf_model

NEW_TOKENS = 12
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
# No native family for any of these: GQA with head_dim != hidden / heads (Mistral),
# fused qkv and gate_up with partial rotary (Phi-3), q/k norms over all heads (OLMo 2),
# embedding, residual, attention and logit multipliers (Granite), parallel residual and
# partial rotary with fused qkv (GPT-NeoX).
SPECS = {
    "MistralForCausalLM": dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                               num_key_value_heads=2, head_dim=12, sliding_window=None),
    "Phi3ForCausalLM": dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, partial_rotary_factor=0.5, sliding_window=None,
                            pad_token_id=0),
    "Olmo2ForCausalLM": dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=4),
    "GraniteForCausalLM": dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
                               num_key_value_heads=3, embedding_multiplier=3.0, residual_multiplier=0.7,
                               attention_multiplier=0.2, logits_scaling=2.5),
    "GPTNeoXForCausalLM": dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                               rotary_pct=0.5, use_parallel_residual=True),
}


def write(arch: str, path: str, seed: int = 0) -> str:
    return write_hf_model(arch, path, seed, tie_word_embeddings=False, **SPECS[arch])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_backend")
    return {arch: write(arch, str(root / arch)) for arch in SPECS}


def _engine(path: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=128, block_size=16, **kw))


@pytest.mark.parametrize("arch", list(SPECS))
def test_equals_transformers_batched_with_prefix_hits_and_chunks(checkpoints, arch):
    path = checkpoints[arch]
    # A budget of 24 tokens a step: the longer prompts prefill in several chunks.
    engine = _engine(path, max_num_batched_tokens=24)
    assert engine.model_config.impl == "transformers"
    rng = random.Random(3)
    shared = [rng.randrange(3, VOCAB) for _ in range(35)]
    prompts = [[rng.randrange(3, VOCAB) for _ in range(5)], shared + [7, 9], shared + [11],
               [rng.randrange(3, VOCAB) for _ in range(50)]]
    outs = engine.generate(prompts, PARAMS)
    again = engine.generate([shared + [13, 5]], PARAMS)[0]
    assert again.num_cached_tokens == 32  # the shared prefix's two whole blocks came from the cache
    hf = load_hf_model(path)
    for i, (prompt, out) in enumerate(zip(prompts + [shared + [13, 5]], outs + [again])):
        ref = hf_greedy(hf, prompt, NEW_TOKENS)
        check_greedy_close(out.token_ids, [dict(t.top) for t in out.logprobs], ref, 1e-4, f"{arch}[{i}]")


def test_auto_picks_native_where_there_is_one_and_native_refuses_the_rest(checkpoints, tiny_model_dirs):
    assert ModelConfig.from_hf(tiny_model_dirs["qwen3"]).impl == "native"
    assert ModelConfig.from_hf(tiny_model_dirs["qwen3"], "transformers").impl == "transformers"
    with pytest.raises(ConfigError, match="unsupported architecture 'MistralForCausalLM' with --model-impl native"):
        ModelConfig.from_hf(checkpoints["MistralForCausalLM"], "native")


def test_a_native_family_through_the_backend_gives_the_native_tokens(tiny_model_dirs):
    path = tiny_model_dirs["qwen3"]
    prompts = [[5, 9, 13, 200, 7], list(range(3, 40))]
    native = _engine(path).generate(prompts, PARAMS)
    backend = _engine(path, model_impl="transformers")
    assert backend.model_config.impl == "transformers"
    got = backend.generate(prompts, PARAMS)
    assert [o.token_ids for o in got] == [o.token_ids for o in native]


def _edited(src: str, dest: str, **changes) -> str:
    os.makedirs(dest)
    for f in os.listdir(src):
        if f != "config.json":
            os.link(os.path.join(src, f), os.path.join(dest, f))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dest


def test_what_it_cannot_serve_is_refused_by_name(checkpoints, tmp_path):
    src = checkpoints["MistralForCausalLM"]
    with pytest.raises(ConfigError, match="sets sliding_window"):
        ModelConfig.from_hf(_edited(src, str(tmp_path / "sw"), sliding_window=64))
    with pytest.raises(ConfigError, match="no class of that name"):
        ModelConfig.from_hf(_edited(src, str(tmp_path / "unknown"), architectures=["NoSuchForCausalLM"]))
    with pytest.raises(ConfigError, match="encoder-decoder"):
        ModelConfig.from_hf(_edited(src, str(tmp_path / "encdec"), is_encoder_decoder=True))


def test_the_engines_layers_replace_only_what_computes_the_same(checkpoints, tmp_path):
    model = _engine(checkpoints["MistralForCausalLM"]).runner.model
    kinds = {type(m).__name__ for m in model.hf.modules()}
    assert "Linear" not in kinds and "MistralRMSNorm" not in kinds and {"_WholeLinear", "_RMSNorm"} <= kinds
    # Gemma's norms scale by 1 + weight: kept as transformers wrote them; its tied LM head
    # becomes the engine's, on the embedding's own tensor.
    gemma = write_hf_model("GemmaForCausalLM", str(tmp_path / "gemma"), 0, tie_word_embeddings=True, hidden_size=48,
                           intermediate_size=80, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16)
    engine = _engine(gemma)
    hf_model = engine.runner.model.hf
    assert sum(type(m).__name__ == "GemmaRMSNorm" for m in hf_model.modules()) == 5
    assert hf_model.get_output_embeddings().weight is hf_model.get_input_embeddings().weight
    prompt = [5, 6, 7, 8, 9, 10]
    out = engine.generate([prompt], PARAMS)[0]
    check_greedy_close(out.token_ids, [dict(t.top) for t in out.logprobs], hf_greedy(load_hf_model(gemma), prompt,
                       NEW_TOKENS), 1e-4, "gemma")


def test_the_compiled_model_gives_the_eager_tokens(checkpoints):
    """What a GPU runs, traced on the CPU (dynamo and AOT autograd; the GPU's code
    generation is Triton's): the engine's linear operator stays whole in the graph,
    attention is the only break, and the tokens and logprobs are the eager model's."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    engine = _engine(checkpoints["Phi3ForCausalLM"])
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 61))]
    eager = engine.generate(prompts, PARAMS)
    torch._dynamo.reset()
    counters.clear()
    engine.runner.model.use_torch_compile("aot_eager")
    try:
        compiled = engine.generate(prompts, PARAMS)
        assert counters["stats"]["unique_graphs"] > 0
        breaks = list(counters["graph_break"])
        assert breaks and all("torch.compiler.disable" in b for b in breaks), breaks
    finally:
        torch._dynamo.reset()
    for a, b in zip(eager, compiled):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
