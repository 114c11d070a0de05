"""Checks of the paged-attention kernels (the K/V store, prefill and decode attention,
their fp8-cache and scaled forms, decode's split merging and row order) against
`agent_infer/kernels/reference.py`, shared by tests/test_triton_interpreter.py and
tests/gpu/test_kernels.py, under the conventions of tests/kernel_checks.py (random
inputs, NaN-poisoned scratch, relative errors)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from agent_infer.attention.metadata import AttentionMetadata
from agent_infer.kernels import reference
from tests.kernel_checks import FP8, _gen, assert_close, fp8_values, kv_cache_randn, poisoned_empty, randn, rel_err, same


class PagedBatch:
    """A ragged batch over a paged cache: random cache contents, block tables drawn from a
    random permutation of the blocks (so sequences are not contiguous), q/k/v as strided
    views of one merged buffer, and the step's metadata."""

    def __init__(
        self, device, dtype: torch.dtype, query_lens: list[int], prefix_lens: list[int],
        heads: int, kv_heads: int, head_dim: int, block_size: int, is_prefill: bool,
        padding_rows: int = 0, seed: int = 0, cache_dtype: torch.dtype | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.kv_scales = kv_scales
        self.scale = head_dim**-0.5
        context_lens = [p + q for p, q in zip(prefix_lens, query_lens)]
        num_seq_blocks = [-(-c // block_size) for c in context_lens]
        num_blocks = sum(num_seq_blocks) + 3
        perm = torch.randperm(num_blocks, generator=_gen(seed))
        width = max(num_seq_blocks) + 1  # one unused column, like a graph's static table
        tables = torch.zeros(len(query_lens), width, dtype=torch.int32)
        used = 0
        for i, n in enumerate(num_seq_blocks):
            tables[i, :n] = perm[used : used + n]
            used += n
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k_cache = kv_cache_randn(*shape, dtype=dtype, cache_dtype=cache_dtype, device=device, seed=seed + 1)
        self.v_cache = kv_cache_randn(*shape, dtype=dtype, cache_dtype=cache_dtype, device=device, seed=seed + 2)
        slots = []
        for i, (q_len, ctx) in enumerate(zip(query_lens, context_lens)):
            pos = torch.arange(ctx - q_len, ctx)
            slots.append(tables[i, pos // block_size].long() * block_size + pos % block_size)
        slots.append(torch.full((padding_rows,), -1, dtype=torch.long))
        slot_mapping = torch.cat(slots)
        tokens = sum(query_lens) + padding_rows
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        qkv = randn(tokens, q_size + 2 * kv_size, dtype=dtype, device=device, seed=seed + 3)
        if cache_dtype == FP8:
            qkv[:, q_size:] = fp8_values(qkv[:, q_size:])
        self.q = qkv[:, :q_size].view(tokens, heads, head_dim)
        self.k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
        self.v = qkv[:, q_size + kv_size :].view(tokens, kv_heads, head_dim)
        if kv_scales != (1.0, 1.0):  # K and V that the cache holds divided by the scales; logits as before
            self.k.mul_(kv_scales[0])
            self.v.mul_(kv_scales[1])
            self.q.div_(kv_scales[0])
        qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(query_lens).cumsum(0)
        self.meta = AttentionMetadata(
            is_prefill=is_prefill,
            slot_mapping=slot_mapping.to(device),
            block_tables=tables.to(device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            query_start_loc=qsl.to(device),
            max_query_len=max(query_lens),
            query_lens_host=list(query_lens),
            context_lens_host=context_lens,
        )


def check_store_kv(
    device, dtype: torch.dtype, tokens: int, kv_heads: int, head_dim: int, block_size: int,
    cache_dtype: torch.dtype | None = None, exact_values: bool = False, kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Scattered slots with padding rows (-1) in between; the whole cache is compared, bit
    for bit. `exact_values`: K and V hold values an fp8 cache stores exactly (for the
    interpreter); otherwise an fp8 store must round as torch does, and saturate.
    `kv_scales` (an fp8 cache): K and V are those values times the scales, and the cache
    must hold them divided back, exactly."""
    from agent_infer.kernels.triton.kv_store import store_kv

    num_blocks = -(-2 * tokens // block_size) + 2
    slots = torch.randperm(num_blocks * block_size, generator=_gen(9))[:tokens]
    slots[torch.arange(tokens) % 3 == 1] = -1
    slots = slots.to(device)
    kv = randn(tokens, 3 * kv_heads * head_dim, dtype=dtype, device=device, seed=10)
    if cache_dtype == FP8:
        kv = fp8_values(kv) if exact_values else kv * 200  # past +-448 too: saturates
    k = kv[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = kv[:, 2 * kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    stored_k, stored_v = k.clone(), v.clone()
    k.mul_(kv_scales[0])
    v.mul_(kv_scales[1])
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = kv_cache_randn(*shape, dtype=dtype, cache_dtype=cache_dtype, device=device, seed=11)
    v_cache = kv_cache_randn(*shape, dtype=dtype, cache_dtype=cache_dtype, device=device, seed=12)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(k, v, ref_k, ref_v, slots, *kv_scales)
    store_kv(k, v, k_cache, v_cache, slots, *kv_scales)
    assert same(k_cache, ref_k), "store_kv: K cache differs from the reference"
    assert same(v_cache, ref_v), "store_kv: V cache differs from the reference"
    if exact_values:  # what the cache holds, times the scales, is K and V
        keep = slots >= 0
        for cache, x in ((k_cache, stored_k), (v_cache, stored_v)):
            held = cache.view(-1, kv_heads, head_dim)[slots[keep]].to(dtype)
            assert torch.equal(held, x[keep]), "store_kv: the cache does not hold the values divided by their scale"
    assert torch.isfinite(k_cache.float()).all() and torch.isfinite(v_cache.float()).all()


def _run_backends(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor, PagedBatch]:
    """The step's K/V stored (Triton's store against the reference's), then each backend
    attends over its cache."""
    from agent_infer.attention.dense_torch import DenseTorchBackend
    from agent_infer.attention.dense_triton import DenseTritonBackend
    from agent_infer.kernels.triton.kv_store import store_kv
    from agent_infer.kvcache.layouts import DenseKVCache, DenseKVLayout

    layer = SimpleNamespace(cache_layout=DenseKVLayout(batch.k_cache.shape[2], batch.k_cache.shape[3]),
                            num_heads=batch.q.shape[1])
    ks, vs = batch.kv_scales
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    reference.store_kv(batch.k, batch.v, ref_k, ref_v, batch.meta.slot_mapping, ks, vs)
    ref = DenseTorchBackend(layer, 1, batch.q.device).attend(
        batch.q, DenseKVCache(ref_k, ref_v, ks, vs), batch.meta, batch.scale
    )
    with poisoned_empty():
        store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping, ks, vs)
        out = DenseTritonBackend(layer, 1, batch.q.device).attend(
            batch.q, DenseKVCache(batch.k_cache, batch.v_cache, ks, vs), batch.meta, batch.scale
        )
    assert same(batch.k_cache, ref_k) and same(batch.v_cache, ref_v), "KV store differs"
    return out, ref, batch


def check_prefill(
    device, dtype: torch.dtype, query_lens: list[int], prefix_lens: list[int],
    heads: int, kv_heads: int, head_dim: int, block_size: int, cache_dtype: torch.dtype | None = None,
) -> None:
    """Through the backend (store + attend); then, with several sequences, the kernel from
    the second sequence on into a given output (a mixed step's call): the first
    sequence's rows keep what they held, the others match the reference."""
    from agent_infer.kernels.triton.prefill_attention import prefill_attention

    batch = PagedBatch(device, dtype, query_lens, prefix_lens, heads, kv_heads, head_dim, block_size, True,
                       cache_dtype=cache_dtype)
    out, ref, _ = _run_backends(batch)
    assert_close(out, ref, f"prefill attention (q {query_lens}, prefix {prefix_lens})")
    if len(query_lens) > 1:
        m = batch.meta
        given = torch.randn_like(out)
        before = given.clone()
        res = prefill_attention(
            batch.q, batch.k_cache, batch.v_cache, m.block_tables, m.query_start_loc, m.context_lens,
            m.max_query_len, batch.scale, out=given, first_seq=1,
        )
        assert res is given
        first = query_lens[0]
        assert torch.equal(given[:first], before[:first]), "rows before first_seq were written"
        assert_close(given[first:], ref[first:], f"prefill attention from the second sequence (q {query_lens})")


def check_decode(
    device, dtype: torch.dtype, context_lens: list[int], heads: int, kv_heads: int, head_dim: int,
    block_size: int, num_splits: int | None = None, cache_dtype: torch.dtype | None = None,
) -> None:
    """Through the backend (store + attend) with the default split count, then with the
    given `num_splits` through the kernel directly, with and without the first key tile
    loaded before the PDL wait (two code paths of the kernel)."""
    from agent_infer.kernels.triton.decode_attention import decode_attention

    batch = PagedBatch(
        device, dtype, [1] * len(context_lens), [c - 1 for c in context_lens],
        heads, kv_heads, head_dim, block_size, False, cache_dtype=cache_dtype,
    )
    out, ref, _ = _run_backends(batch)
    assert_close(out, ref, f"decode attention (contexts {context_lens})")
    if num_splits is not None:
        m = batch.meta
        for preload in (True, False):
            with poisoned_empty():
                out = decode_attention(
                    batch.q, batch.k_cache, batch.v_cache, m.block_tables, m.context_lens, batch.scale, num_splits,
                    preload=preload,
                )
            assert_close(out, ref, f"decode attention (contexts {context_lens}, {num_splits} splits, preload {preload})")
    if len(context_lens) > 1:  # a mixed step's call: the first rows, whole tables, a given output
        m, k = batch.meta, len(context_lens) - 1
        given = torch.randn_like(ref)
        before = given.clone()
        decode_attention(
            batch.q[:k], batch.k_cache, batch.v_cache, m.block_tables, m.context_lens, batch.scale, num_splits,
            out=given[:k],
        )
        assert torch.equal(given[k:], before[k:]), "decode wrote past its rows"
        assert_close(given[:k], ref[:k], f"decode attention into a given output (contexts {context_lens[:k]})")


def check_attention_kv_scales(device, dtype: torch.dtype, prefill: bool, kv_scales: tuple[float, float]) -> None:
    """An fp8 cache with per-layer scales, K and V far past +-448: both backends attend as
    over a cache in the model's dtype holding K and V themselves (the scales are powers of
    two and the values fp8's, so the scaled cache is exact); stored and read with scale 1
    instead, the same K and V saturate and the output is wrong (what the test tells
    apart)."""
    from agent_infer.attention.dense_torch import DenseTorchBackend
    from agent_infer.kvcache.layouts import DenseKVCache, DenseKVLayout

    if prefill:
        batch = PagedBatch(device, dtype, [5, 17, 33], [0, 16, 23], 8, 2, 64, 16, True, cache_dtype=FP8,
                           kv_scales=kv_scales)
    else:
        batch = PagedBatch(device, dtype, [1, 1, 1], [0, 16, 99], 8, 2, 64, 16, False, cache_dtype=FP8,
                           kv_scales=kv_scales)
    ks, vs = kv_scales
    assert batch.k.abs().max() > 448 and batch.v.abs().max() > 448, "the test needs values that saturate unscaled"
    layer = SimpleNamespace(cache_layout=DenseKVLayout(batch.kv_heads, batch.head_dim), num_heads=batch.heads)
    slots = batch.meta.slot_mapping
    k_full, v_full = batch.k_cache.to(dtype) * ks, batch.v_cache.to(dtype) * vs  # the prefix's K and V
    reference.store_kv(batch.k, batch.v, k_full, v_full, slots)
    full = DenseTorchBackend(layer, 1, batch.q.device).attend(batch.q, DenseKVCache(k_full, v_full), batch.meta,
                                                             batch.scale)
    k_sat, v_sat = batch.k_cache.clone(), batch.v_cache.clone()
    out, ref, _ = _run_backends(batch)
    what = f"{'prefill' if prefill else 'decode'} attention over an fp8 cache with scales {kv_scales}"
    assert_close(out, ref, what + ": Triton against the reference")
    assert_close(ref.float(), full.float(), what + ": against the full-precision cache", dtype)
    assert_close(out.float(), full.float(), what + ": Triton against the full-precision cache", dtype)
    reference.store_kv(batch.k, batch.v, k_sat, v_sat, slots)
    unscaled = DenseTorchBackend(layer, 1, batch.q.device).attend(batch.q, DenseKVCache(k_sat, v_sat), batch.meta,
                                                                 batch.scale)
    assert rel_err(unscaled.float(), full.float()) > 0.1, "scale 1 should have saturated these K and V"


def check_attention_scale_share(device, prefill: bool) -> None:
    """Over an fp8 cache, attention does not depend on how the checkpoint shares the
    scores' magnitude between q and K: the same cache entries under a K scale 2^16 times
    larger, with a query 2^16 times smaller (bf16 holds both exactly), give the same
    output bit for bit. (Rounded to fp16 for the dots before the scales multiply it in,
    such a query falls among fp16's subnormals and loses its digits.)"""
    outs = []
    for ks in (2.0, 2.0**17):
        if prefill:
            batch = PagedBatch(device, torch.bfloat16, [5, 17, 33], [0, 16, 23], 8, 2, 64, 16, True,
                               cache_dtype=FP8, kv_scales=(ks, 1.0))
        else:
            batch = PagedBatch(device, torch.bfloat16, [1, 1, 1], [0, 16, 99], 8, 2, 64, 16, False,
                               cache_dtype=FP8, kv_scales=(ks, 1.0))
        outs.append(_run_backends(batch)[0])
    assert same(outs[0], outs[1]), f"{'prefill' if prefill else 'decode'}: the output moved with the K scale"


def check_decode_order(device, dtype: torch.dtype, context_lens: list[int], num_splits: int) -> None:
    """Sequences taken in a given order (`order`, forced on): longest first and a shuffle
    both give the reference, with merged splits and without; an order that lists a row
    twice and leaves one out leaves that row's output untouched (the grid really goes by
    the order, and each program reads and writes the row it names)."""
    from agent_infer.attention.metadata import longest_first
    from agent_infer.kernels.triton.decode_attention import decode_attention, decode_counters

    batch = PagedBatch(
        device, dtype, [1] * len(context_lens), [c - 1 for c in context_lens], 8, 2, 64, 16, False,
    )
    m = batch.meta
    out, ref, _ = _run_backends(batch)  # stores this step's K/V; the reference output
    n = len(context_lens)
    shuffled = torch.randperm(n, generator=_gen(5)).to(torch.int32)
    orders = {"longest first": torch.from_numpy(longest_first(m.context_lens.cpu().numpy())), "shuffled": shuffled}
    counters = decode_counters(n, 2, device)
    for name, order in orders.items():
        for merged in (None, counters):
            with poisoned_empty():
                got = decode_attention(batch.q, batch.k_cache, batch.v_cache, m.block_tables, m.context_lens,
                                       batch.scale, num_splits, counters=merged, order=order.to(device), ordered=True)
            assert_close(got, ref, f"decode attention, {name}, {num_splits} splits, merged {merged is not None}")
    # One split: with several, the second kernel that merges them goes by rows, not the order.
    skip = torch.tensor([0] + list(range(0, n - 1)), dtype=torch.int32, device=device)  # row n - 1 left out
    given = torch.randn_like(ref)
    before = given.clone()
    decode_attention(batch.q, batch.k_cache, batch.v_cache, m.block_tables, m.context_lens, batch.scale, 1,
                     out=given, order=skip, ordered=True)
    assert torch.equal(given[n - 1], before[n - 1]), "a row the order leaves out was written"
    assert_close(given[: n - 1], ref[: n - 1], "decode attention, the rows the order names")


def check_decode_padding_rows(device, dtype: torch.dtype, block_size: int, num_splits: int) -> None:
    """A graph batch padded with rows of context 0 (slot -1): real rows match the
    reference, padding rows are zeros (never NaN), and nothing is stored for them."""
    from agent_infer.kernels.triton.decode_attention import decode_attention
    from agent_infer.kernels.triton.kv_store import store_kv

    batch = PagedBatch(device, dtype, [1, 1], [20, 40], 8, 2, 64, block_size, False, padding_rows=2)
    m = batch.meta
    contexts = torch.cat([m.context_lens, torch.zeros(2, dtype=torch.int32, device=device)])
    tables = torch.cat([m.block_tables, torch.zeros_like(m.block_tables[:2])])
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    reference.store_kv(batch.k, batch.v, ref_k, ref_v, m.slot_mapping)
    store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, m.slot_mapping)
    assert torch.equal(batch.k_cache, ref_k) and torch.equal(batch.v_cache, ref_v)
    with poisoned_empty():
        out = decode_attention(batch.q, batch.k_cache, batch.v_cache, tables, contexts, batch.scale, num_splits)
    ref = reference.decode_attention(batch.q[:2], ref_k, ref_v, m.block_tables, m.context_lens, batch.scale)
    assert_close(out[:2], ref, "decode attention, real rows of a padded batch")
    assert torch.equal(out[2:], torch.zeros_like(out[2:])), "padding rows (context 0) must be zeros"


def check_decode_merged(
    device, dtype: torch.dtype, context_lens: list[int], heads: int, kv_heads: int, head_dim: int,
    block_size: int, split_counts: tuple[int, ...], padding_rows: int = 0,
) -> None:
    """Splits merged in the same launch (the counter workspace): for each forced split
    count, two calls in a row on the same counters (the first must leave them zero, or
    the second merges at the wrong time), with `padding_rows` rows of context 0 that must
    come out as zeros. The two-kernel combine is taken away, so the merge must happen in
    the one launch; counter slack past batch x KV heads must stay untouched. The second
    call runs the kernel without the first-tile preload, so both variants merge. Then once
    through the backend with the counters in the metadata and the default split count."""
    from unittest import mock

    from agent_infer.kernels.triton import decode_attention as dec
    from agent_infer.kernels.triton.kv_store import store_kv

    batch = PagedBatch(
        device, dtype, [1] * len(context_lens), [c - 1 for c in context_lens],
        heads, kv_heads, head_dim, block_size, False, padding_rows=padding_rows,
    )
    m = batch.meta
    real = len(context_lens)
    contexts = torch.cat([m.context_lens, torch.zeros(padding_rows, dtype=torch.int32, device=device)])
    pad_tables = torch.zeros(padding_rows, m.block_tables.shape[1], dtype=torch.int32, device=device)
    tables = torch.cat([m.block_tables, pad_tables])
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    reference.store_kv(batch.k, batch.v, ref_k, ref_v, m.slot_mapping)
    store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, m.slot_mapping)
    ref = reference.decode_attention(batch.q[:real], ref_k, ref_v, m.block_tables, m.context_lens, batch.scale)
    total = real + padding_rows
    counters = dec.decode_counters(total + 2, kv_heads, device)
    counters[total * kv_heads :] = 7  # slack: must not be touched
    slack = counters[total * kv_heads :].clone()
    with mock.patch.object(dec, "_decode_combine_kernel", None):
        for splits in split_counts:
            for call in range(2):
                what = f"merged decode (contexts {context_lens} + {padding_rows} empty, {splits} splits, call {call})"
                with poisoned_empty():
                    out = dec.decode_attention(
                        batch.q, batch.k_cache, batch.v_cache, tables, contexts, batch.scale, splits, counters=counters,
                        preload=call == 0,
                    )
                assert_close(out[:real], ref, what)
                assert torch.equal(out[real:], torch.zeros_like(out[real:])), f"{what}: padding rows must be zeros"
                assert not counters[: total * kv_heads].any(), f"{what}: counters not reset"
                assert torch.equal(counters[total * kv_heads :], slack), f"{what}: counter slack written"
    if padding_rows == 0:
        m.decode_counters = counters
        out, ref2, _ = _run_backends(batch)
        assert_close(out, ref2, f"merged decode through the backend (contexts {context_lens})")
        assert not counters[: total * kv_heads].any(), "backend call left counters set"


def check_decode_merged_repeat(
    device, dtype: torch.dtype, batch_size: int, max_context: int, splits: int, iters: int
) -> None:
    """Many merged launches queued back to back (no sync in between), each with a new q
    and NaN-poisoned scratch, checked afterwards against the two-kernel path on the same
    inputs: a merge that ran before every split's partial was visible would read NaN or
    an earlier launch's values, and a counter left set would skip or misplace a merge. A
    GPU check of the memory ordering (the interpreter runs programs one after another)."""
    from agent_infer.kernels.triton.decode_attention import decode_attention, decode_counters

    gen = _gen(77)
    contexts = torch.randint(1, max_context + 1, (batch_size,), generator=gen).tolist()
    contexts[0] = max_context
    batch = PagedBatch(device, dtype, [1] * batch_size, [c - 1 for c in contexts], 32, 8, 128, 16, False, seed=78)
    m = batch.meta
    counters = decode_counters(batch_size, 8, device)
    args = (batch.k_cache, batch.v_cache, m.block_tables, m.context_lens, batch.scale, splits)
    qs = [randn(batch_size, 32, 128, dtype=dtype, device=device, seed=1000 + i) for i in range(iters)]
    with poisoned_empty():
        got = [decode_attention(q, *args, counters=counters) for q in qs]
    for i, q in enumerate(qs):
        assert_close(got[i], decode_attention(q, *args), f"merged vs two-kernel decode, launch {i}")
    assert not counters.any(), "counters not reset"


def check_decode_shares(
    device, dtype: torch.dtype, context_lens: list[int], shares: int, grids: tuple[int, ...], preload: bool,
    padding_rows: int = 1, heads: int = 6, kv_heads: int = 2, head_dim: int = 32, block_size: int = 16,
    cache_dtype: torch.dtype | None = None,
) -> None:
    """The batch-invariant mode's decode: a batch whose grid has fewer programs than the
    one-row step's `shares` (each of `grids`), every program taking several shares of its
    row, gives each row bitwise what a launch of that row alone at `shares` splits (with
    `preload`, whose tile order the shares keep) gives, padding rows zeros, the counters
    left zero; and it is close to the reference."""
    from agent_infer.kernels.triton import decode_attention as dec
    from agent_infer.kernels.triton.kv_store import store_kv

    batch = PagedBatch(device, dtype, [1] * len(context_lens), [c - 1 for c in context_lens], heads, kv_heads,
                       head_dim, block_size, False, padding_rows=padding_rows, cache_dtype=cache_dtype)
    m = batch.meta
    real, total = len(context_lens), len(context_lens) + padding_rows
    contexts = torch.cat([m.context_lens, torch.zeros(padding_rows, dtype=torch.int32, device=device)])
    tables = torch.cat([m.block_tables, torch.zeros(padding_rows, m.block_tables.shape[1], dtype=torch.int32,
                                                    device=device)])
    store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, m.slot_mapping)
    counters = dec.decode_counters(total, kv_heads, device)
    args = (batch.k_cache, batch.v_cache, tables, contexts, batch.scale)
    alone = []
    for i in range(total):
        with poisoned_empty():
            alone.append(dec.decode_attention(batch.q[i : i + 1], *args[:2], tables[i : i + 1], contexts[i : i + 1],
                                              batch.scale, shares, counters=counters, preload=preload))
    alone = torch.cat(alone)
    ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
    ref = reference.decode_attention(batch.q[:real], ref_k, ref_v, m.block_tables, m.context_lens, batch.scale)
    assert_close(alone[:real], ref, f"one-row decode at {shares} splits (contexts {context_lens})")
    for grid in grids:
        plan = dec.launch_plan(total, kv_heads, heads // kv_heads, head_dim, True, False, device, grid, preload,
                               shares=shares)
        assert (plan.splits, plan.shares) == (grid, shares), plan
        what = f"decode of {total} rows, {grid} programs a row over {shares} shares (contexts {context_lens})"
        with poisoned_empty():
            out = dec.decode_attention(batch.q[:total], *args, grid, counters=counters, preload=preload,
                                       shares=shares)
        assert same(out, alone), f"{what}: rows differ from their one-row launches"
        assert torch.equal(out[real:], torch.zeros_like(out[real:])), f"{what}: padding rows must be zeros"
        assert not counters.any(), f"{what}: counters not reset"
