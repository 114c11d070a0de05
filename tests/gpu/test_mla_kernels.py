"""The DeepSeek MLA Triton kernels on CUDA at DeepSeek-V2-Lite sizes (kv_lora_rank 512,
qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128; 16 heads at TP 1, 8 at TP 2,
and V2/V3's 128), in bf16, fp16 and fp32, against the references (tests/mla_checks.py),
prefill over a long context in windows too (merged by log-sum-exp); the in-launch
merge's memory ordering over hundreds of back-to-back launches; and the rope + cache
write + decode captured in one CUDA graph, replayed with new lengths, block tables and
inputs.

Run on the GPU machine: python -m pytest -q tests/gpu/test_mla_kernels.py
"""

from __future__ import annotations

import pytest
import torch

from tests import kernel_checks as kc
from tests import mla_checks as mc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
RANK, ROPE, NOPE, VDIM = 512, 64, 128, 128


def _lens(n: int, hi: int, seed: int) -> list[int]:
    return [int(x) for x in torch.randint(1, hi, (n,), generator=torch.Generator().manual_seed(seed))]


MLA_DECODE_CASES = [
    # context lens, heads, block size, forced split counts
    ([1], 16, 16, (3,)),
    ([4000], 16, 16, (2, 4, 17, 64)),
    ([1, 15, 16, 17, 513, 2047, 3000, 4096], 16, 16, (1, 3, 4, 9)),
    ([1, 15, 16, 17, 513, 2047, 3000, 4096], 8, 32, (2, 5)),  # TP 2
    (_lens(40, 3000, 0), 16, 16, (2, 4)),
    (_lens(40, 3000, 1), 4, 16, (3,)),  # TP 4
    ([100, 2500], 128, 16, (4, 16)),  # V2 / V3 at TP 1: 8 head blocks
    ([1, 63, 64, 65, 513, 4096], 16, 64, (1, 3, 64)),  # key tiles inside one cache block
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MLA_DECODE_CASES, ids=lambda c: f"b{len(c[0])}-max{max(c[0])}-h{c[1]}-bs{c[2]}-s{c[3]}")
def test_mla_decode(dtype, case):
    contexts, heads, block_size, splits = case
    mc.check_mla_decode(DEV, dtype, contexts, heads, RANK, ROPE, block_size, splits, padding_rows=2)


def test_mla_decode_pool_layout():
    mc.check_mla_decode(DEV, torch.bfloat16, _lens(9, 2000, 2), 16, RANK, ROPE, 16, (4,), pool_layout=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MLA_DECODE_CASES[:3] + MLA_DECODE_CASES[-2:],
                         ids=lambda c: f"b{len(c[0])}-max{max(c[0])}-h{c[1]}-bs{c[2]}-s{c[3]}")
def test_mla_decode_fp8_cache(dtype, case):
    """An fp8 latent cache with a scale: fp16 dots (PTX conversion) for 16-bit queries."""
    contexts, heads, block_size, splits = case
    mc.check_mla_decode(DEV, dtype, contexts, heads, RANK, ROPE, block_size, splits, padding_rows=2,
                        cache_dtype=kc.FP8, cache_scale=0.375)


@pytest.mark.parametrize("batch,max_context,splits", [(1, 8000, 4), (8, 4000, 4), (64, 2000, 2), (1, 8000, 64)])
def test_mla_decode_merged_memory_ordering(batch, max_context, splits):
    """Hundreds of back-to-back launches merged in the launch, each checked against the
    two-kernel path (64 splits: the merge forced past MERGE_MAX_SPLITS, several rounds)."""
    mc.check_mla_decode_repeat(DEV, torch.bfloat16, batch, max_context, splits, iters=200)


MLA_PREFILL_CASES = [
    # query lens, cached prefix lens, heads
    ([512], [0], 16),
    ([1024, 300, 7, 1], [256, 0, 1000, 4000], 16),
    ([100, 1024, 563, 250], [0, 0, 0, 0], 8),
    ([130, 5], [17, 900], 128),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MLA_PREFILL_CASES, ids=lambda c: f"q{c[0]}-p{c[1]}-h{c[2]}")
