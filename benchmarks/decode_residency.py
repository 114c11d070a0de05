"""Decode attention with and without the first-tile preload across batch sizes, in CUDA
graphs, on one GPU. The preload lets a one-wave grid overlap its PDL predecessor, but
holds registers that halve the programs resident per SM, which a many-wave grid (large
batches) pays for. Here each call runs alone (no predecessor to overlap), so this shows
the cost side of `preload_first_tile`'s choice; the gain shows in batch-1 latency.

    python benchmarks/decode_residency.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from agent_infer.kernels.triton.decode_attention import (  # noqa: E402
    decode_attention, decode_counters, decode_num_splits, preload_first_tile,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
# (batch, shortest context, longest context): batch 1 as in the latency benchmark, the
# larger ones spread like the throughput workload's.
CASES = ((1, 640, 640), (4, 600, 1600), (16, 600, 2000), (32, 600, 2000), (64, 300, 2000), (128, 300, 1800),
         (256, 200, 1400))


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    max_blocks = triton.cdiv(2048, BLOCK)
    total_blocks = max(b for b, _, _ in CASES) * max_blocks + 8
    k_cache = torch.randn(total_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    v_cache = torch.randn_like(k_cache)
    counters = decode_counters(max(b for b, _, _ in CASES), KV_HEADS, dev)
    print(f"{'batch':>5s} {'ctx':>11s} {'splits':>6s} {'auto':>5s} {'preload us':>10s} {'plain us':>9s} {'KV GB/s (best)':>14s}")
    for batch, lo, hi in CASES:
        lens = torch.randint(lo, hi + 1, (batch,), generator=gen).to(torch.int32)
        perm = torch.randperm(total_blocks - 8, generator=gen)[: batch * max_blocks].to(torch.int32)
        tables = perm.view(batch, max_blocks).to(dev)
        lens_d = lens.to(dev)
        q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
        scale = HEAD_DIM**-0.5
        times = {}
        for preload in (True, False):
            fn = lambda: decode_attention(q, k_cache, v_cache, tables, lens_d, scale, counters=counters,  # noqa: E731
                                          preload=preload)
            times[preload] = do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
        torch.testing.assert_close(
            decode_attention(q, k_cache, v_cache, tables, lens_d, scale, preload=True),
            decode_attention(q, k_cache, v_cache, tables, lens_d, scale, preload=False), rtol=0, atol=0,
        )
        splits = decode_num_splits(batch, KV_HEADS, dev)
        kv_bytes = 2 * int(lens.sum()) * KV_HEADS * HEAD_DIM * 2
        auto = preload_first_tile(batch, KV_HEADS, splits, dev)
        print(f"{batch:5d} {f'{lo}-{hi}':>11s} {splits:6d} {'pre' if auto else 'plain':>5s} {times[True]:10.1f} "
              f"{times[False]:9.1f} {kv_bytes / min(times.values()) / 1e3:14.0f}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
