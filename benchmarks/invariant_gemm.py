"""The batch-invariant mode's GEMM (`gemv.linear_invariant`) on a model's decode
projections, the way a decode step runs them: one projection of each shape per layer over
distinct weights (so nothing is served from L2), captured in one CUDA graph, at the row
counts of a plain step and of verify steps; the mode's tile against a sweep of others,
beside the batch-1 GEMV (one row) and cuBLAS (the same rows). Then a whole step's
projections as the engine runs them (the add + norm after o and down, SiLU-and-mul after
gate/up fused where they are), the mode's tiles against the batch-1 GEMV path.

    python benchmarks/invariant_gemm.py                          # Qwen3-8B shapes, 1 / 5 / 9 rows
    python benchmarks/invariant_gemm.py --model smollm2-135m     # the default model's shapes
    python benchmarks/invariant_gemm.py --rows 1 --no-sweep      # the mode's tiles only
    python benchmarks/invariant_gemm.py --only o down step       # some shapes (a full sweep takes minutes)

Any tile keeps a row's sums independent of the rows beside it as long as it is chosen from
the weight's shape alone (`gemv.invariant_config`); the sweep shows which costs least at
the row counts that matter, the one-row step first (a plain step runs it), and the step's
projections are timed again with the tiles fastest at the first row count given. cuBLAS also
runs as W x^T, where its heuristics see the weight's rows as M.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from gemv_chain import MODELS, graph_time_us, shapes  # noqa: E402

from agent_infer.kernels.triton import gemv  # noqa: E402
from agent_infer.kernels.triton.gemv import INVARIANT_BLOCK_M, GemvConfig, invariant_config  # noqa: E402

DEV = "cuda"
DT = torch.bfloat16


def candidates(n: int, k: int, silu: bool) -> list[GemvConfig]:
    """Tiles for an [n, k] weight: 16-128 columns, K tiles of 128-512 (32-64 where K is no
    multiple of 128: SmolLM2's 576), K split by the mode's
    rule (reduced by a second kernel, or in the kernel: `reduce_in_kernel`; SiLU-and-mul in
    the epilogue only the latter) or not at all, and from 64 columns the weight tile on the
    dot's left too (`swap_ab`: Hopper's warpgroup MMA; not with SiLU)."""
    out = []
    for bn, bk in itertools.product((16, 32, 64, 128), (128, 256, 512) if k % 128 == 0 else (32, 64)):
        if k % bk:
            continue
        split = gemv.split_for(n, k, bn, bk, torch.device(DEV))
        ways = [(1, False)] + ([(split, True)] + ([] if silu else [(split, False)]) if split > 1 else [])
        for (s, reduce), swap in itertools.product(ways, (False, True) if bn >= 64 and not silu else (False,)):
            out.append(GemvConfig(bn, bk, s, num_warps=4, num_stages=4, use_dot=True, swap_ab=swap,
                                  reduce_in_kernel=reduce))
    return out


def tag(c: GemvConfig) -> str:
    return (f"n{c.block_n} k{c.block_k} split{c.split_k}" + (" in-kernel" if c.reduce_in_kernel else "")
            + (" swap" if c.swap_ab else ""))


def bench_shape(name: str, n: int, k: int, layers: int, rows: list[int], sweep: bool,
                silu: bool = False) -> GemvConfig | None:
    """One [n, k] projection (with `silu`: [gate; up] pairs of 2n rows and SiLU-and-mul) per
    layer: µs a projection and TB/s of weights for each row count; the mode as the engine
    runs it (`linear_invariant`), then the sweep's tiles. Returns the sweep's fastest tile
    at the first row count where it beats the mode's (else None)."""
    rows_w = 2 * n if silu else n
    ws = [torch.randn(rows_w, k, dtype=DT, device=DEV) * k**-0.5 for _ in range(layers)]
    gbytes = rows_w * k * 2 / 1e9
    default = invariant_config(n, k, torch.device(DEV))
    configs = [c for c in candidates(n, k, silu) if c != default] if sweep else []

    def per_layer(fn) -> float:
        return graph_time_us(lambda: [fn(w) for w in ws]) / layers

    tiles = torch.zeros(1 << 16, dtype=torch.int32, device=DEV)  # counters of the in-kernel reductions

    def tile(cfg: GemvConfig, x: torch.Tensor):
        return lambda w: gemv.linear(x, w, None, cfg, block_m=INVARIANT_BLOCK_M, silu_mul=silu, tile_counters=tiles)

    def cublas(x: torch.Tensor, swapped: bool = False):
        # swapped: W x^T, the weight as cuBLAS's M side (its heuristics pick other kernels
        # for a wide M and an N of a few rows), the result left transposed.
        def run(w):
            y = (w @ x.t()).t() if swapped else F.linear(x, w)
            return y[:, :n] * y[:, n:] if silu else y  # the SiLU-and-mul's traffic, roughly
        return run

    line = [f"{name:14s} N={rows_w:6d} K={k:6d}"]
    chosen = None
    for m in rows:
        x = torch.randn(m, k, dtype=DT, device=DEV)
        ref = F.linear(x.float(), ws[0].float())
        if silu:
            ref = F.silu(ref[:, :n]) * ref[:, n:]
        runs = [("mode", lambda w, x=x: gemv.linear_invariant(x, w, silu_mul=silu))]
        runs += [(tag(c), tile(c, x)) for c in configs]
        timed = []
        for label, fn in runs:
            try:
                out = fn(ws[0])
            except triton.runtime.errors.OutOfResources:  # a sweep tile too big for this GPU
                continue
            err = ((out.float() - ref).norm() / ref.norm()).item()
            assert err < 2e-2, f"{label} at {m} rows: relative error {err:.1e}"
            timed.append((per_layer(fn), label))
        t_mode = timed[0][0]
        cell = f"| {m} rows: mode {t_mode:6.1f} us {gbytes / t_mode * 1e3:4.2f} TB/s"
        if m == 1:
            cell += f", GEMV {per_layer(lambda w, x=x: gemv.linear_m1(x, w, silu_mul=silu)):6.1f}"
        cell += f", cuBLAS {per_layer(cublas(x)):6.1f} (W x^T {per_layer(cublas(x, True)):6.1f})"
        if configs:
            t_best, best = min(timed[1:])
            cell += f", best other {t_best:6.1f} ({best})"
            if m == rows[0] and t_best < t_mode:
                chosen = next(c for c in configs if tag(c) == best)
        line.append(cell)
    silu_kernel = " + SiLU kernel" if silu and default.split_k > 1 else ""
    print(" ".join(line), f"| the mode's tile: {tag(default)}{silu_kernel}", flush=True)
    ws.clear()
    torch.cuda.empty_cache()
    return chosen


