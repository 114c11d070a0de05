"""Kernels whose GPU behaviour the interpreter cannot show, compiled on CPU for an H100/H200
(sm_90) with the ptxas that ships with Triton: a compile error shows here instead of on
the GPU machine, and the PTX shows the memory ordering the code asks for."""

from __future__ import annotations

import importlib.util
import os
import re

import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1" or importlib.util.find_spec("triton") is None,
    reason="needs triton's compiler (not the interpreter)",
)

# The shared memory one block of an sm_90 GPU may take (per SM: 228 KB).
SM90_SHARED_BYTES = 227 * 1024


def _compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 3,
                  aligned: tuple[int, ...] = ()):
    """`aligned`: the indices of arguments a launch specialises as multiples of 16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    except RuntimeError as e:  # e.g. no ptxas for this platform in the triton wheel
        if "ptxas" in str(e).lower():
            pytest.skip(f"no CUDA toolchain to compile with: {e}")
        raise


@pytest.mark.parametrize("add", [True, False])
@pytest.mark.parametrize("block_n,num_warps", [(4096, 8), (8192, 16)])
def test_all_reduce_add_rms_norm_compiles_for_sm90(block_n, num_warps, add):
    from agent_infer.kernels.triton.allreduce_norm import _all_reduce_add_rms_norm_kernel

    signature = {
        "y_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "buffer_ptrs": "*i64",
        "epochs_ptr": "*i32", "error_ptr": "*i32", "n_rows": "i32", "n_cols": "i32", "stride_y": "i32",
        "stride_r": "i32", "slot_numel": "i32", "n_slots": "i32", "rank": "i32", "max_spins": "i32", "eps": "fp32",
        "WORLD": "constexpr", "BLOCK_N": "constexpr", "BLOCK_SLOTS": "constexpr", "BITS": "constexpr",
        "ADD": "constexpr", "PDL": "constexpr",
    }
    constexprs = {"WORLD": 2, "BLOCK_N": block_n, "BLOCK_SLOTS": 256, "BITS": 16, "ADD": add, "PDL": True}
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


def _gemv_row_signature(weight: str) -> dict[str, str]:
    return {
        "x_ptr": "*bf16", "w_ptr": weight, "b_ptr": "*bf16", "out_ptr": "*bf16", "res_ptr": "*bf16",
        "nw_ptr": "*bf16", "count_ptr": "*i32", "s_ptr": "*fp32", "N": "i32", "K": "i32", "swn": "i32",
        "up_offset": "i32", "eps": "fp32", "s_stride": "i32", "sxm": "i32", "som": "i32", "srm": "i32",
        "HAS_BIAS": "constexpr", "SILU_MUL": "constexpr",
        "ADD_NORM": "constexpr", "PDL": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
        "BLOCK_H": "constexpr", "PREFETCH": "constexpr", "SCALE": "constexpr", "S_ROWS": "constexpr",
        "S_COLS": "constexpr", "ROW_GRID": "constexpr",
    }


def test_gemv_add_rms_norm_compiles_for_sm90():
    from agent_infer.kernels.triton.gemv import _gemv_row_kernel

    for row_grid in (False, True):  # one row; several (the batch-invariant mode), a counter each
        constexprs = {"HAS_BIAS": False, "SILU_MUL": False, "ADD_NORM": True, "PDL": True, "BLOCK_N": 4,
                      "BLOCK_K": 2048, "BLOCK_H": 4096, "PREFETCH": 2, "SCALE": 0, "S_ROWS": 1, "S_COLS": 1,
                      "ROW_GRID": row_grid}
        kernel = _compile_sm90(_gemv_row_kernel, _gemv_row_signature("*bf16"), constexprs)
        ptx = kernel.asm["ptx"]
        assert "atom.global.gpu.acq_rel.add" in ptx
        assert "ld.global.cg" in ptx  # the last program reads the other programs' rows past L1
        assert _registers_per_thread(kernel)[1] == 0, f"row grid {row_grid}: spills"


@pytest.mark.parametrize("n,k", [(4096, k) for k in (1536, 2048, 4096, 5120, 7168, 12288)]
                         + [(5120, 2048), (2048, 4096), (151936, 2048)])
def test_bf16_gemv_prefetches_only_tiles_it_reads(n, k):
    """The batch-1 GEMV's default launch at the projection shapes of the served models
    compiles without spills, and where a row is shorter than the tiles the kernel may
    prefetch before the PDL wait (an LM head over K = 2,048 is one tile), the default
    holds fewer registers than prefetching the full count, whose extra tile would be
    masked."""
    from agent_infer.kernels.triton.gemv import ROW_PREFETCH_TILES, _gemv_row_kernel, row_config

    cfg = row_config(n, k, torch.device("cuda"))

    def registers(prefetch: int, row_grid: bool = False) -> int:
        constexprs = {"HAS_BIAS": False, "SILU_MUL": False, "ADD_NORM": False, "PDL": True, "BLOCK_N": cfg.block_n,
                      "BLOCK_K": cfg.block_k, "BLOCK_H": 1, "PREFETCH": prefetch, "SCALE": 0, "S_ROWS": 1,
                      "S_COLS": 1, "ROW_GRID": row_grid}
        kernel = _compile_sm90(_gemv_row_kernel, _gemv_row_signature("*bf16"), constexprs, num_warps=cfg.num_warps)
        regs, stack = _registers_per_thread(kernel)
        assert stack == 0, f"K={k}, {prefetch} tiles prefetched (row grid {row_grid}): {stack} bytes of stack"
        return regs

    registers(cfg.prefetch, row_grid=True)  # the batch-invariant mode's launch of several rows
    regs = registers(cfg.prefetch)
    print(f"N={n} K={k}: {cfg}, {regs} registers")
    if k < ROW_PREFETCH_TILES * cfg.block_k:
        full = registers(ROW_PREFETCH_TILES)
        assert regs < full, f"K={k}: {regs} registers with {cfg.prefetch} tiles, {full} with {ROW_PREFETCH_TILES}"


def _compile_few_row_mma(cfg, silu: bool = False, even_k: bool = True):
    """The tensor-core few-row GEMV as a launch `cfg` compiles it for sm_90 (bf16)."""
    from agent_infer.kernels.triton.gemv_rows_mma import BLOCK_M, _gemv_rows_mma_kernel

    names = ["x_ptr", "w_ptr", "b_ptr", "out_ptr", "M", "N", "K", "sxm", "swn", "som", "up_offset"]
    types = ["*bf16"] * 4 + ["i32"] * 7
    constexprs = {"HAS_BIAS": False, "PDL": True, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "BLOCK_M": BLOCK_M,
                  "PRECISION": "tf32", "SILU_MUL": silu, "PREFETCH": cfg.prefetch, "EVEN_K": even_k}
    signature = dict(zip(names, types)) | dict.fromkeys(constexprs, "constexpr")
    aligned = tuple(i for i, name in enumerate(names) if name not in ("M", "N"))
    return _compile_sm90(_gemv_rows_mma_kernel, signature, constexprs, num_warps=cfg.num_warps,
                         num_stages=cfg.num_stages, aligned=aligned)


@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu"])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288), (12288, 4096), (151936, 4096), (960, 576)])
def test_few_row_mma_streams_through_the_tensor_cores(n, k, silu):
    """The tensor-core few-row GEMV in its default launches at the Qwen3-8B and SmolLM2
    shapes: the weight tiles stream into shared memory by 16-byte asynchronous copies
    (Triton's pipeline), the products run as MMAs (the warpgroup MMA for 64-row tiles),
    the loads wait for the previous kernel (PDL), nothing spills, and the stages fit an
    SM's shared memory (a launch past it fails only on the GPU)."""
    from agent_infer.kernels.triton.gemv_rows_mma import mma_config

    cfg = mma_config(n, k, silu)  # n output rows (with SiLU, of a [gate; up] weight of 2n)
    ptx = _streamed_few_row_ptx(_compile_few_row_mma(cfg, silu), f"N={n} K={k} silu={silu}: {cfg}")
    assert ("wgmma.mma_async" in ptx) if cfg.block_n >= 64 else ("mma.sync.aligned.m16n8k16" in ptx)


def _streamed_few_row_ptx(kernel, label: str) -> str:
    """A compiled few-row GEMV's PTX, once its loads are checked to stream as 16-byte
    asynchronous copies after the PDL wait, without spills, within an SM's shared memory."""
    regs, stack = _registers_per_thread(kernel)
    ptx = kernel.asm["ptx"]
    print(f"{label}: {regs} registers, {kernel.metadata.shared} B shared")
    assert stack == 0, f"{label}: {stack} bytes of stack"
    assert kernel.metadata.shared <= SM90_SHARED_BYTES, f"{label}: {kernel.metadata.shared} B of shared memory"
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx), \
        f"{label}: no 16-byte async copies"
    assert "griddepcontrol.wait" in ptx, label
    return ptx


