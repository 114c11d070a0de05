"""The DeepSeek MLA kernels compiled on CPU for an H100/H200 (sm_90) with the ptxas that
ships with Triton, at V2-Lite's widths (L 512, R 64, Dn 128, Dv 128) and the tiles the
launchers pick: compile errors show here instead of on the GPU machine, and the register
count and shared memory show how many programs an SM holds (what
`mla_decode.RESIDENT_PER_SM`, and so the split count, assumes), with no spills.

Measured with Triton 3.9 (registers per thread / shared bytes):
  decode bf16, 16 heads x 32 keys, 4 warps, 5 stages: 184 direct, 191 writing partials,
      185 merging in the launch / 92 KB -> 2 programs per SM (a 128-column merge step
      made it 255: the merge loads 64 columns at a time)
  decode fp32, 16 x 16 keys, 8 warps: 112 direct, 115 writing partials, 102 merging /
      75 KB -> 2 per SM (at 4 warps, the latent in two halves spilled 64-80 bytes)
  combine: 79 / 2 KB
  prefill bf16, 64 queries x 64 keys, 4 warps, 2 stages: 236 / 104 KB, wgmma -> 2 per SM
  prefill fp32, 32 x 32, 8 warps, 1 stage: 200 / 64 KB (64 x 32 at 4 warps spilled 7 KB)
  rope + store, 2 warps: 40 / 1 KB
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1" or importlib.util.find_spec("triton") is None,
    reason="needs triton's compiler (not the interpreter)",
)

SMEM_PER_SM = 227 * 1024
REGS_PER_SM = 65536


def _compile(fn, names: list[str], types: list[str], constexprs: dict, aligned: list[str], num_warps: int,
             num_stages: int):
    """Compile for sm_90 as a launch specialises it: the named arguments 16-byte aligned
    (pointers from the caching allocator, strides of 576- or 192-wide rows)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict(zip(names, types)) | {name: "constexpr" for name in constexprs}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    except RuntimeError as e:
        if "ptxas" in str(e).lower():
            pytest.skip(f"no CUDA toolchain to compile with: {e}")
        raise


def _resident(kernel, num_warps: int) -> int:
    """Programs per SM the kernel's registers and shared memory allow; asserts no spills."""
    from tests.test_kernel_compile import _registers_per_thread

    regs, stack = _registers_per_thread(kernel)
    assert stack == 0, f"{stack} bytes of stack per thread (register spills), {regs} registers"
    by_regs = REGS_PER_SM // (regs * 32 * num_warps)
    by_smem = SMEM_PER_SM // max(1, kernel.metadata.shared)
    return min(by_regs, by_smem)


DECODE_NAMES = ["q_ptr", "out_ptr", "kv_ptr", "table_ptr", "ctx_ptr", "part_o_ptr", "part_lse_ptr", "counter_ptr",
                "sqb", "sqh", "sob", "soh", "kv_b", "kv_s", "s_table",
                "num_heads", "num_head_blocks", "num_splits", "qk_scale", "v_scale"]


