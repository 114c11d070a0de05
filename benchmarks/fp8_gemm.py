"""fp8 W8A8 GEMM on one GPU at Qwen3-8B's linear shapes, against bf16 cuBLAS and
torch._scaled_mm. For each shape and row count M it times:

- bf16 F.linear (cuBLAS), the baseline the fp8 path replaces;
- fp8_linear, block layout (128 x 128 weight blocks): activation quantization + GEMM;
- w8a8_matmul alone on pre-quantized activations (block layout), and the activation
  quantization alone;
- w8a8_matmul, channel layout (per-row weight scales, per-token activation scales);
- torch._scaled_mm with rowwise scales (scale_a [M, 1], scale_b [1, N], bf16 out), the
  cuBLASLt/CUTLASS kernel for the channel layout, where this torch and GPU run it.

    python benchmarks/fp8_gemm.py                       # default tiles
    python benchmarks/fp8_gemm.py --sweep               # + a handful of tiles per M bucket and shape
    python benchmarks/fp8_gemm.py --rows 1,64 --shapes qkv,down --graph

Times are medians of triton.testing.do_bench (L2 flushed before every call, so weights
come from HBM as in a real step), or with --graph of do_bench_cudagraph (no launch
overhead, no flush; how the engine runs decode). TFLOP/s count 2 M N K per GEMM. "err"
is the block-layout fp8_linear's max |y - ref| / max |ref| against
w8a8_block_matmul(quantize_activations=True) in fp32. One table comes last.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from agent_infer.kernels.triton.fp8_gemm import (  # noqa: E402
    Fp8GemmConfig, default_config, fp8_linear, quantize_token_groups, w8a8_matmul,
)
from agent_infer.quantization import fp8 as ref_fp8  # noqa: E402

# Qwen3-8B: (N, K) of qkv, o, gate_up, down.
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
ROWS = (1, 8, 64, 256, 1024, 8192)
BLOCK = (128, 128)
DEV = "cuda"
GRAPH = False


def bench(fn) -> float:
    """Median microseconds."""
    if GRAPH:
        return do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
    return do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


def tflops(m: int, n: int, k: int, us: float | None) -> float | None:
    return None if us is None else 2 * m * n * k / us / 1e6


def sweep_configs(m: int, n: int, k: int, block: tuple[int, int] | None) -> list[Fp8GemmConfig]:
    """The default config first, then a handful of alternatives for M's bucket (tiles that
    divide a 128 x 128 weight block, so every one runs in both layouts)."""
    base = default_config(m, n, k, block)
    if m <= 16:  # weight-bound: also longer K steps where the weight's blocks allow them
        tiles = [(16, 32, 4, 5), (16, 64, 4, 4), (16, 128, 4, 4), (16, 64, 4, 6), (16, 64, 4, 4, 256),
                 (16, 128, 4, 3, 256), (16, 32, 4, 4, 512), (16, 64, 4, 3, 512)]
        splits = (1, 2, 4)
    elif m <= 64:
        tiles = [(32, 64, 4, 4), (64, 64, 4, 4), (64, 128, 4, 4), (32, 128, 4, 4)]
        splits = (1, 2)
    elif m <= 512:
        tiles = [(64, 64, 4, 4), (64, 128, 4, 4), (64, 128, 4, 3), (128, 128, 8, 3), (128, 64, 4, 4)]
        splits = (1,)
    else:
        tiles = [(64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 4),
                 (64, 64, 4, 4)]
        splits = (1,)
    out = [base]
    for bm, bn, warps, stages, *bk in tiles:
        bk = bk[0] if bk else 128
        if block is not None and block[1] % bk:
            continue
        for split in splits:
            for group_m in ((8,) if m <= 512 else (8, 32)):
                cfg = Fp8GemmConfig(bm, bn, bk, group_m, warps, stages, split)
                if cfg not in out:
                    out.append(cfg)
    return out


def _cfg_str(c: Fp8GemmConfig) -> str:
    return f"{c.block_m}x{c.block_n}x{c.block_k} g{c.group_m} w{c.num_warps} s{c.num_stages} k{c.split_k}"


@dataclass
class Row:
    shape: str
    m: int
    n: int
    k: int
    bf16: float
    linear: float
    gemm: float
    quant: float
    channel: float
    scaled_mm: float | None
    err: float
    best: dict = field(default_factory=dict)  # layout -> (us, config)


ROWS_OUT: list[Row] = []


def scaled_mm_fn(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor):
    """torch._scaled_mm with rowwise scales, or None where this torch / GPU refuses it."""
    scale_b = ws.reshape(1, -1).contiguous()

    def run():
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=scale_b, out_dtype=torch.bfloat16)

    try:
        run()
        torch.cuda.synchronize()
    except (RuntimeError, TypeError) as e:
        print(f"    torch._scaled_mm: {str(e).splitlines()[0][:100]}")
        return None
    return run


def sweep(m, n, k, block, xq, xs, wq, ws) -> tuple[float, Fp8GemmConfig]:
    timed = []
    for cfg in sweep_configs(m, n, k, block):
        try:
            t = bench(lambda: w8a8_matmul(xq, xs, wq, ws, block, None, torch.bfloat16, config=cfg))
        except Exception as e:  # e.g. out of shared memory for a tile
            print(f"    {_cfg_str(cfg)}: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
            continue
        timed.append((t, cfg))
    t, cfg = min(timed, key=lambda e: e[0])
    return t, cfg


def run_shape(name: str, n: int, k: int, rows: list[int], do_sweep: bool) -> None:
    w = torch.randn(n, k, dtype=torch.bfloat16, device=DEV) * k**-0.5
    wq, ws = ref_fp8.quantize_block(w, BLOCK)
    wcq, wcs = ref_fp8.quantize_channel(w)
    for m in rows:
        x = torch.randn(m, k, dtype=torch.bfloat16, device=DEV)
        xq, xs = quantize_token_groups(x, BLOCK[1])
        xcq, xcs = quantize_token_groups(x, k)
        ref = ref_fp8.w8a8_block_matmul(x.float(), wq, ws, BLOCK, quantize_activations=True)
        y = fp8_linear(x, wq, ws, BLOCK)
        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
        del ref
        t_bf16 = bench(lambda: F.linear(x, w))
        t_lin = bench(lambda: fp8_linear(x, wq, ws, BLOCK))
        t_gemm = bench(lambda: w8a8_matmul(xq, xs, wq, ws, BLOCK, None, torch.bfloat16))
        t_quant = bench(lambda: quantize_token_groups(x, BLOCK[1]))
        t_chan = bench(lambda: w8a8_matmul(xcq, xcs, wcq, wcs, None, None, torch.bfloat16))
        smm = scaled_mm_fn(xcq, xcs, wcq, wcs)
        t_smm = bench(smm) if smm is not None else None
        row = Row(name, m, n, k, t_bf16, t_lin, t_gemm, t_quant, t_chan, t_smm, err)
        if do_sweep:
            row.best["block"] = sweep(m, n, k, BLOCK, xq, xs, wq, ws)
            row.best["channel"] = sweep(m, n, k, None, xcq, xcs, wcq, wcs)
        ROWS_OUT.append(row)
        tf = lambda us: tflops(m, n, k, us)  # noqa: E731
        smm_s = f"{t_smm:8.1f} us {tf(t_smm):6.1f} TF" if t_smm else "n/a"
        print(f"  {name:8s} {k:5d}->{n:5d} M={m:5d}: bf16 {t_bf16:8.1f} us {tf(t_bf16):6.1f} TF | fp8_linear "
              f"{t_lin:8.1f} us {tf(t_lin):6.1f} TF (quant {t_quant:6.1f} us) | w8a8 {t_gemm:8.1f} us "
              f"{tf(t_gemm):6.1f} TF | channel {t_chan:8.1f} us {tf(t_chan):6.1f} TF | scaled_mm {smm_s} | "
              f"err {err:.1e}", flush=True)
        for layout, (t, cfg) in row.best.items():
            print(f"      best {layout:7s} {_cfg_str(cfg):32s} {t:8.1f} us {tf(t):6.1f} TF "
                  f"(default {_cfg_str(default_config(m, n, k, BLOCK if layout == 'block' else None))})", flush=True)
        x = xq = xs = xcq = xcs = y = None  # freed before the next row count's tensors (the lambdas are done)
    w = wq = ws = wcq = wcs = None
    torch.cuda.empty_cache()


def print_table(do_sweep: bool) -> None:
    print("\n== summary: microseconds (TFLOP/s) ==")
    cols = ["bf16 F.linear", "fp8_linear", "w8a8 block", "quant", "w8a8 channel", "_scaled_mm"]
    head = f"{'shape':9s} {'M':>5s} " + " ".join(f"{c:>17s}" for c in cols) + f" {'err':>8s}"
    if do_sweep:
        head += f"  {'best block':>17s} {'best channel':>17s}"
    print(head)
    for r in ROWS_OUT:
        def cell(us, with_rate=True):
            if us is None:
                return f"{'-':>17s}"
            rate = f" ({tflops(r.m, r.n, r.k, us):5.1f})" if with_rate else ""
            return f"{us:9.1f}{rate}".rjust(17)
        line = (f"{r.shape:9s} {r.m:5d} {cell(r.bf16)} {cell(r.linear)} {cell(r.gemm)} {cell(r.quant, False)} "
                f"{cell(r.channel)} {cell(r.scaled_mm)} {r.err:8.1e}")
        if do_sweep:
            line += f"  {cell(r.best['block'][0])} {cell(r.best['channel'][0])}"
        print(line)
    if do_sweep:
        print("\n== best tiles (block layout | channel layout) ==")
        for r in ROWS_OUT:
            print(f"{r.shape:9s} M={r.m:5d}: {_cfg_str(r.best['block'][1]):32s} | {_cfg_str(r.best['channel'][1])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated M values")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {list(SHAPES)}")
    parser.add_argument("--sweep", action="store_true", help="also time a handful of tiles per M bucket and shape")
    parser.add_argument("--graph", action="store_true",
                        help="time inside CUDA graphs (no launch overhead, no L2 flush)")
    args = parser.parse_args()
    global GRAPH
    GRAPH = args.graph
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"SMs {torch.cuda.get_device_properties(0).multi_processor_count} | "
          f"{'CUDA graphs' if GRAPH else 'L2 flushed before each call'}")
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    start = time.time()
    with torch.inference_mode():
        for name in args.shapes.split(","):
            n, k = SHAPES[name.strip()]
            run_shape(name.strip(), n, k, rows, args.sweep)
    print_table(args.sweep)
    print(f"\ntotal {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
