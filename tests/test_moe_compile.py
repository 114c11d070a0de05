"""The fused-MoE kernels compiled on CPU for an H100/H200 (sm_90) with the ptxas that ships
with Triton, at every configuration the engine can pick without a measurement (the
TUNED table and the default heuristic): each must compile and keep its registers
without spilling to local memory. Specialised as a DeepSeek-V2-Lite launch is (16-byte
aligned pointers, strides and sizes), since that changes vectorisation and registers.

    python -m pytest -q -s tests/test_moe_compile.py   # -s prints registers per kernel
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from agent_infer.kernels.triton.fused_moe_configs import (
    BUCKETS, TUNED, TUNED_FP8, MoeConfig, Tile, default_config, fit_blocks, fp8_rows_config,
)
from benchmarks.tune_fused_moe import FP8_ROWS

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1" or importlib.util.find_spec("triton") is None,
    reason="needs triton's compiler (not the interpreter)",
)


def _compile(fn, args: list[tuple[str, str]], constexprs: dict, aligned: set[str], num_warps: int, num_stages: int):
    """fn compiled for sm_90: args as (name, type) in order; names in `aligned` get
    tt.divisibility 16, as a launch with such values specialises them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict(args) | {name: "constexpr" for name in constexprs}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, _) in enumerate(args) if name in aligned}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    except RuntimeError as e:  # e.g. no ptxas for this platform in the triton wheel
        if "ptxas" in str(e).lower():
            pytest.skip(f"no CUDA toolchain to compile with: {e}")
        raise


def _check_no_spills(kernel, what: str, max_stack: int = 0) -> None:
    from tests.test_kernel_compile import _registers_per_thread

    regs, stack = _registers_per_thread(kernel)
    print(f"{what}: {regs} registers/thread, {kernel.metadata.shared} B shared, {stack} B stack")
    assert kernel.asm.get("cubin"), f"{what}: ptxas produced no cubin"
    assert stack <= max_stack, f"{what}: {stack} bytes of stack (register spills)"
    assert kernel.metadata.shared <= 227 * 1024, f"{what}: {kernel.metadata.shared} B of shared memory"


def _check_fits(kernel, what: str) -> None:
    """Spills allowed (variants off the bf16 path), but the kernel must fit an SM: its
    shared memory within the 227 KiB a block may take, its registers reported."""
    from tests.test_kernel_compile import _registers_per_thread

    regs, stack = _registers_per_thread(kernel)
    print(f"{what}: {regs} registers/thread, {kernel.metadata.shared} B shared, {stack} B stack")
    assert regs > 0, f"{what}: no register count in the cubin"
    assert kernel.metadata.shared <= 227 * 1024, f"{what}: {kernel.metadata.shared} B of shared memory"


def _engine_configs() -> set[MoeConfig]:
    """Every configuration reachable without a measurement: the table, and the heuristic
    over the buckets for V2-Lite (k 6 of 64) and V3 (k 8 of 256) routing."""
    configs = {c for family in TUNED.values() for c in family.values()}
    configs |= {default_config(t, k, e) for t in BUCKETS for k, e in ((6, 64), (8, 256))}
    return configs


GEMM_TILES = sorted({(c.block_m, "up", c.up) for c in _engine_configs()} | {(c.block_m, "down", c.down)
                                                                            for c in _engine_configs()},
                    key=str)
# Not reachable by default, but the tuner's FMA-rows candidates must at least build.
ROWS_TILES = [(1, "up", Tile(8, 256, 4, 2)), (1, "down", Tile(16, 256, 4, 2)), (1, "up", Tile(4, 512, 4, 3))]


@pytest.mark.parametrize("block_m,gemm,tile", GEMM_TILES + ROWS_TILES, ids=str)
def test_moe_gemm_compiles_without_spills(block_m, gemm, tile):
    _check_gemm(block_m, gemm, tile, direct=False)


# The one-token configurations, in the direct slot layout (no alignment) they run in.
DIRECT_TILES = sorted({(c.block_m, g, t) for c in {f[1] for f in TUNED.values()} | {default_config(1, 6, 64)}
                       for g, t in (("up", c.up), ("down", c.down))}, key=str)