@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu"])
@pytest.mark.parametrize("block_n,block_k,warps,prefetch", [(16, 256, 2, False), (32, 128, 2, True), (64, 128, 4, True)])
def test_few_row_mma_with_a_k_tail_keeps_its_pipeline(block_n, block_k, warps, prefetch, silu):
    """Tiles wider than a K they do not divide (SmolLM2-135M's 576), the last one masked:
    the loads still stream as 16-byte asynchronous copies into the same MMAs, after the
    PDL wait, without spilling."""
    from agent_infer.kernels.triton.gemv_rows_mma import MmaConfig

    cfg = MmaConfig(block_n, block_k, warps, 4, prefetch)
    ptx = _streamed_few_row_ptx(_compile_few_row_mma(cfg, silu, even_k=False), f"{cfg} silu={silu}, K tail")
    mma = "wgmma.mma_async" if block_n >= 64 else "mma.sync.aligned.m16n8k16"
    assert ptx.count(mma) == _compile_few_row_mma(cfg, silu).asm["ptx"].count(mma) > 0


@pytest.mark.parametrize("scale,block", [(1, (1, 1)), (2, (128, 128))], ids=["channel", "block"])
def test_fp8_gemv_compiles_for_sm90(scale, block):
    """The batch-1 GEMV over e4m3 weights (read as int32 words) in its default launch
    shape, for each variant the engine runs (plain, gate/up with SiLU, with the add +
    norm): the bytes become fp32 by integer operations, not the hardware conversion; no
    FMA flushes subnormals to zero (e4m3 subnormals become fp32 subnormals there); and
    nothing spills."""
    from agent_infer.kernels.triton.gemv import _gemv_row_kernel, row_config

    for silu, add_norm in ((False, False), (True, False), (False, True)):
        cfg = row_config(12288 if silu else 4096, 4096, torch.device("cuda"), fp8=True, silu_mul=silu)
        constexprs = {"HAS_BIAS": False, "SILU_MUL": silu, "ADD_NORM": add_norm, "PDL": True,
                      "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "BLOCK_H": 4096 if add_norm else 1,
                      "PREFETCH": cfg.prefetch, "SCALE": scale, "S_ROWS": block[0], "S_COLS": block[1],
                      "ROW_GRID": False}
        kernel = _compile_sm90(_gemv_row_kernel, _gemv_row_signature("*i32"), constexprs, num_warps=cfg.num_warps)
        ptx = kernel.asm["ptx"]
        assert not re.search(r"cvt\S*e4m3", ptx) and "fma.rn.f32" in ptx, (silu, add_norm)
        assert not re.search(r"(fma|mul|add)\.rn\.ftz", ptx), (silu, add_norm)
        _, stack = _registers_per_thread(kernel)
        assert stack == 0, f"the fp8 GEMV (silu={silu}, add_norm={add_norm}) spills {stack} bytes per thread"


