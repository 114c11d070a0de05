"""Kernels whose GPU behaviour the interpreter cannot show, compiled on CPU for an H100/H200
(sm_90) with the ptxas that ships with Triton: a compile error shows here instead of on
the GPU machine, and the PTX shows the memory ordering the code asks for."""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1" or importlib.util.find_spec("triton") is None,
    reason="needs triton's compiler (not the interpreter)",
)


def _compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int = 4):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    except RuntimeError as e:  # e.g. no ptxas for this platform in the triton wheel
        if "ptxas" in str(e).lower():
            pytest.skip(f"no CUDA toolchain to compile with: {e}")
        raise


@pytest.mark.parametrize("block_n,num_warps", [(4096, 8), (8192, 16)])
def test_all_reduce_add_rms_norm_compiles_for_sm90(block_n, num_warps):
    from agent_infer.kernels.triton.allreduce_norm import _all_reduce_add_rms_norm_kernel

    signature = {
        "y_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "buffer_ptrs": "*i64",
        "epochs_ptr": "*i32", "error_ptr": "*i32", "n_rows": "i32", "n_cols": "i32", "stride_y": "i32",
        "stride_r": "i32", "slot_numel": "i32", "n_slots": "i32", "rank": "i32", "max_spins": "i32", "eps": "fp32",
        "WORLD": "constexpr", "BLOCK_N": "constexpr", "BLOCK_SLOTS": "constexpr", "BITS": "constexpr",
        "PDL": "constexpr",
    }
    constexprs = {"WORLD": 2, "BLOCK_N": block_n, "BLOCK_SLOTS": 256, "BITS": 16, "PDL": True}
    kernel = _compile_sm90(_all_reduce_add_rms_norm_kernel, signature, constexprs, num_warps)
    ptx = kernel.asm["ptx"]
    # The wait re-reads the own buffer past the L1 (the peers' writes land in L2).
    assert "ld.volatile.global" in ptx
    # The not-arrived mark (-0.0, sign bit only) is stored and compared as the integer
    # -32768, not as a float constant that could be folded to +0.0.
    assert re.search(r"mov\.b16\s+%rs\d+, -32768;", ptx), "the mark is not stored as an integer"
    assert re.search(r"setp\.eq\.b16\s+%p\d+, %rs\d+, -32768;", ptx), "no integer compare against the mark"
    assert "griddepcontrol.wait" in ptx  # PDL: waits for the producer of y before any read
    assert kernel.asm.get("cubin"), "ptxas produced no cubin"


def test_gemv_add_rms_norm_compiles_for_sm90():
    from agent_infer.kernels.triton.gemv import _gemv_row_kernel

    signature = {
        "x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "res_ptr": "*bf16",
        "nw_ptr": "*bf16", "count_ptr": "*i32", "N": "i32", "K": "i32", "swn": "i32", "up_offset": "i32",
        "eps": "fp32", "HAS_BIAS": "constexpr", "SILU_MUL": "constexpr", "ADD_NORM": "constexpr", "PDL": "constexpr",
        "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "BLOCK_H": "constexpr", "PREFETCH": "constexpr",
    }
    constexprs = {"HAS_BIAS": False, "SILU_MUL": False, "ADD_NORM": True, "PDL": True,
                  "BLOCK_N": 4, "BLOCK_K": 2048, "BLOCK_H": 4096, "PREFETCH": 2}
    ptx = _compile_sm90(_gemv_row_kernel, signature, constexprs).asm["ptx"]
    assert "atom.global.gpu.acq_rel.add" in ptx
    assert "ld.global.cg" in ptx  # the last program reads the other programs' rows past L1
