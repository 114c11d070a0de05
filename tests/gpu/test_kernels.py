"""The Triton kernels on CUDA at Qwen3-8B sizes (hidden 4096, 32 heads, 8 KV heads,
head_dim 128, intermediate 12288), in bf16, fp16 and fp32, against the references; and
decode attention captured in a CUDA graph, replayed with new lengths and block tables.

Run on the GPU machine: python -m pytest -q tests/gpu/test_kernels.py
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from agent_infer.attention.metadata import AttentionMetadata
from agent_infer.kernels import reference
from tests import attention_checks as ac
from tests import kernel_checks as kc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 4096, 32, 8, 128, 12288


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 37, 512])
def test_rms_norm(dtype, tokens):
    kc.check_rms_norm(DEV, dtype, tokens, None, HIDDEN, False)
    kc.check_rms_norm(DEV, dtype, tokens, HEADS, HEAD_DIM, True)  # q_norm on the QKV view
    kc.check_rms_norm(DEV, dtype, tokens, KV_HEADS, HEAD_DIM, True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 37, 512])
def test_fused_add_rms_norm(dtype, tokens):
    kc.check_fused_add_rms_norm(DEV, dtype, tokens, HIDDEN)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 37, 512])
def test_silu_and_mul(dtype, tokens):
    kc.check_silu_and_mul(DEV, dtype, (tokens, 2 * INTER))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("head_dim,rot_dim", [(128, 128), (128, 64)])
def test_norm_rope_store(dtype, is_neox, qk_norm, head_dim, rot_dim):
    for tokens in (1, 300):
        kc.check_norm_rope_store(DEV, dtype, tokens, HEADS, KV_HEADS, head_dim, rot_dim, is_neox, qk_norm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv(dtype, block_size):
    ac.check_store_kv(DEV, dtype, 300, KV_HEADS, HEAD_DIM, block_size)


PREFILL_CASES = [
    # query lens, cached prefix lens, heads, kv heads, head_dim, block size
    ([512], [0], HEADS, KV_HEADS, HEAD_DIM, 16),
    ([1024, 300, 7, 1], [256, 0, 1000, 4000], HEADS, KV_HEADS, HEAD_DIM, 16),
    ([1024, 300, 7, 1], [256, 0, 1000, 4000], HEADS, KV_HEADS, HEAD_DIM, 32),
    ([200, 77], [33, 1500], 16, 16, 64, 16),  # MHA, head_dim 64
    ([130, 5], [17, 900], 32, 4, 128, 32),  # GQA 8
    ([90], [40], 8, 2, 96, 16),  # head_dim 96 (masked)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"q{c[0]}-p{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-bs{c[5]}")
def test_prefill_attention(dtype, case):
    ac.check_prefill(DEV, dtype, *case)


DECODE_CASES = [
    # context lens, heads, kv heads, head_dim, block size, forced split count
    ([1], HEADS, KV_HEADS, HEAD_DIM, 16, 7),
    ([4000], HEADS, KV_HEADS, HEAD_DIM, 16, 64),
    ([1, 15, 16, 17, 513, 2047, 3000, 4096], HEADS, KV_HEADS, HEAD_DIM, 16, 1),
    ([1, 15, 16, 17, 513, 2047, 3000, 4096], HEADS, KV_HEADS, HEAD_DIM, 32, 5),
    ([int(x) for x in torch.randint(1, 3000, (40,), generator=torch.Generator().manual_seed(0))],
     HEADS, KV_HEADS, HEAD_DIM, 16, 3),
    ([100, 2500], 16, 16, 64, 16, 4),  # MHA, head_dim 64
    ([100, 2500], 32, 4, 128, 32, 9),  # GQA 8
    ([77, 1000], 8, 2, 96, 16, 2),  # head_dim 96
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"b{len(c[0])}-max{max(c[0])}-h{c[1]}/{c[2]}-d{c[3]}-bs{c[4]}-s{c[5]}")
def test_decode_attention(dtype, case):
    ac.check_decode(DEV, dtype, *case)


# An fp8 (e4m3) KV cache (--kv-cache-dtype fp8): the cache writes round and saturate as
# torch's cast after a clamp does; attention over it matches the reference reading the
# same cache back as the model's dtype.
FP8_MODEL_DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", FP8_MODEL_DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("kv_scales", [(1.0, 1.0), (0.37, 2.9)], ids=str)
def test_norm_rope_store_fp8_cache(dtype, is_neox, kv_scales):
    for tokens in (1, 300):
        kc.check_norm_rope_store(DEV, dtype, tokens, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM, is_neox, True,
                                 cache_dtype=kc.FP8, kv_scales=kv_scales)


@pytest.mark.parametrize("dtype", FP8_MODEL_DTYPES + [torch.float32])
@pytest.mark.parametrize("kv_scales", [(1.0, 1.0), (0.37, 2.9)], ids=str)
def test_store_kv_fp8_cache(dtype, kv_scales):
    ac.check_store_kv(DEV, dtype, 300, KV_HEADS, HEAD_DIM, 16, cache_dtype=kc.FP8, kv_scales=kv_scales)


@pytest.mark.parametrize("dtype", FP8_MODEL_DTYPES)
@pytest.mark.parametrize("prefill", [True, False], ids=["prefill", "decode"])
def test_attention_fp8_cache_scales(dtype, prefill):
    ac.check_attention_kv_scales(DEV, dtype, prefill, (512.0, 256.0))


def test_e4m3_to_f16_ptx_converts_every_value_as_torch_does():
    """The inline-PTX conversion the decode kernel applies to V, on all 256 e4m3 codes
    (NaN codes compared as NaN), against torch's cast."""
    import triton
    import triton.language as tl

    from agent_infer.kernels.triton.utils import e4m3_to_f16_ptx

    @triton.jit
    def convert(x_ptr, out_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(out_ptr + i, e4m3_to_f16_ptx(tl.load(x_ptr + i)))

    codes = torch.arange(256, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
    out = torch.empty(256, dtype=torch.float16, device=DEV)
    convert[(1,)](codes, out, BLOCK=256)
    torch.testing.assert_close(out, codes.to(torch.float16), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", FP8_MODEL_DTYPES)
@pytest.mark.parametrize("case", PREFILL_CASES[1:3], ids=["bs16", "bs32"])
def test_prefill_attention_fp8_cache(dtype, case):
    ac.check_prefill(DEV, dtype, *case, cache_dtype=kc.FP8)


@pytest.mark.parametrize("dtype", FP8_MODEL_DTYPES)
@pytest.mark.parametrize("case", [DECODE_CASES[i] for i in (1, 3, 4, 6)], ids=["long", "mixed", "b40", "gqa8"])
def test_decode_attention_fp8_cache(dtype, case):
    ac.check_decode(DEV, dtype, *case, cache_dtype=kc.FP8)


@pytest.mark.parametrize("num_splits", [1, 8])
def test_decode_padding_rows(num_splits):
    ac.check_decode_padding_rows(DEV, torch.bfloat16, 16, num_splits)


MERGED_DECODE_CASES = [
    # context lens, heads, kv heads, head_dim, block size, forced split counts, padding rows
    ([4000], HEADS, KV_HEADS, HEAD_DIM, 16, (2, 7, 33, 64), 0),
    ([1, 15, 16, 17, 513, 2047, 3000, 4096], HEADS, KV_HEADS, HEAD_DIM, 16, (2, 5, 17), 3),
    ([int(x) for x in torch.randint(1, 3000, (40,), generator=torch.Generator().manual_seed(1))],
     HEADS, KV_HEADS, HEAD_DIM, 32, (3, 8), 0),
    ([100, 2500], 16, 16, 64, 16, (4, 64), 1),  # MHA, head_dim 64
    ([100, 2500], 32, 4, 128, 32, (9,), 0),  # GQA 8
    ([77, 1000], 8, 2, 96, 16, (2, 6), 0),  # head_dim 96
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "case", MERGED_DECODE_CASES,
    ids=lambda c: f"b{len(c[0])}-max{max(c[0])}-h{c[1]}/{c[2]}-d{c[3]}-bs{c[4]}-s{c[5]}-pad{c[6]}",
)
def test_decode_attention_merged(dtype, case):
    ac.check_decode_merged(DEV, dtype, *case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("preload", [True, False])
@pytest.mark.parametrize("kv_heads,shares,grids", [(8, 33, (5, 17)), (3, 64, (6, 44)), (2, 64, (1, 9))])
def test_decode_shares_match_one_row(dtype, preload, kv_heads, shares, grids):
    """The batch-invariant mode's decode of several rows on a smaller grid than the one-row
    step's shares (Qwen3-8B's, SmolLM2's and Qwen2.5-0.5B's KV heads and split counts on
    132 SMs): every row bitwise its one-row launch, on the GPU's concurrent programs."""
    lens = [1, 63, 64, 65, 700, 2047, 4100, 9000]
    ac.check_decode_shares(DEV, dtype, lens, shares, grids, preload, heads=kv_heads * 4, kv_heads=kv_heads,
                           head_dim=128 if kv_heads == 8 else 64)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_order(num_splits):
    """Sequences in a given order (longest first, shuffled), forced on, over 100 rows of
    random contexts, with the GPU running programs concurrently (the interpreter runs
    them one after another)."""
    lens = [int(x) for x in torch.randint(1, 3000, (100,), generator=torch.Generator().manual_seed(3))]
    ac.check_decode_order(DEV, torch.bfloat16, lens, num_splits)


@pytest.mark.parametrize("batch,max_context,splits", [(1, 8000, 64), (8, 4000, 16), (64, 2000, 4)])
def test_decode_merged_memory_ordering(batch, max_context, splits):
    """Hundreds of back-to-back merged launches, each checked against the two-kernel path."""
    ac.check_decode_merged_repeat(DEV, torch.bfloat16, batch, max_context, splits, iters=200)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 33, 64])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288), (1000, 4000)])
