"""fp8 checkpoints as they are published load and run: a tiny dense model and a tiny
DeepSeek-V3 in the block layout (e4m3 projections, `weight_scale_inv` per block, router
gates, embeddings, norms and lm_head left in full precision), and a tiny dense model in
compressed-tensors' per-channel layout. fp32 greedy tokens equal transformers run on the
same weights dequantized, and tensor parallelism splits them as it splits any weight."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from agent_infer.config import ConfigError, EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.quantization import fp8 as F
from agent_infer.sampling_params import SamplingParams
from tests.deepseek_models import write_deepseek_model
from tests.hf_reference import check_greedy_close, hf_greedy, load_hf_model
from tests.tiny_models import write_tiny_model

NEW_TOKENS = 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
BLOCK = (16, 8)  # small enough that the tiny shapes hold several blocks, and partial ones
DEEPSEEK_V3_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
COMPRESSED_TENSORS_FP8 = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                              "dynamic": True}}},
}


def _quantized_pair(src: str, fp8_dir: str, ref_dir: str, layout: str) -> None:
    """Write `src` as an fp8 checkpoint (every projection quantized as the layout stores
    it) and, as the reference, the same model holding the dequantized weights."""
    for d in (fp8_dir, ref_dir):
        shutil.copytree(src, d)
        for f in os.listdir(d):
            if f.endswith(".safetensors") or f.endswith(".index.json"):
                os.remove(os.path.join(d, f))
    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, f)))
    quantized, reference = {}, {}
    for name, t in tensors.items():
        if not (name.endswith("_proj.weight") and t.dim() == 2):
            quantized[name] = reference[name] = t  # embeddings, norms, router gates, lm_head
            continue
        if layout == "block":
            q, scale = F.quantize_block(t, BLOCK)
            quantized[name], quantized[name + "_scale_inv"] = q, scale
            reference[name] = F.dequantize_block(q, scale, BLOCK)
        else:
            q, scale = F.quantize_channel(t)
            quantized[name], quantized[name + "_scale"] = q, scale
            reference[name] = F.dequantize_channel(q, scale)
    save_file(quantized, os.path.join(fp8_dir, "model.safetensors"))
    save_file(reference, os.path.join(ref_dir, "model.safetensors"))
    with open(os.path.join(fp8_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = (dict(DEEPSEEK_V3_FP8, weight_block_size=list(BLOCK)) if layout == "block"
                                     else COMPRESSED_TENSORS_FP8)
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(config, f)


def _deepseek_v3(path: str) -> str:
    """A tiny V3 whose heads and experts divide by 2, its experts one tensor each as the
    published checkpoints store them. Every projection a rank splits, or that is merged
    with another, spans whole blocks of BLOCK at TP 1 and 2, as the published shapes do
    with 128 x 128; the hidden size (42) leaves partial blocks of columns."""
    return write_deepseek_model("v3", path, hub_spelling=True, num_attention_heads=4, num_key_value_heads=4,
                                n_routed_experts=6, n_group=3, topk_group=2, num_experts_per_tok=2,
                                qk_nope_head_dim=24, v_head_dim=12, intermediate_size=64, moe_intermediate_size=32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    made = {}
    sources = {
        "qwen3-block": (write_tiny_model("qwen3", str(root / "qwen3")), "block"),
        "llama-channel": (write_tiny_model("llama", str(root / "llama")), "channel"),
        "deepseek-v3-block": (_deepseek_v3(str(root / "v3")), "block"),
    }
    for name, (src, layout) in sources.items():
        made[name] = (str(root / f"{name}-fp8"), str(root / f"{name}-ref"))
        _quantized_pair(src, *made[name], layout)
    return made


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (4, 19, 37)]


def _engine(path: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=128, block_size=16, **kw))


@pytest.mark.parametrize("name", ["qwen3-block", "llama-channel", "deepseek-v3-block"])
def test_fp8_checkpoint_equals_transformers_on_the_dequantized_weights(checkpoints, name):
    fp8_dir, ref_dir = checkpoints[name]
    engine = _engine(fp8_dir)
    assert engine.model_config.quantization.layout == name.rsplit("-", 1)[1]
    prompts = _prompts(engine.model_config.vocab_size)
    outs = engine.generate(prompts, PARAMS)
    hf = load_hf_model(ref_dir)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        ref = hf_greedy(hf, prompt, NEW_TOKENS)
        check_greedy_close(out.token_ids, [dict(t.top) for t in out.logprobs], ref, 1e-4, f"{name}[{i}]")
    # The same weights as the reference checkpoint, value for value.
    plain = _engine(ref_dir).generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(abs(a.logprob - b.logprob) < 1e-5 for o, p in zip(outs, plain) for a, b in zip(o.logprobs, p.logprobs))


@pytest.mark.parametrize("name,placement", [("qwen3-block", "ep"), ("deepseek-v3-block", "ep"),
                                            ("deepseek-v3-block", "tp")])
def test_tensor_parallel_fp8_equals_one_rank(checkpoints, name, placement):
    """Both expert placements: whole experts per rank, or every expert's intermediate
    dimension split on block boundaries (16 rows of 32 on each rank)."""
    fp8_dir, _ = checkpoints[name]
    reference = _engine(fp8_dir, async_scheduling=False)
    prompts = _prompts(reference.model_config.vocab_size)
    one = reference.generate(prompts, PARAMS)
    two = _engine(fp8_dir, tensor_parallel_size=2, moe_parallel=placement)
    try:
        got = two.generate(prompts, PARAMS)
    finally:
        two.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in one]
    assert all(abs(a.logprob - b.logprob) < 1e-3 for o, p in zip(got, one) for a, b in zip(o.logprobs, p.logprobs))


def test_experts_keep_the_checkpoints_blocks_or_refuse_a_split_by_name():
    """Routed experts hold a block layout's e4m3 values and scales as stored when this
    rank's intermediate size is whole blocks of rows and of columns; tensor-parallel
    experts that would cut a block are refused before anything loads, naming the sizes;
    on one rank an intermediate size no published checkpoint has (not whole blocks)
    falls back to dequantizing the experts as they load."""
    from agent_infer.distributed.state import SINGLE, ParallelState
    from agent_infer.layers.moe import MoE, RouterConfig

    router = RouterConfig(num_experts=4, top_k=2)
    config = F.Fp8Config("block", (16, 8))
    whole = MoE(40, 32, router, 1, SINGLE)
    assert whole.use_fp8(config) and whole.experts.w13.dtype == F.FP8 and whole.experts.block == (16, 8)
    assert tuple(whole.experts.w13_scale.shape) == (5, 4, 5) and tuple(whole.experts.w2_scale.shape) == (5, 3, 4)
    ranks = MoE(40, 32, router, 1, ParallelState(rank=1, world_size=2, moe_parallel="tp"))
    assert ranks.use_fp8(config) and tuple(ranks.experts.w13_scale.shape) == (4, 2, 5)
    assert ranks.shared_experts is not None and ranks.shared_experts.gate_up_proj.quantizable
    cut = MoE(40, 32, router, 1, ParallelState(rank=1, world_size=2, moe_parallel="tp"))
    with pytest.raises(ConfigError, match=r"routed experts of intermediate size 16 on this rank \(tp over 2\) "
                                          r"would split the checkpoint's 32 x 8 fp8 blocks"):
        cut.use_fp8(F.Fp8Config("block", (32, 8)))
    odd = MoE(40, 24, router, 1, ParallelState(rank=0, world_size=2, moe_parallel="ep"))
    assert not odd.use_fp8(F.Fp8Config("block", (16, 8))) and odd.experts.fp8 is None
    assert not odd.shared_experts.gate_up_proj.quantizable  # computed as one rank computes it


def test_missing_or_misshapen_scales_are_named(checkpoints, tmp_path):
    fp8_dir, _ = checkpoints["qwen3-block"]
    tensors = load_file(os.path.join(fp8_dir, "model.safetensors"))
    name = next(n for n in tensors if n.endswith("q_proj.weight_scale_inv"))
    for case, change in (("missing", lambda t: t.pop(name)),
                         ("misshapen", lambda t: t.__setitem__(name, t[name][:1]))):
        broken = tmp_path / case
        shutil.copytree(fp8_dir, broken)
        edited = dict(tensors)
        change(edited)
        save_file(edited, str(broken / "model.safetensors"))
        with pytest.raises((ConfigError, ValueError), match=name.removesuffix("_scale_inv")):
            _engine(str(broken))


def test_the_gpu_tests_reference_patches_take_what_the_layers_pass(checkpoints, monkeypatch):
    """tests/gpu hold the fp8 engine to reference arithmetic made by patching `ops`
    (`_reference_outputs` in test_fp8_engine.py, `_fp32_products` in
    test_fp8_real_shapes.py). The stand-ins sit on the layers' own call paths, so they
    must take whatever those pass: a row-invariance argument once broke every reference
    run, unseen here. On the CPU, where fp8 weights are dequantized as they load, the
    stand-ins pass everything on, so the patched runs give the engine's own tokens and
    logprobs (the dense layers and the MoE's experts, through both)."""
    from tests.gpu.test_fp8_engine import _reference_outputs
    from tests.gpu.test_fp8_real_shapes import FORCED, _fp32_products

    cpu = dict(device="cpu", dtype="float32", kv_cache_bytes=None, num_kv_blocks=128, block_size=16)
    for name in ("qwen3-block", "deepseek-v3-block"):
        fp8_dir, _ = checkpoints[name]
        engine = _engine(fp8_dir)
        prompts = _prompts(engine.model_config.vocab_size)
        want = engine.generate(prompts, PARAMS)
        got = _reference_outputs(fp8_dir, prompts, monkeypatch, PARAMS, **cpu)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], name
        assert all(abs(a.logprob - b.logprob) < 1e-5 for o, w in zip(got, want) for a, b in zip(o.logprobs, w.logprobs))
        want = engine.generate(prompts, FORCED)
        got = _fp32_products(fp8_dir, prompts, monkeypatch, max_model_len=None, **cpu)
        for o, w in zip(got, want):
            assert len(o.prompt_logprobs) == len(w.prompt_logprobs) == len(o.prompt_token_ids), name
            assert all(abs(a.logprob - b.logprob) < 1e-5 for a, b in zip(o.prompt_logprobs[1:], w.prompt_logprobs[1:]))
    # The teacher-forced test's floor runs the reference with these settings.
    fp8_dir, _ = checkpoints["qwen3-block"]
    got = _reference_outputs(fp8_dir, prompts, monkeypatch, PARAMS, **(cpu | dict(max_num_batched_tokens=512,
                                                                                  warmup=False)))
    assert [o.token_ids for o in got] == [o.token_ids for o in _engine(fp8_dir).generate(prompts, PARAMS)]


