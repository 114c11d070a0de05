"""The fp8 W8A8 kernels (agent_infer/kernels/triton/fp8_gemm.py) on CUDA at Qwen3-8B's
linear shapes, against the references of agent_infer/quantization/fp8.py
(tests/fp8_kernel_checks.py); and fp8_linear captured in a CUDA graph and replayed.

The activation quantization must match the reference bit for bit, and the reference
gives the same bits on the GPU as on the CPU (tests/fp8_kernel_checks.py). The GEMM's
bound is relative to the largest output: on Hopper the tensor cores accumulate fp8
products with fewer bits than fp32 within each BLOCK_K step, and a bf16 output rounds
to 2^-8.

Run on the GPU machine: python -m pytest -q tests/gpu/test_fp8_gemm.py
"""

from __future__ import annotations

import pytest
import torch

from tests import fp8_kernel_checks as fc
from tests import kernel_checks as kc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"
# Qwen3-8B: (N, K) of qkv, o, gate_up, down.
SHAPES = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))
ROWS = (1, 16, 64, 256, 2048)
BLOCK = (128, 128)
# max |out - ref| / max |ref| (and the same bound on the norm-wise error).
BOUND = {torch.bfloat16: 1e-2, torch.float32: 2e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 7, 256, 8192])
@pytest.mark.parametrize("group", [128, 4096])
def test_quantize_token_groups_bit_exact(dtype, m, group):
    fc.check_quantize_token_groups(DEV, dtype, m, 4096, group)


@pytest.mark.parametrize("m,k,group", [(33, 12288, 12288), (5, 4000, 128), (3, 200, 16)])
def test_quantize_token_groups_odd_shapes(m, k, group):
    """Per token over a row wider than one tile (read in chunks), partial last groups."""
    fc.check_quantize_token_groups(DEV, torch.bfloat16, m, k, group)


@pytest.mark.parametrize("m,k", [(475, 4096), (33, 12288)])
def test_the_reference_quantizes_on_the_gpu_as_on_the_cpu(m, k):
    fc.check_reference_quantizer_on_device(DEV, m, k)


def test_e4m3_rounding():
    fc.check_e4m3_rounding(DEV)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"n{s[0]}-k{s[1]}")
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("block", [BLOCK, None], ids=["block", "channel"])
def test_w8a8_matmul(shape, m, block):
    n, k = shape
    fc.check_w8a8_matmul(DEV, m, n, k, block, False, torch.bfloat16, tol=BOUND[torch.bfloat16])


@pytest.mark.parametrize("block", [BLOCK, None], ids=["block", "channel"])
@pytest.mark.parametrize("m", [1, 64, 2048])
def test_w8a8_matmul_fp32_out_and_bias(block, m):
    fc.check_w8a8_matmul(DEV, m, 6144, 4096, block, True, torch.float32, tol=BOUND[torch.float32])


@pytest.mark.parametrize("block", [BLOCK, None], ids=["block", "channel"])
@pytest.mark.parametrize("m,n,k", [(3, 40, 72), (77, 1000, 1100), (300, 4096, 4000)])
def test_w8a8_matmul_odd_shapes(block, m, n, k):
    if block is not None and k == 72:
        block = (16, 32)
    fc.check_w8a8_matmul(DEV, m, n, k, block, True, torch.bfloat16, tol=BOUND[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [BLOCK, None], ids=["block", "channel"])
@pytest.mark.parametrize("m", [1, 37, 256, 1024])  # per-channel from 128 rows on: torch._scaled_mm
def test_fp8_linear(dtype, block, m):
    fc.check_fp8_linear(DEV, dtype, m, 4096, 4096, block, m in (37, 256), tol=BOUND[torch.bfloat16])


@pytest.mark.parametrize("block", [BLOCK, None], ids=["block", "channel"])
@pytest.mark.parametrize("m", [1, 64, 512])
def test_every_config_of_the_sweep(block, m):
    """The tiles benchmarks/fp8_gemm.py --sweep tries compile and compute the same product."""
    from benchmarks.fp8_gemm import sweep_configs

    for cfg in sweep_configs(m, 6144, 4096, block):
        fc.check_w8a8_matmul(DEV, m, 6144, 4096, block, False, torch.bfloat16, config=cfg, tol=BOUND[torch.bfloat16])


@pytest.mark.parametrize("m", [8, 256])
@pytest.mark.parametrize("block", [BLOCK, None], ids=["block", "channel"])
def test_fp8_linear_in_a_cuda_graph(block, m):
    """Quantization and GEMM (K split for few rows: a second kernel) captured once and
    replayed with new activations give what an eager call gives."""
    from agent_infer.kernels.triton.fp8_gemm import fp8_linear
    from agent_infer.quantization import fp8 as ref_fp8

    n, k = 4096, 4096
    w = kc.randn(n, k, dtype=torch.float32, device="cpu", seed=1, scale=k**-0.5)
    w_fp8, w_scale = ref_fp8.quantize_block(w, block) if block is not None else ref_fp8.quantize_channel(w)
    w_fp8, w_scale = w_fp8.to(DEV), w_scale.to(DEV)
    x = kc.randn(m, k, dtype=torch.bfloat16, device=DEV, seed=2)
    graph, out = kc.capture_graph(lambda: fp8_linear(x, w_fp8, w_scale, block))
    for seed in (3, 4):
        x.copy_(kc.randn(m, k, dtype=torch.bfloat16, device=DEV, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert kc.same(out, fp8_linear(x, w_fp8, w_scale, block)), "replay differs from an eager call"
