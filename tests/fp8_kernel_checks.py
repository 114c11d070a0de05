"""Checks of the fp8 W8A8 kernels (agent_infer/kernels/triton/fp8_gemm.py) against the
references in agent_infer/quantization/fp8.py, shared by tests/test_triton_interpreter.py
(CPU tensors through Triton's interpreter, tiny shapes) and tests/gpu/test_fp8_gemm.py
(CUDA, Qwen3-8B shapes).

Activation quantization must be bit-identical to the reference. The reference runs on
CPU here; on a GPU it gives the same bits (`check_reference_quantizer_on_device`: its
scales divide by a tensor, which CUDA rounds correctly, where division by the Python
float 448 was a multiplication by its fp32 reciprocal), so a reference run on the GPU,
as the GPU tests' engine references are, quantizes as the kernels do.

The GEMM is checked with operands quantized by the reference, so it is tested apart
from the quantization; both sides multiply the same fp8 values and scales in fp32 (the
reference on the same device, with torch's fp32 matmul), and differ only in summation
order (and, on Hopper, the tensor cores' fp8 accumulation).
"""

from __future__ import annotations

import functools

import torch

from agent_infer.quantization import fp8 as ref_fp8
from tests.kernel_checks import TOLERANCE, _gen, poisoned_empty, rel_err, same

FP8 = torch.float8_e4m3fn


