"""The kernels of the throughput workload (bench throughput: 256 requests, prompts and
outputs of 100-1024 tokens) at its own shapes, Qwen3-8B, bf16, one GPU: a decode step at
batch 256 and a prefill step of 14 prompts of 562 tokens (7,868 tokens, what an
8,192-token step budget takes), with alternative configurations beside the defaults, and
the read bandwidth that bounds the KV-cache reads. Two sections follow the workload's
falling batch instead: decode attention by split count (`splits`) and the 36 layers'
GEMMs in one graph, cuBLAS against the Triton skinny GEMM (`chain`); `blas` compares
cuBLAS with cuBLASLt at every captured decode batch and at prefill sizes;
`prefill_rows` times a layer's GEMMs per token by prefill step size; `tunable` lets
PyTorch's TunableOp time every GEMM algorithm it offers per decode shape and compares
the fastest with cuBLAS's own pick.

    python benchmarks/throughput_kernels.py [--quick] [--block-size N] [--kv-cache-dtype fp8] [--tunable-rows 32,64,...]
        [--only read,decode,splits,prefill,rope,sampling,linears,chain,blas,prefill_rows,tunable]

Decode kernels run in CUDA graphs (as the engine runs them); the others take the median
of triton.testing.do_bench (L2 flushed before each call). Each line prints as it goes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from agent_infer.attention.metadata import longest_first  # noqa: E402
from agent_infer.bench.roofline import copy_rate_tbs  # noqa: E402
from benchmarks.gemv_chain import graph_time_us  # noqa: E402
from agent_infer.kernels import reference  # noqa: E402
from agent_infer.kernels.triton.decode_attention import (  # noqa: E402
    DecodeConfig,
    decode_attention,
    decode_counters,
    decode_num_splits,
    ordered_rows,
)
from agent_infer.kernels.triton.gemv import MAX_M, GemvConfig, default_config, split_for  # noqa: E402
from agent_infer.kernels.triton.gemv import linear as gemv_linear  # noqa: E402
from agent_infer.kernels.triton.prefill_attention import (  # noqa: E402
    PrefillConfig,
    prefill_attention,
)
from agent_infer.kernels.triton.rope_store import norm_rope_store  # noqa: E402
from agent_infer.kernels.triton.sampling import gumbel_sample  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, BLOCK = 4096, 32, 8, 128, 12288, 151936, 16
DTYPE, DEV = torch.bfloat16, "cuda"
DECODE_BATCH, CTX_LO, CTX_HI = 256, 200, 1400
PREFILL_SEQS, PREFILL_LEN = 14, 562
LINEARS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def bench(fn, rep: int = 50) -> float:
    return do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3


def bench_graph(fn) -> float:
    return do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK_E: tl.constexpr):
    # Each program sums a grid-strided share: a pure stream of loads, one store.
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for start in range(pid * BLOCK_E, n, tl.num_programs(0) * BLOCK_E):
        offs = start + tl.arange(0, BLOCK_E)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def read_bandwidth() -> None:
    print("\n== HBM bandwidth (8 GiB bf16) ==")
    x = torch.randn(4 << 30, dtype=DTYPE, device=DEV)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    nbytes = x.numel() * 2
    best = None
    for per_sm in (2, 4, 8):
        for block in (4096, 8192):
            out = torch.empty(sms * per_sm, dtype=torch.float32, device=DEV)
            t = bench(lambda: _read_kernel[(sms * per_sm,)](x, out, x.numel(), BLOCK_E=block, num_warps=8), rep=20)
            print(f"  read  {per_sm} programs/SM, {block} elems: {t:8.1f} us  {nbytes / t / 1e6:6.2f} TB/s", flush=True)
            best = t if best is None else min(best, t)
    print(f"  copy (read + write, as bench latency's roofline measures it): {copy_rate_tbs(DEV):6.2f} TB/s")
    print(f"  best read: {nbytes / best / 1e6:.2f} TB/s")


def decode(quick: bool, block: int = BLOCK, fp8: bool = False) -> None:
    cache = "an fp8 cache (against bf16's default)" if fp8 else "a bf16 cache"
    print(f"\n== decode attention, batch {DECODE_BATCH}, contexts uniform in [{CTX_LO}, {CTX_HI}], cache blocks of "
          f"{block} tokens, {cache}, CUDA graph ==")
    gen = torch.Generator().manual_seed(0)
    max_blocks = triton.cdiv(CTX_HI, block)
    blocks = DECODE_BATCH * max_blocks + 8
    k_cache = torch.randn(blocks, block, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(blocks - 8, generator=gen)[: DECODE_BATCH * max_blocks].view(DECODE_BATCH, -1)
    tables = tables.to(torch.int32).to(DEV)
    lens = torch.randint(CTX_LO, CTX_HI + 1, (DECODE_BATCH,), generator=gen).to(torch.int32).to(DEV)
    q = torch.randn(DECODE_BATCH, HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
    counters = decode_counters(DECODE_BATCH, KV_HEADS, DEV)
    scale = HEAD_DIM**-0.5
    if fp8:
        t_bf16 = bench_graph(lambda: decode_attention(q, k_cache, v_cache, tables, lens, scale, counters=counters))
        print(f"  bf16 cache, default: {t_bf16:7.1f} us")
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
        # The reference: the same fp8 values in a bf16 cache.
        want = decode_attention(q, k_cache.to(DTYPE), v_cache.to(DTYPE), tables, lens, scale)
    else:
        want = decode_attention(q, k_cache, v_cache, tables, lens, scale)
    kv_bytes = 2 * int(lens.sum()) * KV_HEADS * HEAD_DIM * k_cache.element_size()
    # The closest rivals of the default in a full sweep (n 32/64/128 x warps 2/4/8 x stages 1/2/3/4 x
    # splits 1/2) on an H200: enough to see whether a new GPU or Triton moves the choice.
    # Five stages added: the first depth that double-buffers the paged tiles (gpu_kernels.py).
    configs = [None, DecodeConfig(64, 4, 2), DecodeConfig(64, 4, 3), DecodeConfig(128, 4, 3), DecodeConfig(128, 8, 3),
               DecodeConfig(64, 2, 3), DecodeConfig(64, 4, 1), DecodeConfig(64, 8, 2), DecodeConfig(64, 4, 5),
               DecodeConfig(32, 4, 5)]
    if quick:
        configs = configs[:2]
    rows = []
    for cfg in configs:
        for splits in (1, 2):
            fn = lambda: decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=splits,  # noqa: E731
                                          config=cfg, counters=counters)
            torch.testing.assert_close(fn(), want, rtol=2e-2, atol=2e-2)
            t = bench_graph(fn)
            name = "default" if cfg is None else f"n{cfg.block_n} w{cfg.num_warps} st{cfg.num_stages}"
            rows.append((t, name, splits))
            print(f"  {name:16s} splits {splits}: {t:7.1f} us  {kv_bytes / t / 1e6:5.2f} TB/s", flush=True)
    t, name, splits = min(rows)
    print(f"  best: {name} splits {splits}: {t:.1f} us  {kv_bytes / t / 1e6:.2f} TB/s")


# (name, query lengths, cached prefix per sequence): the workload's step first.
PREFILL_CASES = (("14 x 562", [PREFILL_LEN] * PREFILL_SEQS, 0), ("1 x 512", [512], 0), ("4 x 2048", [2048] * 4, 0),
                 ("8 x 1024 +256 cached", [1024] * 8, 256))
PREFILL_CONFIGS = (None, PrefillConfig(128, 64, 8, 3), PrefillConfig(64, 32, 4, 2), PrefillConfig(64, 64, 4, 3),
                   PrefillConfig(64, 32, 4, 5))


def prefill(quick: bool) -> None:
    print("\n== prefill attention (paged cache, block 16) ==")
    scale = HEAD_DIM**-0.5
    for case, q_lens, prefix in PREFILL_CASES[:1] if quick else PREFILL_CASES:
        ctx = [n + prefix for n in q_lens]
        nb = triton.cdiv(max(ctx), BLOCK)
        k_cache = torch.randn(len(ctx) * nb + 8, BLOCK, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(len(ctx) * nb, device=DEV).to(torch.int32).view(len(ctx), nb)
        tokens = sum(q_lens)
        q = torch.randn(tokens, HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
        qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEV)
        lens = torch.tensor(ctx, dtype=torch.int32, device=DEV)
        flops = 4 * HEADS * HEAD_DIM * sum(n * (prefix + (n + 1) / 2) for n in q_lens)
        ref = reference.prefill_attention(q, k_cache, v_cache, tables, q_lens, ctx, scale)
        line = []
        for cfg in PREFILL_CONFIGS:
            fn = lambda: prefill_attention(q, k_cache, v_cache, tables, qsl, lens, max(q_lens), scale, cfg)  # noqa: E731
            torch.testing.assert_close(fn(), ref, rtol=2e-2, atol=2e-2)
            t = bench(fn)
            name = "default" if cfg is None else f"m{cfg.block_m} n{cfg.block_n} w{cfg.num_warps} st{cfg.num_stages}"
            line.append(f"{name} {t:.1f} us ({flops / t / 1e6:.0f} TFLOP/s)")
        del ref
        print(f"  {case:22s}: " + "; ".join(line), flush=True)


def _orders(lens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same context lengths in three row orders: as drawn, longest first, and
    alternating longest / shortest."""
    desc = lens.sort(descending=True).values
    alt = torch.empty_like(desc)
    half = (len(desc) + 1) // 2
    alt[0::2] = desc[:half]
    alt[1::2] = desc[half:].flip(0)
    return {"random": lens, "longest first": desc, "long/short": alt}


