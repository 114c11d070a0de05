"""How the fp8 GEMMs on this GPU sum their products, against exact sums and against a
model of the tensor cores' accumulator (GPU; no checkpoint).

    python benchmarks/fp8_accumulation.py [--rows 475] [--shapes o,down]

fp8 tensor-core MMAs do not sum in fp32: each step's products are aligned to the largest
exponent among them and the accumulator, and bits below a fixed width are dropped. The
kernels therefore promote to an fp32 register every 128 features of K (the W8A8 GEMM's
scaled add per K step; torch._scaled_mm's sums match it here); what is left is the error
of those 128-feature partial sums. `reference.fp8_mma_sums` models it with three parameters:
products per aligned step, bits kept below the largest exponent, promotion interval.

Part 1 (calibration): e4m3 operands with unit scales, so each kernel's fp32 output is
its raw sum, against the model at a grid of parameters: the share of outputs bit for bit
equal, per kernel (the W8A8 GEMM in both layouts; torch._scaled_mm per tensor with and
without fast accumulation).

Part 2 (what reaches bf16): at Qwen3-8B's projection shapes with per-token activations
and per-row or 128 x 128-block weights as the engine runs them, the share of bf16
outputs that differ from the exact sum's bf16 rounding: each kernel (torch._scaled_mm
rowwise, which the engine takes for per-row weights from 128 rows on; the W8A8 GEMM
for block weights), the W8A8 GEMM with K steps of 64 (promoted twice as often), exact
sums in another order (K in halves), and the model. Where the model's share matches the
kernels', it puts as much between exact sums and itself as the hardware does, and
tests/gpu/test_fp8_real_shapes.py takes it as fp8's floor. The activations are quantized
by the reference, which gives the kernels' bits on the GPU too.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_infer.bench.table import render_table  # noqa: E402
from agent_infer.kernels import reference  # noqa: E402
from agent_infer.kernels.triton.fp8_gemm import default_config, fp8_linear, w8a8_matmul  # noqa: E402
from agent_infer.quantization import fp8 as F8  # noqa: E402

FP8 = torch.float8_e4m3fn
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def _e4m3(shape, generator, device) -> torch.Tensor:
    """Random e4m3 values spread over the format's range (quantized normals times 64)."""
    return (torch.randn(shape, generator=generator, device=device) * 64).clamp(-448, 448).to(FP8)


def calibration(device: str, m: int, n: int, k: int) -> list[tuple]:
    g = torch.Generator(device=device).manual_seed(0)
    xq, wq = _e4m3((m, k), g, device), _e4m3((n, k), g, device)
    one_m = torch.ones(m, 1, device=device)
    one_n = torch.ones(n, 1, device=device)
    blocks = torch.ones(-(-n // 128), -(-k // 128), device=device)
    unit = torch.ones((), device=device)
    kernels = {
        "W8A8 GEMM, per row": w8a8_matmul(xq, one_m, wq, one_n, None, out_dtype=torch.float32),
        "W8A8 GEMM, 128 x 128 blocks": w8a8_matmul(
            xq, torch.ones(m, -(-k // 128), device=device), wq, blocks, (128, 128), out_dtype=torch.float32),
        "torch._scaled_mm": torch._scaled_mm(xq, wq.t(), scale_a=unit, scale_b=unit, out_dtype=torch.float32),
        "torch._scaled_mm, fast accumulation": torch._scaled_mm(
            xq, wq.t(), scale_a=unit, scale_b=unit, out_dtype=torch.float32, use_fast_accum=True),
    }
    exact = (xq.double() @ wq.double().t()).float()
    models = [(step, bits, promote) for promote in (128, None) for step in (4, 8, 16, 32) for bits in (12, 13, 14, 16, 17)]
    sums = {p: reference.fp8_mma_sums(xq, wq, step=p[0], bits=p[1], promote=p[2]) for p in models}
    rows = []
    for name, out in kernels.items():
        shares = {p: (out == s).float().mean().item() for p, s in sums.items()}
        best = max(shares, key=shares.get)
        rows.append((name, f"{(out == exact).float().mean().item():.2%}",
                     f"step {best[0]}, {best[1]} bits, promote {best[2] or 'never'}", f"{shares[best]:.2%}",
                     f"{shares[(32, 13, 128)]:.2%}"))
    return rows


def _flips(out: torch.Tensor, exact_bf16: torch.Tensor) -> str:
    return f"{(out.to(torch.bfloat16) != exact_bf16).float().mean().item():.3%}"


def to_bf16(m: int, shape: str, device: str, step: int, bits: int) -> list[tuple]:
    n, k = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device=device) * 0.02).to(torch.bfloat16)
    rows = []
    for layout, block in (("per row", None), ("128 x 128 blocks", (128, 128))):
        wq, ws = F8.quantize_channel(w) if block is None else F8.quantize_block(w, block)
        group = block[1] if block else k
        xq, xs = F8.quantize_token_groups(x, group)  # the kernels' bits (tests/gpu/test_fp8_gemm.py)
        xv = F8.dequantize_token_groups(xq, xs, group).double()
        wv = reference.fp8_weight_values(wq, ws, block).double()
        exact = (xv @ wv.t()).to(torch.bfloat16)
        h = k // 2
        cand = {
            "exact sums, K in halves (fp32)": (xv[:, :h].float() @ wv[:, :h].float().t())
            + (xv[:, h:].float() @ wv[:, h:].float().t()),
            f"model: {step} a step, {bits} bits, promoted every 128": reference.fp8_mma_sums(
                xq, wq, step=step, bits=bits, promote=128, x_scale=xs, w_scale=ws, block=block),
            "fp8_linear" + (" (torch._scaled_mm rowwise)" if block is None and m >= 128 else " (W8A8 GEMM)"):
                fp8_linear(x, wq, ws, block),
            "W8A8 GEMM, K steps of 64 (promoted every 64)": w8a8_matmul(
                xq, xs, wq, ws, block, out_dtype=torch.float32,
                config=replace(default_config(m, n, k, block), block_k=64)),
        }
        if block is None:
            cand[f"model: {step} a step, {bits} bits, promoted every 64"] = reference.fp8_mma_sums(
                xq, wq, step=step, bits=bits, promote=64, x_scale=xs, w_scale=ws)
        for name, out in cand.items():
            rows.append((f"{shape} {m} x {n} x {k}", layout, name, _flips(out, exact)))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=475)
    ap.add_argument("--shapes", default="o,down")
    ap.add_argument("--step", type=int, default=32, help="the model's products per aligned step (part 2)")
    ap.add_argument("--bits", type=int, default=13, help="the model's bits below the largest exponent (part 2)")
    args = ap.parse_args()
    device = "cuda"
    print(torch.cuda.get_device_name(), flush=True)
    cal = [("kernel", "equal to exact sums", "best model", "equal to it", "equal to (32, 13, 128)")]
    cal += calibration(device, 256, 256, 4096)
    flips = [("GEMM", "weights", "sums", "bf16 outputs differing from exact's")]
    for shape in args.shapes.split(","):
        flips += to_bf16(args.rows, shape, device, args.step, args.bits)
    print(render_table(cal))
    print(render_table(flips))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