def _compile_decode(dtype: str, cache: str, variant: str, config=None, block_size: int = 16):
    """The decode kernel at V2-Lite's widths (16 heads, L 512, R 64, rows packed, blocks of
    `block_size` tokens) as a launch specialises it: `variant` "direct", "partials" or
    "merge", `config` the tiles (default: `default_config` for the dtypes). Returns
    (kernel, config)."""
    import torch

    from agent_infer.kernels.triton.mla_decode import (
        _MERGE_COLS, _MERGE_TILE, MERGE_MAX_SPLITS, _mla_decode_kernel, default_config,
    )

    fp8 = cache == "fp8e4nv"
    cfg = config or default_config(torch.float32 if dtype == "fp32" else torch.bfloat16,
                                   torch.float8_e4m3fn if fp8 else None)
    merge = variant == "merge"
    types = [f"*{dtype}"] * 2 + [f"*{cache}"] + ["*i32"] * 2 + ["*fp32"] * 2 + ["*i32"] + ["i32"] * 10 + ["fp32"] * 2
    constexprs = {
        "KV_LORA": 512, "ROPE_DIM": 64, "BLOCK_SIZE": block_size, "BLOCK_H": cfg.block_h, "BLOCK_N": cfg.block_n,
        "BLOCK_L": 512, "BLOCK_R": 64, "DIRECT": variant == "direct", "MERGE": merge,
        "MERGE_S": min(MERGE_MAX_SPLITS, _MERGE_TILE // (cfg.block_h * _MERGE_COLS)) if merge else 1,
        "MERGE_C": _MERGE_COLS, "PRECISION": "ieee" if dtype == "fp32" else "tf32", "PDL": True,
        "V_SCALED": fp8, "F16_DOTS": fp8, "PTX_CVT": fp8, "PACKED": True,
    }
    aligned = [n for n in DECODE_NAMES if n.endswith("_ptr") or n in ("sqb", "sqh", "sob", "soh", "kv_b", "kv_s")]
    return _compile(_mla_decode_kernel, DECODE_NAMES, types, constexprs, aligned, cfg.num_warps, cfg.num_stages), cfg


@pytest.mark.parametrize("dtype,cache", [("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "fp8e4nv")])
@pytest.mark.parametrize("variant", ["direct", "partials", "merge"])
def test_mla_decode_residency_on_sm90(dtype, cache, variant):
    """Every variant of the default tiles holds RESIDENT_PER_SM programs per SM, without
    spills; the 16-bit one runs its dots on the tensor cores (mma: 16 heads are too few
    rows for Hopper's wgmma, whose M is 64), over an fp8 cache in fp16."""
    from agent_infer.kernels.triton.mla_decode import RESIDENT_PER_SM

    kernel, cfg = _compile_decode(dtype, cache, variant)
    fp8 = cache == "fp8e4nv"
    merge = variant == "merge"
    assert _resident(kernel, cfg.num_warps) >= RESIDENT_PER_SM
    ptx = kernel.asm["ptx"]
    assert "griddepcontrol.wait" in ptx  # PDL: waits for the rope + cache write
    if dtype == "bf16":
        assert "mma.sync" in ptx, "the decode dots are not on the tensor cores"
    if fp8:
        assert "f16.f16" in ptx, "the dots over an fp8 cache are not in fp16"
    if merge:
        assert "atom.global.gpu.acq_rel.add" in ptx
        assert "ld.global.cg" in ptx  # the merging program reads the others' partials past L1


@pytest.mark.parametrize("stages,in_flight", [(2, False), (3, False), (5, True)])
def test_mla_decode_overlaps_key_tiles_from_five_stages(stages, in_flight):
    """Where Triton's pipeliner double-buffers the decode loop's key tiles. Each tile's
    copy depends on a load of the block table, and the two take the stages: at 2 and 3
    stages every iteration waits for all copies in flight and requests the next tile only
    after this one's dots, so a program never overlaps a load with its arithmetic; at 5 a
    tile is in flight while the one before it is used (two 36 KB buffers), and an SM still
    holds two programs. benchmarks/mla_kernels.py --sweep times these depths."""
    from agent_infer.kernels.triton.mla_decode import MlaDecodeConfig
    from tests.test_kernel_compile import first_loop_wait

    kernel, _ = _compile_decode("bf16", "bf16", "partials", MlaDecodeConfig(16, 32, 4, stages))
    assert (first_loop_wait(kernel) > 0) == in_flight, first_loop_wait(kernel)
    assert _resident(kernel, 4) >= 2


@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv"])
def test_mla_decode_key_loop_addresses_keys_in_32_bits(cache):
    """The decode loop at its default tiles: each key's latent row comes from its block id
    and slot in unsigned 32-bit arithmetic (paged.kv_row_offsets). A thread loads 18 rows'
    vectors a tile, so the signed remainder and 64-bit multiply it took per key made the
    bf16 loop 827 instructions a tile (Triton 3.9; 828 with 3.6) against 554 (548) after
    it, 466 (471) with the latent in halves (at 2 stages); at batch 1 the kernel issues
    instructions, not bytes, at its limit (docs/PERFORMANCE.md). The halves' scores are two chains of
    tensor-core products, 20 and 16 long, where one of 36 ran back to back; over an fp8
    cache too, where the sum of the halves is not rescaled and Triton had folded it into
    one chain. The loop runs whole key tiles only, its copies unmasked (the partial tile
    goes first, on its own): at 5 stages a mask per key row put 68 compares and predicate
    selects in the bf16 loop, 510 instructions in all against 446 (150, and 608 against
    507, with 3.6)."""
    from tests.test_kernel_compile import (
        _tensor_core_loop, longest_mma_chain, predicate_logic_count, tensor_core_loop_length,
    )

    kernel, _ = _compile_decode("bf16", cache, "partials")
    assert tensor_core_loop_length(kernel) <= 560, tensor_core_loop_length(kernel)
    # The softmax sums stay per key column in the loop: a row sum a tile crossed the warps
    # through shared memory, two of the barriers a tile had (7 over a bf16 cache, 10 fp8).
    barriers = sum("BAR.SYNC" in text for text in _tensor_core_loop(kernel))
    assert barriers <= {"bf16": 5, "fp8e4nv": 8}[cache], barriers
    assert longest_mma_chain(kernel) <= 20, longest_mma_chain(kernel)
    assert predicate_logic_count(kernel) <= 8, predicate_logic_count(kernel)


def test_mla_decode_tile_in_one_block_takes_one_table_entry():
    """With cache blocks of 64 tokens, a 32-key tile lies in one block: the loop loads one
    table entry a tile and multiplies it by the block stride once, on the uniform
    datapath, where 16-token blocks take an entry a key and a 64-bit multiply for each of
    the rows a thread copies; the rows then sit at constant distances (packed rows). The
    bf16 loop: 387 instructions a tile against 430 (Triton 3.9), both two programs an SM."""
    from tests.test_kernel_compile import _tensor_core_loop

    def loop(block_size):
        kernel, cfg = _compile_decode("bf16", "bf16", "partials", block_size=block_size)
        assert _resident(kernel, cfg.num_warps) >= 2
        return [re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for text in _tensor_core_loop(kernel)]

    paged, one_block = loop(16), loop(64)
    assert "IMAD.WIDE.U32" in paged  # the check below can see a per-row product
    assert "IMAD.WIDE.U32" not in one_block and "IMAD.WIDE" not in one_block
    assert len(one_block) <= 0.93 * len(paged), (len(one_block), len(paged))


@pytest.mark.parametrize("splits", [8, 66, 256])
def test_mla_combine_compiles_for_sm90(splits):
    """The merge kernel's tile as the launch plan picks it, up to MAX_SPLITS splits."""
    import torch

    from agent_infer.kernels.triton.mla_decode import _mla_combine_kernel, mla_launch_plan

    plan = mla_launch_plan(1, 16, 512, False, torch.device("cpu"), num_splits=splits)
    names = ["part_o_ptr", "part_lse_ptr", "out_ptr", "ctx_ptr", "sob", "soh", "num_heads", "num_splits"]
    types = ["*fp32", "*fp32", "*bf16", "*i32"] + ["i32"] * 4
    constexprs = {"KV_LORA": 512, "BLOCK_N": 32, "MERGE_S": plan.combine_s, "MERGE_C": plan.combine_c, "PDL": True}
    kernel = _compile(_mla_combine_kernel, names, types, constexprs, names[:6], 4, 1)
    assert _resident(kernel, 4) >= 4


PREFILL_NAMES = ["qn_ptr", "qp_ptr", "kn_ptr", "kp_ptr", "v_ptr", "out_ptr", "cuq_ptr", "cuk_ptr",
                 "kstart_ptr", "ctx_ptr", "lse_ptr",
                 "sqn_t", "sqn_h", "sqp_t", "sqp_h", "skn_t", "skn_h", "skp_t", "sv_t", "sv_h", "so_t", "so_h",
                 "slse_t", "qk_scale"]


@pytest.mark.parametrize("window", [False, True], ids=["whole", "window"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_mla_prefill_residency_on_sm90(dtype, window):
    """The default prefill tiles at Dn 128 / R 64 / Dv 128, over the whole context and over
    a window of it: no spills, two programs per SM in 16 bits, on Hopper's wgmma."""
    import torch

    from agent_infer.kernels.triton.mla_prefill import _mla_prefill_kernel, default_config

    cfg = default_config(torch.float32 if dtype == "fp32" else torch.bfloat16, window)
    types = [f"*{dtype}"] * 6 + ["*i32"] * 4 + ["*fp32"] + ["i32"] * 12 + ["fp32"]
    constexprs = {"NOPE": 128, "ROPE": 64, "VDIM": 128, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                  "BLOCK_DN": 128, "BLOCK_R": 64, "BLOCK_DV": 128, "PRECISION": "ieee" if dtype == "fp32" else "tf32",
                  "WINDOW": window}
    aligned = [n for n in PREFILL_NAMES if n.endswith("_ptr") or n.startswith("s")]
    kernel = _compile(_mla_prefill_kernel, PREFILL_NAMES, types, constexprs, aligned, cfg.num_warps, cfg.num_stages)
    resident = _resident(kernel, cfg.num_warps)
    if dtype == "bf16":
        assert resident >= 2
        assert "wgmma" in kernel.asm["ptx"], "the prefill dots are not on Hopper's wgmma"


@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv"])
@pytest.mark.parametrize("heads", [16, 128])
def test_mla_rope_store_compiles_for_sm90(heads, cache):
    from agent_infer.kernels.triton.mla_rope_store import MAX_HEADS_PER_PROGRAM, _mla_rope_store_kernel

    names = ["kv_a_ptr", "q_pe_ptr", "pos_ptr", "w_ptr", "cs_ptr", "cache_ptr", "slot_ptr",
             "skv", "sqt", "sqh", "scs", "kc_b", "kc_s", "num_heads", "eps", "inv_scale"]
    types = ["*bf16", "*bf16", "*i64", "*bf16", "*fp32", f"*{cache}", "*i64"] + ["i32"] * 7 + ["fp32"] * 2
    constexprs = {"KV_LORA": 512, "ROPE_DIM": 64, "IS_NEOX": False, "BLOCK_SIZE": 16, "BLOCK_L": 512,
                  "BLOCK_HALF": 32, "BLOCK_HQ": min(heads, MAX_HEADS_PER_PROGRAM), "PDL": True,
                  "SCALED": cache == "fp8e4nv"}
    kernel = _compile(_mla_rope_store_kernel, names, types, constexprs, names[:12], 2, 1)
    assert _resident(kernel, 2) >= 8
    assert "griddepcontrol.wait" in kernel.asm["ptx"]


@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv"])
def test_mla_rope_store_absorb_compiles_for_sm90(cache):
    """The decode form with W_UK absorbed, at V2-Lite's Dn 128 / L 512 / R 64: no spills,
    into a bf16 or an fp8 cache."""
    from agent_infer.kernels.triton.mla_rope_store import _ABSORB_C, _mla_rope_store_absorb_kernel

    names = ["kv_a_ptr", "q_ptr", "pos_ptr", "w_ptr", "cs_ptr", "cache_ptr", "slot_ptr", "uk_ptr", "out_ptr",
             "skv", "sqt", "sqh", "scs", "kc_b", "kc_s", "suh", "suk", "sot", "soh", "eps", "inv_scale"]
    types = ["*bf16", "*bf16", "*i64", "*bf16", "*fp32", f"*{cache}", "*i64", "*bf16", "*bf16"] + ["i32"] * 10 + \
        ["fp32"] * 2
    constexprs = {"KV_LORA": 512, "ROPE_DIM": 64, "NOPE": 128, "IS_NEOX": False, "BLOCK_SIZE": 16, "BLOCK_L": 512,
                  "BLOCK_HALF": 32, "BLOCK_D": 128, "BLOCK_C": _ABSORB_C, "NUM_C": 512 // _ABSORB_C, "PDL": True,
                  "SCALED": cache == "fp8e4nv"}
    kernel = _compile(_mla_rope_store_absorb_kernel, names, types, constexprs, names[:19], 4, 1)
    assert _resident(kernel, 4) >= 4
    assert "griddepcontrol.wait" in kernel.asm["ptx"]
