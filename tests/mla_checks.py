"""Checks of the DeepSeek MLA Triton kernels (latent-cache decode, prefill over
materialised K/V, the fused norm + rope + cache write) against the references in
`agent_infer/kernels/reference.py`; shared by tests/test_triton_interpreter.py (CPU,
Triton's interpreter, odd tiny shapes) and tests/gpu/test_mla_kernels.py (CUDA,
DeepSeek-V2-Lite sizes).

As in tests/kernel_checks.py: random inputs (never zeros), every `torch.empty` made
during a kernel call filled with NaN (so a forgotten output element or scratch slot
fails), in-place kernels compared over whole tensors (stray or missing writes show),
relative error ||out - ref|| / ||ref|| against a per-dtype bound.
"""

from __future__ import annotations

from unittest import mock

import torch

from agent_infer.kernels import reference
from tests.kernel_checks import (
    _gen, assert_close, capture_graph, kv_cache_randn, poisoned_empty, randn, rel_err, same,
)


def rope_table(rope_dim: int, max_pos: int, device) -> torch.Tensor:
    """[max_pos, R] float32, cos of the R/2 frequencies then their sin (layers/rotary.py)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


class LatentBatch:
    """Sequences over a paged latent cache [blocks, block_size, L + R] of random rows, their
    block tables drawn from a shuffled block list (no sequence is contiguous), one unused
    table column (like a graph's static table), and `padding_rows` rows of context 0
    (table of zeros) after the real ones, as a padded graph batch has."""

    def __init__(self, device, dtype: torch.dtype, context_lens: list[int], heads: int, rank: int, rope_dim: int,
                 block_size: int, padding_rows: int = 0, seed: int = 0, pool_layout: bool = False,
                 cache_dtype: torch.dtype | None = None, cache_scale: float = 1.0, row_padding: int = 0):
        self.rank, self.width = rank, rank + rope_dim
        self.cache_scale = cache_scale
        self.real = len(context_lens)
        self.scale = 1.5 * self.width**-0.5  # peaky enough that a wrong key shows
        blocks_per_seq = [-(-c // block_size) for c in context_lens]
        num_blocks = sum(blocks_per_seq) + 3
        perm = torch.randperm(num_blocks, generator=_gen(seed))
        rows = self.real + padding_rows
        tables = torch.zeros(rows, max(blocks_per_seq + [0]) + 1, dtype=torch.int32)
        used = 0
        for i, n in enumerate(blocks_per_seq):
            tables[i, :n] = perm[used : used + n]
            used += n
        # row_padding: the rows as views of wider ones (a row stride past L + R).
        self.kv_cache = kv_cache_randn(num_blocks, block_size, self.width + row_padding, dtype=dtype,
                                       cache_dtype=cache_dtype, device=device, seed=seed + 1)[..., : self.width]
        if pool_layout:  # the KV pool's [blocks, block_size, 1, L + R]
            self.kv_cache = self.kv_cache.unsqueeze(2)
        self.block_tables = tables.to(device)
        self.context_lens = torch.tensor(context_lens + [0] * padding_rows, dtype=torch.int32, device=device)
        # The absorbed query as a strided view (rows wider than L + R), as a slice of a
        # larger buffer would be.
        buf = randn(rows, heads, self.width + 8, dtype=dtype, device=device, seed=seed + 2)
        self.q = buf[:, :, : self.width]

    def reference(self) -> torch.Tensor:
        n = self.real
        return reference.mla_decode(self.q[:n], self.kv_cache, self.block_tables[:n], self.context_lens[:n],
                                    self.scale, self.rank, self.cache_scale)


def _check_rows(out: torch.Tensor, ref: torch.Tensor, real: int, what: str) -> None:
    assert_close(out[:real], ref, what)
    pad = out[real:]
    assert torch.equal(pad, torch.zeros_like(pad)), f"{what}: padding rows (context 0) must be zeros"


def check_mla_decode(
    device, dtype: torch.dtype, context_lens: list[int], heads: int, rank: int, rope_dim: int, block_size: int,
    split_counts: tuple[int, ...] = (), padding_rows: int = 1, config=None, pool_layout: bool = False,
    cache_dtype: torch.dtype | None = None, cache_scale: float = 1.0, row_padding: int = 0,
) -> None:
    """The default call (shape-derived splits, two-kernel merge); then for each forced
    split count the two-kernel path and the in-launch merge (the combine kernel taken
    away, so the merge must happen in the one launch), the latter twice in a row on the
    same counters (the first must leave them zero, counter slack untouched); then the
    default call with counters into a given strided `out`. Padding rows must be zeros.
    `cache_dtype` fp8: the cache's entries times `cache_scale` are the rows. `row_padding`:
    the cache's rows are views of rows that many values wider."""
    from agent_infer.kernels.triton import mla_decode as dec

    b = LatentBatch(device, dtype, context_lens, heads, rank, rope_dim, block_size, padding_rows,
                    pool_layout=pool_layout, cache_dtype=cache_dtype, cache_scale=cache_scale, row_padding=row_padding)
    ref = b.reference()
    args = (b.q, b.kv_cache, b.block_tables, b.context_lens, b.scale, rank)

    def decode(*a, **kw):
        return dec.mla_decode(*a, cache_scale=cache_scale, **kw)
    label = (f"MLA decode (contexts {context_lens} + {padding_rows} empty, H {heads}, L {rank}, R {rope_dim}, {config}, "
             f"cache {b.kv_cache.dtype} x {cache_scale})")
    with poisoned_empty():
        out = decode(*args, config=config)
    assert out.shape == (len(b.context_lens), heads, rank) and out.dtype == dtype
    _check_rows(out, ref, b.real, label)

    rows = len(b.context_lens)
    block_h = config.block_h if config is not None else dec.MIN_BLOCK_H
    need = rows * dec.num_head_blocks(heads, block_h)
    counters = dec.mla_decode_counters(rows + 2, heads, device)
    counters[need:] = 7  # slack: must not be touched
    slack = counters[need:].clone()
    for splits in split_counts:
        with poisoned_empty():
            out = decode(*args, num_splits=splits, config=config)
        _check_rows(out, ref, b.real, f"{label}, {splits} splits, two kernels")
        with mock.patch.object(dec, "_mla_combine_kernel", None):
            for call in range(2):
                what = f"{label}, {splits} splits merged in the launch, call {call}"
                with poisoned_empty():
                    out = decode(*args, num_splits=splits, config=config, counters=counters,
                                         merge_in_launch=True)
                _check_rows(out, ref, b.real, what)
                assert not counters[:need].any(), f"{what}: counters not reset"
                assert torch.equal(counters[need:], slack), f"{what}: counter slack written"

    given = randn(rows, heads, rank + 5, dtype=dtype, device=device, seed=99)
    before = given.clone()
    with poisoned_empty():
        res = decode(*args, out=given[:, :, :rank], counters=counters, config=config)
    assert res.data_ptr() == given.data_ptr()
    _check_rows(given[:, :, :rank], ref, b.real, f"{label}, into a given output")
    assert torch.equal(given[:, :, rank:], before[:, :, rank:]), "decode wrote past its output columns"
    assert not counters[:need].any(), "counters not reset"


def check_mla_decode_repeat(device, dtype: torch.dtype, batch: int, max_context: int, splits: int, iters: int) -> None:
    """Many launches merged in the launch queued back to back (no sync in between), each
    with a new q and NaN-poisoned scratch, checked afterwards against the two-kernel path
    on the same inputs: a merge run before every partial was visible reads NaN or an
    earlier launch's values; a counter left set skips or misplaces a merge. A GPU check
    of the memory ordering (the interpreter runs programs one after another)."""
    from agent_infer.kernels.triton.mla_decode import mla_decode, mla_decode_counters

    gen = _gen(77)
    contexts = torch.randint(1, max_context + 1, (batch,), generator=gen).tolist()
    contexts[0] = max_context
    b = LatentBatch(device, dtype, contexts, 16, 512, 64, 16, padding_rows=0, seed=78)
    counters = mla_decode_counters(batch, 16, device)
    args = (b.kv_cache, b.block_tables, b.context_lens, b.scale, 512)
    qs = [randn(batch, 16, 576, dtype=dtype, device=device, seed=1000 + i) for i in range(iters)]
    with poisoned_empty():
        got = [mla_decode(q, *args, counters=counters, num_splits=splits, merge_in_launch=True) for q in qs]
    for i, q in enumerate(qs):
        assert_close(got[i], mla_decode(q, *args, num_splits=splits), f"merged vs two-kernel MLA decode, launch {i}")
    assert not counters.any(), "counters not reset"


def check_mla_prefill(
    device, dtype: torch.dtype, query_lens: list[int], prefix_lens: list[int], heads: int, nope: int, rope_dim: int,
    vdim: int, config=None,
) -> None:
    """Ragged causal prefill with cached prefixes (nk > nq), inputs as the model has them:
    q_nope / q_pe views of one q projection [T, H, Dn + R], k_nope / v views of one kv_b
    projection [Tk, H, Dn + Dv], k_pe a strided view of latent-cache-like rows. Then into
    a given output: rows outside cu_seqlens_q (a trailing padding row) stay as they were."""
    from agent_infer.kernels.triton.mla_prefill import mla_prefill_attention

    key_lens = [p + q for p, q in zip(prefix_lens, query_lens)]
    tokens, keys = sum(query_lens), sum(key_lens)
    cu_q = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    cu_k = torch.tensor([0] + key_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    q = randn(tokens + 1, heads, nope + rope_dim, dtype=dtype, device=device, seed=11)
    kv = randn(keys, heads, nope + vdim, dtype=dtype, device=device, seed=12)
    rows = randn(keys, 40 + rope_dim, dtype=dtype, device=device, seed=13)
    q_nope, q_pe = q[:tokens, :, :nope], q[:tokens, :, nope:]
    k_nope, v, k_pe = kv[:, :, :nope], kv[:, :, nope:], rows[:, 40:]
    scale = 1.5 * (nope + rope_dim) ** -0.5
    args = (q_nope, q_pe, k_nope, k_pe, v, cu_q, cu_k, max(query_lens), scale)
    ref = reference.mla_prefill_attention(*args)
    label = f"MLA prefill (q {query_lens}, prefix {prefix_lens}, H {heads}, Dn {nope}, R {rope_dim}, Dv {vdim})"
    with poisoned_empty():
        out = mla_prefill_attention(*args, config=config)
    assert out.shape == (tokens, heads, vdim) and out.dtype == dtype
    assert_close(out, ref, label)
    given = randn(tokens + 1, heads, vdim, dtype=dtype, device=device, seed=14)
    before = given.clone()
    res = mla_prefill_attention(*args, out=given[:tokens], config=config)
    assert res.data_ptr() == given.data_ptr()
    assert_close(given[:tokens], ref, f"{label}, into a given output")
    assert torch.equal(given[tokens:], before[tokens:]), "prefill wrote a row past the batch"


def check_mla_prefill_windows(
    device, dtype: torch.dtype, query_lens: list[int], prefix_lens: list[int], width: int, heads: int, nope: int,
    rope_dim: int, vdim: int, config=None,
) -> None:
    """Prefill over a context cut into windows of `width` positions per sequence (as the
    engine cuts long contexts to bound memory): each window's output and log-sum-exp
    against the reference, rows that see none of a window's keys included (0, -inf), and
    the windows merged against the unwindowed reference."""
    from agent_infer.kernels.triton.mla_prefill import mla_prefill_attention_window

    key_lens = [p + q for p, q in zip(prefix_lens, query_lens)]
    tokens, keys = sum(query_lens), sum(key_lens)
    cu_q = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32).to(device)
    cu_k = torch.tensor([0] + key_lens).cumsum(0).to(torch.int32).to(device)
    q = randn(tokens, heads, nope + rope_dim, dtype=dtype, device=device, seed=21)
    kv = randn(keys, heads, nope + vdim, dtype=dtype, device=device, seed=22)
    k_pe = randn(keys, rope_dim, dtype=dtype, device=device, seed=23)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    scale = 1.5 * (nope + rope_dim) ** -0.5
    full = reference.mla_prefill_attention(q_nope, q_pe, kv[..., :nope], k_pe, kv[..., nope:], cu_q, cu_k,
                                           max(query_lens), scale)
    ctx_lens = torch.tensor(key_lens, dtype=torch.int32, device=device)
    first_key = [int(x) for x in cu_k[:-1].tolist()]
    merged = None
    for j in range(-(-max(key_lens) // width)):
        starts = [min(j * width, n) for n in key_lens]
        ends = [min((j + 1) * width, n) for n in key_lens]
        idx = torch.cat([torch.arange(f + a, f + b) for f, a, b in zip(first_key, starts, ends)]).to(device)
        cu_w = torch.tensor([0] + [b - a for a, b in zip(starts, ends)]).cumsum(0).to(torch.int32).to(device)
        start_t = torch.tensor(starts, dtype=torch.int32, device=device)
        args = (q_nope, q_pe, kv[idx, :, :nope], k_pe[idx], kv[idx, :, nope:], cu_q, cu_w, start_t, ctx_lens)
        ref_out, ref_lse = reference.mla_prefill_attention_window(*args, max(query_lens), scale)
        label = f"MLA prefill window {j} x {width} (q {query_lens}, prefix {prefix_lens}, H {heads})"
        with poisoned_empty():
            out, lse = mla_prefill_attention_window(*args, max(query_lens), scale, config=config)
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), f"{label}: rows that see no key differ"
        seen = torch.isfinite(ref_lse)
        assert_close(torch.where(seen, lse, 0.0), torch.where(seen, ref_lse, 0.0), f"{label} lse", dtype)
        assert_close(out, ref_out, label)
        merged = (out, lse) if merged is None else reference.merge_attention_partials(*merged, out, lse)
    assert_close(merged[0], full, f"MLA prefill in windows of {width}, merged")


def check_mla_rope_store(
    device, dtype: torch.dtype, tokens: int, heads: int, rank: int, rope_dim: int, block_size: int,
    is_neox: bool = False, pool_layout: bool = False, absorb: bool = False,
    cache_dtype: torch.dtype | None = None, cache_scale: float = 1.0, cache_tol: float | None = None,
) -> None:
    """The fused kv_a RMSNorm + rope of k_pe and q_pe + cache write against the reference
    (`cache_dtype` fp8: rows divided by `cache_scale`, compared within `cache_tol` where
    Triton's interpreter rounds to fp8 its own way, else bit for bit):
    kv_a a strided view (rows wider than L + R), q_pe a strided view into a q projection
    [T, H, Dn + R], scattered slots with padding (-1); the whole cache, the whole q
    buffer and the whole kv_a buffer are compared (stray writes show; what the kernel
    must not touch is compared bit for bit). `absorb`: mla_rope_store_absorb, which also
    returns the absorbed query [q_nope @ W_UK | rope(q_pe)], W_UK a strided view of a
    kv_b_proj-shaped weight."""
    from agent_infer.kernels.triton.mla_rope_store import mla_rope_store, mla_rope_store_absorb

    width, nope = rank + rope_dim, 24
    max_pos = 4 * tokens + 50
    kv_buf = randn(tokens, width + 6, dtype=dtype, device=device, seed=31)
    q_buf = randn(tokens, heads, nope + rope_dim, dtype=dtype, device=device, seed=32)
    kv_a, q_pe = kv_buf[:, :width], q_buf[:, :, nope:]
    positions = torch.randint(0, max_pos, (tokens,), generator=_gen(33)).to(device)
    weight = (1.0 + 0.3 * randn(rank, dtype=torch.float32, device=device, seed=34)).to(dtype)
    table = rope_table(rope_dim, max_pos, device)
    num_blocks = -(-2 * tokens // block_size) + 2
    slots = torch.randperm(num_blocks * block_size, generator=_gen(35))[:tokens]
    slots[torch.arange(tokens) % 3 == 2] = -1
    slots = slots.to(device)
    cache = kv_cache_randn(num_blocks, block_size, width, dtype=dtype, cache_dtype=cache_dtype, device=device, seed=36)
    if pool_layout:
        cache = cache.unsqueeze(2)
    ref_kv, ref_q, ref_cache = kv_buf.clone(), q_buf.clone(), cache.clone()
    label = f"MLA rope + store (T {tokens}, H {heads}, L {rank}, R {rope_dim}, neox {is_neox}, absorb {absorb})"
    if absorb:
        w_uk = (randn(heads, nope + 8, rank, dtype=torch.float32, device=device, seed=37) * nope**-0.5).to(dtype)
        w_uk = w_uk[:, :nope]
        want = reference.mla_rope_store_absorb(ref_kv[:, :width], ref_q, w_uk, positions, weight, 1e-6, table,
                                               ref_cache, slots, is_neox, cache_scale)
        with poisoned_empty():
            got = mla_rope_store_absorb(kv_a, q_buf, w_uk, positions, weight, 1e-6, table, cache, slots, is_neox,
                                        cache_scale)
        assert got.shape == (tokens, heads, width) and got.dtype == dtype
        assert_close(got[..., :rank], want[..., :rank], f"{label}: q_nope @ W_UK")
        assert_close(got[..., rank:], want[..., rank:], f"{label}: the query's rotated q_pe")
    else:
        reference.mla_rope_store(ref_kv[:, :width], ref_q[:, :, nope:], positions, weight, 1e-6, table, ref_cache,
                                 slots, is_neox, cache_scale)
        with poisoned_empty():
            latent, k_pe = mla_rope_store(kv_a, q_pe, positions, weight, 1e-6, table, cache, slots, is_neox,
                                          cache_scale)
        assert latent.data_ptr() == kv_a.data_ptr() and latent.shape == (tokens, rank), "latent: a view of kv_a"
        assert k_pe.data_ptr() == kv_a[:, rank:].data_ptr() and k_pe.shape == (tokens, rope_dim)
    assert_close(kv_buf[:, :rank], ref_kv[:, :rank], f"{label}: normed latent")
    assert_close(kv_buf[:, rank:width], ref_kv[:, rank:width], f"{label}: rotated k_pe")
    assert torch.equal(kv_buf[:, width:], ref_kv[:, width:]), f"{label}: kv_a written past its row"
    assert_close(q_buf[:, :, nope:], ref_q[:, :, nope:], f"{label}: rotated q_pe")
    assert torch.equal(q_buf[:, :, :nope], ref_q[:, :, :nope]), f"{label}: q_nope must be left alone"
    flat, ref_flat = cache.view(-1, width), ref_cache.view(-1, width)
    written = torch.zeros(flat.shape[0], dtype=torch.bool, device=device)
    written[slots[slots >= 0]] = True
    assert same(flat[~written], ref_flat[~written]), f"{label}: cache written outside the step's slots"
    if cache.dtype == dtype:
        # The cache rows are what kv_a now holds, bit for bit (one value, two stores).
        assert same(flat[slots[slots >= 0]], kv_buf[:, :width][slots >= 0]), f"{label}: cache rows differ from kv_a"
        assert_close(flat[written], ref_flat[written], f"{label}: cache rows")
    else:  # kv_a's rows divided by the scale, as the reference stores them from kv_a's values
        stored = reference.to_cache_dtype(reference.scaled_for_cache(kv_buf[:, :width][slots >= 0], cache_scale),
                                          cache.dtype)
        got_rows, want_rows = flat[slots[slots >= 0]].float(), stored.float()
        if cache_tol is None:
            assert same(got_rows, want_rows), f"{label}: fp8 cache rows differ from kv_a's divided by the scale"
        else:
            err = rel_err(got_rows, want_rows)
            assert err <= cache_tol, f"{label}: fp8 cache rows off by {err:.3g} (> {cache_tol})"


def check_mla_decode_step(
    device, dtype: torch.dtype, block_size: int, batch: int, splits: int | None, merged: bool,
    heads: int = 16, rank: int = 512, rope_dim: int = 64, max_context: int = 4100, capture: bool = True,
) -> None:
    """A decode step's attention on static buffers, as a CUDA graph runs it: the rope +
    cache write (ops.mla_rope_store on kv_a and the query's last R columns) then the
    decode, captured once (`capture`; else run eagerly each time, for the interpreter)
    and replayed with contexts longer and shorter than at capture time, padding rows of
    context 0 (slot -1), new block tables, new inputs. Each replay must match the
    references on the same data and leave the counters zero."""
    from agent_infer.kernels import ops
    from agent_infer.kernels.triton.mla_decode import mla_decode, mla_decode_counters

    width = rank + rope_dim
    max_blocks = max_context // block_size + 2
    num_blocks = batch * max_blocks + 5
    cache = randn(num_blocks, block_size, width, dtype=dtype, device=device, seed=21)
    table = rope_table(rope_dim, 2 * max_context, device)
    weight = (1.0 + 0.3 * randn(rank, dtype=torch.float32, device=device, seed=22)).to(dtype)
    kv_a = torch.empty(batch, width, dtype=dtype, device=device)
    q = torch.empty(batch, heads, width, dtype=dtype, device=device)
    positions = torch.empty(batch, dtype=torch.long, device=device)
    slots = torch.empty(batch, dtype=torch.long, device=device)
    tables = torch.empty(batch, max_blocks, dtype=torch.int32, device=device)
    contexts = torch.empty(batch, dtype=torch.int32, device=device)
    counters = mla_decode_counters(batch, heads, device) if merged else None
    out = torch.empty(batch, heads, rank, dtype=dtype, device=device)
    scale = 1.5 * width**-0.5

    def lens_for(seed: int) -> list[int]:
        lens = torch.randint(1, max_context, (batch,), generator=_gen(100 + seed)).tolist()
        lens[0], lens[-1] = max_context, 0  # the longest, and a padding row
        if batch > 2:
            lens[1] = 1
        return lens

    def fill(lens: list[int], seed: int) -> None:
        gen = _gen(seed)
        perm = torch.randperm(num_blocks, generator=gen)
        t = torch.zeros(batch, max_blocks, dtype=torch.int32)
        s = torch.full((batch,), -1, dtype=torch.long)
        for i, ctx in enumerate(lens):
            t[i] = perm[i * max_blocks : (i + 1) * max_blocks]
            if ctx > 0:
                s[i] = int(t[i, (ctx - 1) // block_size]) * block_size + (ctx - 1) % block_size
        tables.copy_(t)
        slots.copy_(s)
        contexts.copy_(torch.tensor(lens, dtype=torch.int32))
        positions.copy_((torch.tensor(lens) - 1).clamp(min=0))
        kv_a.copy_(torch.randn(kv_a.shape, generator=gen).to(dtype))
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))

    def forward() -> None:
        ops.mla_rope_store(kv_a, q[:, :, rank:], positions, weight, 1e-6, table, cache, slots)
        mla_decode(q, cache, tables, contexts, scale, rank, out=out, counters=counters, num_splits=splits)

    fill(lens_for(0), seed=0)
    if capture:
        graph, _ = capture_graph(forward)
    for seed in (1, 2, 3):
        lens = lens_for(seed)
        fill(lens, seed)
        ref_cache, ref_kv, ref_q = cache.clone(), kv_a.clone(), q.clone()
        reference.mla_rope_store(ref_kv, ref_q[:, :, rank:], positions, weight, 1e-6, table, ref_cache, slots)
        real = torch.tensor([i for i, c in enumerate(lens) if c > 0], device=device)
        ref = reference.mla_decode(ref_q[real], ref_cache, tables[real], contexts[real], scale, rank)
        if capture:
            graph.replay()
            torch.cuda.synchronize()
        else:
            with poisoned_empty():
                forward()
        what = f"replay {seed} (batch {batch}, {splits} splits, merged {merged}, longest {max(lens)})"
        assert_close(cache.float(), ref_cache.float(), f"{what}: latent cache", dtype)
        assert_close(out[real], ref, what)
        pad = [i for i, c in enumerate(lens) if c == 0]
        assert torch.equal(out[pad], torch.zeros_like(out[pad])), f"{what}: padding rows must be zeros"
        if merged:
            assert not counters.any(), f"{what}: counters not reset"
