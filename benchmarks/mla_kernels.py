"""DeepSeek MLA kernels on one GPU at DeepSeek-V2-Lite's shapes (16 heads, kv_lora_rank
512 + rope 64 = 576 cached values per token and layer, bf16, block size 16 unless
--block-sizes says otherwise).

    python benchmarks/mla_kernels.py                 # decode + prefill + rope/store, defaults
    python benchmarks/mla_kernels.py --sweep         # + split counts and tile configs per case
    python benchmarks/mla_kernels.py --only decode --heads 8    # V2-Lite at TP 2
    python benchmarks/mla_kernels.py --only decode --batches 1 --contexts 32768 --splits 64 128
                                                     # the default tiles at 2 and 5 stages, those splits

decode: `mla_decode` at batch 1-256 over contexts 512/1024/4096 (every sequence that
long; `--batches` and `--contexts` choose others, up to 128k), in a CUDA graph (as the engine runs it), against the HBM roofline of the latent
it must read (batch x context x 576 x 2 B at 4.26 TB/s) and against the PyTorch
reference in a graph. Each graph runs the kernel over enough distinct caches (at least
256 MB in all) that no call finds its latent in L2, as a real step's 27 layers do not
(the weights stream through L2 between them). Modes: two kernels (split kernel + merge
kernel), and with the counter workspace (merged in the launch when at most
MERGE_MAX_SPLITS splits, else two kernels as well).

prefill: `mla_prefill_attention` on the throughput workload's prompts (100-1024 tokens:
a step of 14 x 562, single prompts of 128, 512 and 1024, a 1024-token chunk after 1024
cached) against torch's scaled_dot_product_attention run per sequence on the same
materialised K (k_nope | k_pe broadcast, built outside the timing) and V.

rope: `mla_rope_store` at 1, 256 and 7,868 tokens.

Prints each line as it goes and a summary table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from agent_infer.kernels import reference  # noqa: E402
from agent_infer.kernels.triton.mla_decode import (  # noqa: E402
    MERGE_MAX_SPLITS,
    MlaDecodeConfig,
    default_config,
    mla_decode,
    mla_decode_counters,
    mla_decode_num_splits,
)
from agent_infer.kernels.triton.mla_prefill import MlaPrefillConfig, mla_prefill_attention  # noqa: E402
from agent_infer.kernels.triton.mla_rope_store import mla_rope_store  # noqa: E402
from benchmarks.gemv_chain import graph_time_us  # noqa: E402

DEV, DT = "cuda", torch.bfloat16
RANK, ROPE, NOPE, VDIM, BLOCK = 512, 64, 128, 128, 16
WIDTH = RANK + ROPE
LAYERS = 27
HBM_BYTES_PER_S = 4.26e12  # H200 device-to-device copy rate (docs/PERFORMANCE.md)
L2_FLUSH_BYTES = 256 << 20
MAX_COPIES = 512
SCALE = 0.1147  # V2-Lite's softmax scale (1/sqrt(192) x mscale^2)
BATCHES = (1, 8, 32, 64, 128, 256)
CONTEXTS = (512, 1024, 4096)


def decode_inputs(batch: int, ctx: int, heads: int, copies: int, block: int = BLOCK):
    """`copies` latent caches holding `batch` sequences of `ctx` tokens each in blocks of
    `block` tokens, every table a shuffled set of blocks; one query."""
    blocks = triton.cdiv(ctx, block)
    gen = torch.Generator(device=DEV).manual_seed(0)
    caches = [torch.randn(batch * blocks + 1, block, WIDTH, dtype=DT, device=DEV, generator=gen) for _ in range(copies)]
    tables = torch.randperm(batch * blocks, device=DEV, generator=gen).view(batch, blocks).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    q = torch.randn(batch, heads, WIDTH, dtype=DT, device=DEV, generator=gen)
    return caches, tables, lens, q


PIPELINED = (MlaDecodeConfig(16, 32, 4, 5), MlaDecodeConfig(16, 16, 4, 5), MlaDecodeConfig(16, 16, 4, 7),
             MlaDecodeConfig(16, 32, 8, 5))


def parse_config(text: str) -> MlaDecodeConfig:
    """"block_h,block_n,warps,stages" (MlaDecodeConfig's fields in order)."""
    return MlaDecodeConfig(*map(int, text.split(",")))


def bench_decode(batch: int, ctx: int, heads: int, sweep: bool,
                 grid: tuple[list[int], list[int]] | None = None, configs: list[MlaDecodeConfig] = (),
                 block: int = BLOCK) -> dict:
    latent_bytes = batch * ctx * WIDTH * 2
    copies = max(1, min(MAX_COPIES, math.ceil(L2_FLUSH_BYTES / latent_bytes)))
    caches, tables, lens, q = decode_inputs(batch, ctx, heads, copies, block)
    out = torch.empty(batch, heads, RANK, dtype=DT, device=DEV)
    counters = mla_decode_counters(batch, heads, DEV)

    def timed(**kw) -> float:
        def run():
            for c in caches:
                mla_decode(q, c, tables, lens, SCALE, RANK, out=out, **kw)
        return graph_time_us(run) / copies

    small = latent_bytes * 4 * heads / 16 < 8 << 30  # the reference holds the gathered rows in fp32
    ref = reference.mla_decode(q, caches[0], tables, lens, SCALE, RANK).float() if small else None

    def error(**kw) -> float:
        """The relative error of a call against the reference (NaN where it does not fit)."""
        if ref is None:
            return float("nan")
        got = mla_decode(q, caches[0], tables, lens, SCALE, RANK, **kw).float()
        return ((got - ref).norm() / ref.norm()).item()

    err = error(counters=counters)
    splits = mla_decode_num_splits(batch, heads, torch.device(DEV))
    row = {"batch": batch, "ctx": ctx, "block": block, "splits": splits, "err": err,
           "roofline": latent_bytes / HBM_BYTES_PER_S * 1e6,
           "two": timed(), "counters": timed(counters=counters)}
    if splits > 1:  # the in-launch merge at the default split count, whatever MERGE_MAX_SPLITS says
        row["merged"] = timed(counters=counters, merge_in_launch=True)
    if small:
        row["ref"] = graph_time_us(lambda: reference.mla_decode(q, caches[0], tables, lens, SCALE, RANK), replays=5)
    best = min(v for k, v in row.items() if k in ("two", "counters", "merged"))
    print(f"decode b{batch:3d} ctx{ctx:6d} bs{block:3d}: {splits:2d} splits | two kernels {row['two']:7.1f} us | "
          f"counters {row['counters']:7.1f} us | forced in-launch merge {row.get('merged', float('nan')):7.1f} us | "
          f"roofline {row['roofline']:6.1f} us ({row['roofline'] / best:4.0%}) | "
          f"{latent_bytes / best / 1e6:5.2f} TB/s | ref {row.get('ref', float('nan')):8.1f} us | err {err:.1e}",
          flush=True)
    if sweep:
        results = []
        split_set = sorted({1, 2, 4, 8, 16, 32, 64, 128, splits} | ({256} if ctx >= 32768 else set()))
        for s in split_set:
            for merged in ((False, True) if 1 < s <= 16 else (False,)):
                kw = {"num_splits": s}
                if merged:
                    kw |= {"counters": counters, "merge_in_launch": True}
                results.append((timed(**kw), f"splits {s}{' merged' if merged else ''}"))
        for cfg in (MlaDecodeConfig(16, 16, 4, 2), MlaDecodeConfig(16, 16, 4, 3), MlaDecodeConfig(16, 32, 4, 3),
                    MlaDecodeConfig(16, 32, 8, 2), MlaDecodeConfig(16, 64, 8, 2), MlaDecodeConfig(32, 32, 8, 2)):
            if cfg.block_h > 16 and heads <= 16:
                continue
            results.append((timed(config=cfg), f"{cfg}"))
        # Five stages or more: the first depth at which Triton (3.6 and 3.9) double-buffers
        # this loop's key tiles. Below it the block-table load and the tile copy take the
        # stages, every iteration waits for all copies in flight, and the next tile is only
        # requested after this one's dots (tests/test_mla_compile.py). Deeper pipelines
        # keep bytes in flight longer, so also at half the split count.
        for cfg in PIPELINED:
            for s in sorted({splits, max(1, splits // 2)}):
                results.append((timed(config=cfg, num_splits=s), f"{cfg} splits {s}"))
        results.sort()
        print("    sweep: " + " | ".join(f"{name} {t:.1f}" for t, name in results[:6]), flush=True)
        row["best_sweep"] = results[0]
    if grid:
        # The default tiles at other pipeline depths and split counts, merged as the engine
        # merges them (with the counters workspace): what chooses the split rule.
        split_counts, stage_counts = grid
        default = default_config(DT)
        cells = [(f"splits {s} stages {st}",
                  timed(counters=counters, num_splits=s, config=dataclasses.replace(default, num_stages=st)))
                 for s in sorted(set(split_counts) | {splits}) for st in stage_counts]
        print("    grid: " + " | ".join(f"{name} {t:.1f}" for name, t in cells), flush=True)
        row["grid"] = cells
    if configs:
        # Other tiles at the default split count and at --splits, each checked against the
        # reference where it fits.
        cells = []
        for cfg in configs:
            for s in sorted(set(grid[0] if grid else []) | {splits}):
                kw = {"counters": counters, "num_splits": s, "config": cfg}
                cells.append((f"{cfg} splits {s}", timed(**kw), error(**kw)))
        for name, t, cell_err in cells:
            print(f"    config {name}: {t:.1f} us ({latent_bytes / t / 1e6:.2f} TB/s), err {cell_err:.1e}", flush=True)
        row["configs"] = cells
    caches.clear()  # the cache copies go before the next cell's
    torch.cuda.empty_cache()
    return row


def prefill_inputs(query_lens: list[int], prefix_lens: list[int], heads: int):
    key_lens = [q + p for q, p in zip(query_lens, prefix_lens)]
    gen = torch.Generator(device=DEV).manual_seed(1)
    q = torch.randn(sum(query_lens), heads, NOPE + ROPE, dtype=DT, device=DEV, generator=gen)
    kv = torch.randn(sum(key_lens), heads, NOPE + VDIM, dtype=DT, device=DEV, generator=gen)
    k_pe = torch.randn(sum(key_lens), ROPE, dtype=DT, device=DEV, generator=gen)
    cu_q = torch.tensor([0] + query_lens, device=DEV).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + key_lens, device=DEV).cumsum(0).to(torch.int32)
    return q, kv, k_pe, cu_q, cu_k, key_lens


def bench_prefill(name: str, query_lens: list[int], prefix_lens: list[int], heads: int, sweep: bool) -> dict:
    q, kv, k_pe, cu_q, cu_k, key_lens = prefill_inputs(query_lens, prefix_lens, heads)
    args = (q[..., :NOPE], q[..., NOPE:], kv[..., :NOPE], k_pe, kv[..., NOPE:], cu_q, cu_k, max(query_lens), SCALE)
    out = torch.empty(q.shape[0], heads, VDIM, dtype=DT, device=DEV)
    t_triton = do_bench(lambda: mla_prefill_attention(*args, out=out), warmup=10, rep=50, return_mode="median") * 1e3

    # SDPA per sequence on materialised heads: K = [k_nope | k_pe broadcast], built here.
    seqs = []
    qs, ks = cu_q.tolist(), cu_k.tolist()
    for s in range(len(query_lens)):
        qi = q[qs[s] : qs[s + 1]].transpose(0, 1)[None]
        k_rope = k_pe[ks[s] : ks[s + 1], None, :].expand(-1, heads, -1)
        ki = torch.cat((kv[ks[s] : ks[s + 1], :, :NOPE], k_rope), dim=-1).transpose(0, 1)[None].contiguous()
        vi = kv[ks[s] : ks[s + 1], :, NOPE:].transpose(0, 1)[None].contiguous()
        nq, nk = qi.shape[2], ki.shape[2]
        mask = None
        if nq != nk:
            mask = torch.arange(nk, device=DEV)[None, :] <= (nk - nq + torch.arange(nq, device=DEV))[:, None]
        seqs.append((qi, ki, vi, mask))

    def sdpa():
        for qi, ki, vi, mask in seqs:
            F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=SCALE)

    t_sdpa = do_bench(sdpa, warmup=10, rep=50, return_mode="median") * 1e3
    ref = reference.mla_prefill_attention(*args).float()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    # Causal pairs (query, visible key) x heads x (QK over Dn + R, PV over Dv) x 2 flops.
    pairs = sum(nq * (nk - nq) + nq * (nq + 1) // 2 for nq, nk in zip(query_lens, key_lens))
    tflops = pairs * heads * (NOPE + ROPE + VDIM) * 2 / (t_triton * 1e-6) / 1e12
    print(f"prefill {name:>22s}: triton {t_triton:8.1f} us ({tflops:5.1f} TFLOP/s) | SDPA per sequence "
          f"{t_sdpa:8.1f} us | x{t_sdpa / t_triton:4.2f} | err {err:.1e}", flush=True)
    row = {"name": name, "triton": t_triton, "sdpa": t_sdpa, "tflops": tflops}
    if sweep:
        results = []
        for cfg in (MlaPrefillConfig(64, 32, 4, 2), MlaPrefillConfig(64, 64, 4, 3), MlaPrefillConfig(128, 32, 8, 2),
                    MlaPrefillConfig(128, 64, 8, 2), MlaPrefillConfig(32, 64, 4, 2)):
            t = do_bench(lambda cfg=cfg: mla_prefill_attention(*args, out=out, config=cfg), warmup=5, rep=30,
                         return_mode="median") * 1e3
            results.append((t, f"{cfg}"))
        results.sort()
        print("    sweep: " + " | ".join(f"{name} {t:.1f}" for t, name in results[:3]), flush=True)
    return row


def bench_rope(tokens: int, heads: int) -> None:
    gen = torch.Generator(device=DEV).manual_seed(2)
    kv_a = torch.randn(tokens, WIDTH, dtype=DT, device=DEV, generator=gen)
    q = torch.randn(tokens, heads, NOPE + ROPE, dtype=DT, device=DEV, generator=gen)
    weight = torch.ones(RANK, dtype=DT, device=DEV)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float32, device=DEV) / ROPE))
    freqs = torch.arange(8192, dtype=torch.float32, device=DEV)[:, None] * inv_freq[None, :]
    table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    cache = torch.zeros(tokens // BLOCK + 2, BLOCK, WIDTH, dtype=DT, device=DEV)
    positions = torch.randint(0, 8192, (tokens,), device=DEV, generator=gen)
    slots = torch.randperm(cache.shape[0] * BLOCK, device=DEV, generator=gen)[:tokens]
    t = graph_time_us(lambda: mla_rope_store(kv_a, q[:, :, NOPE:], positions, weight, 1e-6, table, cache, slots))
    moved = tokens * (WIDTH * 2 * 2 + WIDTH * 2 + heads * ROPE * 2 * 2)  # kv_a r/w, cache row, q_pe r/w
    print(f"rope + store {tokens:5d} tokens: {t:6.1f} us ({moved / t / 1e6:5.2f} TB/s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time split counts and tile configs per case")
    ap.add_argument("--heads", type=int, default=16, help="query heads per rank (V2-Lite: 16 at TP 1, 8 at TP 2)")
    ap.add_argument("--only", default="decode,prefill,rope")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES), help="decode batch sizes")
    ap.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS),
                    help="decode context lengths (every sequence that long), e.g. 512 8192 32768 131072")
    ap.add_argument("--splits", type=int, nargs="+", default=[],
                    help="also time the default tiles at these split counts (and the default count)")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 5], help="... at these pipeline depths")
    ap.add_argument("--configs", nargs="+", default=[],
                    help='decode tiles to time beside the default, "block_h,block_n,warps,stages", '
                         'at the default split count and --splits, each checked against the reference')
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[BLOCK],
                    help="decode: the cache's block sizes, each in turn (a key tile inside one block "
                         "takes one table entry)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    print(torch.cuda.get_device_name(), torch.__version__, "triton", triton.__version__,
          f"heads {args.heads}, default decode config {default_config(DT)}, merge in launch up to "
          f"{MERGE_MAX_SPLITS} splits", flush=True)
    decode_rows, prefill_rows = [], []
    if "decode" in only:
        grid = (args.splits, args.stages) if args.splits else None
        configs = [parse_config(c) for c in args.configs]
        for batch in args.batches:
            for ctx in args.contexts:
                for block in args.block_sizes:
                    decode_rows.append(bench_decode(batch, ctx, args.heads, args.sweep, grid, configs, block))
    if "prefill" in only:
        cases = [("14 x 562", [562] * 14, [0] * 14), ("128", [128], [0]), ("512", [512], [0]), ("1024", [1024], [0]),
                 ("100..1024 x 8", [100, 230, 360, 490, 620, 750, 880, 1024], [0] * 8),
                 ("1024 after 1024 cached", [1024], [1024])]
        for name, ql, pl in cases:
            prefill_rows.append(bench_prefill(name, ql, pl, args.heads, args.sweep))
    if "rope" in only:
        for tokens in (1, 256, 7868):
            bench_rope(tokens, args.heads)

    if decode_rows:
        print(f"\nMLA decode, {args.heads} heads, bf16, CUDA graph, us per layer call "
              f"(x{LAYERS} layers = the attention share of a step)")
        print(f"{'batch':>5} {'ctx':>6} {'block':>5} {'splits':>6} {'two-kern':>9} {'counters':>9} {'roofline':>9} "
              f"{'of roof':>7} {'TB/s':>5} {'ref':>9} {'x ref':>6} {'27 layers ms':>12}")
        for r in decode_rows:
            best = min(r["two"], r["counters"])
            ref = r.get("ref", float("nan"))
            read_tbs = r["batch"] * r["ctx"] * WIDTH * 2 / best / 1e6
            print(f"{r['batch']:5d} {r['ctx']:6d} {r['block']:5d} {r['splits']:6d} {r['two']:9.1f} {r['counters']:9.1f} "
                  f"{r['roofline']:9.1f} {r['roofline'] / best:7.0%} {read_tbs:5.2f} {ref:9.1f} {ref / best:6.1f} "
                  f"{best * LAYERS / 1e3:12.3f}")
    if prefill_rows:
        print(f"\nMLA prefill, {args.heads} heads, bf16, us")
        print(f"{'case':>24} {'triton':>9} {'TFLOP/s':>8} {'SDPA/seq':>9} {'x SDPA':>7}")
        for r in prefill_rows:
            print(f"{r['name']:>24} {r['triton']:9.1f} {r['tflops']:8.1f} {r['sdpa']:9.1f} {r['sdpa'] / r['triton']:7.2f}")


if __name__ == "__main__":
    main()