def splits() -> None:
    """Decode attention over the workload's falling batch: at decode step s about
    256 * (1 - s / 1024) sequences remain, with contexts of their prompt (100-1024) + s.
    Times each split count; the engine's rule (decode_num_splits) is marked. Then the
    rule's split count with the rows in other orders (the grid runs sequences in order:
    with the longest first, they no longer finish alone at the end of the call)."""
    print("\n== decode attention by split count over the workload's batches, CUDA graph ==")
    gen = torch.Generator().manual_seed(1)
    counters = decode_counters(DECODE_BATCH, KV_HEADS, DEV)
    scale = HEAD_DIM**-0.5
    for batch in (8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 72, 80, 96, 128, 192, 256):
        step = int(1024 * (1 - batch / 256))
        lens = torch.randint(100 + step, 1025 + step, (batch,), generator=gen).to(torch.int32)
        max_blocks = triton.cdiv(int(lens.max()), BLOCK)
        k_cache = torch.randn(batch * max_blocks + 8, BLOCK, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(batch * max_blocks, generator=gen).to(torch.int32).view(batch, -1).to(DEV)
        lens = lens.to(DEV)
        q = torch.randn(batch, HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
        kv_bytes = 2 * int(lens.sum()) * KV_HEADS * HEAD_DIM * 2
        rule = decode_num_splits(batch, KV_HEADS, q.device)
        ordered = ordered_rows(batch, KV_HEADS, rule, rule > 1, q.device)
        line = []
        for n in sorted({1, 2, 4, 8, rule}):
            t = bench_graph(lambda: decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=n,
                                                     counters=counters))
            line.append(f"{n}{'*' if n == rule else ''}: {t:6.1f} us {kv_bytes / t / 1e6:4.2f}")
        print(f"  batch {batch:3d}, contexts {100 + step}-{1024 + step}: " + "; ".join(line), flush=True)
        line = []
        for name, ordered_lens in _orders(lens).items():
            t = bench_graph(lambda: decode_attention(q, k_cache, v_cache, tables, ordered_lens, scale,
                                                     num_splits=rule, counters=counters))
            line.append(f"{name} {t:6.1f} us {kv_bytes / t / 1e6:4.2f}")
        # As the engine does it: rows as drawn, the grid through `order` (longest first).
        order = torch.from_numpy(longest_first(lens.cpu().numpy())).to(DEV)
        t = bench_graph(lambda: decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=rule,
                                                 counters=counters, order=order, ordered=True))
        line.append(f"order tensor {t:6.1f} us {kv_bytes / t / 1e6:4.2f}")
        print(f"      splits {rule}, by row order (the engine orders: {ordered}): " + "; ".join(line), flush=True)