def test_gemv(dtype, m, n, k):
    kc.check_gemv(DEV, dtype, m, n, k, bias=(n == 1000))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,silu_mul", [(6144, 4096, False), (4096, 12288, False), (12288, 4096, True),
                                          (1000, 4000, False), (151936, 4096, False), (576, 1536, True)])
def test_gemv_m1(dtype, n, k, silu_mul):
    kc.check_gemv_m1(DEV, dtype, n, k, bias=(n == 1000), silu_mul=silu_mul)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize("n,k,epilogue", [(6144, 4096, "plain"), (4096, 12288, "plain"), (12288, 4096, "silu"),
                                          (4096, 4096, "plain"), (151936, 4096, "plain"), (960, 576, "plain"),
                                          (1000, 4032, "plain"), (1536, 576, "silu")])
def test_gemv_rows_mma(dtype, m, n, k, epilogue):
    """The few-row GEMV on the tensor cores at the Qwen3-8B (LM head included) and
    SmolLM2-135M shapes in its default launches, plain and ending in SiLU-and-mul."""
    kc.check_gemv_rows(DEV, dtype, m, n, k, bias=(n == 1000), epilogue=epilogue)


# The batch-invariant mode's GEMM at the Qwen3-8B and SmolLM2-135M shapes, up to a batch
# of 8 with 8 drafts each.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288), (24576, 4096), (960, 576), (576, 1536),
                                 (49152, 576), (1000, 4000)])
