"""Benchmark of the Triton kernels at Qwen3-8B sizes on one GPU, against the plain-PyTorch
references (and torch SDPA / cuBLAS where those are the real competition).

    python benchmarks/gpu_kernels.py                   # everything (< 3 min on an H200)
    python benchmarks/gpu_kernels.py --no-sweep        # default configs only (faster)
    python benchmarks/gpu_kernels.py --only decode,gemv --no-sweep   # a subset, defaults only

Times are medians of triton.testing.do_bench (L2 flushed before every call, so weights
and KV are read from HBM as in a real step). For decode attention a second time is
taken inside a CUDA graph (do_bench_cudagraph: no launch overhead, no L2 flush), which is
how the engine runs decode. Bandwidth counts bytes read + written once each; for gemv it
is weight bytes only. Alternative tile configs are timed beside the defaults ("best ..."
in each line) until SWEEP_DEADLINE_S has passed. Each section prints as it goes; one
compact table comes last.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from agent_infer.kernels import reference  # noqa: E402
from agent_infer.kernels.triton import activation, norm, rope_store  # noqa: E402
from agent_infer.kernels.triton.decode_attention import (  # noqa: E402
    DecodeConfig, decode_attention, decode_counters, decode_num_splits,
)
from agent_infer.kernels.triton.gemv import GemvConfig, default_config, linear  # noqa: E402
from agent_infer.kernels.triton.kv_store import store_kv  # noqa: E402
from agent_infer.kernels.triton.prefill_attention import PrefillConfig, prefill_attention  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 4096, 32, 8, 128, 12288, 151936
DTYPE = torch.bfloat16
DEV = "cuda"
ELEM = 2  # bytes per bf16
DECODE_BATCHES = (1, 8, 64)
DECODE_CONTEXTS = (512, 4096, 32768)
PREFILL_CASES = (("1 x 512", [512], 0), ("8 x 1024 +256 cached", [1024] * 8, 256))
ELEMENTWISE_TOKENS = (1, 512)
GEMV_MS = (1, 2, 4, 8, 16)
# Alternatives timed beside the defaults (the first entry of each list is the default).
# Five stages: the first depth at which Triton double-buffers the paged K/V tiles (the
# block-table load takes a stage; tests/test_kernel_compile.py).
DECODE_SWEEP = (DecodeConfig(64, 4, 3), DecodeConfig(32, 4, 3), DecodeConfig(128, 4, 2), DecodeConfig(64, 8, 3),
                DecodeConfig(64, 4, 2), DecodeConfig(64, 4, 5), DecodeConfig(32, 4, 5))
PREFILL_SWEEP = (PrefillConfig(64, 64, 4, 2), PrefillConfig(128, 64, 8, 3), PrefillConfig(64, 32, 4, 2),
                 PrefillConfig(128, 128, 8, 2), PrefillConfig(128, 32, 4, 4), PrefillConfig(64, 32, 4, 5),
                 PrefillConfig(128, 32, 8, 5))


@dataclass
class Row:
    kernel: str
    case: str
    triton_us: float
    rate: str  # achieved GB/s, TB/s or TFLOP/s
    torch_us: float | None
    torch_name: str
    err: float
    extra: str = ""


ROWS: list[Row] = []
SWEEP = True  # time alternative configs too; --no-sweep turns it off
SWEEP_DEADLINE_S = 120.0  # past this many seconds, skip the remaining sweeps to stay under 3 minutes
START = time.time()


def sweeping() -> bool:
    return SWEEP and time.time() - START < SWEEP_DEADLINE_S


def bench(fn, rep: int = 60) -> float:
    """Median microseconds, L2 flushed before each call."""
    return do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3


def bench_graph(fn) -> float:
    return do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def gbps(nbytes: float, us: float) -> str:
    return f"{nbytes / us / 1e3:7.0f} GB/s"


def add(row: Row) -> None:
    ROWS.append(row)
    torch_part = f"{row.torch_name} {row.torch_us:9.1f} us ({row.torch_us / row.triton_us:5.2f}x)" if row.torch_us else ""
    print(f"  {row.kernel:14s} {row.case:34s} {row.triton_us:9.1f} us  {row.rate:>14s}  {torch_part:42s} "
          f"err {row.err:.1e} {row.extra}", flush=True)


# ---- elementwise kernels ---------------------------------------------------------------


def bench_elementwise() -> None:
    print("\n== norms, activation, RoPE + KV write, KV store (bf16) ==")
    eps = 1e-6
    for tokens in ELEMENTWISE_TOKENS:
        x = torch.randn(tokens, HIDDEN, dtype=DTYPE, device=DEV)
        w = torch.randn(HIDDEN, dtype=DTYPE, device=DEV)
        nbytes = 2 * x.numel() * ELEM
        t = bench(lambda: norm.rms_norm(x, w, eps))
        add(Row("rms_norm", f"T={tokens} x {HIDDEN}", t, gbps(nbytes, t), bench(lambda: reference.rms_norm(x, w, eps)),
                "torch", rel_err(norm.rms_norm(x, w, eps), reference.rms_norm(x, w, eps))))

        r = torch.randn_like(x)
        ref_out, ref_res = reference.fused_add_rms_norm(x, r, w, eps)
        xc, rc = x.clone(), r.clone()
        norm.fused_add_rms_norm(xc, rc, w, eps)
        err = max(rel_err(xc, ref_out), rel_err(rc, ref_res))
        t = bench(lambda: norm.fused_add_rms_norm(xc, rc, w, eps))
        add(Row("fused_add_rms", f"T={tokens} x {HIDDEN}", t, gbps(4 * x.numel() * ELEM, t),
                bench(lambda: reference.fused_add_rms_norm(x, r, w, eps)), "torch", err))

        qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=DTYPE, device=DEV)
        q = qkv[:, : HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
        wq = torch.randn(HEAD_DIM, dtype=DTYPE, device=DEV)
        t = bench(lambda: norm.rms_norm(q, wq, eps))
        add(Row("q_norm", f"T={tokens} x {HEADS}x{HEAD_DIM} strided", t, gbps(2 * q.numel() * ELEM, t),
                bench(lambda: reference.rms_norm(q, wq, eps)), "torch",
                rel_err(norm.rms_norm(q, wq, eps), reference.rms_norm(q, wq, eps))))

        g = torch.randn(tokens, 2 * INTER, dtype=DTYPE, device=DEV)
        t = bench(lambda: activation.silu_and_mul(g))
        add(Row("silu_and_mul", f"T={tokens} x 2x{INTER}", t, gbps(1.5 * g.numel() * ELEM, t),
                bench(lambda: reference.silu_and_mul(g)), "torch",
                rel_err(activation.silu_and_mul(g), reference.silu_and_mul(g))))

        k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
        max_pos = 40960
        inv = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, device=DEV).float() / HEAD_DIM))
        f = torch.arange(max_pos, device=DEV).float()[:, None] * inv[None]
        cache = torch.cat((f.cos(), f.sin()), -1)
        pos = torch.randint(0, max_pos, (tokens,), device=DEV)
        # RoPE as the engine runs it (with the KV write, one kernel), without q/k norms.
        vr = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(tokens, KV_HEADS, HEAD_DIM)
        kcr = torch.zeros(tokens // 16 + 2, 16, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
        vcr = torch.zeros_like(kcr)
        rslots = torch.arange(tokens, device=DEV)
        ref_q, ref_k = reference.apply_rotary(pos, q, cache, True), reference.apply_rotary(pos, k, cache, True)
        q2, k2 = q.clone(), k.clone()
        rope_store.norm_rope_store(pos, q2, k2, vr, None, None, 0.0, cache, True, kcr, vcr, rslots)
        err = max(rel_err(q2, ref_q), rel_err(k2, ref_k))
        t = bench(lambda: rope_store.norm_rope_store(pos, q, k, vr, None, None, 0.0, cache, True, kcr, vcr, rslots))
        nbytes = 2 * (q.numel() + 2 * k.numel()) * ELEM + tokens * HEAD_DIM * 4
        t_ref = bench(lambda: (reference.apply_rotary(pos, q, cache, True), reference.apply_rotary(pos, k, cache, True)))
        add(Row("rope_store", f"T={tokens} q{HEADS}+k{KV_HEADS} heads", t, gbps(nbytes, t), t_ref, "torch", err))

        v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(tokens, KV_HEADS, HEAD_DIM)
        blocks = 4096
        kc = torch.zeros(blocks, 16, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
        vc = torch.zeros_like(kc)
        slots = torch.randperm(blocks * 16, device=DEV)[:tokens]
        store_kv(k, v, kc, vc, slots)
        rk, rv = torch.zeros_like(kc), torch.zeros_like(vc)
        reference.store_kv(k, v, rk, rv, slots)
        err = 0.0 if torch.equal(kc, rk) and torch.equal(vc, rv) else float("inf")
        t = bench(lambda: store_kv(k, v, kc, vc, slots))
        add(Row("store_kv", f"T={tokens} {KV_HEADS}x{HEAD_DIM} bs16", t, gbps(4 * k.numel() * ELEM, t),
                bench(lambda: reference.store_kv(k, v, kc, vc, slots)), "torch", err))


# ---- attention -------------------------------------------------------------------------


def paged_cache(total_tokens: int, block_size: int):
    blocks = triton.cdiv(total_tokens, block_size) + 8
    k = torch.randn(blocks, block_size, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
    v = torch.randn_like(k)
    return k, v, torch.randperm(blocks, device=DEV).to(torch.int32)


def bench_decode() -> None:
    print("\n== decode attention (bf16, 32 q heads / 8 KV heads, head_dim 128, block 16) ==")
    block_size = 16
    scale = HEAD_DIM**-0.5
    k_cache, v_cache, perm = paged_cache(max(DECODE_BATCHES) * max(DECODE_CONTEXTS), block_size)
    counters = decode_counters(max(DECODE_BATCHES), KV_HEADS, DEV)  # splits merged in the same launch
    for batch in DECODE_BATCHES:
        for ctx in DECODE_CONTEXTS:
            nb = triton.cdiv(ctx, block_size)
            tables = perm[: batch * nb].view(batch, nb).contiguous()
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
            q = torch.randn(batch, HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
            out = decode_attention(q, k_cache, v_cache, tables, lens, scale)
            ref = reference.decode_attention(q, k_cache, v_cache, tables, lens, scale)
            err = rel_err(out, ref)
            err_m = rel_err(decode_attention(q, k_cache, v_cache, tables, lens, scale, counters=counters), ref)
            del ref
            t = bench(lambda: decode_attention(q, k_cache, v_cache, tables, lens, scale))
            tg = bench_graph(lambda: decode_attention(q, k_cache, v_cache, tables, lens, scale))
            best = (t, "default")
            for cfg in DECODE_SWEEP[1:] if sweeping() and ctx >= 4096 else ():
                ta = bench(lambda: decode_attention(q, k_cache, v_cache, tables, lens, scale, config=cfg))
                best = min(best, (ta, f"n{cfg.block_n} w{cfg.num_warps} st{cfg.num_stages}"))
            splits = decode_num_splits(batch, KV_HEADS, q.device)
            if batch == 1 and sweeping():
                for s_alt in (max(1, splits // 2), min(64, splits * 2)):
                    ta = bench(lambda: decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=s_alt))
                    best = min(best, (ta, f"splits {s_alt}"))
            nbytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * ELEM + 2 * q.numel() * ELEM
            # The dense-torch competitor: SDPA on K/V already gathered contiguously (gather not timed).
            kd = k_cache[tables].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
            vd = v_cache[tables].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
            qd = q.unsqueeze(2)
            t_sdpa = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True))
            kd = vd = None  # freed; the SDPA lambda is done
            t_ref = bench(lambda: reference.decode_attention(q, k_cache, v_cache, tables, lens, scale), rep=20) \
                if batch * ctx <= 8 * 32768 else float("nan")  # the reference needs ~25 GB beyond that
            add(Row("decode_attn", f"B={batch} ctx={ctx}", t, gbps(nbytes, t), t_sdpa, "sdpa(contig)", err,
                    f"graph {tg:.1f} us = {nbytes / tg / 1e3:.0f} GB/s; splits {splits}; torch ref {t_ref:.0f} us; "
                    f"best {best[1]} {best[0]:.1f} us"))
            # One launch (the last program of each KV head merges) against the two-kernel path above.
            tm = bench(lambda: decode_attention(q, k_cache, v_cache, tables, lens, scale, counters=counters))
            tmg = bench_graph(lambda: decode_attention(q, k_cache, v_cache, tables, lens, scale, counters=counters))
            assert not counters.any(), "merged decode left its counters set"
            add(Row("decode_merged", f"B={batch} ctx={ctx}", tm, gbps(nbytes, tm), t, "2 kernels", err_m,
                    f"graph {tmg:.1f} us vs {tg:.1f} us with 2 kernels ({tg - tmg:+.1f} us saved)"))
            if batch == 1 and ctx == max(DECODE_CONTEXTS):
                t1 = bench(lambda: decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=1))
                add(Row("decode_attn", f"B=1 ctx={ctx} splits=1 (no split-K)", t1, gbps(nbytes, t1), None, "", err))


def bench_prefill() -> None:
    print("\n== prefill attention (bf16, 32/8 heads, head_dim 128, block 16) ==")
    block_size = 16
    scale = HEAD_DIM**-0.5
    try:
        from torch.nn.attention.bias import causal_lower_right
    except ImportError:
        causal_lower_right = None
    for name, q_lens, prefix in PREFILL_CASES:
        ctx = [q + prefix for q in q_lens]
        k_cache, v_cache, perm = paged_cache(sum(ctx), block_size)
        nb = triton.cdiv(ctx[0], block_size)
        tables = perm[: len(ctx) * nb].view(len(ctx), nb).contiguous()
        tokens = sum(q_lens)
        q = torch.randn(tokens, HEADS, HEAD_DIM, dtype=DTYPE, device=DEV)
        qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEV)
        lens = torch.tensor(ctx, dtype=torch.int32, device=DEV)
        out = prefill_attention(q, k_cache, v_cache, tables, qsl, lens, max(q_lens), scale)
        ref = reference.prefill_attention(q, k_cache, v_cache, tables, q_lens, ctx, scale)
        err = rel_err(out, ref)
        t = bench(lambda: prefill_attention(q, k_cache, v_cache, tables, qsl, lens, max(q_lens), scale))
        best = (t, "default")
        for cfg in PREFILL_SWEEP[1:] if sweeping() else ():
            ta = bench(lambda: prefill_attention(q, k_cache, v_cache, tables, qsl, lens, max(q_lens), scale, cfg))
            best = min(best, (ta, f"m{cfg.block_m} n{cfg.block_n} w{cfg.num_warps} st{cfg.num_stages}"))
        t_ref = bench(lambda: reference.prefill_attention(q, k_cache, v_cache, tables, q_lens, ctx, scale), rep=30)
        # SDPA on contiguous, head-expanded K/V (gather and expansion not timed); equal lengths -> one batch.
        b, ql, kl = len(q_lens), q_lens[0], ctx[0]
        qd = q.view(b, ql, HEADS, HEAD_DIM).transpose(1, 2)
        kd = k_cache[tables].flatten(1, 2)[:, :kl].transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1)
        vd = v_cache[tables].flatten(1, 2)[:, :kl].transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1)
        if prefix == 0:
            sdpa = lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)  # noqa: E731
        elif causal_lower_right is not None:
            mask = causal_lower_right(ql, kl)
            sdpa = lambda: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)  # noqa: E731
        else:
            sdpa = None
        t_sdpa = bench(sdpa) if sdpa else float("nan")
        flops = 4 * HEADS * HEAD_DIM * sum(q * (p + (q + 1) / 2) for q, p in zip(q_lens, [prefix] * len(q_lens)))
        add(Row("prefill_attn", name, t, f"{flops / t / 1e6:7.1f} TFLOP/s", t_sdpa, "sdpa(contig)", err,
                f"torch ref {t_ref:.0f} us; best {best[1]} {best[0]:.1f} us"))


# ---- skinny GEMM ------------------------------------------------------------------------

GEMV_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288), "lm_head": (VOCAB, 4096)}


def sweep_configs(m: int, n: int, k: int) -> list[GemvConfig]:
    """The default config first, then a few alternatives with the split scaled to keep
    about the same number of programs."""
    base = default_config(m, n, k, torch.device(DEV))
    if not sweeping():
        return [base]
    tiles = [(8, 1024, 4, 4, False), (32, 256, 4, 4, False), (16, 1024, 8, 4, False)] if m == 1 else [
        (32, 256, 4, 4, False), (128, 64, 4, 4, False), (64, 128, 8, 4, False),
        # the weight tile as the MMA's left operand (Hopper's warpgroup MMA)
        (64, 128, 4, 4, True), (64, 128, 4, 6, True), (128, 128, 4, 4, True), (64, 256, 4, 4, True),
        (128, 64, 8, 6, True)]
    out = [base]
    for bn, bk, warps, stages, swap in tiles:
        split = max(1, min(base.split_k * base.block_n // bn, triton.cdiv(k, bk) // 2 or 1))
        out.append(GemvConfig(bn, bk, split, warps, stages, use_dot=m > 1, swap_ab=swap))
    return out


def bench_gemv() -> None:
    print("\n== skinny GEMM vs F.linear (cuBLAS), bf16 ==")
    for name, (n, k) in GEMV_SHAPES.items():
        w = torch.randn(n, k, dtype=DTYPE, device=DEV) * k**-0.5
        w32 = w.float()
        wbytes = n * k * ELEM
        for m in GEMV_MS:
            x = torch.randn(m, k, dtype=DTYPE, device=DEV)
            ref = F.linear(x.float(), w32)
            t_torch = bench(lambda: F.linear(x, w))
            timed = []
            for cfg in sweep_configs(m, n, k):
                err = rel_err(linear(x, w, None, cfg), ref)
                timed.append((bench(lambda: linear(x, w, None, cfg)), cfg, err))
            t, _, err = timed[0]  # the default config
            tb, cfg, _ = min(timed, key=lambda e: e[0])
            cfg_s = (f"n{cfg.block_n} k{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages} "
                     f"{('dot-swapped' if cfg.swap_ab else 'dot') if cfg.use_dot else 'fma'}")
            add(Row("gemv", f"{name} {k}->{n} M={m}", t, f"{wbytes / t / 1e6:5.2f} TB/s", t_torch, "cuBLAS", err,
                    f"cuBLAS {wbytes / t_torch / 1e6:.2f} TB/s; best {cfg_s} {tb:.1f} us = {wbytes / tb / 1e6:.2f} TB/s"))
        w = w32 = None


def print_table() -> None:
    print("\n== summary ==")
    print(f"{'kernel':14s} {'case':36s} {'triton us':>10s} {'rate':>16s} {'vs':>13s} {'torch us':>10s} {'speedup':>8s} {'rel err':>8s}")
    for r in ROWS:
        tu = f"{r.torch_us:10.1f}" if r.torch_us and not math.isnan(r.torch_us) else f"{'-':>10s}"
        sp = f"{r.torch_us / r.triton_us:7.2f}x" if r.torch_us and not math.isnan(r.torch_us) else f"{'-':>8s}"
        print(f"{r.kernel:14s} {r.case:36s} {r.triton_us:10.1f} {r.rate:>16s} {r.torch_name:>13s} {tu} {sp} {r.err:8.1e}")


SECTIONS = {"elementwise": bench_elementwise, "decode": bench_decode, "prefill": bench_prefill, "gemv": bench_gemv}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {list(SECTIONS)}")
    parser.add_argument("--no-sweep", action="store_true", help="time the default configs only")
    args = parser.parse_args()
    global SWEEP, START
    SWEEP = not args.no_sweep
    START = time.time()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"SMs {torch.cuda.get_device_properties(0).multi_processor_count}")
    torch.manual_seed(0)
    with torch.inference_mode():
        for name in args.only.split(","):
            t0 = time.time()
            SECTIONS[name.strip()]()
            torch.cuda.empty_cache()
            print(f"  ({name.strip()}: {time.time() - t0:.0f} s)", flush=True)
    print_table()
    print(f"\ntotal {time.time() - START:.0f} s" + ("" if not SWEEP or sweeping() else
          f" (config sweeps stopped after {SWEEP_DEADLINE_S:.0f} s)"))


if __name__ == "__main__":
    main()
