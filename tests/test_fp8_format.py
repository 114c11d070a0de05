"""fp8 weights as checkpoints store them (agent_infer/quantization/fp8.py): block scales of
DeepSeek-V3 / Qwen3-FP8, compressed-tensors' per-channel scales, dynamic per-token-group
activations, the W8A8 product, and the quantization_config each checkpoint family writes."""

from __future__ import annotations

import pytest
import torch

from agent_infer.checkpoint_files import ConfigError
from agent_infer.quantization import fp8 as F

E4M3_STEP = 2.0**-3  # 3 mantissa bits: neighbours of a normal value differ by at most this, relatively
E4M3_TINY = 2.0**-6  # the smallest normal e4m3 value (in units of the scale)


def _within_e4m3(approx: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor) -> bool:
    """Round to nearest: half a step of the value, or of a subnormal, in scale units."""
    bound = torch.maximum(exact.abs() * E4M3_STEP / 2, scale * E4M3_TINY * E4M3_STEP / 2)
    return bool(((approx - exact).abs() <= bound * 1.0001).all())


@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((200, 300), (128, 128)), ((37, 50), (16, 8))])
def test_block_quantization_is_the_published_layout(shape, block):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 3  # rows of different magnitude
    q, scale = F.quantize_block(w, block)
    rows, cols = block
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (-(-shape[0] // rows), -(-shape[1] // cols))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
            qtile = q[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols].float()
            assert scale[i, j] == tile.abs().max() / 448  # absmax / e4m3's largest value
            assert qtile.abs().max() == 448  # the block's largest element lands on the top
    full = scale.repeat_interleave(rows, 0)[:shape[0]].repeat_interleave(cols, 1)[:, :shape[1]]
    back = F.dequantize_block(q, scale, block)
    assert _within_e4m3(back, w, full)
    assert F.dequantize_block(q, scale, block, torch.bfloat16).dtype == torch.bfloat16


def test_zero_block_and_bad_scale_shapes():
    w = torch.zeros(16, 32)
    w[:, 16:] = torch.randn(16, 16)
    q, scale = F.quantize_block(w, (16, 16))
    assert scale[0, 0] == 1 and (q[:, :16].float() == 0).all()
    with pytest.raises(ValueError, match=r"needs scales of shape \[1, 2\]"):
        F.dequantize_block(q, scale.t(), (16, 16))
    with pytest.raises(ValueError, match="rows"):
        F.dequantize_channel(q, torch.ones(3, 1))


def test_channel_quantization():
    torch.manual_seed(1)
    w = torch.randn(48, 70) * torch.logspace(-2, 1, 48)[:, None]
    q, scale = F.quantize_channel(w)
    assert scale.shape == (48, 1) and torch.equal(scale[:, 0], w.abs().amax(1) / 448)
    assert torch.equal(q.float().abs().amax(1), torch.full((48,), 448.0))
    assert _within_e4m3(F.dequantize_channel(q, scale), w, scale.expand_as(w))


@pytest.mark.parametrize("group", [128, 16, 1000])
def test_token_group_quantization(group):
    torch.manual_seed(2)
    x = torch.randn(7, 300) * 5
    q, scale = F.quantize_token_groups(x, group)
    assert scale.shape == (7, -(-300 // group))
    assert torch.equal(scale[:, 0], x[:, :group].abs().amax(1) / 448)
    back = q.float() * scale.repeat_interleave(group, 1)[:, :300]
    assert _within_e4m3(back, x, scale.repeat_interleave(group, 1)[:, :300])


def test_w8a8_block_matmul():
    torch.manual_seed(3)
    block = (32, 32)
    w, x = torch.randn(96, 80), torch.randn(5, 80)
    q, scale = F.quantize_block(w, block)
    dequantized = F.dequantize_block(q, scale, block)
    # Weight-only: exactly the product with the dequantized weight.
    assert torch.equal(F.w8a8_block_matmul(x, q, scale, block, quantize_activations=False), x @ dequantized.t())
    # W8A8: the activations' own quantization, written out.
    xq, xs = F.quantize_token_groups(x, 32)
    expected = (xq.float() * xs.repeat_interleave(32, 1)[:, :80]) @ dequantized.t()
    got = F.w8a8_block_matmul(x, q, scale, block)
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-5)
    exact = x @ w.t()
    assert (got - exact).norm() / exact.norm() < 0.05
    assert F.w8a8_block_matmul(x.bfloat16(), q, scale, block).dtype == torch.bfloat16


DEEPSEEK_V3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
COMPRESSED_TENSORS_FP8 = {  # llm-compressor's FP8_DYNAMIC scheme
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None,
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False,
                    "group_size": None, "block_structure": None, "observer": "minmax"},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                              "dynamic": True, "group_size": None, "observer": None}}},
}