@pytest.mark.parametrize("block", [(128, 128), None], ids=["block", "channel"])
def test_the_gpu_tests_tensor_core_reference_stands_in_for_the_fp8_gemm(block):
    """The teacher-forced GPU test's floor replaces the fp8 GEMM's reference with the
    tensor cores' accumulator model (a GPU engine calls it where the CPU's dequantized
    weights never do): it takes the GEMM's arguments (x [M, K]), keeps x's dtype, adds
    the bias, and lands from exact sums of the same quantized values no further than the
    accumulator's bits allow, yet not on them."""
    from tests.gpu.test_fp8_engine import _reference_fp8_gemm
    from tests.gpu.test_fp8_real_shapes import _reference_fp8_gemm_tensor_cores

    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 512, generator=g).to(torch.bfloat16)
    w = torch.randn(384, 512, generator=g) * 0.05
    bias = torch.randn(384, generator=g).to(torch.bfloat16)
    wq, ws = F.quantize_block(w, block) if block else F.quantize_channel(w)
    exact = _reference_fp8_gemm(x, wq, bias, ws, block)
    got = _reference_fp8_gemm_tensor_cores(x, wq, bias, ws, block)
    assert got.shape == exact.shape == (6, 384) and got.dtype == torch.bfloat16
    assert not torch.equal(got, exact)
    assert ((got.float() - exact.float()).abs().max() / exact.float().abs().max()).item() < 2e-2
