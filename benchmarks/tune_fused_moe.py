"""Tune the fused-MoE launch configurations (agent_infer/kernels/triton/fused_moe_configs.py)
on the GPU, and compare the result with the plain loops.

    python benchmarks/tune_fused_moe.py              # all V2-Lite families, every bucket (~5 min)
    python benchmarks/tune_fused_moe.py --quick      # fewer candidates (~2 min)
    python benchmarks/tune_fused_moe.py --family v2-lite --tokens 1 8 64
    python benchmarks/tune_fused_moe.py --compare    # the table in the file vs the reference loop
                                                     # and per-expert torch.matmul (~1 min)
    python benchmarks/tune_fused_moe.py --weights fp8 --family v2-lite-shared --tokens 1 2 4
                                                     # e4m3 experts (one scale per row): TUNED_FP8
    python benchmarks/tune_fused_moe.py --compare-weights --family v2-lite qwen3-30b-a3b --tokens 1 8 64 512
                                                     # the table's configs over bf16, e4m3 per-row
                                                     # and e4m3 128 x 128 block experts (~1 min)
    python benchmarks/tune_fused_moe.py --family qwen3-30b-a3b
    python benchmarks/tune_fused_moe.py --family qwen3-30b-a3b --tokens 1 \
        --write /tmp/t/agent_infer/kernels/triton/fused_moe_configs.py   # merged into a copied tree (for `ab`)

Families (k = 6 of 64 experts, D = 2048): V2-Lite whole (E_local 64, I 1408), the same with
its 2 shared experts joined (66 stored experts, every token routed to the last two at
weight 1: what one GPU runs up to layers/moe.py's FUSED_SHARED_MAX_TOKENS), under EP = 2
(rank 0: 32 local experts, an expert map) and with TP = 2 experts (I 704); and Qwen3-30B-A3B
(k = 8 of 128 experts, I 768, D 2048; not in the default run).

How it measures. Routing is uniform (k distinct experts per token), drawn anew for each
of LAYERS layers, each with its own weights (1.1 GB per V2-Lite layer), so the touched
experts' weights come from HBM as in a real step, not from L2. Every timing is a CUDA
graph over the LAYERS layers (benchmarks/gemv_chain.py's timer), per layer. GEMM 1 (+
SiLU) and GEMM 2 are timed separately for each block_m candidate (they share only block_m
and the alignment); the best PAIRED of each are paired and every pair timed as the whole
layer (align + both GEMMs + sum, as the engine launches them), the fastest kept and
checked against the reference. Bandwidth counts the distinct
experts the step touches (3 * I * D weights each); TFLOP/s the local slots' 6 * I * D.
The last lines are the TUNED block to paste into fused_moe_configs.py.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_infer.kernels import reference  # noqa: E402
from agent_infer.quantization import fp8 as F8  # noqa: E402
from agent_infer.kernels.triton import fused_moe as moe  # noqa: E402
from agent_infer.kernels.triton.fused_moe_configs import (  # noqa: E402
    BUCKETS, MoeConfig, Tile, format_config, format_table, format_tile, get_config,
)
from benchmarks.gemv_chain import graph_time_us  # noqa: E402

DEV = "cuda"
DTYPE = torch.bfloat16
LAYERS = 4


@dataclass(frozen=True)
class Family:
    num_local: int
    inter: int
    hidden: int
    experts: int = 64  # global, routed
    top_k: int = 6
    shared: int = 0  # shared experts stored after the local routed ones (num_local counts them)
    note: str = ""

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.num_local, self.inter, self.hidden)

    @property
    def slots_per_token(self) -> int:
        return self.top_k + self.shared


FAMILIES = {
    "v2-lite": Family(64, 1408, 2048, note="V2-Lite, EP = 1"),
    "v2-lite-shared": Family(66, 1408, 2048, shared=2, note="V2-Lite, EP = 1, the 2 shared experts joined"),
    "v2-lite-ep2": Family(32, 1408, 2048, note="V2-Lite, EP = 2"),
    "v2-lite-tp2": Family(64, 704, 2048, note="V2-Lite, TP = 2 experts"),
    "qwen3-30b-a3b": Family(128, 768, 2048, experts=128, top_k=8, note="Qwen3-30B-A3B, EP = 1"),
}
DEFAULT_FAMILIES = ["v2-lite", "v2-lite-shared", "v2-lite-ep2", "v2-lite-tp2"]

# Candidate tiles per block_m, pruned to what can win: FMA rows (block_m 1, among them the
# batch-1 GEMV's kind: a few rows by 1,024-2,048 columns) and narrow tl.dot tiles for
# streaming weights at decode, wide tensor-core tiles for prefill. The same tiles serve
# GEMM 1 and GEMM 2 (timed separately). "quick" keeps the first few.
CANDIDATES: dict[int, list[Tile]] = {
    1: [Tile(8, 256, 4, 2), Tile(4, 512, 4, 2), Tile(16, 256, 4, 2), Tile(8, 512, 4, 2), Tile(16, 128, 4, 3),
        Tile(4, 2048, 4, 1), Tile(2, 2048, 4, 1), Tile(8, 1024, 4, 1), Tile(4, 1024, 4, 2), Tile(2, 1024, 4, 2),
        Tile(4, 256, 4, 3)],
    16: [Tile(32, 128, 4, 4), Tile(64, 128, 4, 4), Tile(16, 256, 4, 3), Tile(32, 256, 4, 3), Tile(64, 64, 4, 4),
         Tile(32, 128, 4, 6)],
    32: [Tile(64, 128, 4, 3), Tile(32, 128, 4, 4), Tile(64, 64, 4, 4), Tile(128, 64, 4, 3)],
    64: [Tile(64, 64, 4, 3), Tile(128, 64, 4, 3), Tile(64, 128, 4, 3), Tile(128, 64, 8, 3), Tile(64, 64, 4, 4)],
    128: [Tile(64, 64, 8, 4), Tile(128, 64, 8, 3), Tile(128, 64, 8, 4), Tile(64, 128, 8, 3)],
}
# e4m3 experts at one slot a block read int32 words: BLOCK_N rows by BLOCK_K values, the
# dense fp8 GEMV's kind of tile (K tails masked); their tensor-core tiles are CANDIDATES'.
FP8_ROWS = [Tile(4, 2048, 4, 1), Tile(8, 1024, 4, 1), Tile(2, 2048, 4, 1), Tile(8, 512, 4, 2), Tile(16, 512, 4, 1),
            Tile(4, 1024, 4, 2), Tile(16, 256, 4, 2), Tile(8, 2048, 8, 1), Tile(32, 128, 4, 3)]
QUICK = 3


def block_m_candidates(tokens: int, fam: Family) -> list[int]:
    """block_m worth trying from the expected slots per expert under uniform routing."""
    m = tokens * fam.top_k / fam.experts
    out = []
    if tokens <= 16:
        out.append(1)
    if m <= 16:
        out.append(16)
    if 3 <= m <= 64:
        out.append(32)
    if m >= 16:
        out.append(64)
    if m >= 64:
        out.append(128)
    return out


@dataclass
class Layer:
    w13: torch.Tensor
    w2: torch.Tensor
    scales: dict  # fused_moe's w13_scale / w2_scale (and block) for e4m3 experts, else empty

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights as the reference takes them: fp32, or the e4m3 values themselves."""
        return (self.w13, self.w2) if self.scales else (self.w13.float(), self.w2.float())