def bench_step(model: str, rows: list[int], best: dict[str, GemvConfig | None]) -> None:
    """A decode step's projections (layers of qkv, o + add + norm, gate/up + SiLU-and-mul,
    down + add + norm, then the LM head) in one graph: the mode's GEMM at each row count,
    the same with the sweep's fastest tiles where `best` has one (the mode's elsewhere),
    and for one row the batch-1 GEMV path the default engine runs."""
    m = MODELS[model]
    sh = shapes(m, 1)
    layers = [{name: torch.randn(n, k, dtype=DT, device=DEV) * k**-0.5 for name, (n, k) in sh.items()}
              for _ in range(m.layers)]
    head = torch.randn(m.vocab, m.hidden, dtype=DT, device=DEV) * m.hidden**-0.5
    norm_w = torch.ones(m.hidden, dtype=DT, device=DEV)
    total = (sum(w.numel() for w in layers[0].values()) * m.layers + head.numel()) * 2 / 1e9
    counters = torch.zeros(m.layers * 2 * 16, dtype=torch.int32, device=DEV)
    tiles = torch.zeros(1 << 16, dtype=torch.int32, device=DEV)

    def proj(name: str, x: torch.Tensor, w: torch.Tensor, tuned: bool, **kw) -> torch.Tensor:
        cfg = best.get(name) if tuned else None
        if cfg is None:
            return gemv.linear_invariant(x, w, **kw)
        return gemv.linear(x, w, None, cfg, block_m=INVARIANT_BLOCK_M, tile_counters=tiles, **kw)

    def step(x, x_o, residual, kind: str):
        one_row, tuned = kind == "gemv", kind == "tuned"

        def run():
            for i, w in enumerate(layers):
                c_o, c_down = counters[32 * i:32 * i + 16], counters[32 * i + 16:32 * i + 32]
                if one_row:
                    gemv.linear_m1(x, w["qkv"])
                    gemv.linear_m1_add_rms_norm(x_o, w["o"], None, residual, norm_w, 1e-6, c_o)
                    h = gemv.linear_m1(x, w["gate_up"], silu_mul=True)
                    gemv.linear_m1_add_rms_norm(h, w["down"], None, residual, norm_w, 1e-6, c_down)
                else:
                    proj("qkv", x, w["qkv"], tuned)
                    proj("o", x_o, w["o"], tuned, add_norm=(residual, norm_w, c_o, 1e-6))
                    h = proj("gate_up+silu", x, w["gate_up"], tuned, silu_mul=True)
                    proj("down", h, w["down"], tuned, add_norm=(residual, norm_w, c_down, 1e-6))
            if one_row:
                gemv.linear_m1(x, head)
            else:
                proj("head", x, head, tuned)
        return run

    cells = []
    for r in rows:
        x = torch.randn(r, m.hidden, dtype=DT, device=DEV)
        x_o = torch.randn(r, m.o_in, dtype=DT, device=DEV)
        residual = torch.randn(r, m.hidden, dtype=DT, device=DEV)
        t = graph_time_us(step(x, x_o, residual, "mode")) / 1e3
        cells.append(f"{r} rows {t:.3f} ms ({total / t:.2f} TB/s)")
        if any(best.values()):
            t = graph_time_us(step(x, x_o, residual, "tuned")) / 1e3
            cells.append(f"with the sweep's tiles {t:.3f} ms")
        if r == 1:
            t1 = graph_time_us(step(x, x_o, residual, "gemv")) / 1e3
            cells.append(f"the batch-1 GEMV path {t1:.3f} ms ({total / t1:.2f} TB/s)")
    print(f"step's projections ({total:.2f} GB), the mode: " + " | ".join(cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-8b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 9])
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--only", nargs="+", choices=["qkv", "o", "gate_up", "down", "head", "step"],
                    help="these projections (and the step) only: a sweep of every shape takes minutes")
    args = ap.parse_args()
    wanted = set(args.only or ["qkv", "o", "gate_up", "down", "head", "step"])
    m = MODELS[args.model]
    print(torch.cuda.get_device_name(), torch.__version__, args.model, "rows", args.rows)
    best = {}
    for name, (n, k) in [*shapes(m, 1).items(), ("head", (m.vocab, m.hidden))]:
        if name not in wanted:
            continue
        layers = 4 if name == "head" else m.layers
        if name == "gate_up":
            best["gate_up+silu"] = bench_shape("gate_up+silu", n // 2, k, layers, args.rows, not args.no_sweep,
                                               silu=True)
        else:
            best[name] = bench_shape(name, n, k, layers, args.rows, not args.no_sweep)
    print("the sweep's tiles at", args.rows[0], "row(s):", {name: tag(c) for name, c in best.items() if c})
    if "step" in wanted:
        bench_step(args.model, args.rows, best)


if __name__ == "__main__":
    main()