def rope() -> None:
    print("\n== q/k norm + RoPE + KV write (Qwen3: q/k norms on) ==")
    for tokens, graph in ((DECODE_BATCH, True), (PREFILL_SEQS * PREFILL_LEN, False)):
        qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=DTYPE, device=DEV)
        q = qkv[:, : HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
        k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
        v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(tokens, KV_HEADS, HEAD_DIM)
        pos = torch.randint(0, 2048, (tokens,), device=DEV)
        cache = torch.randn(4096, HEAD_DIM, device=DEV)
        w = torch.randn(HEAD_DIM, dtype=DTYPE, device=DEV)
        blocks = triton.cdiv(tokens, BLOCK) + 8
        kc = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
        vc = torch.randn_like(kc)
        slots = torch.randperm(blocks * BLOCK, device=DEV)[:tokens]
        nbytes = 2 * qkv.numel() * 2 + 2 * k.numel() * 2  # q, k read + written, v read; K and V written
        for heads in (1, None):
            fn = lambda: norm_rope_store(pos, q, k, v, w, w, 1e-6, cache, True, kc, vc, slots, heads=heads)  # noqa: E731
            t = bench_graph(fn) if graph else bench(fn)
            label = "one head" if heads == 1 else "auto"
            print(f"  T={tokens:5d} {label:9s}: {t:7.1f} us  {nbytes / t / 1e3:6.0f} GB/s", flush=True)


def sampling() -> None:
    print(f"\n== temperature sampling, {DECODE_BATCH} rows x {VOCAB} ==")
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.randn(DECODE_BATCH, VOCAB, dtype=dtype, device=DEV)
        temp = torch.full((DECODE_BATCH,), 0.6, device=DEV)
        seeds = torch.randint(0, 2**62, (DECODE_BATCH,), device=DEV)
        steps = torch.randint(0, 1000, (DECODE_BATCH,), device=DEV)
        t = bench_graph(lambda: gumbel_sample(logits, temp, seeds, steps))
        print(f"  {str(dtype):15s}: {t:7.1f} us  {logits.numel() * logits.element_size() / t / 1e3:6.0f} GB/s")


def linears() -> None:
    print("\n== the layer's GEMMs (cuBLAS through F.linear), weights [N, K] as the engine holds them ==")
    for m in (DECODE_BATCH, PREFILL_SEQS * PREFILL_LEN):
        x = torch.randn(m, HIDDEN, dtype=DTYPE, device=DEV)
        total = 0.0
        for name, (n, k) in LINEARS.items():
            xin = x if k == HIDDEN else torch.randn(m, k, dtype=DTYPE, device=DEV)
            w = torch.randn(n, k, dtype=DTYPE, device=DEV) * k**-0.5
            t = bench(lambda: F.linear(xin, w))
            wt = w.t().contiguous()
            t_kn = bench(lambda: torch.mm(xin, wt))
            total += t
            print(f"  M={m:5d} {name:8s}: {t:7.1f} us  {2 * m * n * k / t / 1e6:4.0f} TFLOP/s;  weights [K, N]: "
                  f"{t_kn:7.1f} us", flush=True)
        print(f"  M={m:5d} one layer's four: {total:.1f} us")


def _gemv_configs(m: int, n: int, k: int) -> list[GemvConfig]:
    """The skinny GEMM's default for this shape, then two other tile shapes with the split
    chosen the same way (about four programs per SM)."""
    dev = torch.device(DEV)
    configs = [default_config(m, n, k, dev)]
    for block_n, block_k in ((32, 256), (128, 64)):
        split = split_for(n, k, block_n, block_k, dev)
        configs.append(GemvConfig(block_n, block_k, split, num_warps=4, num_stages=4, use_dot=True))
    return configs


def layer_chain() -> None:
    """A whole layer's four GEMMs back to back in one CUDA graph (36 layers' distinct
    weights, so nothing stays in L2), as decode runs them, for the batch sizes the
    workload passes through; against the floor max(weight bytes at the read bandwidth,
    FLOPs at 790 TFLOP/s) per GEMM, summed. Up to gemv.MAX_M rows, the Triton skinny
    GEMM too (its default tiles and two others, the same for every shape)."""
    print("\n== 36 layers' GEMMs in one CUDA graph, by decode batch: cuBLAS, and the Triton skinny GEMM ==")
    layers = 36
    weights = [{name: torch.randn(n, k, dtype=DTYPE, device=DEV) * k**-0.5 for name, (n, k) in LINEARS.items()}
               for _ in range(layers)]
    for m in (2, 8, 16, 32, 64, 96, 128, 192, 256):
        xs = {k: torch.randn(m, k, dtype=DTYPE, device=DEV) for k in (HIDDEN, INTER)}
        floor = layers * sum(max(2 * n * k / 4.5e6, 2 * m * n * k / 790e6) for n, k in LINEARS.values())

        def chain(use):
            for w in weights:
                for name, (n, k) in LINEARS.items():
                    use(xs[k], w[name], name)

        t = bench_graph(lambda: chain(lambda x, w, name: F.linear(x, w)))
        line = f"  M={m:3d}: floor {floor:7.1f} us; cuBLAS {t:8.1f} us ({100 * floor / t:3.0f} %)"
        if m <= MAX_M:
            cfgs = {name: _gemv_configs(m, n, k) for name, (n, k) in LINEARS.items()}
            for i in range(3):
                tt = bench_graph(lambda: chain(lambda x, w, name: gemv_linear(x, w, None, cfgs[name][i])))
                c = cfgs["o"][i]
                line += f"; Triton n{c.block_n} k{c.block_k} {tt:8.1f} us ({100 * floor / tt:3.0f} %)"
        print(line, flush=True)


def blas() -> None:
    """cuBLAS against cuBLASLt (torch's preferred_blas_library) for each projection at
    every decode batch the engine captures a graph for (36 weights per graph), and at
    prefill sizes (L2 flushed)."""
    print("\n== cuBLAS / cuBLASLt per projection, us per GEMM; decode: 36 weights in one graph ==")
    layers = 36
    weights = {name: [torch.randn(n, k, dtype=DTYPE, device=DEV) * k**-0.5 for _ in range(layers)]
               for name, (n, k) in LINEARS.items()}
    libs = ("cublas", "cublaslt")
    for m in list(range(16, 257, 8)) + [7868, 8192]:
        times = {}  # (projection, library) -> us
        for name, (n, k) in LINEARS.items():
            x = torch.randn(m, k, dtype=DTYPE, device=DEV)
            for lib in libs:
                torch.backends.cuda.preferred_blas_library(lib)
                if m <= 256:
                    times[name, lib] = graph_time_us(lambda: [F.linear(x, w) for w in weights[name]]) / layers
                else:
                    times[name, lib] = bench(lambda: F.linear(x, weights[name][0]))
        torch.backends.cuda.preferred_blas_library("cublas")
        line = "; ".join(f"{name} {times[name, libs[0]]:6.1f}/{times[name, libs[1]]:6.1f}" for name in LINEARS)
        layer = [sum(times[name, lib] for name in LINEARS) for lib in libs]
        best = sum(min(times[name, lib] for lib in libs) for name in LINEARS)
        print(f"  M={m:5d}: {line}; layer {layer[0]:7.1f}/{layer[1]:7.1f}, best of each {best:7.1f}", flush=True)


def prefill_rows(sizes: list[int]) -> None:
    """A layer's four GEMMs (cuBLAS, L2 flushed) per prefill token by step size: the
    step budget (--max-num-batched-tokens, 8,192 by default) decides the M of every
    prefill GEMM, and cuBLAS's speed per row moves with M."""
    print("\n== one layer's four GEMMs by prefill step size (cuBLAS), us per token ==")
    weights = {name: torch.randn(n, k, dtype=DTYPE, device=DEV) * k**-0.5 for name, (n, k) in LINEARS.items()}
    flops_per_row = 2 * sum(n * k for n, k in LINEARS.values())
    for m in sizes:
        xs = {k: torch.randn(m, k, dtype=DTYPE, device=DEV) for k in (HIDDEN, INTER)}
        t = sum(bench(lambda: F.linear(xs[k], weights[name]), rep=20) for name, (n, k) in LINEARS.items())
        print(f"  M={m:5d}: {t:8.1f} us, {t / m * 1e3:6.1f} ns per token, {flops_per_row * m / t / 1e6:4.0f} TFLOP/s",
              flush=True)


def tunable(sizes: list[int]) -> None:
    """cuBLAS's own pick against the fastest of the GEMM algorithms PyTorch's TunableOp
    times (torch.cuda.tunable; which candidates it offers depends on the torch build:
    torch 2.11 on CUDA offers only the default, so there the two agree), per projection
    at decode batches, 36 weights in one graph as in `blas`. Tuning runs eagerly before
    each capture; the graph then holds the chosen kernel."""
    import torch.cuda.tunable as tunable_op

    print("\n== cuBLAS's pick / TunableOp's fastest per projection, us per GEMM; 36 weights in one graph ==")
    tunable_op.set_filename("/tmp/tunableop_results.csv")
    layers = 36
    weights = {name: [torch.randn(n, k, dtype=DTYPE, device=DEV) * k**-0.5 for _ in range(layers)]
               for name, (n, k) in LINEARS.items()}
    for m in sizes:
        times = {}
        for name, (n, k) in LINEARS.items():
            x = torch.randn(m, k, dtype=DTYPE, device=DEV)
            tunable_op.enable(False)
            times[name, 0] = graph_time_us(lambda: [F.linear(x, w) for w in weights[name]]) / layers
            tunable_op.enable(True)
            tunable_op.tuning_enable(True)
            F.linear(x, weights[name][0])  # tunes this shape
            torch.cuda.synchronize()
            tunable_op.tuning_enable(False)
            times[name, 1] = graph_time_us(lambda: [F.linear(x, w) for w in weights[name]]) / layers
            tunable_op.enable(False)
        line = "; ".join(f"{name} {times[name, 0]:6.1f}/{times[name, 1]:6.1f}" for name in LINEARS)
        layer = [sum(times[name, i] for name in LINEARS) for i in (0, 1)]
        print(f"  M={m:4d}: {line}; layer {layer[0]:7.1f}/{layer[1]:7.1f} ({100 * (layer[1] / layer[0] - 1):+.1f} %)",
              flush=True)
    for row in tunable_op.get_results():
        print("  picked:", *row, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the defaults and a few alternatives only")
    parser.add_argument("--only", default="read,decode,splits,prefill,rope,sampling,linears,chain,blas,prefill_rows")
    parser.add_argument("--tunable-rows", default="32,64,96,128,160,192,224,256", help="decode batches of `tunable`")
    parser.add_argument("--block-size", type=int, default=BLOCK, help="KV-cache block size of the decode section")
    parser.add_argument("--prefill-rows", default="4096:16385:512", help="start:stop:step of the prefill_rows sizes")
    parser.add_argument("--kv-cache-dtype", choices=("bf16", "fp8"), default="bf16", help="the decode section's cache")
    args = parser.parse_args()
    fp8_cache = args.kv_cache_dtype == "fp8"
    sections = {"read": read_bandwidth, "decode": lambda: decode(args.quick, args.block_size, fp8_cache),
                "prefill": lambda: prefill(args.quick), "splits": splits, "chain": layer_chain,
                "rope": rope, "sampling": sampling, "linears": linears, "blas": blas,
                "prefill_rows": lambda: prefill_rows(range(*map(int, args.prefill_rows.split(":")))),
                "tunable": lambda: tunable([int(m) for m in args.tunable_rows.split(",")])}
    print(torch.cuda.get_device_name(0), "torch", torch.__version__, "triton", triton.__version__)
    with torch.inference_mode():
        for name in args.only.split(","):
            sections[name]()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