# The experts' forms: bf16; e4m3 with one scale per row (--quantization fp8, per-channel
# checkpoints); e4m3 with one per 128 x 128 block of each expert's matrices (DeepSeek-V3's
# and Qwen3's FP8 checkpoints), as the loader stores each.
WEIGHTS = ("bf16", "fp8", "fp8-block")
BLOCK = (128, 128)


def make_layers(fam: Family, layers: int, weights: str) -> list[Layer]:
    out = []
    for _ in range(layers):
        w13 = (torch.randn(fam.num_local, 2 * fam.inter, fam.hidden, device=DEV) * fam.hidden**-0.5).to(DTYPE)
        w2 = (torch.randn(fam.num_local, fam.hidden, fam.inter, device=DEV) * fam.inter**-0.5).to(DTYPE)
        scales = {}
        if weights == "fp8":
            (w13, s13), (w2, s2) = (F8.quantize_channel(w.reshape(-1, w.shape[-1])) for w in (w13, w2))
            w13, w2 = w13.view(fam.num_local, 2 * fam.inter, fam.hidden), w2.view(fam.num_local, fam.hidden, fam.inter)
            scales = {"w13_scale": s13.view(fam.num_local, -1), "w2_scale": s2.view(fam.num_local, -1)}
        elif weights == "fp8-block":
            (w13, s13), (w2, s2) = (F8.quantize_experts(w, BLOCK) for w in (w13, w2))
            scales = {"w13_scale": s13, "w2_scale": s2, "block": BLOCK}
        out.append(Layer(w13, w2, scales))
    return out


