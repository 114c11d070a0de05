"""A plain Triton tiled GEMM against cuBLAS at the decode batches where cuBLAS is
furthest from its floor (96-256 rows), Qwen3-8B's four projections, one H200.

    python benchmarks/decode_gemm.py [--tma] [--sizes 96,128,192,256]

The kernel: y = x W^T, x [M, K], W [N, K] (the engine's layout), tiles [BLOCK_M,
BLOCK_N] with the M tiles that share a weight tile adjacent in launch order (L2 reuse),
an optional K split whose fp32 partials a second kernel adds up. Pointer loads pipelined
by Triton, or (`--tma`) TMA loads. Every tile shape x split in `TILES` is
checked against F.linear, then timed as 36 distinct weights in one CUDA graph (nothing
stays in L2), beside cuBLAS and cuBLASLt in the same graph.

`--tma` loads the tiles through tensor descriptors (TMA) instead, with and without
Triton's warp specialisation. On an H200 (ninth session, docs/PERFORMANCE.md) the best
tile per shape ran a layer at 73-82 % of cuBLAS's speed with pointer loads and 85-87 %
with TMA loads, so the engine keeps cuBLAS; this file is the measurement.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_infer.kernels.triton.gemv import split_reduce  # noqa: E402
from benchmarks.gemv_chain import graph_time_us  # noqa: E402
from benchmarks.throughput_kernels import DEV, DTYPE, LINEARS  # noqa: E402

# (block_m, block_n, block_k, warps, stages)
TILES = ((64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 4, 3), (64, 256, 64, 8, 3),
         (128, 64, 64, 4, 4), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (128, 128, 128, 8, 3),
         (128, 256, 64, 8, 3), (64, 64, 64, 4, 5))


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    tma: bool = False
    warp_specialize: bool = False


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, K, k_per_split,
                   SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # M tiles fastest: the programs needing one weight tile run together (L2 reuse).
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n, pid_k = pid % num_m, pid // num_m, tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + m.to(tl.int64)[:, None] * K + kk[None, :]
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K + kk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * k_per_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):  # K is a multiple of BLOCK_K
        x = tl.load(x_rows + k0, mask=(m < M)[:, None], other=0.0)
        w = tl.load(w_rows + k0, mask=(n < N)[:, None], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    mask = (m < M)[:, None] & (n < N)[None, :]
    if SPLIT:
        tl.store(out_ptr + (pid_k * M + m).to(tl.int64)[:, None] * N + n[None, :], acc, mask=mask)
    else:
        tl.store(out_ptr + m.to(tl.int64)[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _matmul_tma_kernel(x_desc, w_desc, out_desc, M, K, k_per_split,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       WARP_SPECIALIZE: tl.constexpr):
    # The same tiling with TMA loads (tensor descriptors); out_desc covers [S * M, N]
    # fp32 partials when K is split (M a multiple of BLOCK_M), else [M, N] bf16.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n, pid_k = pid % num_m, pid // num_m, tl.program_id(1)
    off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * k_per_split
    for k0 in tl.range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K, warp_specialize=WARP_SPECIALIZE):
        x = x_desc.load([off_m, k0])
        w = w_desc.load([off_n, k0])
        acc = tl.dot(x, w.T, acc)
    out_desc.store([pid_k * M + off_m, off_n], acc.to(out_desc.dtype))


def matmul(x: torch.Tensor, w: torch.Tensor, t: Tile) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T with the tiles, K split and loads of `t`."""
    (m, k), n = x.shape, w.shape[0]
    assert k % t.block_k == 0
    k_tiles = k // t.block_k
    k_per_split = triton.cdiv(k_tiles, min(t.split_k, k_tiles)) * t.block_k
    split = triton.cdiv(k, k_per_split)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n), split)
    if t.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        assert split == 1 or m % t.block_m == 0, "split partial tiles would cross into the next split's rows"
        _matmul_tma_kernel[grid](
            TensorDescriptor.from_tensor(x, [t.block_m, t.block_k]),
            TensorDescriptor.from_tensor(w, [t.block_n, t.block_k]),
            TensorDescriptor.from_tensor(part.view(-1, n), [t.block_m, t.block_n]), m, k, k_per_split,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, WARP_SPECIALIZE=t.warp_specialize,
            num_warps=t.num_warps, num_stages=t.num_stages,
        )
    else:
        _matmul_kernel[grid](x, w, part, m, n, k, k_per_split, SPLIT=split > 1, BLOCK_M=t.block_m,
                             BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.num_warps, num_stages=t.num_stages)
    if split > 1:
        split_reduce(part, None, out)
    return out


