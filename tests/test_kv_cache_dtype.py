"""--kv-cache-dtype fp8: K and V cached as float8 e4m3 (divided by the checkpoint's
per-layer scales, else by 1; saturating), read back as the model's dtype. On CPU this
runs the PyTorch reference path; the Triton kernels' fp8 paths are checked in
tests/test_triton_interpreter.py and tests/gpu/."""

from __future__ import annotations

import pytest
import torch

from agent_infer.config import ConfigError, EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.kernels import reference
from agent_infer.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea. The waves",
    "In 1969, astronauts landed on the Moon for the first time. The mission was called Apollo 11, and it was "
    "commanded by Neil Armstrong. Together with Buzz Aldrin he walked on the lunar surface while Michael Collins",
]
NEW_TOKENS = 24


def test_unknown_kv_cache_dtype_is_a_config_error(default_model_dir):
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(model=default_model_dir, kv_cache_dtype="int4")


def test_fp8_store_saturates_instead_of_overflowing():
    x = torch.tensor([1000.0, -1e6, 3.0, 0.3, -448.0, 500.0])
    out = reference.to_cache_dtype(x, torch.float8_e4m3fn)
    assert out.dtype == torch.float8_e4m3fn
    back = out.float()
    assert torch.isfinite(back).all()
    assert back.tolist() == [448.0, -448.0, 3.0, 0.3125, -448.0, 448.0]  # 0.3 rounds to 0.3125 in e4m3


def test_fp8_cache_holds_more_blocks_in_the_same_bytes(default_model_dir):
    budget = 64 << 20
    engines = {
        kind: LLMEngine(EngineConfig(model=default_model_dir, device="cpu", dtype="float32", kv_cache_dtype=kind,
                                     kv_cache_bytes=budget, warmup=False))
        for kind in ("auto", "fp8")
    }
    pools = {kind: e.runner.pool for kind, e in engines.items()}
    assert pools["auto"].dtype == torch.float32
    assert pools["fp8"].dtype == torch.float8_e4m3fn
    # fp32 -> 1 byte per value: four times the blocks, each byte budget used alike.
    assert engines["fp8"].block_manager.num_blocks == 4 * engines["auto"].block_manager.num_blocks
    assert pools["fp8"].nbytes == pools["auto"].nbytes


def test_fp8_cache_generates_close_to_the_full_precision_cache(default_model_dir, smol_engine):
    """Greedy, vLLM's closeness rule between the two caches: the tokens agree until the
    first difference, where each engine's pick is among the other's top 5 (fp8 rounding
    moves logprobs by far more than a tie, so no gap bound)."""
    fp8 = LLMEngine(EngineConfig(model=default_model_dir, device="cpu", dtype="float32", kv_cache_dtype="fp8",
                                 num_kv_blocks=512))
    prompts = [fp8.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    ours = fp8.generate(prompts, params)
    ref = smol_engine.generate(prompts, params)
    matched = []
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert len(a.token_ids) == NEW_TOKENS
        n = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), NEW_TOKENS)
        if n < NEW_TOKENS:
            x, y = a.token_ids[n], b.token_ids[n]
            assert x in dict(b.logprobs[n].top), f"prompt {i} step {n}: fp8 picked {x}, not in the fp32 cache's top 5"
            assert y in dict(a.logprobs[n].top), f"prompt {i} step {n}: fp32 picked {y}, not in the fp8 cache's top 5"
        matched.append(n)
    # Not a coin toss either: most of the greedy run agrees before any difference.
    assert sum(matched) >= NEW_TOKENS * len(PROMPTS) // 2, f"tokens matched before a difference: {matched}"


# ---- per-layer scales (compressed-tensors' kv_cache_scheme) -------------------------------

SCALE = 4096.0  # a power of two: scaling the weights by it and dividing it back out is exact