def expert_map(fam: Family) -> torch.Tensor | None:
    """Rank 0's map when the family holds part of the experts (EP)."""
    if fam.num_local - fam.shared == fam.experts:
        return None
    m = torch.full((fam.experts,), -1, dtype=torch.int32)
    m[: fam.num_local] = torch.arange(fam.num_local, dtype=torch.int32)
    return m.to(DEV)


@dataclass
class Step:
    """One step's inputs for every layer, and what it touches."""

    x: torch.Tensor
    weights: list[torch.Tensor]
    ids: list[torch.Tensor]
    touched: float  # distinct local experts per layer (mean)
    local_slots: float  # slots routed to a local expert per layer (mean)


def make_step(fam: Family, tokens: int, layers: int, emap: torch.Tensor | None, seed: int) -> Step:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(tokens, fam.hidden, device=DEV, generator=gen).to(DTYPE)
    weights, ids, touched, slots = [], [], 0, 0
    for _ in range(layers):
        i = torch.rand(tokens, fam.experts, device=DEV, generator=gen).topk(fam.top_k, dim=1).indices.to(torch.int32)
        w = torch.rand(tokens, fam.top_k, device=DEV, generator=gen) + 0.05
        w = w / w.sum(dim=1, keepdim=True)
        if fam.shared:  # the router's shared columns: the experts after the routed ones, weight 1
            fixed = torch.arange(fam.experts, fam.experts + fam.shared, device=DEV, dtype=torch.int32)
            i = torch.cat([i, fixed.expand(tokens, -1)], dim=1)
            w = torch.cat([w, torch.ones(tokens, fam.shared, device=DEV)], dim=1)
        weights.append(w)
        ids.append(i)
        local = i.long() if emap is None else emap.long()[i.long()]
        local = local[local >= 0]
        touched += local.unique().numel()
        slots += local.numel()
    return Step(x, weights, ids, touched / layers, slots / layers)


def per_layer_us(fn, layers: int) -> float:
    return graph_time_us(lambda: [fn(layer) for layer in range(layers)]) / layers


def weight_tbs(fam: Family, step: Step, us: float, ws: list[Layer]) -> float:
    """The touched experts' weights read per second, in TB/s (scales not counted)."""
    return step.touched * 3 * fam.inter * fam.hidden * ws[0].w13.element_size() / us / 1e6


def rates(fam: Family, step: Step, us: float, ws: list[Layer]) -> str:
    flops = step.local_slots * 6 * fam.inter * fam.hidden
    return f"{weight_tbs(fam, step, us, ws):5.2f} TB/s {flops / us / 1e6:6.1f} TFLOP/s"


