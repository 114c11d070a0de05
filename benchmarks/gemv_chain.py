"""Batch-1 linear layers the way decode runs them: a chain of GEMVs over distinct weights
(so nothing is served from L2), captured in one CUDA graph, cuBLAS against the Triton
M = 1 kernel (`agent_infer.kernels.triton.gemv.linear_m1`), with and without
programmatic dependent launch (PDL).

    python benchmarks/gemv_chain.py                 # Qwen3-8B shapes, TP = 1 and TP = 2 shards
    python benchmarks/gemv_chain.py --no-sweep      # default configs only
    python benchmarks/gemv_chain.py --fp8 channel   # e4m3 weights, one scale per row (or: block, 128 x 128)
    python benchmarks/gemv_chain.py --model qwen3-30b-a3b --tp 1   # its attention projections (MoE: no MLP GEMVs)
    python benchmarks/gemv_chain.py --model deepseek-v2-lite --tp 1 --fp8 channel   # stacked q / kv_a, o
    python benchmarks/gemv_chain.py --rows 8 2 4 16 --tp 1   # rows of x (verify steps, small batches)
    python benchmarks/gemv_chain.py --rows 1 --tp 1 --few-row   # the few-row GEMV at one row
    python benchmarks/gemv_chain.py --model smollm2-135m --rows 1 9 --tp 1 --few-row   # short K (576)
    python benchmarks/gemv_chain.py --rows 5 --tp 1 --only o qkv   # those shapes alone, no chain

Per shape: one GEMV of that shape per layer in a graph, µs per GEMV and the weight read
rate (with --rows M > 1, x has M rows and the Triton side is the few-row GEMV on the tensor
cores, `gemv_rows_mma.linear_rows_mma`, with SiLU-and-mul in its epilogue, the engine's
launch with PDL); the sweep ranks the configurations by
their time with PDL where the GPU has it (as the engine launches them). Then the whole
per-layer chain (qkv, o, gate_up [+ SiLU-and-mul], down) over the layers plus the LM
head, ms per step: what the linear layers cost in one decode step.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from agent_infer.kernels.triton.activation import silu_and_mul  # noqa: E402
from agent_infer.kernels.triton.gemv import RowConfig, linear_m1, row_config  # noqa: E402
from agent_infer.kernels.triton.gemv_rows_mma import MmaConfig, linear_rows_mma, mma_config  # noqa: E402
from agent_infer.kernels.triton.utils import pdl_enabled  # noqa: E402
from agent_infer.quantization import fp8 as F8  # noqa: E402

DEV = "cuda"
DT = torch.bfloat16


@dataclass(frozen=True)
class Shape:
    """A model's dense decode projections: layers, hidden size, MLP width (0: a MoE, whose
    experts are not GEMVs), the rows of the first projection (q, k and v; DeepSeek's
    stacked q and kv_a), the o projection's input width, the LM head's rows."""

    layers: int
    hidden: int
    inter: int
    qkv: int
    o_in: int
    vocab: int = 151936


MODELS = {
    "qwen3-8b": Shape(36, 4096, 12288, 4096 + 2 * 1024, 4096),
    "qwen3-30b-a3b": Shape(48, 2048, 0, 4096 + 2 * 512, 4096),
    # MLA: 16 heads' q (192 wide) and the 576-wide kv_a in one GEMV; o over 16 x 128. Its
    # one dense layer's MLP is left out.
    "deepseek-v2-lite": Shape(27, 2048, 0, 16 * 192 + 576, 16 * 128, vocab=102400),
    "qwen3-0.6b": Shape(28, 1024, 3072, 2048 + 2 * 1024, 2048),
    "smollm2-135m": Shape(30, 576, 1536, 576 + 2 * 192, 576, vocab=49152),
}


def shapes(m: Shape, tp: int) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of one rank's shard (every width divided by tp, as a sketch of TP
    for MLA, whose kv_a is not sharded)."""
    out = {"qkv": (m.qkv // tp, m.hidden), "o": (m.hidden, m.o_in // tp)}
    if m.inter:
        out |= {"gate_up": (2 * m.inter // tp, m.hidden), "down": (m.hidden, m.inter // tp)}
    return out


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


class Weight:
    """One layer's weight as the GEMV reads it: bf16, or e4m3 with its scales (--fp8)."""

    layout: str | None = None  # None | "channel" | "block"

    def __init__(self, n: int, k: int):
        w = torch.randn(n, k, dtype=DT, device=DEV) * k**-0.5
        self.block = (128, 128) if Weight.layout == "block" else None
        if Weight.layout is None:
            self.w, self.scale = w, None
        else:
            self.w, self.scale = F8.quantize(w.float(), F8.Fp8Config(Weight.layout, self.block))
        self.ref = w if Weight.layout is None else F8.dequantize(self.w, self.scale, F8.Fp8Config(Weight.layout, self.block), DT)
        self.nbytes = self.w.numel() * self.w.element_size()

    def __call__(self, x: torch.Tensor, *, config: RowConfig | MmaConfig, pdl: bool | None = None,
                 silu_mul: bool = False) -> torch.Tensor:
        return gemv(x, self.w, config, pdl, silu_mul, self.scale, self.block)


def gemv(x: torch.Tensor, w: torch.Tensor, config: RowConfig | MmaConfig, pdl: bool | None, silu_mul: bool = False,
         scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """The engine's batch-1 GEMV (a RowConfig), or for several rows of x the few-row GEMV
    (an MmaConfig), SiLU-and-mul in the epilogue of either."""
    if isinstance(config, MmaConfig):
        assert scale is None, "the few-row GEMV takes bf16 weights"
        return linear_rows_mma(x, w, config=config, pdl=pdl, silu_mul=silu_mul)
    return linear_m1(x, w, scale=scale, block=block, config=config, pdl=pdl, silu_mul=silu_mul)


def mma_sweep(k: int) -> list[MmaConfig]:
    """Tiles of 16 weight rows on one or two warps (mma.sync), 32 on two or four, 64 on a
    warpgroup (Hopper's wgmma); the 64-row tiles with and without the first tile before
    the PDL wait (which holds the tile in registers: up to 255 a thread at 16 rows on
    sm_90, tests/test_kernel_compile.py). Where no 128-column tile divides K (SmolLM2-135M's
    576), every height also runs 64 columns, with and without the early first tile (the
    widest tile that divides such a K), and the wider tiles run with a masked K tail."""
    out = []
    short = k % 128 != 0
    for bn, warps, bks in ((16, (1, 2), (128, 256, 512)), (32, (2, 4), (128, 256)), (64, (4,), (64, 128, 256))):
        for w, bk, stages, prefetch in itertools.product(warps, ((64,) if short and bn < 64 else ()) + bks, (3, 4),
                                                         (True, False)):
            if bn == 64 or not prefetch or bk == 64:
                out.append(MmaConfig(bn, bk, w, stages, prefetch))
    return out


def sweep(few_row: bool, k: int) -> list[RowConfig | MmaConfig]:
    if few_row:
        return mma_sweep(k)
    out = []
    fp8 = Weight.layout is not None
    if fp8:
        grid = itertools.product((2, 4, 8, 16), (512, 1024, 2048), (4, 8), (2,), (1, 2))
    else:
        grid = itertools.product((2, 4, 8, 16), (512, 1024, 2048), (4, 8), (2, 4), (1, 2))
    for bn, bk, warps, stages, prefetch in grid:
        # bf16: the tiles held before the PDL wait; the row kernel's tile must divide K.
        if bn * bk * (1 if fp8 else prefetch) <= 16384 and k % bk == 0:
            out.append(RowConfig(bn, bk, warps, stages, prefetch))
    return out


def bench_shape(name: str, n: int, k: int, layers: int, do_sweep: bool, silu: bool = False,
                rows: int = 1, few_row: bool = False) -> RowConfig | MmaConfig:
    """One GEMV of [n, k] per layer (with `silu`: gate/up pairs and the SiLU-and-mul) on
    `rows` rows of x."""
    ws = [Weight(n, k) for _ in range(layers)]
    x = torch.randn(rows, k, dtype=DT, device=DEV)
    gbytes = ws[0].nbytes / 1e9
    ref = F.linear(x.float(), ws[0].ref.float())
    if silu:
        ref = F.silu(ref[:, : n // 2]) * ref[:, n // 2 :]

    def cublas():
        for w in ws:
            y = F.linear(x, w.ref)
            if silu:
                silu_and_mul(y)

    def chain(cfg: RowConfig | MmaConfig, pdl: bool) -> float:
        return graph_time_us(lambda: [w(x, config=cfg, pdl=pdl, silu_mul=silu) for w in ws]) / layers

    t_cublas = graph_time_us(cublas) / layers
    out_n = n // 2 if silu else n
    if few_row:
        default = mma_config(out_n, k, silu)
    else:
        default = row_config(out_n, k, torch.device(DEV), fp8=Weight.layout is not None, silu_mul=silu)
    configs = [default] + ([c for c in sweep(few_row, k) if c != default] if do_sweep else [])
    pdl = pdl_enabled(torch.device(DEV))
    timed = []
    for cfg in configs:
        try:
            err = ((ws[0](x, config=cfg, silu_mul=silu).float() - ref).norm() / ref.norm()).item()
        except triton.runtime.errors.OutOfResources:  # a tile the GPU cannot hold
            continue
        t_pdl = chain(cfg, pdl)
        # The tensor-core sweep times the engine's launch alone (each launch kind compiles its own).
        t = chain(cfg, False) if pdl and not few_row else t_pdl
        timed.append((t_pdl, t, cfg, err))
    t_def_pdl, t_def = timed[0][0], timed[0][1]
    timed.sort(key=lambda e: e[0])
    t_pdl, t_best, best, err = timed[0]
    tag = lambda c: f"n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages} p{int(c.prefetch)}"  # noqa: E731
    print(
        f"{name:8s} N={n:6d} K={k:6d} | cuBLAS bf16 {t_cublas:6.1f} us {2 * n * k / t_cublas / 1e6:5.2f} TB/s | "
        f"triton default {t_def:6.1f}, +PDL {t_def_pdl:6.1f} | best with PDL {t_pdl:6.1f} us "
        f"{gbytes / t_pdl * 1e3:5.2f} TB/s, without {t_best:6.1f} ({tag(best)}, err {err:.1e})",
        flush=True,
    )
    if len(timed) > 1:
        print("    next: " + " | ".join(f"{tag(c)} {tp:.1f}/{t:.1f}" for tp, t, c, _ in timed[1:6]), flush=True)
    ws.clear()
    torch.cuda.empty_cache()
    return best


def bench_chain(m: Shape, tp: int, best: dict[str, RowConfig | MmaConfig], rows: int = 1) -> None:
    sh = shapes(m, tp)
    layers = [{name: Weight(n, k) for name, (n, k) in sh.items()} for _ in range(m.layers)]
    head = torch.randn(m.vocab // tp, m.hidden, dtype=DT, device=DEV) * m.hidden**-0.5  # bf16 in every format
    x = torch.randn(rows, m.hidden, dtype=DT, device=DEV)
    x_o = torch.randn(rows, m.o_in // tp, dtype=DT, device=DEV)
    total = (sum(w.nbytes for w in layers[0].values()) * m.layers + head.numel() * 2) / 1e9

    def cublas():
        for w in layers:
            F.linear(x, w["qkv"].ref)
            F.linear(x_o, w["o"].ref)
            if m.inter:
                F.linear(silu_and_mul(F.linear(x, w["gate_up"].ref)), w["down"].ref)
        F.linear(x, head)

    def triton_chain(pdl: bool):
        def run():
            for w in layers:
                w["qkv"](x, config=best["qkv"], pdl=pdl)
                w["o"](x_o, config=best["o"], pdl=pdl)
                if m.inter:
                    h = w["gate_up"](x, silu_mul=True, config=best["gate_up_silu"], pdl=pdl)
                    w["down"](h, config=best["down"], pdl=pdl)
            gemv(x, head, best["head"], pdl)
        return run

    t_c = graph_time_us(cublas) / 1e3
    t_t = graph_time_us(triton_chain(False)) / 1e3
    t_p = graph_time_us(triton_chain(True)) / 1e3 if pdl_enabled(torch.device(DEV)) else t_t
    print(
        f"TP={tp} chain ({total:.2f} GB/rank): cuBLAS + SiLU kernel {t_c:.3f} ms ({total / t_c:.2f} TB/s) | "
        f"Triton fused SiLU {t_t:.3f} ms ({total / t_t:.2f} TB/s) | Triton + PDL {t_p:.3f} ms ({total / t_p:.2f} TB/s)",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-8b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1],
                    help="rows of x (2-16: the few-row GEMV), each in turn")
    ap.add_argument("--few-row", action="store_true",
                    help="the few-row GEMV at one row of x too (where the engine runs the batch-1 GEMV)")
    ap.add_argument("--fp8", choices=["channel", "block"], default=None,
                    help="the layers' weights in e4m3 (the LM head stays bf16); cuBLAS runs their bf16 values")
    ap.add_argument("--only", nargs="+", default=None, choices=["qkv", "o", "gate_up", "gate_up_silu", "down", "head"],
                    help="sweep these shapes alone (the whole chain needs every shape, so it is left out)")
    args = ap.parse_args()
    m = MODELS[args.model]

    def wanted(name: str) -> bool:
        return args.only is None or name in args.only

    assert (args.rows == [1] and not args.few_row) or args.fp8 is None, "the few-row GEMV takes bf16 weights"
    print(torch.cuda.get_device_name(), torch.__version__, args.model, f"weights: {args.fp8 or 'bf16'}, "
          f"{args.rows} row(s) of x")
    for rows, tp in itertools.product(args.rows, args.tp):
        few = rows > 1 or args.few_row
        best = {}
        Weight.layout = args.fp8
        sweep_on = not args.no_sweep
        for name, (n, k) in shapes(m, tp).items():
            if not wanted(name):
                continue
            best[name] = bench_shape(f"{name}/tp{tp}/M{rows}", n, k, m.layers, sweep_on, rows=rows, few_row=few)
        if m.inter and wanted("gate_up_silu"):
            n, k = shapes(m, tp)["gate_up"]
            best["gate_up_silu"] = bench_shape(f"gate_up+silu/tp{tp}/M{rows}", n, k, m.layers, sweep_on, silu=True,
                                               rows=rows, few_row=few)
        Weight.layout = None
        # The LM head is swept for the few-row GEMV only (its tile is the engine's choice there).
        if wanted("head"):
            best["head"] = bench_shape(f"head/tp{tp}/M{rows}", m.vocab // tp, m.hidden, m.layers, sweep_on and few,
                                       rows=rows, few_row=few)
        Weight.layout = args.fp8
        if args.only is None:
            bench_chain(m, tp, best, rows)


if __name__ == "__main__":
    main()