def test_gemv_invariant(dtype, n, k):
    kc.check_gemv_invariant(DEV, dtype, n, k, bias=(n == 1000), row_counts=(1, 2, 5, 9, 16, 17, 72))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(1536, 576), (4864, 896)])  # SmolLM2-135M, Qwen2.5-0.5B gate/up
def test_gemv_invariant_silu(dtype, n, k):
    kc.check_gemv_invariant(DEV, dtype, n, k, bias=False, row_counts=(1, 3, 9, 17), epilogue="silu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 12288), (576, 576), (576, 1536), (896, 4864)])
def test_gemv_invariant_add_norm(dtype, n, k):
    """The o and down projections of Qwen3-8B, SmolLM2-135M and Qwen2.5-0.5B, then the
    add + norm kernel."""
    kc.check_gemv_invariant(DEV, dtype, n, k, bias=False, row_counts=(1, 3, 9, 17, 72), epilogue="add_norm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 12288), (1000, 4000), (896, 4864)])
def test_gemv_m1_add_norm(dtype, n, k):
    kc.check_gemv_m1_add_norm(DEV, dtype, n, k, bias=(n == 1000), calls=50)


# fp8 weights at the Qwen3-8B and DeepSeek-V2-Lite shapes, block-scaled (128 x 128,
# partial blocks included) and per row, against their dequantized values.
@pytest.mark.parametrize("fp8", [(128, 128), "channel"], ids=["block", "channel"])
@pytest.mark.parametrize("n,k,silu_mul", [(6144, 4096, False), (4096, 12288, False), (12288, 4096, True),
                                          (3648, 2048, False), (1408, 2048, True), (1000, 4000, False)])
def test_gemv_m1_fp8(fp8, n, k, silu_mul):
    kc.check_gemv_m1(DEV, torch.bfloat16, n, k, bias=(n == 1000), silu_mul=silu_mul, fp8=fp8)


def test_gemv_m1_every_e4m3_value():
    kc.check_gemv_m1_every_e4m3_value(DEV)


@pytest.mark.parametrize("fp8", [(128, 128), "channel"], ids=["block", "channel"])
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 12288), (2048, 1408)])
def test_gemv_m1_add_norm_fp8(fp8, n, k):
    kc.check_gemv_m1_add_norm(DEV, torch.bfloat16, n, k, bias=False, calls=20, fp8=fp8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 151936), (64, 151936), (7, 49152), (256, 151936)])
