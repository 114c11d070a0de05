"""Batch-1 linear layers the way decode runs them: a chain of GEMVs over distinct weights
(so nothing is served from L2), captured in one CUDA graph, cuBLAS against the Triton
M = 1 kernel (`agent_infer.kernels.triton.gemv.linear_m1`), with and without
programmatic dependent launch (PDL).

    python benchmarks/gemv_chain.py                 # Qwen3-8B shapes, TP = 1 and TP = 2 shards
    python benchmarks/gemv_chain.py --no-sweep      # default configs only

Per shape: 36 GEMVs of that shape (one per layer) in a graph, µs per GEMV and the weight
read rate. Then the whole per-layer chain (qkv, o, gate_up [+ SiLU-and-mul], down) x 36
plus the LM head, ms per step: what the linear layers cost in one decode step.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from agent_infer.kernels.triton.activation import silu_and_mul  # noqa: E402
from agent_infer.kernels.triton.gemv import RowConfig, linear_m1, row_config  # noqa: E402

DEV = "cuda"
DT = torch.bfloat16
LAYERS = 36
HIDDEN, INTER, Q, KV, VOCAB = 4096, 12288, 4096, 1024, 151936


def shapes(tp: int) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of one rank's shard."""
    return {
        "qkv": ((Q + 2 * KV) // tp, HIDDEN),
        "o": (HIDDEN, Q // tp),
        "gate_up": (2 * INTER // tp, HIDDEN),
        "down": (HIDDEN, INTER // tp),
    }


def graph_time_us(fn, replays: int = 20) -> float:
    """Mean µs of one replay of a graph holding fn()."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile / warm outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / replays


def sweep() -> list[RowConfig]:
    out = []
    for bn, bk, warps, stages in itertools.product((2, 4, 8, 16), (512, 1024, 2048), (4, 8), (2, 4)):
        if bn * bk <= 16384:
            out.append(RowConfig(bn, bk, warps, stages))
    return out


def bench_shape(name: str, n: int, k: int, do_sweep: bool) -> RowConfig:
    ws = [torch.randn(n, k, dtype=DT, device=DEV) * k**-0.5 for _ in range(LAYERS)]
    x = torch.randn(1, k, dtype=DT, device=DEV)
    gbytes = n * k * 2 / 1e9
    ref = F.linear(x.float(), ws[0].float())
    t_cublas = graph_time_us(lambda: [F.linear(x, w) for w in ws]) / LAYERS
    default = row_config(n, k, torch.device(DEV))
    configs = [default] + ([c for c in sweep() if k % c.block_k == 0 and c != default] if do_sweep else [])
    timed = []
    for cfg in configs:
        err = ((linear_m1(x, ws[0], config=cfg).float() - ref).norm() / ref.norm()).item()
        t = graph_time_us(lambda cfg=cfg: [linear_m1(x, w, config=cfg) for w in ws]) / LAYERS
        timed.append((t, cfg, err))
    t_def = timed[0][0]
    t_best, best, err = min(timed, key=lambda e: e[0])
    t_pdl = graph_time_us(lambda: [linear_m1(x, w, config=best, pdl=True) for w in ws]) / LAYERS
    print(
        f"{name:8s} N={n:6d} K={k:6d} | cuBLAS {t_cublas:6.1f} us {gbytes / t_cublas * 1e3:5.2f} TB/s | "
        f"triton default {t_def:6.1f} | best {t_best:6.1f} us {gbytes / t_best * 1e3:5.2f} TB/s "
        f"(n{best.block_n} k{best.block_k} w{best.num_warps} s{best.num_stages}, err {err:.1e}) | "
        f"+PDL {t_pdl:6.1f} us {gbytes / t_pdl * 1e3:5.2f} TB/s",
        flush=True,
    )
    ws.clear()
    torch.cuda.empty_cache()
    return best


def bench_chain(tp: int, best: dict[str, RowConfig]) -> None:
    sh = shapes(tp)
    layers = [{name: torch.randn(n, k, dtype=DT, device=DEV) * k**-0.5 for name, (n, k) in sh.items()} for _ in range(LAYERS)]
    head = torch.randn(VOCAB // tp, HIDDEN, dtype=DT, device=DEV) * HIDDEN**-0.5
    x = torch.randn(1, HIDDEN, dtype=DT, device=DEV)
    x_o = torch.randn(1, Q // tp, dtype=DT, device=DEV)
    total = (sum(n * k for n, k in sh.values()) * LAYERS + head.numel()) * 2 / 1e9

    def cublas():
        for w in layers:
            F.linear(x, w["qkv"])
            F.linear(x_o, w["o"])
            F.linear(silu_and_mul(F.linear(x, w["gate_up"])), w["down"])
        F.linear(x, head)

    def triton_chain(pdl: bool):
        def run():
            for w in layers:
                linear_m1(x, w["qkv"], config=best["qkv"], pdl=pdl)
                linear_m1(x_o, w["o"], config=best["o"], pdl=pdl)
                h = linear_m1(x, w["gate_up"], silu_mul=True, config=best["gate_up_silu"], pdl=pdl)
                linear_m1(h, w["down"], config=best["down"], pdl=pdl)
            linear_m1(x, head, config=best["head"], pdl=pdl)
        return run

    t_c = graph_time_us(cublas) / 1e3
    t_t = graph_time_us(triton_chain(False)) / 1e3
    t_p = graph_time_us(triton_chain(True)) / 1e3
    print(
        f"TP={tp} chain ({total:.2f} GB/rank): cuBLAS + SiLU kernel {t_c:.3f} ms ({total / t_c:.2f} TB/s) | "
        f"Triton fused SiLU {t_t:.3f} ms ({total / t_t:.2f} TB/s) | Triton + PDL {t_p:.3f} ms ({total / t_p:.2f} TB/s)",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    for tp in args.tp:
        best = {}
        for name, (n, k) in shapes(tp).items():
            best[name] = bench_shape(f"{name}/tp{tp}", n, k, not args.no_sweep)
        best["gate_up_silu"] = best["gate_up"]
        best["head"] = bench_shape(f"head/tp{tp}", VOCAB // tp, HIDDEN, not args.no_sweep)
        bench_chain(tp, best)


if __name__ == "__main__":
    main()