def _scaled_checkpoint(src: str, dst: str, with_scales: bool) -> None:
    """`src` with every layer's K and V made SCALE times larger (k_proj and v_proj times
    SCALE, q_proj and o_proj divided by it: the same model, K and V far past +-448), and,
    `with_scales`, the per-layer `self_attn.k_scale` / `v_scale` = SCALE a kv_cache_scheme
    stores."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    layers = set()
    for name in list(tensors):
        for proj, factor in (("k_proj", SCALE), ("v_proj", SCALE), ("q_proj", 1 / SCALE), ("o_proj", 1 / SCALE)):
            if name.endswith(f"self_attn.{proj}.weight"):
                tensors[name] = tensors[name] * factor
                layers.add(name.split(".self_attn.")[0])
    if with_scales:
        for layer in layers:
            tensors[f"{layer}.self_attn.k_scale"] = torch.tensor(SCALE)
            tensors[f"{layer}.self_attn.v_scale"] = torch.tensor([SCALE])  # one-element form too
    save_file(tensors, path)


def _tokens(path: str, kv_cache_dtype: str, prompts: list[list[int]]) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", kv_cache_dtype=kv_cache_dtype,
                                    num_kv_blocks=64, block_size=16, warmup=False))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]


def test_checkpoint_kv_scales_are_applied_by_the_fp8_cache(tmp_path):
    """A checkpoint whose K and V run 4096 times larger than its fp8 cache can hold, with
    scales that say so: the fp8 cache stores K / k_scale and V / v_scale and reads them
    back scaled, so the tokens are those of the unscaled model on the same fp8 cache
    (exactly: the scale is a power of two); without the scales the same checkpoint
    saturates its cache and decodes otherwise; a cache in the model's dtype ignores them."""
    from tests.tiny_models import write_tiny_model

    src = write_tiny_model("llama", str(tmp_path / "plain"))
    _scaled_checkpoint(src, str(tmp_path / "scaled"), with_scales=True)
    _scaled_checkpoint(src, str(tmp_path / "unscaled"), with_scales=False)
    prompts = [[(5 * i + 7) % 200 + 3 for i in range(n)] for n in (9, 23, 40)]
    plain = _tokens(src, "fp8", prompts)
    assert _tokens(str(tmp_path / "scaled"), "fp8", prompts) == plain
    assert _tokens(str(tmp_path / "unscaled"), "fp8", prompts) != plain
    assert _tokens(str(tmp_path / "scaled"), "auto", prompts) == _tokens(src, "auto", prompts)


def test_kv_scales_bind_to_an_fp8_cache_only(tmp_path):
    from tests.tiny_models import write_tiny_model

    src = write_tiny_model("llama", str(tmp_path / "plain"))
    _scaled_checkpoint(src, str(tmp_path / "scaled"), with_scales=True)
    for kind, want in (("fp8", SCALE), ("auto", 1.0)):
        engine = LLMEngine(EngineConfig(model=str(tmp_path / "scaled"), device="cpu", dtype="float32",
                                        kv_cache_dtype=kind, num_kv_blocks=16, warmup=False))
        caches = [layer.cache for layer in engine.runner.model.attention_layers]
        assert caches and all(c.k_scale == c.v_scale == want for c in caches), (kind, caches[0])