def _tensor_core_sum(xs: list[float], ws: list[float], step: int, bits: int, promote: int | None) -> float:
    """One output of reference.fp8_mma_sums, written out in Python floats."""
    import math

    total, k = 0.0, len(xs)
    interval = promote or k
    for k0 in range(0, k, interval):
        acc = 0.0
        for s in range(k0, min(k0 + interval, k), step):
            terms = [a * b for a, b in zip(xs[s:min(s + step, k0 + interval)], ws[s:min(s + step, k0 + interval)])]
            top = max([abs(t) for t in terms] + [abs(acc)])
            unit = math.ldexp(1.0, math.frexp(top)[1] - 1 - bits)
            acc = math.trunc(acc / unit) * unit + sum(math.trunc(t / unit) * unit for t in terms)
        total = float(torch.tensor(total, dtype=torch.float32) + torch.tensor(acc, dtype=torch.float32))
    return total


@pytest.mark.parametrize("step,promote", [(16, 64), (32, None), (8, 48)])
def test_the_tensor_core_accumulator_model(step, promote):
    """reference.fp8_mma_sums against the same rule written out one output at a time (K of
    200: partial steps and intervals at the end), and the rule's own bound: with positive
    operands a cut sum never exceeds the exact one and falls short by at most one unit per
    term a step."""
    from agent_infer.kernels import reference

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 200, generator=g) * 40).to(torch.float8_e4m3fn)
    w = (torch.randn(4, 200, generator=g) * 40).to(torch.float8_e4m3fn)
    got = reference.fp8_mma_sums(x, w, step=step, bits=13, promote=promote)
    assert got.dtype == torch.float32 and got.shape == (3, 4)
    for i in range(3):
        for j in range(4):
            assert got[i, j].item() == _tensor_core_sum(x[i].tolist(), w[j].tolist(), step, 13, promote), (i, j)
    exact = x.double() @ w.double().t()
    assert (got.double() != exact).any(), "13 bits cut nothing: the model would be exact sums"
    xp, wp = x.float().abs().to(torch.float8_e4m3fn), w.float().abs().to(torch.float8_e4m3fn)
    cut, exact = reference.fp8_mma_sums(xp, wp, step=step, bits=13, promote=None).double(), xp.double() @ wp.double().t()
    assert (cut <= exact).all()
    assert ((exact - cut) / exact <= (200 / step + 1) * (step + 1) * 2.0**-13).all()


@pytest.mark.parametrize("block", [(128, 128), None])
def test_the_accumulator_model_applies_the_scales_as_the_kernels_do(block):
    """Scaled: per 128-feature interval for block weights (each promoted sum times its
    token-group and weight-block scales), once at the end per row."""
    from agent_infer.kernels import reference

    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 384, generator=g).to(torch.bfloat16)
    w = torch.randn(256, 384, generator=g) * 0.05
    wq, ws = F.quantize_block(w, block) if block else F.quantize_channel(w)
    xq, xs = F.quantize_token_groups(x, block[1] if block else 384)
    got = reference.fp8_mma_sums(xq, wq, x_scale=xs, w_scale=ws, block=block, n_chunk=100)
    raw = [reference.fp8_mma_sums(xq[:, k0:k0 + 128], wq[:, k0:k0 + 128]) for k0 in (0, 128, 256)]
    if block:
        want = torch.zeros(5, 256)
        for kb, part in enumerate(raw):
            want = want + part * (xs[:, kb, None] * ws[:, kb].repeat_interleave(128)[None, :])
    else:
        want = (raw[0] + raw[1] + raw[2]) * (xs * ws.reshape(1, -1))
    assert torch.equal(got, want)
    exact = F.w8a8_block_matmul(x, wq, ws, block).float() if block else None
    if exact is not None:
        assert ((got - exact).abs().max() / exact.abs().max()).item() < 2e-2


def test_quantization_configs_of_published_checkpoints():
    assert F.Fp8Config.from_hf(None) is None
    assert F.Fp8Config.from_hf(DEEPSEEK_V3) == F.Fp8Config("block", (128, 128))
    qwen3 = dict(DEEPSEEK_V3, modules_to_not_convert=["lm_head"])
    assert F.Fp8Config.from_hf(qwen3).ignored == ("lm_head",)
    assert F.Fp8Config.from_hf(COMPRESSED_TENSORS_FP8) == F.Fp8Config("channel", None, ("lm_head",))


def _int8_weights(config: dict) -> dict:
    group = dict(config["config_groups"]["group_0"], weights={"num_bits": 8, "type": "int", "symmetric": True,
                                                              "strategy": "channel"})
    return dict(config, config_groups={"group_0": group})


@pytest.mark.parametrize("config,words", [
    (dict(DEEPSEEK_V3, activation_scheme="static"), ["static", "dynamic only"]),
    (dict(DEEPSEEK_V3, fmt="e5m2"), ["e5m2"]),
    ({k: v for k, v in DEEPSEEK_V3.items() if k != "weight_block_size"}, ["weight_block_size", "per-tensor"]),
    ({"quant_method": "awq", "bits": 4}, ["awq"]),
    (_int8_weights(COMPRESSED_TENSORS_FP8), ["int"]),
    ("fp8", ["object"]),
], ids=["static-activations", "e5m2", "per-tensor", "awq", "int8-compressed-tensors", "not-an-object"])
def test_unsupported_schemes_are_refused_by_name(config, words):
    with pytest.raises(ConfigError) as e:
        F.Fp8Config.from_hf(config)
    for w in words:
        assert w in str(e.value)