# gemv._gemv_kernel's arguments for bf16 tensors (fp32 partial sums).
_GEMV_KERNEL_SIGNATURE = {
    "x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
    "M": "i32", "N": "i32", "K": "i32", "sxm": "i32", "swn": "i32", "som": "i32", "k_per_split": "i32",
    "HAS_BIAS": "constexpr", "SPLIT": "constexpr", "USE_DOT": "constexpr", "EVEN_K": "constexpr",
    "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "PRECISION": "constexpr",
    "SWAP_AB": "constexpr", "PDL": "constexpr",
}


@pytest.mark.parametrize("swap_ab", [False, True])
def test_skinny_gemm_with_the_weight_on_the_left_takes_the_warpgroup_mma(swap_ab):
    """A few rows (verify steps, small batches) padded to 16: with x as the left operand
    the dot can only take the older 16-row MMA (mma.sync); with the weight tile on the
    left (`GemvConfig.swap_ab`) it takes Hopper's warpgroup MMA, fed from shared memory by
    the same pipelined loads, without spilling."""
    from agent_infer.kernels.triton.gemv import _gemv_kernel

    signature = _GEMV_KERNEL_SIGNATURE
    constexprs = {"HAS_BIAS": False, "SPLIT": True, "USE_DOT": True, "EVEN_K": True, "BLOCK_M": 16, "BLOCK_N": 64,
                  "BLOCK_K": 128, "PRECISION": "tf32", "SWAP_AB": swap_ab, "PDL": False}
    kernel = _compile_sm90(_gemv_kernel, signature, constexprs, num_warps=4, num_stages=4,
                           aligned=(0, 1, 3, 4, 8, 9, 10, 11))
    ptx = kernel.asm["ptx"]
    assert ("wgmma.mma_async" in ptx) == swap_ab and ("mma.sync" in ptx) == (not swap_ab)
    assert "cp.async" in ptx  # the weight tiles stream through the software pipeline either way
    regs, stack = _registers_per_thread(kernel)
    assert stack == 0, f"{regs} registers, {stack} bytes of stack"


