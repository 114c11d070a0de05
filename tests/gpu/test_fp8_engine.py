"""fp8 weights on the GPU, through the engine, under vLLM's closeness rule (identical until
the first difference, where each pick is in the other's top 5), with CUDA graphs and
eagerly:
- a block-fp8 and a per-channel checkpoint of a tiny Qwen3, and a block-fp8 tiny
  DeepSeek-V3 (its routed and shared experts e4m3 with block scales in the fused MoE),
  against the reference arithmetic: the dequantized weights in fp32 with the same
  activation quantization (per token and group for the W8A8 GEMM of several rows; none
  for the batch-1 GEMV, which reads x as it is, nor for the experts);
- the default model quantized on load (`quantization="fp8"`) against its bf16 self.
The mean absolute logprob difference of the greedy tokens against the full-precision
weights is printed (run with -s)."""

from __future__ import annotations

import random

import pytest
import torch

from agent_infer.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.kernels import ops, reference
from agent_infer.quantization import fp8 as F8
from agent_infer.sampling_params import SamplingParams
from tests.gpu.test_engine_gpu import SMOL_PROMPTS, check_logprobs_close, default_model_gpu  # noqa: F401 (fixture)
from tests.hf_reference import HFResult
from tests.tiny_models import write_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NEW = 32
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=5)


def _engine(path: str, eager: bool = False, **kw) -> LLMEngine:
    """A GPU engine in bf16; `kw` adds to or replaces its settings (the CPU suite runs the
    reference arithmetic on a CPU engine: tests/test_fp8_checkpoints.py)."""
    settings = dict(device="cuda", dtype="bfloat16", kv_cache_bytes=1 << 30, max_num_seqs=16) | kw
    return LLMEngine(EngineConfig(model=path, enforce_eager=eager, **settings))


def _compare(ours, ref, name: str) -> float:
    """ours against ref under the closeness rule; returns the mean |logprob difference| of
    the tokens both picked before any difference."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        r = HFResult(tokens=b.token_ids, top=[dict(t.top) for t in b.logprobs])
        check_logprobs_close(a.token_ids, [dict(t.top) for t in a.logprobs], r, f"{name}[{i}]")
    return _mean_diff(ours, ref)


@pytest.fixture(scope="module")
def tiny_pairs(tmp_path_factory):
    from tests import test_fp8_checkpoints as T

    root = tmp_path_factory.mktemp("fp8gpu")
    src = write_tiny_model("qwen3", str(root / "src"))
    saved, T.BLOCK = T.BLOCK, (16, 32)  # fp8 tl.dot takes K tiles of 32 or more
    try:
        pairs = {}
        sources = {"block": src, "channel": src, "deepseek-v3-block": T._deepseek_v3(str(root / "v3"))}
        for name, source in sources.items():
            pairs[name] = (str(root / f"{name}-fp8"), str(root / f"{name}-ref"))
            T._quantized_pair(source, *pairs[name], name.rsplit("-", 1)[-1])
        return pairs
    finally:
        T.BLOCK = saved


def _reference_fp8_gemm(x, weight, bias, scale, block):
    """The fp8 GEMM's arithmetic in fp32: activations quantized as the kernel does (per
    token and group of block[1] features, per token without a block), dequantized
    weights, fp32 products."""
    k = x.shape[-1]
    group = block[1] if block is not None else k
    xf = F8.dequantize_token_groups(*F8.quantize_token_groups(x.reshape(-1, k).float(), group), group)
    return reference.fp8_linear(xf, weight, scale, block, None if bias is None else bias.float()).to(x.dtype)


def _reference_outputs(path: str, prompts, monkeypatch, params: SamplingParams = PARAMS, **kw):
    """Greedy outputs of the fp8 checkpoint (or bf16 one quantized on load: `kw`) through
    the reference arithmetic: batch-1 projections read x unquantized (as the GEMV does),
    others quantize it; e4m3 experts multiply x as it is (the fused MoE's reference)."""
    def fp8_gemm(x, weight, bias, scale, block):
        return _reference_fp8_gemm(x, weight, bias, scale, block)

    # The stand-ins pass on whatever else ops' functions take (row invariance, ...).
    def m1_linear(x, weight, bias=None, scale=None, block=None, *rest, **kw):
        if scale is None or x.shape[0] != 1:
            return original_linear(x, weight, bias, scale, block, *rest, **kw)
        return reference.fp8_linear(x.float(), weight, scale, block, None if bias is None else bias.float()).to(x.dtype)

    def fused_moe(x, w13, w2, topk_weights, topk_ids, expert_map=None, out=None, w13_scale=None, w2_scale=None,
                  block=None):
        y = reference.fused_moe(x, w13, w2, topk_weights, topk_ids, expert_map, w13_scale, w2_scale, block)
        return y if out is None else out.copy_(y)

    original_linear = ops.linear
    with monkeypatch.context() as m:
        m.setattr(ops, "_gemv_ok", lambda *args, **kwargs: False)
        m.setattr(ops, "_fp8_gemm", fp8_gemm)
        m.setattr(ops, "linear", m1_linear)
        m.setattr(ops, "fused_moe", fused_moe)
        engine = _engine(path, eager=True, **kw)
        try:
            return engine.generate(prompts, params)
        finally:
            engine.shutdown()


@pytest.mark.parametrize("layout", ["block", "channel", "deepseek-v3-block"])
def test_fp8_checkpoint_close_to_the_reference_arithmetic(tiny_pairs, layout, monkeypatch):
    from agent_infer.layers.moe import RoutedExperts

    fp8_dir, ref_dir = tiny_pairs[layout]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (3, 17, 40, 90)]
    reference_outs = _reference_outputs(fp8_dir, prompts, monkeypatch)
    engine = _engine(fp8_dir)
    experts = [m for m in engine.runner.model.modules() if isinstance(m, RoutedExperts)]
    if experts:  # the fused MoE runs them as stored
        assert all(e.w13.dtype == torch.float8_e4m3fn and e.block == (16, 32) for e in experts)
    else:
        assert engine.runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    graphs = engine.generate(prompts, PARAMS)
    eager = _engine(fp8_dir, eager=True).generate(prompts, PARAMS)
    err = _compare(graphs, reference_outs, layout)
    _compare(eager, reference_outs, layout + " eager")
    assert [o.token_ids for o in graphs] == [o.token_ids for o in eager]
    full = _engine(ref_dir).generate(prompts, PARAMS)
    print(f"{layout}: mean |logprob diff| against the reference arithmetic {err:.4f}, against the "
          f"dequantized weights in bf16 (activations unquantized) {_mean_diff(graphs, full):.4f}")


