"""The fused-MoE kernels on CUDA at DeepSeek sizes, against the fp32 reference: V2-Lite's
routed experts (64 x [2 x 1408, 2048], top-6), V3's under EP = 8 (this rank holds 32 of
256 experts of [2 x 2048, 7168], top-8, an expert map), V2-Lite's under TP = 2 (I = 704);
bf16, fp16, fp32; T from batch-1 decode to prefill. Then the whole layer captured in a
CUDA graph and replayed with new routing, run-to-run bit identity, moe_align at prefill
sizes on both of its paths, every configuration of the TUNED table at its bucket, and the
batch-1 router (one launch) against reference.moe_route at the released models' shapes.

Run on the GPU machine: python -m pytest -q tests/gpu/test_fused_moe.py   (~2-3 min)
"""

from __future__ import annotations

import functools

import pytest
import torch

from agent_infer.kernels.triton.fused_moe_configs import TUNED, MoeConfig, Tile
from tests import moe_checks as mc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOKENS = [1, 7, 64, 256, 2048]
# name -> (global experts, top_k, D, I, this rank's experts (first, count) or None)
SHAPES = {
    "v2-lite": (64, 6, 2048, 1408, None),
    "v3-ep8": (256, 8, 7168, 2048, (96, 32)),
    "v2-lite-tp2": (64, 6, 2048, 704, None),
    "qwen3-30b-a3b": (128, 8, 2048, 768, None),
}