def _run_tool(name: str, kernel, *args: str) -> str:
    """The output of one of the Triton wheel's CUDA tools (cuobjdump, nvdisasm) on a
    compiled kernel's cubin."""
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not tool.exists():
        pytest.skip(f"no {name} in the triton wheel ({tool})")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([str(tool), *args, f.name], capture_output=True, text=True, check=True).stdout


def _registers_per_thread(kernel) -> tuple[int, int]:
    """(registers per thread, stack bytes) of a compiled kernel, from its cubin."""
    usage = _run_tool("cuobjdump", kernel, "--dump-resource-usage")
    return int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1))


def _sass(kernel) -> str:
    """A compiled kernel's machine code (SASS)."""
    return _run_tool("nvdisasm", kernel)


def _tensor_core_loop(kernel) -> list[str]:
    """The SASS instructions of the body of the kernel's longest loop that runs tensor-core
    (HMMA) instructions: one key tile's work per thread in the attention kernels."""
    instructions, labels = [], {}
    for line in _sass(kernel).splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        op = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if op:
            instructions.append(op.group(1))
    body: list[str] = []
    for end, text in enumerate(instructions):
        target = re.search(r"\bBRA\b.*?(\.L_x_\d+)", text)
        start = labels.get(target.group(1), end + 1) if target else end + 1
        if start <= end and end + 1 - start > len(body) and any("HMMA" in t for t in instructions[start:end + 1]):
            body = instructions[start:end + 1]
    return body


def tensor_core_loop_length(kernel) -> int:
    """Instructions a thread runs per iteration of that loop."""
    return len(_tensor_core_loop(kernel))


def predicate_logic_count(kernel) -> int:
    """That loop's integer compares and predicate selects and moves (ISETP, SEL, PLOP3,
    P2R): what a mask per key row costs each vector a thread copies."""
    ops = (re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0] for text in _tensor_core_loop(kernel))
    return sum(op in ("ISETP", "SEL", "PLOP3", "P2R") for op in ops)


def longest_mma_chain(kernel) -> int:
    """The longest run of that loop's tensor-core products each accumulating onto the one
    before it (a chain the warp must run back to back, at the product's latency)."""
    depth: dict[str, int] = {}
    for text in _tensor_core_loop(kernel):
        if "HMMA" not in text:
            continue
        regs = re.findall(r"\bR\d+\b|\bRZ\b", text.split("HMMA", 1)[1])
        dst, acc = regs[0], regs[-1]
        depth[dst] = 1 if acc == "RZ" else depth.get(acc, 0) + 1
    return max(depth.values(), default=0)


def first_loop_wait(kernel) -> int:
    """How many async copy groups the first wait inside the kernel's first loop leaves in
    flight (0: every copy is waited for before the loop body computes)."""
    ttgir = kernel.asm["ttgir"]
    return int(re.search(r"async_wait[^\n]*\{num = (\d+)", ttgir[ttgir.index("scf.for"):]).group(1))