def _mean_diff(ours, ref) -> float:
    """Mean |logprob difference| of the greedy tokens up to each prompt's first difference."""
    diffs = []
    for a, b in zip(ours, ref):
        for x, y, lx, ly in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            if x != y:
                break
            diffs.append(abs(lx.logprob - ly.logprob))
    return sum(diffs) / max(1, len(diffs))


def test_default_model_quantized_on_load_close_to_bf16(default_model_gpu):
    full = _engine(default_model_gpu)
    prompts = [full.tokenizer.encode(p) for p in SMOL_PROMPTS]
    ref = full.generate(prompts, PARAMS)
    fp8 = _engine(default_model_gpu, quantization="fp8")
    assert fp8.runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    print(f"default model: mean |logprob diff| fp8 against bf16 {_compare(fp8.generate(prompts, PARAMS), ref, 'smol'):.4f}")


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_computed_kv_scales_follow_the_checkpoints_magnitudes_on_the_gpu(tmp_path, eager):
    """--calculate-kv-scales through the Triton kernels (bf16, an fp8 cache): a checkpoint
    whose K and V run 4,096 times larger gets exactly 4,096 times the scales (bf16 GEMMs
    scale exactly by a power of two) and decodes the same tokens as the unscaled one."""
    from tests.test_kv_cache_dtype import SCALE, _scaled_checkpoint

    src = write_tiny_model("llama", str(tmp_path / "plain"))
    _scaled_checkpoint(src, str(tmp_path / "large"), with_scales=False)
    prompts = [[(5 * i + 7) % 200 + 3 for i in range(n)] for n in (9, 23, 40)]
    runs = {}
    for name, path in (("plain", src), ("large", str(tmp_path / "large"))):
        engine = _engine(path, eager, kv_cache_dtype="fp8", calculate_kv_scales=True)
        scales = [(layer.cache.k_scale, layer.cache.v_scale) for layer in engine.runner.model.attention_layers]
        runs[name] = scales, [o.token_ids for o in engine.generate(prompts, PARAMS)]
        engine.shutdown()
    assert all(k != 1.0 and v != 1.0 for k, v in runs["plain"][0])
    assert runs["large"][0] == [(k * SCALE, v * SCALE) for k, v in runs["plain"][0]]
    assert runs["large"][1] == runs["plain"][1]