def test_argmax(dtype, rows, vocab):
    kc.check_argmax(DEV, dtype, rows, vocab)


@pytest.mark.parametrize("n", [1, 100, 4096])
def test_fill_placeholders(n):
    kc.check_fill_placeholders(DEV, n)


@pytest.mark.parametrize("max_k,min_n,max_n,block", [(8, 2, 4, 1024), (4, 1, 3, 64), (16, 5, 5, 1024)])
def test_lookup_drafts(max_k, min_n, max_n, block):
    kc.check_lookup_drafts(DEV, max_k, min_n, max_n, block)


@pytest.mark.parametrize("num_seqs,max_k", [(1, 4), (7, 8), (40, 16)])
def test_resolve_rows(num_seqs, max_k):
    kc.check_resolve_rows(DEV, num_seqs, max_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab,words", [(1, 151936, 4748), (64, 151936, 4748), (8, 151936, 1536)])
def test_apply_token_bitmask(dtype, rows, vocab, words):
    kc.check_apply_token_bitmask(DEV, dtype, rows, vocab, words)


def test_gumbel_never_samples_banned_tokens():
    kc.check_gumbel_never_samples_banned_tokens(DEV, 151936)


def test_gemv_fp32():
    kc.check_gemv(DEV, torch.float32, 1, 4096, 4096, True)
    kc.check_gemv(DEV, torch.float32, 5, 4096, 4096, False)


# ---- CUDA graph ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("merged", [False, True], ids=["two-kernel", "merged"])
def test_decode_attention_cuda_graph(dtype, block_size, merged):
    """Capture store + decode attention once; replay with context lengths longer and
    shorter than at capture time (and a padding row of context 0), new block tables, new
    q/k/v. Each replay must match the reference on the same data. `merged`: with the
    counter workspace in the metadata (one launch), which every replay must leave zero."""
    from agent_infer.attention.dense_triton import DenseTritonBackend
    from agent_infer.kernels.triton.decode_attention import decode_counters
    from agent_infer.kernels.triton.kv_store import store_kv
    from agent_infer.kvcache.layouts import DenseKVCache, DenseKVLayout

    batch, max_blocks = 4, 4200 // block_size + 2
    num_blocks = batch * max_blocks + 5
    shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
    k_cache = kc.randn(*shape, dtype=dtype, device=DEV, seed=21)
    v_cache = kc.randn(*shape, dtype=dtype, device=DEV, seed=22)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = torch.empty(batch, q_size + 2 * kv_size, dtype=dtype, device=DEV)
    q = qkv[:, :q_size].view(batch, HEADS, HEAD_DIM)
    k = qkv[:, q_size : q_size + kv_size].view(batch, KV_HEADS, HEAD_DIM)
    v = qkv[:, q_size + kv_size :].view(batch, KV_HEADS, HEAD_DIM)
    meta = AttentionMetadata(
        is_prefill=False,
        slot_mapping=torch.empty(batch, dtype=torch.long, device=DEV),
        block_tables=torch.empty(batch, max_blocks, dtype=torch.int32, device=DEV),
        context_lens=torch.empty(batch, dtype=torch.int32, device=DEV),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=DEV),
        max_query_len=1,
        query_lens_host=[1] * batch,
        context_lens_host=[],  # nor host lists
        decode_counters=decode_counters(batch, KV_HEADS, DEV) if merged else None,
    )
    scale = HEAD_DIM**-0.5

    def fill(contexts: list[int], seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        perm = torch.randperm(num_blocks, generator=gen)
        tables = torch.zeros(batch, max_blocks, dtype=torch.int32)
        slots = torch.full((batch,), -1, dtype=torch.long)
        for i, ctx in enumerate(contexts):
            tables[i] = perm[i * max_blocks : (i + 1) * max_blocks]
            if ctx > 0:
                pos = ctx - 1
                slots[i] = int(tables[i, pos // block_size]) * block_size + pos % block_size
        meta.block_tables.copy_(tables)
        meta.slot_mapping.copy_(slots)
        meta.context_lens.copy_(torch.tensor(contexts, dtype=torch.int32))
        qkv.copy_(torch.randn(qkv.shape, generator=gen).to(dtype))

    layer = SimpleNamespace(cache_layout=DenseKVLayout(KV_HEADS, HEAD_DIM), num_heads=HEADS)
    backend = DenseTritonBackend(layer, batch, DEV)

    def forward() -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return backend.attend(q, DenseKVCache(k_cache, v_cache), meta, scale)

    fill([1, 17, 300, 2000], seed=0)
    graph, out = kc.capture_graph(forward)

    for seed, contexts in enumerate([[4100, 2, 64, 65], [16, 1000, 33, 0], [1, 17, 300, 2000]], start=1):
        fill(contexts, seed)
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        reference.store_kv(k, v, ref_k, ref_v, meta.slot_mapping)
        real = [i for i, c in enumerate(contexts) if c > 0]
        rows = torch.tensor(real, device=DEV)
        ref = reference.decode_attention(q[rows], ref_k, ref_v, meta.block_tables[rows], meta.context_lens[rows], scale)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v), f"replay {seed}: KV store differs"
        kc.assert_close(out[rows], ref, f"replay {seed} (contexts {contexts})")
        pad = [i for i, c in enumerate(contexts) if c == 0]
        if pad:
            assert torch.equal(out[pad], torch.zeros_like(out[pad])), "padding row must be zeros"
        if merged:
            assert not meta.decode_counters.any(), f"replay {seed}: counters not reset"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 151936), (64, 151936), (7, 49152)])
def test_gumbel_sample(dtype, rows, vocab):
    kc.check_gumbel_sample("cuda", dtype, rows, vocab)