def _compile_decode(cache: str, variant: str, stages: int, block_n: int = 64):
    """The dense decode kernel (4 warps) as the engine launches it for Qwen3-8B (GQA 4,
    head_dim 128, `block_n` keys a tile) over a `cache` ("bf16" or "fp8e4nv") cache:
    "direct", "merge" (splits merged in the launch) or "preload" (the first tile before
    the PDL wait)."""
    from agent_infer.kernels.triton.decode_attention import _decode_split_kernel

    names = ["q_ptr", "out_ptr", "k_cache_ptr", "v_cache_ptr", "table_ptr", "ctx_ptr", "part_o_ptr", "part_lse_ptr",
             "counter_ptr", "order_ptr", "sqb", "sqh", "sob", "soh", "kc_b", "kc_s", "kc_h", "vc_b", "vc_s", "vc_h", "s_table",
             "num_heads", "num_kv_heads", "group", "head_dim", "num_splits", "qk_scale", "v_scale"]
    types = ["*bf16"] * 2 + [f"*{cache}"] * 2 + ["*i32"] * 2 + ["*fp32"] * 2 + ["*i32"] * 2 + ["i32"] * 16 + ["fp32"] * 2
    preload, merge = variant == "preload", variant == "merge"
    # As the engine launches it for Qwen3-8B (GQA 4): the order only past one wave, which
    # the preload never is; merging 2-64 splits, 16 at a time.
    constexprs = {"BLOCK_SIZE": 16, "BLOCK_G": 16, "BLOCK_N": block_n, "BLOCK_D": 128, "DIRECT": not merge, "MERGE": merge,
                  "GROUP_P": 4 if merge else 1, "MERGE_S": 16 if merge else 1, "PRECISION": "tf32", "PDL": True,
                  "PRELOAD": preload, "ORDERED": not preload, "V_SCALED": cache != "bf16",
                  "F16_DOTS": cache != "bf16", "PTX_CVT": cache != "bf16", "EVEN_D": True}
    signature = dict(zip(names, types)) | {name: "constexpr" for name in constexprs}
    # What a launch specialises on: 16-byte aligned pointers and strides, head_dim 128.
    aligned = [i for i, n in enumerate(names) if n.endswith("_ptr") or n[:3] in ("sqb", "sqh", "sob", "soh")
               or n[:3] in ("kc_", "vc_") or n == "head_dim"]
    return _compile_sm90(_decode_split_kernel, signature, constexprs, num_warps=4, num_stages=stages,
                         aligned=tuple(aligned))


@pytest.mark.parametrize("cache,variant,per_sm", [
    ("bf16", "direct", 4), ("bf16", "merge", 3), ("bf16", "preload", 2),
    ("fp8e4nv", "direct", 4), ("fp8e4nv", "merge", 3), ("fp8e4nv", "preload", 3),
])
def test_decode_attention_residency_on_sm90(cache, variant, per_sm):
    """How many 4-warp decode programs an SM holds, as `decode_num_splits`,
    `preload_first_tile` and `ordered_rows` assume: without the first-tile preload (the
    large-batch kernel, one split, many waves, sequences in the given order) four (<= 128
    registers per thread); merging splits in the same launch three; with the preload two
    (no spills).
    Holding the preload at every batch size, or computing V's offsets between the two tile
    loads (30 registers more), halves the programs per SM, so a many-wave grid has half the
    KV loads in flight. With an fp8 cache (--kv-cache-dtype fp8; fp16 dots, V converted by
    PTX before it is staged, two stages) the variants hold at least as many programs as
    with bf16; converted as a cast, V was read back from shared memory a byte at a time and
    every variant took ~160-200 registers, three programs per SM or fewer."""
    kernel = _compile_decode(cache, variant, 3 if cache == "bf16" else 2)
    regs, stack = _registers_per_thread(kernel)
    assert stack == 0, f"{stack} bytes of stack (register spills)"
    if cache != "bf16":  # no 8-bit shared-memory loads (one byte each): V is staged as fp16
        assert "LDS.U8" not in _sass(kernel)
    assert 65536 // (regs * 128) >= per_sm, f"{regs} registers per thread: fewer than {per_sm} programs per SM"
    assert kernel.metadata.shared * per_sm <= SM90_SHARED_BYTES