def variants(tma: bool, m: int) -> list[Tile]:
    """Pointer loads: every tile with 1-4 K splits. TMA loads: every tile with 1 or 2
    splits (2 only where M fills whole tiles), with and without warp specialisation."""
    out = []
    for bm, bn, bk, warps, stages in TILES:
        if not tma:
            out += [Tile(bm, bn, bk, split, warps, stages) for split in (1, 2, 3, 4)]
            continue
        for split in (1, 2) if m % bm == 0 else (1,):
            out += [Tile(bm, bn, bk, split, warps, stages, True, ws) for ws in (False, True)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tma", action="store_true", help="TMA loads (tensor descriptors) instead of pointers")
    parser.add_argument("--sizes", default="96,128,192,256", help="batch sizes (rows of x)")
    args = parser.parse_args()
    sizes = [int(v) for v in args.sizes.split(",")]
    print(torch.cuda.get_device_name(0), "torch", torch.__version__, "triton", triton.__version__)
    print(f"== Triton ({'TMA' if args.tma else 'pointer'} loads) tiles x K splits against cuBLAS / cuBLASLt, "
          "36 weights per graph, us per GEMM ==")
    layers = 36
    best = {}
    failed = set()
    for name, (n, k) in LINEARS.items():
        weights = [torch.randn(n, k, dtype=DTYPE, device=DEV) * k**-0.5 for _ in range(layers)]
        for m in sizes:
            x = torch.randn(m, k, dtype=DTYPE, device=DEV)
            want = F.linear(x, weights[0])
            floor = max(2 * n * k / 4.5e6, 2 * m * n * k / 790e6)
            lib = {}
            for blas in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(blas)
                lib[blas] = graph_time_us(lambda: [F.linear(x, w) for w in weights]) / layers
            torch.backends.cuda.preferred_blas_library("cublas")
            rows = []
            for t in variants(args.tma, m):
                key = (t.block_m, t.block_n, t.block_k, t.num_warps, t.num_stages, t.split_k > 1, t.warp_specialize)
                if key in failed:
                    continue
                try:
                    torch.testing.assert_close(matmul(x, weights[0], t), want, rtol=2e-2, atol=2e-2)
                    rows.append((graph_time_us(lambda: [matmul(x, w, t) for w in weights]) / layers, t))
                except Exception as exc:  # noqa: BLE001 - a variant that does not compile or fit is skipped
                    failed.add(key)
                    print(f"    skipped {t}: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}",
                          flush=True)
            rows.sort(key=lambda r: r[0])
            best[name, m] = (rows[0][0], lib["cublas"], lib["cublaslt"], floor)
            top = "; ".join(f"m{t.block_m} n{t.block_n} k{t.block_k} w{t.num_warps} st{t.num_stages} s{t.split_k}"
                            f"{' ws' if t.warp_specialize else ''} {us:.1f}" for us, t in rows[:3])
            print(f"  {name:8s} M={m:3d}: floor {floor:6.1f}; cuBLAS {lib['cublas']:6.1f}, Lt {lib['cublaslt']:6.1f}; "
                  f"Triton best: {top}", flush=True)
        del weights
        torch.cuda.empty_cache()
    print("  per layer (four GEMMs), us: Triton best / cuBLAS / cuBLASLt / floor")
    for m in sizes:
        tot = [sum(best[name, m][i] for name in LINEARS) for i in range(4)]
        print(f"    M={m:3d}: {tot[0]:6.1f} / {tot[1]:6.1f} / {tot[2]:6.1f} / {tot[3]:6.1f}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