@functools.cache
def _weights(shape: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    experts, _, hidden, inter, local = SHAPES[shape]
    return mc.moe_weights(local[1] if local else experts, inter, hidden, dtype, DEV, seed=7)


def _check(shape: str, dtype: torch.dtype, tokens: int, **kw) -> None:
    experts, top_k, hidden, inter, local = SHAPES[shape]
    mc.check_fused_moe(DEV, dtype, tokens, experts, top_k, hidden, inter, local=local,
                       weights=_weights(shape, dtype), **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("shape", ["v2-lite", "v3-ep8"])
def test_fused_moe(shape, tokens, dtype):
    _check(shape, dtype, tokens, repeat=True)


@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_fused_moe_tp_sharded_experts(tokens):
    _check("v2-lite-tp2", torch.bfloat16, tokens)


@pytest.mark.parametrize("tokens", [1, 7, 64, 256, 2048])
@pytest.mark.parametrize("shape", ["v2-lite", "qwen3-30b-a3b"])
def test_fused_moe_fp8_experts(shape, tokens):
    """e4m3 experts with per-row scales (--quantization fp8), bf16 activations."""
    _check(shape, torch.bfloat16, tokens, fp8=True)


@pytest.mark.parametrize("tokens", [1, 7, 64, 256, 2048])
@pytest.mark.parametrize("shape", ["v3-ep8", "qwen3-30b-a3b"])
def test_fused_moe_block_fp8_experts(shape, tokens):
    """e4m3 experts with one scale per 128 x 128 block, as DeepSeek-V3's and Qwen3's FP8
    checkpoints store them, bf16 activations."""
    _check(shape, torch.bfloat16, tokens, fp8=(128, 128))


ROWS = MoeConfig(1, Tile(8, 256, 4, 2), Tile(16, 256, 4, 2))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_fused_moe_fma_rows(dtype, tokens):
    """block_m = 1 (one slot per block, no tl.dot), the GEMV-like decode candidate."""
    _check("v2-lite", dtype, tokens, config=ROWS)
    _check("v3-ep8", dtype, tokens, config=ROWS)


@pytest.mark.parametrize("one_program", [True, False])
@pytest.mark.parametrize("tokens", [256, 2048])
def test_fused_moe_both_align_paths(one_program, tokens):
    _check("v2-lite", torch.bfloat16, tokens, one_program=one_program)


@pytest.mark.parametrize(
    "family,bucket", [(f, b) for f, table in TUNED.items() for b in table], ids=lambda v: str(v).replace(" ", "")
)
def test_tuned_configs(family, bucket):
    """Each entry of the table at its own bucket size (a pasted table is checked here)."""
    e_local, inter, hidden = family
    experts, top_k = 64, 6  # V2-Lite; a family with fewer local experts is rank 0 of an EP group
    local = None if e_local == experts else (0, e_local)
    if e_local > experts:  # the shared experts joined: all local, 8 slots a token
        experts, top_k, local = e_local, top_k + e_local - experts, None
    mc.check_fused_moe(DEV, torch.bfloat16, bucket, experts, top_k, hidden, inter, local=local,
                       config=TUNED[family][bucket])


@pytest.mark.parametrize(
    "shape,tokens", [("v2-lite", 1), ("v2-lite", 64), ("v2-lite", 256), ("v3-ep8", 1), ("v3-ep8", 7), ("v3-ep8", 512)]
)
def test_fused_moe_cuda_graph_replay(shape, tokens):
    """Captured once, replayed with new x and routing; one token takes the direct
    layout, 7 (56 slots) the one-program align path, the others the three-kernel one."""
    experts, top_k, hidden, inter, local = SHAPES[shape]
    mc.check_fused_moe_graph(DEV, torch.bfloat16, tokens, experts, top_k, hidden, inter, local=local)


@pytest.mark.parametrize("tokens", [1, 256, 2048])
def test_fused_moe_deterministic(tokens):
    """Ten runs on the same inputs are bit-identical (no atomics in the sums)."""
    from agent_infer.kernels.triton.fused_moe import fused_moe

    experts, top_k, hidden, inter, _ = SHAPES["v2-lite"]
    w13, w2 = _weights("v2-lite", torch.bfloat16)
    x = mc.dev_randn(tokens, hidden, dtype=torch.bfloat16, device=DEV, seed=9)
    topw, ids = mc.make_routing(tokens, experts, top_k, DEV, seed=10)
    first = fused_moe(x, w13, w2, topw, ids)
    for _ in range(9):
        assert torch.equal(fused_moe(x, w13, w2, topw, ids), first)


@pytest.mark.parametrize("one_program", [True, False])
@pytest.mark.parametrize(
    "tokens,local,top_k,experts,first,block_m",
    [(8192, 64, 6, None, 0, 128), (8192, 64, 6, None, 0, 16), (4096, 32, 8, 256, 224, 64), (4096, 256, 8, None, 0, 128),
     (256, 64, 6, None, 0, 1), (1, 32, 8, 256, 96, 16)],
)
def test_moe_align(one_program, tokens, local, top_k, experts, first, block_m):
    mc.check_moe_align(DEV, tokens, local, top_k, block_m, num_experts=experts, first=first, one_program=one_program)


# The released routers: V2-Lite (greedy, 64 experts), V2 (group-limited, 160 in 8 groups),
# V3 (sigmoid + bias, 256 in 8 groups, renormalised, scaled 2.5); plus the odd tiny cases.
ROUTERS = [("softmax", 64, 1, 1, 6, 2048, False, 1.0), ("softmax", 160, 8, 3, 6, 5120, False, 16.0),
           ("sigmoid", 256, 8, 4, 8, 7168, True, 2.5)] + mc.ROUTER_CASES


@pytest.mark.parametrize("case", ROUTERS, ids=lambda c: f"{c[0]}-e{c[1]}-d{c[5]}")
def test_moe_route_m1(case):
    for seed in range(3):
        mc.check_moe_route(DEV, *case, seed=seed)


@pytest.mark.parametrize("case", ROUTERS, ids=lambda c: f"{c[0]}-e{c[1]}-d{c[5]}")
@pytest.mark.parametrize("tokens", [2, 37, 256])
def test_moe_route_rows(case, tokens):
    mc.check_moe_route_rows(DEV, *case, tokens=tokens, shared=2)


@pytest.mark.parametrize("case", ROUTERS[:1] + ROUTERS[2:3], ids=lambda c: f"{c[0]}-e{c[1]}")
def test_moe_route_m1_shared_columns(case):
    """V2-Lite's 2 and V3's 1 shared experts as the routing's last columns."""
    mc.check_moe_route(DEV, *case, shared=2 if case[1] == 64 else 1)