def _activations(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of very different magnitudes, every seventh column much smaller than the rest
    (values in e4m3's subnormal range after scaling), an all-zero row (scale 1) holding
    negative zeros, and a run of zeros inside the first row."""
    g = _gen(seed)
    x = torch.randn(m, k, generator=g) * 10.0 ** torch.empty(m, 1).uniform_(-3, 3, generator=g)
    x[:, 1::7] *= 1e-3
    if m > 1:
        x[1] = 0.0
        x[1, ::3] = -0.0
    if k > 8:
        x[0, 3:9] = 0.0
        x[0, 4] = -0.0
    return x.to(dtype)


def _e4m3_rounding_cases() -> torch.Tensor:
    """fp32 values that probe every rounding decision: each finite e4m3 value, each midpoint
    between neighbours (a tie), one fp32 ulp either side of it, and values around and below
    the smallest subnormal (2^-9), with both signs."""
    exact = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # 0 .. 448
    mid = (exact[:-1] + exact[1:]) / 2
    tiny = torch.tensor([2.0**-10, 2.0**-11, 3 * 2.0**-11, 1e-30, 1e-40, 2.0**-6, 2.0**-7 * 1.5])
    probes = torch.cat([mid, tiny])
    up, down = torch.full_like(probes, float("inf")), torch.full_like(probes, -float("inf"))
    vals = torch.cat([exact, probes, torch.nextafter(probes, up), torch.nextafter(probes, down)])
    return torch.cat([vals, -vals])


def check_quantize_token_groups(device, dtype: torch.dtype, m: int, k: int, group: int, seed: int = 0) -> None:
    """x_fp8 and x_scale bit for bit as the reference's, for random rows of mixed magnitudes."""
    from agent_infer.kernels.triton.fp8_gemm import quantize_token_groups

    x = _activations(m, k, dtype, seed)
    ref_q, ref_s = ref_fp8.quantize_token_groups(x, group)
    with poisoned_empty():
        q, s = quantize_token_groups(x.to(device), group)
    assert q.dtype == FP8 and q.shape == (m, k), (q.dtype, tuple(q.shape))
    assert s.dtype == torch.float32 and s.shape == ref_s.shape, (s.dtype, tuple(s.shape), tuple(ref_s.shape))
    assert same(s.cpu(), ref_s), f"scales differ in {(s.cpu() != ref_s).sum().item()} of {ref_s.numel()}"
    bad = (q.cpu().view(torch.uint8) != ref_q.view(torch.uint8)).nonzero()
    assert bad.numel() == 0, f"{len(bad)} fp8 values differ, first at {bad[0].tolist()}"


def check_reference_quantizer_on_device(device, m: int, k: int, seed: int = 0) -> None:
    """The reference quantizers (activations per token and per 128-feature group, weights
    per row and per 128 x 128 block) give on `device` the bits they give on the CPU."""
    x = _activations(m, k, torch.bfloat16, seed)
    cases = {f"activations, groups of {g}": lambda t, g=g: ref_fp8.quantize_token_groups(t, g) for g in (128, k)}
    cases["weights, per row"] = ref_fp8.quantize_channel
    cases["weights, 128 x 128 blocks"] = lambda t: ref_fp8.quantize_block(t, (128, 128))
    for name, quantize in cases.items():
        ref_q, ref_s = quantize(x)
        q, s = quantize(x.to(device))
        assert same(s.cpu(), ref_s), f"{name}: scales differ in {(s.cpu() != ref_s).sum().item()} of {ref_s.numel()}"
        bad = (q.cpu().view(torch.uint8) != ref_q.view(torch.uint8)).sum().item()
        assert bad == 0, f"{name}: {bad} fp8 values differ"


def check_e4m3_rounding(device, group: int = 32) -> None:
    """Groups whose amax is 448 (scale exactly 1) holding the rounding cases: the
    kernel's fp8 rounding against torch's conversion, value by value."""
    from agent_infer.kernels.triton.fp8_gemm import quantize_token_groups

    cases = _e4m3_rounding_cases()
    per_group = group - 1
    cases = torch.cat([cases, torch.zeros(-len(cases) % (4 * per_group))]).view(-1, per_group)
    x = torch.cat([torch.full((len(cases), 1), 448.0), cases], dim=1).reshape(-1, 4 * group)  # 4 groups a row
    ref_q, ref_s = ref_fp8.quantize_token_groups(x, group)
    assert (ref_s == 1).all()
    q, s = quantize_token_groups(x.to(device), group)
    assert same(s.cpu(), ref_s)
    q = q.cpu()
    bad = (q.view(torch.uint8) != ref_q.view(torch.uint8)).nonzero()
    if bad.numel():
        r, c = bad[0].tolist()
        raise AssertionError(f"{len(bad)} values round differently, e.g. {x[r, c].item()!r}: kernel "
                             f"{q[r, c].float().item()!r}, torch {ref_q[r, c].float().item()!r}")


@functools.lru_cache(maxsize=2)
def _weights(n: int, k: int, block: tuple[int, int] | None, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_fp8, w_scale) on CPU, quantized by the reference; kept for the next case of the same shape."""
    g = _gen(seed)
    w = torch.randn(n, k, generator=g) * k**-0.5
    w *= 1 + 3 * torch.rand(n, 1, generator=g)  # rows (and so blocks) of different ranges
    return ref_fp8.quantize_block(w, block) if block is not None else ref_fp8.quantize_channel(w)


def _report(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    """Both the norm-wise relative error and max |out - ref| / max |ref| within tol."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{what}: non-finite values (an unwritten element?)"
    err = rel_err(out, ref)
    worst = ((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()
    assert err <= tol and worst <= tol, f"{what}: relative error {err:.3g} (max-abs {worst:.3g}) > {tol:g}"


def check_w8a8_matmul(
    device, m: int, n: int, k: int, block: tuple[int, int] | None, bias: bool, out_dtype: torch.dtype,
    config=None, tol: float | None = None, seed: int = 0,
) -> None:
    """w8a8_matmul on reference-quantized operands against the fp32 product of their
    dequantized values: w8a8_block_matmul (no activation quantization) for the block
    layout, a plain fp32 matmul for the channel layout."""
    from agent_infer.kernels.triton.fp8_gemm import w8a8_matmul

    group = block[1] if block is not None else k
    x_fp8, x_scale = ref_fp8.quantize_token_groups(_activations(m, k, torch.float32, seed), group)
    w_fp8, w_scale = _weights(n, k, block, seed + 1)
    x_fp8, x_scale, w_fp8, w_scale = (t.to(device) for t in (x_fp8, x_scale, w_fp8, w_scale))
    b = torch.randn(n, generator=_gen(seed + 2)).to(device=device, dtype=out_dtype) if bias else None
    # The reference product in fp32 on the same device (torch's fp32 matmul: no TF32 by default).
    assert not torch.backends.cuda.matmul.allow_tf32
    x_deq = ref_fp8.dequantize_token_groups(x_fp8, x_scale, group)
    if block is not None:
        ref = ref_fp8.w8a8_block_matmul(x_deq, w_fp8, w_scale, block, quantize_activations=False)
    else:
        ref = x_deq @ (w_fp8.float() * w_scale).t()
    if b is not None:
        ref = ref + b.float()  # the kernel adds the bias as out_dtype holds it
    with poisoned_empty():
        out = w8a8_matmul(x_fp8, x_scale, w_fp8, w_scale, block, b, out_dtype, config=config)
    assert out.dtype == out_dtype, out.dtype
    _report(out.float(), ref, tol if tol is not None else TOLERANCE[out_dtype],
            f"w8a8_matmul M={m} N={n} K={k} block={block} bias={bias} {out_dtype} {config}")


def check_fp8_linear(
    device, dtype: torch.dtype, m: int, n: int, k: int, block: tuple[int, int] | None, bias: bool,
    config=None, tol: float | None = None, seed: int = 0,
) -> None:
    """fp8_linear end to end (activation quantization + GEMM) against
    w8a8_block_matmul(..., quantize_activations=True) for the block layout, and the
    reference per-token quantization + fp32 matmul for the channel layout."""
    from agent_infer.kernels.triton.fp8_gemm import fp8_linear

    x = _activations(m, k, dtype, seed)
    w_fp8, w_scale = _weights(n, k, block, seed + 1)
    b = torch.randn(n, generator=_gen(seed + 2)).to(dtype) if bias else None
    if block is not None:
        ref = ref_fp8.w8a8_block_matmul(x.float(), w_fp8, w_scale, block, quantize_activations=True)
    else:
        x_fp8, x_scale = ref_fp8.quantize_token_groups(x, k)
        ref = (x_fp8.float() * x_scale) @ (w_fp8.float() * w_scale).t()
    if b is not None:
        ref = ref + b.float()
    with poisoned_empty():
        out = fp8_linear(x.to(device), w_fp8.to(device), w_scale.to(device), block,
                         None if b is None else b.to(device), config=config)
    assert out.dtype == dtype and out.shape == (m, n), (out.dtype, tuple(out.shape))
    _report(out.float().cpu(), ref, tol if tol is not None else TOLERANCE[dtype],
            f"fp8_linear {dtype} M={m} N={n} K={k} block={block} bias={bias} {config}")


# ---- the interpreter's cases (tests/test_triton_interpreter.py) ------------------------
# Tiny odd shapes: K tails inside a scale group (72 = 2 x 32 + 8), N tails inside a tile
# (40 over 16-wide tiles), M below one tile, row tiles ordered in groups of two (M = 37),
# K steps half a scale block (block_k 32 in bk 64), K split over programs, a per-token
# group wider than the quantizer's tile (9000 > 4096: read in chunks).


def _interpreter_cases() -> list[tuple[str, object, tuple]]:
    from agent_infer.kernels.triton.fp8_gemm import Fp8GemmConfig as C

    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    tol = 1e-6  # fp32 outputs: the same fp8 values and scales, summed in another order
    cases: list[tuple[str, object, tuple]] = [("e4m3-rounding", check_e4m3_rounding, ())]
    for dtype in (f32, bf16, f16):
        for m, k, group in ((5, 72, 32), (3, 200, 16), (1, 7, 128), (4, 100, 1000), (2, 9000, 9000)):
            name = f"quant-{str(dtype)[6:]}-m{m}-k{k}-g{group}"
            cases.append((name, check_quantize_token_groups, (dtype, m, k, group)))
    gemm = [
        # M, N, K, block, bias, out dtype, config, tol
        (3, 40, 72, (16, 32), False, f32, None, tol),
        (1, 40, 72, (16, 32), True, f32, None, tol),
        (37, 40, 72, (16, 32), True, f32, C(16, 16, 32, group_m=2, split_k=2), tol),
        (37, 40, 72, (32, 64), False, f32, C(32, 16, 32, group_m=1), tol),
        (3, 40, 72, (16, 32), True, bf16, None, None),
        (5, 40, 72, None, True, f32, None, tol),
        (37, 40, 72, None, False, f32, C(16, 32, 32, group_m=2, split_k=3), tol),
        (3, 40, 72, None, False, bf16, None, None),
    ]
    for m, n, k, block, bias, out, cfg, t in gemm:
        layout = "block" if block else "channel"
        name = f"gemm-m{m}-n{n}-k{k}-{layout}-b{int(bias)}-{str(out)[6:]}" + ("-cfg" if cfg else "")
        cases.append((name, check_w8a8_matmul, (m, n, k, block, bias, out, cfg, t)))
    for dtype in (f32, bf16):
        for block in ((16, 32), None):
            cases.append((f"linear-{str(dtype)[6:]}-{'block' if block else 'channel'}", check_fp8_linear,
                          (dtype, 5, 40, 72, block, True, None, tol if dtype == f32 else None)))
    return cases


INTERPRETER_CASES = _interpreter_cases()
