"""What batch-1 decode attention costs inside the step: per layer the qkv GEMV, the q/k
norms + RoPE + cache write, decode attention and the o GEMV with its add + RMSNorm, each
layer with its own weights and KV cache, captured in one CUDA graph and launched as the
engine launches them (PDL where the GPU has it). The same chain without attention (o
reads q instead) gives what attention adds; then the attention launch's choices are
swept (splits, keys a tile, warps, stages, the first-tile preload, the in-launch merge
against the combining kernel).

    python benchmarks/attention_chain.py                                  # Qwen3-30B-A3B shape
    python benchmarks/attention_chain.py --model qwen3-8b --contexts 512 4096
    python benchmarks/attention_chain.py --no-sweep                       # default launch only

µs a layer. The KV caches are spread over `--cache-gb` of memory and each sequence's
blocks are drawn at random from its layer's cache, so the reads miss L2 and the TLB as a
long-running server's would.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from dataclasses import dataclass

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from agent_infer.kernels import reference  # noqa: E402
from agent_infer.kernels.triton.decode_attention import (  # noqa: E402
    DecodeConfig, decode_attention, decode_counters, default_config, launch_plan,
)
from agent_infer.kernels.triton.gemv import linear_m1, linear_m1_add_rms_norm  # noqa: E402
from agent_infer.kernels.triton.rope_store import norm_rope_store  # noqa: E402
from agent_infer.kernels.triton.utils import PDL_ENV, pdl_enabled  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from gemv_chain import graph_time_us  # noqa: E402

DEV = "cuda"
DT = torch.bfloat16
BLOCK_SIZE = 16  # the engine's KV block


@dataclass(frozen=True)
class Model:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int = 128


MODELS = {
    "qwen3-30b-a3b": Model(48, 2048, 32, 4),
    "qwen3-8b": Model(36, 4096, 32, 8),
}


@dataclass(frozen=True)
class Launch:
    """One way to launch decode attention (None: the shape-derived default)."""

    splits: int | None = None
    config: DecodeConfig | None = None
    preload: bool | None = None
    merge: bool = True

    def tag(self, cfg: DecodeConfig) -> str:
        c = self.config or cfg
        return (f"splits {self.splits or 'default'} n{c.block_n} w{c.num_warps} s{c.num_stages} "
                f"preload {'default' if self.preload is None else self.preload} {'merge' if self.merge else 'combine'}")


class Layer:
    def __init__(self, m: Model, blocks: int, ctx: int):
        q_w, kv_w = m.heads * m.head_dim, m.kv_heads * m.head_dim
        self.w_qkv = torch.randn(q_w + 2 * kv_w, m.hidden, dtype=DT, device=DEV) * m.hidden**-0.5
        self.w_o = torch.randn(m.hidden, q_w, dtype=DT, device=DEV) * q_w**-0.5
        self.q_norm = torch.rand(m.head_dim, dtype=DT, device=DEV) + 0.5
        self.k_norm = torch.rand(m.head_dim, dtype=DT, device=DEV) + 0.5
        self.post_norm = torch.rand(m.hidden, dtype=DT, device=DEV) + 0.5
        self.k_cache = torch.randn(blocks, BLOCK_SIZE, m.kv_heads, m.head_dim, dtype=DT, device=DEV)
        self.v_cache = torch.randn_like(self.k_cache)
        need = triton.cdiv(ctx + 1, BLOCK_SIZE)
        table = torch.randperm(blocks, device=DEV)[:need].to(torch.int32)
        self.table = table.view(1, need).contiguous()
        self.slot = (table[ctx // BLOCK_SIZE].long() * BLOCK_SIZE + ctx % BLOCK_SIZE).view(1)
        self.counter = torch.zeros(1, dtype=torch.int32, device=DEV)
        self.attn_counters = decode_counters(1, m.kv_heads, DEV)


class Chain:
    """The model's layers at one context length (the new token's position is `ctx`)."""

    def __init__(self, m: Model, ctx: int, cache_gb: float):
        self.m = m
        per_layer = int(cache_gb * 1e9 / m.layers / (4 * BLOCK_SIZE * m.kv_heads * m.head_dim))
        blocks = max(per_layer, triton.cdiv(ctx + 1, BLOCK_SIZE) + 1)
        self.layers = [Layer(m, blocks, ctx) for _ in range(m.layers)]
        self.x = torch.randn(1, m.hidden, dtype=DT, device=DEV)
        self.residual = torch.randn(1, m.hidden, dtype=DT, device=DEV)
        self.positions = torch.full((1,), ctx, dtype=torch.long, device=DEV)
        self.lens = torch.full((1,), ctx + 1, dtype=torch.int32, device=DEV)
        self.cos_sin = torch.randn(ctx + 1, m.head_dim, dtype=torch.float32, device=DEV)  # any values time alike
        self.scale = m.head_dim**-0.5

    def attention(self, layer: Layer, qkv: torch.Tensor, launch: Launch | None) -> torch.Tensor:
        m = self.m
        q_w, kv_w = m.heads * m.head_dim, m.kv_heads * m.head_dim
        q = qkv[:, :q_w].view(1, m.heads, m.head_dim)
        k = qkv[:, q_w : q_w + kv_w].view(1, m.kv_heads, m.head_dim)
        v = qkv[:, q_w + kv_w :].view(1, m.kv_heads, m.head_dim)
        q, _ = norm_rope_store(self.positions, q, k, v, layer.q_norm, layer.k_norm, 1e-6, self.cos_sin, True,
                               layer.k_cache, layer.v_cache, layer.slot)
        if launch is None:
            return q.reshape(1, q_w)
        out = decode_attention(q, layer.k_cache, layer.v_cache, layer.table, self.lens, self.scale,
                               num_splits=launch.splits, config=launch.config, preload=launch.preload,
                               counters=layer.attn_counters if launch.merge else None)
        return out.view(1, q_w)

    def run(self, launch: Launch | None) -> torch.Tensor:
        x = self.x
        for layer in self.layers:
            qkv = linear_m1(x, layer.w_qkv)
            a = self.attention(layer, qkv, launch)
            x, _ = linear_m1_add_rms_norm(a, layer.w_o, None, self.residual, layer.post_norm, 1e-6, layer.counter)
        return x

    def check(self, launch: Launch) -> float:
        """Relative error of the first layer's attention against the reference."""
        layer = self.layers[0]
        qkv = linear_m1(self.x, layer.w_qkv)
        out = self.attention(layer, qkv, launch).view(1, self.m.heads, self.m.head_dim)
        q = qkv[:, : self.m.heads * self.m.head_dim].view(1, self.m.heads, self.m.head_dim)  # normed + roped in place
        ref = reference.decode_attention(q, layer.k_cache, layer.v_cache, layer.table, self.lens, self.scale)
        return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def sweep() -> list[Launch]:
    """Split counts past the default's cap (64) included, each merged in the launch and by
    the combining kernel."""
    out = [Launch(merge=False), Launch(preload=False), Launch(preload=True)]
    for splits, (bn, warps, stages), merge in itertools.product(
        (8, 16, 32, 64, 128),
        # 5 stages: the first depth at which Triton double-buffers the paged K/V tiles
        # (tests/test_kernel_compile.py).
        ((32, 4, 2), (32, 4, 3), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 2), (64, 4, 5), (32, 4, 5)),
        (True, False),
    ):
        out.append(Launch(splits, DecodeConfig(bn, warps, stages), merge=merge))
    return out