@pytest.mark.parametrize("block_m,gemm,tile", DIRECT_TILES, ids=str)
def test_moe_gemm_direct_layout_compiles_without_spills(block_m, gemm, tile):
    _check_gemm(block_m, gemm, tile, direct=True)


FP8_TILES = sorted(set(GEMM_TILES + ROWS_TILES) | set(DIRECT_TILES), key=str)


@pytest.mark.parametrize("block_m,gemm,tile", FP8_TILES, ids=str)
def test_moe_gemm_fp8_experts_compile_with_few_spills(block_m, gemm, tile):
    """Every tuned tile with e4m3 experts (converted to bf16 before each dot, scaled in
    the epilogue), in the layout it runs in."""
    _check_gemm(block_m, gemm, tile, direct=(block_m, gemm, tile) in DIRECT_TILES, fp8=True)


BLOCK_TILES = sorted({(b, g, fit_blocks(MoeConfig(b, t, t), (128, 128)).up, (b, g, t) in DIRECT_TILES)
                      for b, g, t in FP8_TILES}, key=str)


@pytest.mark.parametrize("block_m,gemm,tile,direct", BLOCK_TILES, ids=str)
def test_moe_gemm_block_fp8_experts_compile_with_few_spills(block_m, gemm, tile, direct):
    """The same tiles with DeepSeek-V3's 128 x 128 block scales, fitted to the blocks as
    fused_moe fits them (K steps of at most 128, FMA rows within a block of rows): each
    K step's weight tile times its columns' scales before the dot."""
    _check_gemm(block_m, gemm, tile, direct=direct, fp8=True, block=(128, 128))


# e4m3 experts at one slot a block read int32 words: the default tiles of the V2-Lite and
# Qwen3-30B-A3B shapes and TUNED_FP8's (K tails masked where the tile does not divide K)
# and the tuner's first candidates, in the direct layout of one token.
_WORD_CONFIGS = [((i, d), fp8_rows_config(i, d)) for i, d in ((1408, 2048), (768, 2048))] + [
    ((i, d), c) for (_, i, d), family in TUNED_FP8.items() for c in family.values() if c.block_m == 1]
WORD_TILES = sorted({(g, t, k % t.block_k == 0) for (i, d), c in _WORD_CONFIGS
                     for g, t, k in (("up", c.up, d), ("down", c.down, i))}
                    | {(g, t, True) for g in ("up", "down") for t in FP8_ROWS[:4]}, key=str)


@pytest.mark.parametrize("block", [None, (128, 128)], ids=["row", "block"])
@pytest.mark.parametrize("gemm,tile,even_k", WORD_TILES, ids=str)
def test_moe_gemm_fp8_word_rows_compile_without_spills(gemm, tile, even_k, block):
    """Per-row scales after the sums, or block scales on x (gemv_fp8.py)."""
    _check_gemm(1, gemm, tile, direct=True, fp8=True, even_k=even_k, block=block)


def _gemm_args(gemm: str, dtype: str = "bf16", weight: str | None = None) -> list[tuple[str, str]]:
    """The GEMM kernels' pointer and integer arguments; `weight`: the experts' dtype
    (default: the activations')."""
    weight = weight or dtype
    rows = [("slots_ptr", "*i32"), ("blocks_ptr", "*i32"), ("npad_ptr", "*i32"), ("ids_ptr", "*i32"),
            ("map_ptr", "*i32")]
    if gemm == "up":
        return [("x_ptr", f"*{dtype}"), ("w_ptr", f"*{weight}"), ("h_ptr", f"*{dtype}")] + rows + [
            ("s_ptr", "*fp32")] + [(n, "i32") for n in ("N", "K", "top_k", "num_slots", "num_experts", "num_tiles_n",
                                                        "sxm", "swe", "swn", "shm", "sse", "ssn")]
    return [("h_ptr", f"*{dtype}"), ("w_ptr", f"*{weight}"), ("y_ptr", f"*{dtype}")] + rows + [
        ("topw_ptr", "*fp32"), ("s_ptr", "*fp32")] + [(n, "i32") for n in ("N", "K", "num_slots", "num_experts",
                                                                           "num_tiles_n", "shm", "swe", "swn", "sym",
                                                                           "sse", "ssn")]