def test_mla_prefill(dtype, case):
    mc.check_mla_prefill(DEV, dtype, *case, NOPE, ROPE, VDIM)


MLA_WINDOW_CASES = [
    # query lens, cached prefix lens, window width (positions per sequence), heads
    ([1024], [5000], 2048, 16),  # a long prompt's late chunk: three windows
    ([1024, 300, 7, 1], [256, 0, 1000, 4000], 1000, 16),  # ragged, windows inside the queries
    ([130, 5], [17, 900], 333, 128),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MLA_WINDOW_CASES, ids=lambda c: f"q{c[0]}-p{c[1]}-w{c[2]}-h{c[3]}")
def test_mla_prefill_windows(dtype, case):
    mc.check_mla_prefill_windows(DEV, dtype, *case, NOPE, ROPE, VDIM)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [16, 8, 128])
@pytest.mark.parametrize("tokens", [1, 300])
def test_mla_rope_store(dtype, heads, tokens):
    mc.check_mla_rope_store(DEV, dtype, tokens, heads, RANK, ROPE, 16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [16, 8, 128])
@pytest.mark.parametrize("tokens", [1, 4])
def test_mla_rope_store_absorb(dtype, heads, tokens):
    mc.check_mla_rope_store(DEV, dtype, tokens, heads, RANK, ROPE, 16, absorb=True)


@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize("tokens", [1, 4])
def test_mla_rope_store_fp8_cache(absorb, tokens):
    """Rows into an fp8 latent cache divided by the scale, bit for bit as the reference."""
    mc.check_mla_rope_store(DEV, torch.bfloat16, tokens, 16, RANK, ROPE, 16, absorb=absorb, cache_dtype=kc.FP8,
                            cache_scale=0.375)


# ---- CUDA graph ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize(
    "batch,splits,merged",
    [(4, None, False), (4, 4, True), (70, None, True), (300, None, True)],
    ids=["b4-two-kernel", "b4-merged4", "b70-auto-merged", "b300-direct"],
)
def test_mla_decode_cuda_graph(dtype, block_size, batch, splits, merged):
    """Rope + cache write + decode captured once, replayed with new lengths, tables and
    inputs. Batch 4 takes 66 splits (merged by the second kernel, counters or not) or 4
    forced and merged in the launch; batch 70 three splits, merged in the launch; batch
    300 one split (direct)."""
    mc.check_mla_decode_step(DEV, dtype, block_size, batch, splits, merged)


@pytest.mark.parametrize("merged", [False, True], ids=["two-kernel", "counters"])
def test_mla_decode_compiles_nothing_after_variant_warmup(merged):
    """Calls at the batches `mla_variant_batches` names compile every variant that decode
    batches of 1..256 need: afterwards no batch size compiles anything (a compile in the
    middle of serving stalls a step for a second or two)."""
    import triton

    from agent_infer.kernels.triton.mla_decode import mla_decode, mla_decode_counters, mla_variant_batches

    heads, max_batch = 16, 256
    b = mc.LatentBatch(DEV, torch.bfloat16, _lens(max_batch, 200, 4), heads, RANK, ROPE, 16)
    counters = mla_decode_counters(max_batch, heads, DEV) if merged else None

    def call(n: int) -> None:
        mla_decode(b.q[:n], b.kv_cache, b.block_tables, b.context_lens, b.scale, RANK, counters=counters)

    for n in mla_variant_batches(max_batch, heads, RANK, merged, torch.device(DEV)):
        call(n)
    compiled: list[str] = []

    def hook(*args, **kwargs):
        compiled.append(str(kwargs.get("repr", "?")))
        return None  # compile as usual; only record it

    previous = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = hook
    try:
        for n in range(1, max_batch + 1):
            call(n)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_cache_hook = previous
    assert not compiled, f"compiled after the warm-up: {compiled}"