def try_time(fn, layers: int) -> float | None:
    """µs per layer, or None when the configuration does not build or launch."""
    try:
        return per_layer_us(fn, layers)
    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: not a candidate
        print(f"      skipped: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
        torch.cuda.synchronize()
        return None


# Per block_m, the best few of each GEMM alone are paired and every pair timed as the
# whole fused MoE (its own launch sequence: GEMM 2 launched early at one token, the sum):
# a tile that overlaps its neighbour well can win there and lose alone.
PAIRED = 3


def tune_bucket(fam: Family, tokens: int, ws: list[Layer], emap, quick: bool) -> tuple[MoeConfig, str]:
    layers = len(ws)
    step = make_step(fam, tokens, layers, emap, seed=tokens)

    def full_us(cfg: MoeConfig) -> float | None:
        return try_time(lambda i: moe.fused_moe(step.x, ws[i].w13, ws[i].w2, step.weights[i], step.ids[i], emap,
                                                config=cfg, **ws[i].scales), layers)

    best: tuple[float, MoeConfig] | None = None
    for bm in block_m_candidates(tokens, fam):
        aligned = [moe.slot_layout(step.ids[i], fam.num_local, bm, emap) for i in range(layers)]
        tiles = FP8_ROWS if bm == 1 and ws[0].scales else CANDIDATES[bm]
        tiles = tiles[:QUICK] if quick else tiles
        k = fam.slots_per_token

        def run_up(i, t):
            return moe.gate_up_silu(step.x, ws[i].w13, aligned[i], k, t, ws[i].scales.get("w13_scale"))

        def run_down(i, t):
            return moe.down_weighted(hs[i], ws[i].w2, step.weights[i], aligned[i], t, ws[i].scales.get("w2_scale"))

        ups = [(t, try_time(lambda i, t=t: run_up(i, t), layers)) for t in tiles]
        hs = [run_up(i, tiles[0]) for i in range(layers)]
        downs = [(t, try_time(lambda i, t=t: run_down(i, t), layers)) for t in tiles]
        ups = [(us, t) for t, us in ups if us is not None]
        downs = [(us, t) for t, us in downs if us is not None]
        if not ups or not downs:
            continue
        ups.sort(key=lambda e: e[0])
        downs.sort(key=lambda e: e[0])
        (t_up, up), (t_down, down) = ups[0], downs[0]
        print(f"    block_m {bm:3d}: gate/up {t_up:8.1f} us {up}   down {t_down:8.1f} us {down}", flush=True)
        for what, timed in (("gate/up", ups), ("down", downs)):  # the runners-up: how close the choice was
            print(f"      next {what}: " + " | ".join(f"{format_tile(t)} {us:.1f}" for us, t in timed[1:5]), flush=True)
        pairs = [MoeConfig(bm, u, d) for _, u in ups[:PAIRED] for _, d in downs[:PAIRED]]
        timed_pairs = sorted(((us, c) for c in pairs if (us := full_us(c)) is not None), key=lambda e: e[0])
        print("      whole MoE: " + " | ".join(f"{format_tile(c.up)} + {format_tile(c.down)} {us:.1f}"
                                               for us, c in timed_pairs), flush=True)
        if timed_pairs and (best is None or timed_pairs[0][0] < best[0]):
            best = timed_pairs[0]
    assert best is not None, f"no configuration ran for T = {tokens}"
    t_full, cfg = best
    align = {one: per_layer_us(lambda i, one=one: moe.moe_align(step.ids[i], fam.num_local, cfg.block_m, emap,
                                                                 one_program=one), layers) for one in (True, False)}
    out = moe.fused_moe(step.x, ws[0].w13, ws[0].w2, step.weights[0], step.ids[0], emap, config=cfg,
                        **ws[0].scales).float()
    ref = reference.fused_moe(step.x.float(), *ws[0].reference(), step.weights[0], step.ids[0], emap, **ws[0].scales)
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()  # 0 / 0: no local slot at all
    line = (f"T={tokens:5d} touched {step.touched:5.1f} | layer {t_full:8.1f} us {rates(fam, step, t_full, ws)} | "
            f"align one-program {align[True]:5.1f} / three-kernel {align[False]:5.1f} us | err {err:.1e} | "
            f"{format_config(cfg)}")
    if err > 2e-2:
        line += "   <-- WRONG RESULT, not trusted"
    return cfg, line


def tune_family(name: str, tokens: list[int], layers: int, quick: bool, summary: list[str],
                fp8: bool) -> dict[int, MoeConfig]:
    fam = FAMILIES[name]
    ws = make_layers(fam, layers, "fp8" if fp8 else "bf16")
    emap = expert_map(fam)
    configs = {}
    for t in tokens:
        start = time.time()
        print(f"{name} T={t}", flush=True)
        configs[t], line = tune_bucket(fam, t, ws, emap, quick)
        summary.append(f"{name:12s} {line}")
        print(f"  {line}  ({time.time() - start:.0f} s)", flush=True)
    return configs


def merge_into_source(source: str, name: str, family: tuple[int, int, int], note: str,
                      entries: dict[int, MoeConfig], stamp: str) -> str:
    """`source` (fused_moe_configs.py's text) with `entries` (bucket -> config) written
    into table `name`'s block for `family`: a bucket's line replaced or inserted in
    order, each new line ending in `# stamp`; a family not yet in the table gets a block
    of its own (`note` after its key) at the table's end. Other lines stay as they are."""
    table = re.search(rf"^{name}: .*?^}}$", source, flags=re.S | re.M)
    assert table, f"no {name} block"
    lines = table.group(0).split("\n")
    head = next((i for i, line in enumerate(lines) if line.startswith(f"    {family}: {{")), None)
    if head is None:
        lines[-1:-1] = [f"    {family}: {{  # {note}", "    },"]
        head = len(lines) - 3
    end = next(i for i in range(head + 1, len(lines)) if lines[i] == "    },")
    body = {int(re.match(r"\s+(\d+):", line).group(1)): line for line in lines[head + 1:end]}
    body |= {b: f"        {b}: {format_config(c)},  # {stamp}" for b, c in entries.items()}
    lines[head + 1:end] = [body[b] for b in sorted(body)]
    return source[:table.start()] + "\n".join(lines) + source[table.end():]


def tune(families: list[str], tokens: list[int], layers: int, quick: bool, fp8: bool, write: str | None) -> None:
    table, notes, summary = {}, {}, []
    for name in families:
        fam = FAMILIES[name]
        table[fam.key], notes[fam.key] = tune_family(name, tokens, layers, quick, summary, fp8), fam.note
        torch.cuda.empty_cache()  # the family's weights are gone with tune_family's frame
    name = "TUNED_FP8" if fp8 else "TUNED"
    print("\n".join(["", "summary (per layer):"] + summary))
    print(f"\n# ---- paste over the {name} block of agent_infer/kernels/triton/fused_moe_configs.py ----")
    print(f"# measured: {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    if sorted(tokens) != list(BUCKETS):
        print(f"# PARTIAL run (T = {tokens}, buckets are {list(BUCKETS)}): merge these entries by hand or "
              "with --write")
    print(format_table(table, notes, name))
    if write:
        stamp = f"{torch.cuda.get_device_name()}, torch {torch.__version__.split('+')[0]}, {time.strftime('%Y-%m-%d')}"
        source = Path(write).read_text()
        for family, entries in table.items():
            source = merge_into_source(source, name, family, notes[family], entries, stamp)
        Path(write).write_text(source)
        print(f"# written into {write}")


def touched_matmuls(step: Step, ws: list[Layer], emap, layer: int):
    """A step's experts as plain torch matmuls over pre-gathered rows (routing known on the
    host, no gather or scatter): the per-expert cuBLAS cost of the same work."""
    ids = step.ids[layer].long()
    local = ids if emap is None else emap.long()[ids]
    inter = ws[layer].w2.shape[2]
    work = []
    for e in local[local >= 0].unique().tolist():
        tok = torch.nonzero(local == e, as_tuple=True)[0]
        work.append((e, step.x[tok].contiguous()))

    def run():
        for e, xe in work:
            g = F.linear(xe, ws[layer].w13[e])
            F.linear(F.silu(g[:, :inter]) * g[:, inter:], ws[layer].w2[e])
    return run


def compare(families: list[str], tokens: list[int], layers: int) -> None:
    """The table in fused_moe_configs.py against the reference loop (eager: it syncs on
    every expert's token list) and per-expert torch matmuls (in a graph); bf16 experts."""
    for name in families:
        compare_family(name, tokens, layers)
        torch.cuda.empty_cache()


def compare_family(name: str, tokens: list[int], layers: int) -> None:
    fam = FAMILIES[name]
    ws = make_layers(fam, layers, "bf16")
    emap = expert_map(fam)
    print(f"{name}: fused_moe (table config) | per-expert torch.matmul, graph | reference loop, eager")
    for t in tokens:
        step = make_step(fam, t, layers, emap, seed=1000 + t)
        cfg = get_config(fam.num_local, fam.inter, fam.hidden, t, fam.slots_per_token, fam.experts)
        t_fused = per_layer_us(lambda i: moe.fused_moe(step.x, ws[i].w13, ws[i].w2, step.weights[i], step.ids[i],
                                                       emap, config=cfg), layers)
        runs = [touched_matmuls(step, ws, emap, i) for i in range(layers)]
        t_mm = per_layer_us(lambda i: runs[i](), layers)
        reference.fused_moe(step.x, ws[0].w13, ws[0].w2, step.weights[0], step.ids[0], emap)  # warm
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(layers):
            reference.fused_moe(step.x, ws[i].w13, ws[i].w2, step.weights[i], step.ids[i], emap)
        end.record()
        end.synchronize()
        t_ref = start.elapsed_time(end) * 1000 / layers
        print(f"  T={t:5d} touched {step.touched:5.1f} | {t_fused:8.1f} us {rates(fam, step, t_fused, ws)} | "
              f"{t_mm:8.1f} us {rates(fam, step, t_mm, ws)} | {t_ref:9.1f} us | fused x{t_mm / t_fused:4.2f} "
              f"vs matmul, x{t_ref / t_fused:5.1f} vs reference", flush=True)


def compare_weights(families: list[str], tokens: list[int], layers: int) -> None:
    """The whole fused MoE at the engine's configuration (the table, fitted to the blocks)
    for each form of the experts in WEIGHTS, on the same steps: µs per layer and the
    touched experts' bytes per µs (scales not counted)."""
    for name in families:
        fam = FAMILIES[name]
        emap = expert_map(fam)
        steps = {t: make_step(fam, t, layers, emap, seed=2000 + t) for t in tokens}
        timed: dict[str, dict[int, tuple[float, float]]] = {}
        for weights in WEIGHTS:
            ws = make_layers(fam, layers, weights)
            timed[weights] = {}
            for t, step in steps.items():
                us = per_layer_us(lambda i: moe.fused_moe(step.x, ws[i].w13, ws[i].w2, step.weights[i], step.ids[i],
                                                          emap, **ws[i].scales), layers)
                timed[weights][t] = (us, weight_tbs(fam, step, us, ws))
            ws = []  # freed before the next form is made (the timing lambdas are done with it)
            torch.cuda.empty_cache()
        print(f"{name} ({fam.note}): µs per layer (TB/s of touched weights)")
        print("      T | " + " | ".join(f"{w:>18s}" for w in WEIGHTS) + " | block / row | row / bf16")
        for t in tokens:
            cells = " | ".join(f"{timed[w][t][0]:9.1f} ({timed[w][t][1]:5.2f})" for w in WEIGHTS)
            print(f"  {t:5d} | {cells} | {timed['fp8-block'][t][0] / timed['fp8'][t][0]:11.3f} | "
                  f"{timed['fp8'][t][0] / timed['bf16'][t][0]:9.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", nargs="+", choices=list(FAMILIES), default=DEFAULT_FAMILIES)
    ap.add_argument("--tokens", nargs="+", type=int, default=list(BUCKETS))
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--quick", action="store_true", help=f"the first {QUICK} tiles per block_m only")
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--compare-weights", action="store_true",
                    help="the table's configurations over bf16, per-row e4m3 and 128 x 128 block e4m3 experts")
    ap.add_argument("--weights", choices=["bf16", "fp8"], default="bf16",
                    help="fp8: e4m3 experts with one scale per row (tunes TUNED_FP8)")
    ap.add_argument("--write", metavar="CONFIGS_PY", default=None,
                    help="merge the measured entries into this copy of fused_moe_configs.py (a tree for `ab`)")
    args = ap.parse_args()
    if args.compare and args.weights == "fp8":
        ap.error("--compare runs bf16 experts")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    start = time.time()
    if args.compare:
        compare(args.family, args.tokens, args.layers)
    elif args.compare_weights:
        compare_weights(args.family, args.tokens, args.layers)
    else:
        tune(args.family, args.tokens, args.layers, args.quick, args.weights == "fp8", args.write)
    print(f"# {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