def _scale_constexprs(fp8: bool, block: tuple[int, int] | None = None) -> dict:
    """The GEMMs' scale constexprs (fused_moe._scale_args): none, per row, per block."""
    if block is not None:
        return {"SCALE": 2, "S_ROWS": block[0], "S_COLS": block[1]}
    return {"SCALE": int(fp8), "S_ROWS": 1, "S_COLS": 1}


def _check_gemm(block_m: int, gemm: str, tile: Tile, direct: bool, fp8: bool = False, even_k: bool = True,
                block: tuple[int, int] | None = None) -> None:
    from agent_infer.kernels.triton import fused_moe as moe

    common = {"HAS_MAP": False, "DIRECT": direct, "EVEN_K": even_k, "BLOCK_M": block_m, "BLOCK_N": tile.block_n,
              "BLOCK_K": tile.block_k, "PRECISION": "tf32", "PDL": True, **_scale_constexprs(fp8, block)}
    common |= {"TRIGGER": direct} if gemm == "up" else {"PRELOAD": direct}  # as fused_moe launches them under PDL
    fn = moe._moe_gate_up_kernel if gemm == "up" else moe._moe_down_kernel
    # e4m3 experts at one slot a block arrive as int32 words (fused_moe._as_words).
    args = _gemm_args(gemm, weight=("i32" if block_m == 1 else "fp8e4nv") if fp8 else None)
    # V2-Lite: N, K in {1408, 2048}, strides multiples of 16; top_k = 6 and T * k are not.
    aligned = {name for name, ty in args if ty.startswith("*")} | {"N", "K", "sxm", "swe", "swn", "shm", "sym"}
    kernel = _compile(fn, args, common, aligned, tile.num_warps, tile.num_stages)
    what = f"{gemm} block_m={block_m} {tile}{' direct' if direct else ''}{' fp8' if fp8 else ''}" \
           f"{f' blocks {block}' if block else ''}{'' if even_k else ' masked K'}"
    # fp8 experts in tensor-core tiles: the bf16 table's tiles, not yet retuned for them;
    # three GEMM-1 tiles spill a few registers converting the e4m3 tiles (up to 16 B),
    # none more. The word rows spill nothing.
    _check_no_spills(kernel, what, max_stack=16 if fp8 and block_m > 1 else 0)


@pytest.mark.parametrize("experts,slots,block_m", [(64, 6, 16), (64, 4096, 16), (64, 4096, 1), (256, 4096, 128),
                                                   (128, 4096, 16), (8, 4096, 16)])