def bench_context(m: Model, ctx: int, cache_gb: float, do_sweep: bool) -> None:
    chain = Chain(m, ctx, cache_gb)
    per_layer = lambda launch: graph_time_us(lambda: chain.run(launch)) / m.layers  # noqa: E731
    dev = torch.device(DEV)
    cfg = default_config(m.head_dim, DT)
    plan = launch_plan(1, m.kv_heads, m.heads // m.kv_heads, m.head_dim, True, False, dev)
    base = per_layer(None)
    default = Launch()
    t_default = per_layer(default)
    print(f"\n{ctx} tokens: qkv + RoPE + o {base:.1f} us a layer; with attention {t_default:.1f} "
          f"(+{t_default - base:.1f}; {plan.splits} splits, n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}, "
          f"preload {plan.preload}, err {chain.check(default):.1e})", flush=True)
    if pdl_enabled(dev):
        os.environ[PDL_ENV] = "0"
        print(f"  without PDL: {per_layer(None):.1f} / {per_layer(default):.1f} us", flush=True)
        os.environ[PDL_ENV] = "1"
    if not do_sweep:
        return
    timed = []
    for launch in sweep():
        try:
            err = chain.check(launch)
            timed.append((per_layer(launch) - base, launch, err))
        except Exception as e:  # a tile that does not compile for this shape
            print(f"  {launch.tag(cfg)}: {type(e).__name__}", flush=True)
    timed.sort(key=lambda e: e[0])
    for t, launch, err in timed[:12]:
        print(f"  +{t:5.1f} us  {launch.tag(cfg)}  err {err:.1e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 32768])
    ap.add_argument("--cache-gb", type=float, default=16.0, help="KV cache memory over all layers (K and V)")
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    m = MODELS[args.model]
    print(f"{args.model}: {m.layers} layers, {m.heads} / {m.kv_heads} heads, hidden {m.hidden}; "
          f"{torch.cuda.get_device_name()}; PDL {pdl_enabled(torch.device(DEV))}", flush=True)
    for ctx in args.contexts:
        bench_context(m, ctx, args.cache_gb, not args.no_sweep)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