@pytest.mark.parametrize("scheme,ok", [
    ({"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}, True),
    ({"num_bits": 8, "type": "float", "strategy": "head", "symmetric": True, "dynamic": False}, False),
    ({"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": True}, False),
    ({"num_bits": 8, "type": "int", "strategy": "tensor", "symmetric": True, "dynamic": False}, False),
])
def test_kv_cache_scheme_is_read_or_refused_by_name(scheme, ok):
    from agent_infer.quantization.fp8 import Fp8Config
    from tests.test_fp8_checkpoints import COMPRESSED_TENSORS_FP8

    quant = dict(COMPRESSED_TENSORS_FP8, kv_cache_scheme=scheme)
    if ok:
        assert Fp8Config.from_hf(quant).layout == "channel"
    else:
        with pytest.raises(ConfigError, match="kv_cache_scheme"):
            Fp8Config.from_hf(quant)


def test_a_bad_kv_scale_is_named(tmp_path):
    import os

    from safetensors.torch import load_file, save_file

    from tests.tiny_models import write_tiny_model

    src = write_tiny_model("llama", str(tmp_path / "plain"))
    _scaled_checkpoint(src, str(tmp_path / "bad"), with_scales=True)
    path = os.path.join(tmp_path / "bad", "model.safetensors")
    tensors = load_file(path)
    name = next(n for n in tensors if n.endswith("self_attn.v_scale"))
    tensors[name] = torch.tensor(-1.0)
    save_file(tensors, path)
    with pytest.raises(ValueError, match=f"{name}.*positive"):
        LLMEngine(EngineConfig(model=str(tmp_path / "bad"), device="cpu", dtype="float32", kv_cache_dtype="fp8",
                               num_kv_blocks=16, warmup=False))


# ---- scales computed at start-up (--calculate-kv-scales) ------------------------------------


def _engine(path: str, kv_cache_dtype: str = "fp8", **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", kv_cache_dtype=kv_cache_dtype,
                                  num_kv_blocks=64, block_size=16, warmup=False, **kw))


def _scales(engine: LLMEngine) -> list[tuple[float, float]]:
    return [(layer.cache.k_scale, layer.cache.v_scale) for layer in engine.runner.model.attention_layers]


def test_computed_kv_scales_follow_the_checkpoints_magnitudes(tmp_path):
    """A checkpoint whose K and V run 4096 times larger than its fp8 cache can hold, and
    no scales: computed at start-up, they come out exactly 4096 times those computed for
    the unscaled model (the calibration reads what each layer stored), so both decode the
    same tokens; without them the large checkpoint saturates its cache and decodes
    otherwise."""
    from tests.tiny_models import write_tiny_model

    src = write_tiny_model("llama", str(tmp_path / "plain"))
    _scaled_checkpoint(src, str(tmp_path / "large"), with_scales=False)
    prompts = [[(5 * i + 7) % 200 + 3 for i in range(n)] for n in (9, 23, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = _engine(src, calculate_kv_scales=True)
    large = _engine(str(tmp_path / "large"), calculate_kv_scales=True)
    small_scales, large_scales = _scales(plain), _scales(large)
    assert all(k != 1.0 and v != 1.0 for k, v in small_scales)
    assert large_scales == [(k * SCALE, v * SCALE) for k, v in small_scales]
    tokens = [o.token_ids for o in large.generate(prompts, params)]
    assert tokens == [o.token_ids for o in plain.generate(prompts, params)]
    assert tokens != [o.token_ids for o in _engine(str(tmp_path / "large")).generate(prompts, params)]


def test_computed_kv_scales_put_the_calibrations_largest_values_at_200_and_100(tmp_path):
    """Each layer's scales are its largest |K| / 200 and |V| / 100 over the calibration
    prefill, as a cache in the model's dtype stores them."""
    from agent_infer.kvcache.calibration import MAX_CALIBRATION_TOKENS, calibration_ids
    from tests.tiny_models import write_tiny_model

    src = write_tiny_model("llama", str(tmp_path / "plain"))
    engine = _engine(src, calculate_kv_scales=True)
    runner, scales = engine.runner, _scales(engine)
    ids = calibration_ids(None, runner.model_config.vocab_size, MAX_CALIBRATION_TOKENS)
    amax = runner.measure_kv_amax(ids)  # the same prefill again, into a fresh throwaway cache (then none bound)
    assert amax.shape == (len(scales), 2) and bool((amax > 0).all())
    for (k_scale, v_scale), (k_max, v_max) in zip(scales, amax.tolist()):
        assert k_scale == pytest.approx(k_max / 200, rel=1e-6) and v_scale == pytest.approx(v_max / 100, rel=1e-6)


def test_checkpoint_kv_scales_win_over_computed_ones(tmp_path):
    from tests.tiny_models import write_tiny_model

    src = write_tiny_model("llama", str(tmp_path / "plain"))
    _scaled_checkpoint(src, str(tmp_path / "scaled"), with_scales=True)
    assert set(_scales(_engine(str(tmp_path / "scaled"), calculate_kv_scales=True))) == {(SCALE, SCALE)}


def test_computed_kv_scales_on_the_default_model_keep_its_answer(default_model_dir):
    """The calibration text through the model's own tokenizer: every layer scaled, and
    the demo question answered as with the full-precision cache."""
    from agent_infer.llm import LLM

    llm = LLM(default_model_dir, device="cpu", dtype="float32", num_kv_blocks=256, kv_cache_dtype="fp8",
              calculate_kv_scales=True)
    try:
        scales = [(layer.cache.k_scale, layer.cache.v_scale) for layer in llm.engine.runner.model.attention_layers]
        assert all(k != 1.0 and v != 1.0 for k, v in scales)
        answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                          SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0].text
        assert "Paris" in answer
    finally:
        llm.shutdown()


def test_computed_kv_scales_need_an_fp8_cache_and_scalable_attention(tmp_path, default_model_dir):
    from tests.tiny_models import write_tiny_model

    with pytest.raises(ConfigError, match="calculate_kv_scales.*fp8"):
        EngineConfig(model=default_model_dir, calculate_kv_scales=True)
    src = write_tiny_model("llama", str(tmp_path / "plain"))
    with pytest.raises(ConfigError, match="calculate-kv-scales.*transformers.*no KV-cache scales"):
        _engine(src, calculate_kv_scales=True, model_impl="transformers")


def test_a_tokenizer_that_is_not_the_models_is_refused_for_calibration():
    from agent_infer.kvcache.calibration import calibration_ids

    class Tokenizer:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [3, 900, 7]}

    assert calibration_ids(Tokenizer(), 1000, 512) == [3, 900, 7]
    with pytest.raises(ConfigError, match="token id 900 for a model of 500 tokens"):
        calibration_ids(Tokenizer(), 500, 512)
    assert calibration_ids(None, 500, 40) == calibration_ids(None, 500, 40) and len(calibration_ids(None, 500, 40)) == 40