def test_moe_align_kernels_compile_without_spills(experts, slots, block_m):
    """The align kernels at the tile sizes moe_align picks (`_align_shapes`): V2-Lite (64
    experts) at batch 1 and at its largest one-hot tiles, V3 with 256 local experts,
    Qwen3-30B-A3B's 128, Mixtral's 8. With Triton 3.6 a 128-slot chunk at 64 experts
    spilled 280 bytes a thread in the scatter kernel (what _ALIGN_MAX_CHUNK prevents)."""
    import triton

    from agent_infer.kernels.triton import fused_moe as moe

    block_e, chunk = moe._align_shapes(slots, experts)
    block_p = max(16, min(moe._ALIGN_TILE // block_e, triton.next_power_of_2(moe.num_positions(slots, experts, block_m))))
    ids = [("ids_ptr", "*i32"), ("map_ptr", "*i32")]
    kernels = {
        "one program": (moe._align_one_program_kernel, ids + [
            ("slots_ptr", "*i32"), ("blocks_ptr", "*i32"), ("npad_ptr", "*i32"), ("num_slots", "i32"),
            ("num_experts", "i32"), ("num_positions", "i32")],
            {"HAS_MAP": True, "BLOCK_M": block_m, "BLOCK_E": block_e, "CHUNK": chunk, "BLOCK_P": block_p}, 8),
        "count": (moe._align_count_kernel, ids + [("counts_ptr", "*i32"), ("num_slots", "i32"), ("num_experts", "i32")],
                  {"HAS_MAP": True, "BLOCK_E": block_e, "CHUNK": chunk}, 4),
        "offsets": (moe._align_offsets_kernel, [("counts_ptr", "*i32"), ("layout_ptr", "*i32"), ("npad_ptr", "*i32"),
                                                ("num_chunks", "i32")],
                    {"BLOCK_M": block_m, "BLOCK_E": block_e, "ROWS": 8192 // block_e}, 8),
        "scatter": (moe._align_scatter_kernel, ids + [
            ("offsets_ptr", "*i32"), ("layout_ptr", "*i32"), ("npad_ptr", "*i32"), ("slots_ptr", "*i32"),
            ("blocks_ptr", "*i32"), ("num_slots", "i32"), ("num_experts", "i32"), ("num_positions", "i32")],
            {"HAS_MAP": True, "BLOCK_M": block_m, "BLOCK_E": block_e, "CHUNK": chunk, "BLOCK_P": block_p}, 4),
    }
    for name, (fn, args, constexprs, warps) in kernels.items():
        aligned = {n for n, ty in args if ty.startswith("*")}
        kernel = _compile(fn, args, constexprs | {"PDL": True}, aligned, warps, 3)
        _check_no_spills(kernel, f"align {name} BLOCK_E={block_e} CHUNK={chunk} block_m={block_m}")


def test_moe_sum_compiles_without_spills():
    from agent_infer.kernels.triton import fused_moe as moe

    args = [("y_ptr", "*bf16"), ("ids_ptr", "*i32"), ("map_ptr", "*i32"), ("out_ptr", "*bf16"), ("N", "i32"),
            ("top_k", "i32"), ("num_experts", "i32"), ("sym", "i32"), ("som", "i32")]
    kernel = _compile(moe._moe_sum_kernel, args, {"HAS_MAP": True, "BLOCK_J": 8, "BLOCK_N": 1024, "PDL": True},
                      {"y_ptr", "ids_ptr", "map_ptr", "out_ptr", "N", "sym", "som"}, 4, 3)
    _check_no_spills(kernel, "sum over k")


@pytest.mark.parametrize("scoring,experts,groups,topk_groups,top_k,hidden,norm", [
    ("softmax", 64, 1, 1, 6, 2048, False),  # V2-Lite
    ("softmax", 128, 1, 1, 8, 2048, True),  # Qwen3-30B-A3B
    ("softmax", 128, 1, 1, 8, 4096, True),  # Qwen3-235B-A22B
    ("softmax", 160, 8, 3, 6, 5120, False),  # V2
    ("sigmoid", 256, 8, 4, 8, 7168, True),  # V3
])
def test_router_compiles_without_spills(scoring, experts, groups, topk_groups, top_k, hidden, norm):
    """The batch-1 router at the released models' shapes; with one warp a program, its
    routing reduces without a round through shared memory (two barriers order the
    logits around the counter, each compiled twice)."""
    import re

    from agent_infer.kernels.triton import router

    launch = router.m1_launch(hidden)
    args = [("x_ptr", "*bf16"), ("w_ptr", "*fp32"), ("bias_ptr", "*fp32"), ("logits_ptr", "*fp32"),
            ("weights_ptr", "*fp32"), ("ids_ptr", "*i32"), ("count_ptr", "*i32"), ("E", "i32"), ("K", "i32"),
            ("scaling", "fp32")]
    constexprs = {**router._routing_constexprs(scoring, experts, top_k, groups, topk_groups, norm, 2),
                  "BLOCK_N": launch.block_n, "BLOCK_K": launch.block_k, "PREFETCH": launch.prefetch, "PDL": True}
    kernel = _compile(router._route_m1_kernel, args, constexprs,
                      {"x_ptr", "w_ptr", "bias_ptr", "logits_ptr", "weights_ptr", "ids_ptr", "count_ptr", "K"},
                      launch.num_warps, 2)
    what = f"router {scoring} E={experts} K={hidden}"
    _check_no_spills(kernel, what)
    barriers = len(re.findall(r"\bbar(?:rier)?\.sync", kernel.asm["ptx"]))
    print(f"{what}: {launch.num_warps} warps, {barriers} barriers")
    if launch.num_warps == 1:
        assert barriers <= 4, f"{barriers} barriers in a one-warp router"


@pytest.mark.parametrize("scoring,experts,groups,topk_groups,top_k,hidden", [
    ("softmax", 64, 1, 1, 6, 2048),  # V2-Lite
    ("softmax", 160, 8, 3, 6, 5120),  # V2
    ("sigmoid", 256, 8, 4, 8, 7168),  # V3
])
def test_router_rows_compiles_without_spills(scoring, experts, groups, topk_groups, top_k, hidden):
    """The decode-batch router (a program per token) at the released models' shapes."""
    from agent_infer.kernels.triton import router

    constexprs = router._routing_constexprs(scoring, experts, top_k, groups, topk_groups, scoring == "sigmoid", 2)
    block_k = router.rows_block_k(experts, hidden)
    args = [("x_ptr", "*bf16"), ("w_ptr", "*fp32"), ("bias_ptr", "*fp32"), ("weights_ptr", "*fp32"),
            ("ids_ptr", "*i32"), ("E", "i32"), ("K", "i32"), ("sxm", "i32"), ("swm", "i32"), ("sim", "i32"),
            ("scaling", "fp32")]
    kernel = _compile(router._route_rows_kernel, args,
                      {**constexprs, "BLOCK_K": block_k, "FROM_LOGITS": False, "PDL": True},
                      {"x_ptr", "w_ptr", "bias_ptr", "weights_ptr", "ids_ptr", "K", "sxm"}, 4, 2)
    _check_no_spills(kernel, f"router rows {scoring} E={experts}")


@pytest.mark.parametrize("dtype,precision", [("fp16", "tf32"), ("fp32", "ieee")])
@pytest.mark.parametrize("block_m,even_k", [(16, False), (64, True), (1, False)])
def test_moe_variants_compile(dtype, precision, block_m, even_k):
    """fp16 / fp32 (IEEE dots) and masked K tails build too, with int64 ids (torch.topk's)
    in the sum; registers are printed, spills allowed (not the bf16 defaults)."""
    from agent_infer.kernels.triton import fused_moe as moe

    tile = Tile(32, 64, 4, 3) if block_m > 1 else Tile(8, 256, 4, 2)
    constexprs = {"HAS_MAP": True, "DIRECT": block_m == 1, "EVEN_K": even_k, "BLOCK_M": block_m,
                  "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k, "PRECISION": precision, "PDL": False,
                  **_scale_constexprs(False)}
    for fn, args, launch in ((moe._moe_gate_up_kernel, _gemm_args("up", dtype), {"TRIGGER": False}),
                             (moe._moe_down_kernel, _gemm_args("down", dtype), {"PRELOAD": block_m == 1})):
        kernel = _compile(fn, args, constexprs | launch, {n for n, ty in args if ty.startswith("*")}, tile.num_warps,
                          tile.num_stages)
        _check_fits(kernel, f"{fn.__name__} {dtype} block_m={block_m}")
    args = [("y_ptr", f"*{dtype}"), ("ids_ptr", "*i64"), ("map_ptr", "*i32"), ("out_ptr", f"*{dtype}"),
            ("N", "i32"), ("top_k", "i32"), ("num_experts", "i32"), ("sym", "i32"), ("som", "i32")]
    _check_fits(_compile(moe._moe_sum_kernel, args, {"HAS_MAP": False, "BLOCK_J": 4, "BLOCK_N": 64, "PDL": False},
                         set(), 4, 3), f"_moe_sum_kernel {dtype}")