@pytest.mark.parametrize("preload_order", [True, False])
def test_decode_shares_kernel_holds_two_programs_per_sm(preload_order):
    """The batch-invariant mode's decode of several rows (`_decode_shares_kernel`: every
    program a few of its row's shares, merged in the launch) at Qwen3-8B's shape holds the
    two programs per SM that `decode_num_splits` sizes one wave of its grid by (212
    registers a thread with Triton 3.9: the share loop around the key loop), with no
    spills."""
    from agent_infer.kernels.triton.decode_attention import _decode_shares_kernel

    names = ["q_ptr", "out_ptr", "k_cache_ptr", "v_cache_ptr", "table_ptr", "ctx_ptr", "part_o_ptr", "part_lse_ptr",
             "counter_ptr", "sqb", "sqh", "sob", "soh", "kc_b", "kc_s", "kc_h", "vc_b", "vc_s", "vc_h", "s_table",
             "num_heads", "num_kv_heads", "group", "head_dim", "num_shares", "num_programs", "qk_scale", "v_scale"]
    types = ["*bf16"] * 4 + ["*i32"] * 2 + ["*fp32"] * 2 + ["*i32"] + ["i32"] * 17 + ["fp32"] * 2
    constexprs = {"BLOCK_SIZE": 16, "BLOCK_G": 16, "BLOCK_N": 64, "BLOCK_D": 128, "GROUP_P": 4, "MERGE_S": 16,
                  "PRECISION": "tf32", "PDL": True, "V_SCALED": False, "F16_DOTS": False, "PTX_CVT": False,
                  "PRELOAD_ORDER": preload_order, "EVEN_D": True}
    signature = dict(zip(names, types)) | {name: "constexpr" for name in constexprs}
    aligned = [i for i, n in enumerate(names) if n.endswith("_ptr") or n[:3] in ("sqb", "sqh", "sob", "soh")
               or n[:3] in ("kc_", "vc_") or n == "head_dim"]
    kernel = _compile_sm90(_decode_shares_kernel, signature, constexprs, num_warps=4, num_stages=3,
                           aligned=tuple(aligned))
    regs, stack = _registers_per_thread(kernel)
    assert stack == 0, f"{stack} bytes of stack (register spills)"
    assert min(65536 // (regs * 128), SM90_SHARED_BYTES // kernel.metadata.shared) >= 2, (regs, kernel.metadata.shared)
    assert "atom.global.gpu.acq_rel.add" in kernel.asm["ptx"]


@pytest.mark.parametrize("stages,block_n,in_flight,per_sm", [(3, 64, False, 4), (5, 64, True, 3), (5, 32, True, 4)])
def test_decode_attention_overlaps_kv_tiles_from_five_stages(stages, block_n, in_flight, per_sm):
    """Where Triton's pipeliner double-buffers the dense decode loop (bf16, one split): each
    K/V tile's copy depends on a block-table load, and the two take the stages. At the
    default 3 every iteration waits for all copies in flight, so a program overlaps no load
    with its arithmetic and the SM's four programs are what keep the memory busy; at 5 the
    next tile is in flight while this one is used, at (at least) three programs per SM
    with 64-key tiles and four with 32. benchmarks/attention_chain.py sweeps these."""
    kernel = _compile_decode("bf16", "direct", stages, block_n)
    assert (first_loop_wait(kernel) > 0) == in_flight, first_loop_wait(kernel)
    regs, stack = _registers_per_thread(kernel)
    assert stack == 0 and min(65536 // (regs * 128), SM90_SHARED_BYTES // kernel.metadata.shared) >= per_sm, (
        regs, kernel.metadata.shared)


@pytest.mark.parametrize("cache,stages", [("bf16", 3), ("fp8e4nv", 2)])
def test_decode_attention_key_loop_addresses_keys_in_32_bits(cache, stages):
    """The dense decode loop (at its default stages) computes each key's cache row from
    its block id and slot with unsigned 32-bit arithmetic (paged.kv_row_offsets). With a
    signed remainder and a 64-bit multiply per key the bf16 loop was 586 instructions a
    tile (Triton 3.9; 653 with 3.6), against 370 (425) after it. The loop runs whole key
    tiles only, their copies unmasked (the partial tile goes before it): a mask per key
    row put 57 compares and predicate selects in it (93 with 3.6), 315 instructions in all
    (368) since; over an fp8 cache 30 (35), 518 against 491 (526 against 497). The softmax
    sums stay per key column through the loop (a row sum a tile crossed the four warps
    through shared memory): 297 instructions and five barriers a tile where 315 took seven
    (bf16), 467 and four where 491 took six (fp8)."""
    kernel = _compile_decode(cache, "direct", stages)
    assert tensor_core_loop_length(kernel) <= (400 if cache == "bf16" else 520), tensor_core_loop_length(kernel)
    assert predicate_logic_count(kernel) <= 8, predicate_logic_count(kernel)
    barriers = sum("BAR.SYNC" in text for text in _tensor_core_loop(kernel))
    assert barriers <= (5 if cache == "bf16" else 4), barriers


def test_prefill_attention_over_an_fp8_cache_converts_to_fp16_on_sm90():
    """The prefill kernel over an fp8 cache (a bf16 model): its dots run in fp16, so each
    tile converts e4m3 -> fp16 (two values an instruction) and nothing further; with bf16
    dots every value also went fp16 -> bf16 one at a time (256 F2F a tile per thread)."""
    from agent_infer.kernels.triton.prefill_attention import _prefill_kernel

    names = ["q_ptr", "out_ptr", "k_cache_ptr", "v_cache_ptr", "table_ptr", "qsl_ptr", "ctx_ptr", "sqt", "sqh", "sot",
             "soh", "kc_b", "kc_s", "kc_h", "vc_b", "vc_s", "vc_h", "s_table", "first_seq", "group", "head_dim",
             "qk_scale", "v_scale"]
    types = ["*bf16"] * 2 + ["*fp8e4nv"] * 2 + ["*i32"] * 3 + ["i32"] * 14 + ["fp32"] * 2
    constexprs = {"BLOCK_SIZE": 16, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 128, "EVEN_D": True, "PRECISION": "tf32",
                  "V_SCALED": True, "F16_DOTS": True}
    # As launched for Qwen3-8B: the default tile (64 x 64, 4 warps, 2 stages), aligned pointers and strides.
    aligned = tuple(i for i, n in enumerate(names) if n.endswith("_ptr") or n[:3] in ("sqt", "sqh", "sot", "soh", "kc_",
                                                                                      "vc_") or n == "head_dim")
    kernel = _compile_sm90(_prefill_kernel, dict(zip(names, types)) | {n: "constexpr" for n in constexprs}, constexprs,
                           num_stages=2, aligned=aligned)
    sass = _sass(kernel)
    assert "F2FP.F16.E4M3" in sass and "F2F.BF16.F16" not in sass
    assert _registers_per_thread(kernel)[1] == 0


def test_gumbel_hash_uses_32_bit_multiplies_on_sm90():
    """The per-entry hash of the sampler multiplies in 32 bits: an int64 hash (the
    reference's arithmetic, masked) compiles to emulated 64-bit multiplies, several per
    vocabulary entry, and made the kernel compute-bound (170 us at 256 rows on an H200)."""
    from agent_infer.kernels.triton.sampling import _gumbel_argmax_kernel

    signature = {
        "logits_ptr": "*bf16", "stride": "i32", "temp_ptr": "*fp32", "seed_ptr": "*i64", "step_ptr": "*i64",
        "val_ptr": "*fp32", "idx_ptr": "*i64", "vocab": "i32", "num_splits": "i32",
        "SPLIT": "constexpr", "BLOCK": "constexpr", "PDL": "constexpr",
    }
    constexprs = {"SPLIT": 8192, "BLOCK": 2048, "PDL": True}
    ptx = _compile_sm90(_gumbel_argmax_kernel, signature, constexprs, num_warps=8).asm["ptx"]
    wide = len(re.findall(r"\bmul\.(?:lo|wide)\.[su]64\b", ptx))
    narrow = len(re.findall(r"\bmul\.lo\.[su]32\b", ptx))
    # The key (three finalisers on scalars) may use a few wide ones; the loop none.
    assert wide <= 8, f"{wide} 64-bit multiplies"
    assert narrow >= 8, f"only {narrow} 32-bit multiplies: the hash is not in 32 bits"


@pytest.mark.parametrize("max_n,block_k", [(4, 8), (5, 16)])
def test_prompt_lookup_on_the_device_compiles_for_sm90(max_n, block_k):
    """The device's prompt lookup (one program a row, the history scanned in blocks of 1,024
    positions) compiles for sm_90 without spilling, and waits for the row moves before it
    first reads the previous step's samples (PDL)."""
    from agent_infer.kernels.triton.ngram import _BLOCK, _lookup_drafts_kernel

    names = ["ids_ptr", "hist_ptr", "offsets_ptr", "starts_ptr", "slots_ptr", "refs_ptr", "ref_k_ptr",
             "prev_tokens_ptr", "prev_inputs_ptr"]
    constexprs = {"MIN_N": 2, "MAX_N": max_n, "BLOCK": _BLOCK, "BLOCK_K": block_k, "PDL": True}
    signature = {n: "*i64" for n in names} | {n: "constexpr" for n in constexprs}
    kernel = _compile_sm90(_lookup_drafts_kernel, signature, constexprs)
    regs, spills = _registers_per_thread(kernel)
    assert spills == 0 and regs <= 128, (regs, spills)
    ptx = kernel.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
