"""A floor for `bench throughput`'s workload on one GPU (CPU only, no model needed): the
time the run could not beat if every kernel ran at the hardware's rate and nothing else
took time. The workload is regenerated from its seed, as the benchmark draws it
(nano-vllm's draw by default, `--workload uniform` for the other).

    python benchmarks/workload_floor.py [--preset qwen3-8b|deepseek-v2-lite|qwen3-30b-a3b|...] [--workload nano-vllm]
        [--read-tbs 4.5] [--tflops 790 705] [--target 12000]

Prefill: the projections' FLOPs (every prompt token through every layer) and causal
attention's, at the GEMM rate. Decode, step by step over the falling batch (every prompt
prefilled first, as the default schedule does): each projection and the LM head at
max(weight bytes at the read rate, FLOPs at the GEMM rate), plus every context's KV
bytes at the read rate. Nothing else: no norms, activations, sampling or launch gaps.
A second total adds the bytes the engine's other kernels must move at the read rate (two
add + RMSNorms, q/k-norm + RoPE + KV write and SiLU-and-mul per token and layer, the
final norm, the logits written and sampled): they run between the GEMMs, so no schedule
hides them; still no launch gaps.
The DeepSeek presets (deepseek-v2-lite, deepseek-v3-small: latent attention and mixtures
of experts) are counted as the engine computes them: prefill up-projects every token's
latent to per-head K and V and routes it to its top-k experts; decode absorbs W_UK into
the query and W_UV into the output, reads each cached token's latent row once per layer,
and reads only the routed experts the step's tokens touch (uniform routing, as
`agent_infer.bench.roofline.decode_weight_params` counts them), those as one group at
max(their bytes, their FLOPs). Details in `deepseek_times`. The sparse-MoE preset
(qwen3-30b-a3b) has a dense model's attention and KV reads with the experts counted the
same way (`sparse_moe_times`).
Each --tflops value gives one line: on an H200, 790 TFLOP/s is what a short GEMM
benchmark reaches at boost clock, ~705 what the workload's GEMMs sustain at the 700 W
power limit (the sustained rate: benchmarks/gemm_sustained.py; docs/PERFORMANCE.md).
Each line says what share of the floor a target is: by default 12,000 output tok/s for
the dense presets and 15,000 for the DeepSeek ones, the goals set for each.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from dataclasses import dataclass
from typing import Iterator

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_infer.bench.offline import WORKLOADS  # noqa: E402
from agent_infer.bench.random_weights import HubPreset, RandomPreset, get_preset, hf_config  # noqa: E402
from agent_infer.bench.roofline import decode_weight_params  # noqa: E402
from agent_infer.config import ModelConfig  # noqa: E402
from agent_infer.models.sparse_moe import SparseMoeFamilyConfig  # noqa: E402

DENSE_TARGET, DEEPSEEK_TARGET = 12_000.0, 15_000.0  # output tok/s


@dataclass(frozen=True)
class Rates:
    """What the floor assumes of the GPU and the formats: bytes a second read, FLOPs a
    second of the projections (`gemm`: the fp8 rate for fp8 weights) and of attention and
    the bf16 remainder (`bf16`), bytes per weight of the projections and experts, and per
    KV-cache value."""

    read: float
    gemm: float
    bf16: float
    weight_bytes: int = 2
    kv_bytes: int = 2


def floor(preset: str, workload: str, num_seqs: int, min_len: int, max_len: int, seed: int,
          rates: Rates) -> dict[str, float]:
    p = get_preset(preset)
    # The lengths exactly as `bench throughput` draws them.
    prompts, outs = WORKLOADS[workload](num_seqs, min_len, max_len, p.vocab_size, seed)
    in_lens = np.asarray([len(x) for x in prompts])
    out_lens = np.asarray(outs)
    read = rates.read
    if is_sparse_moe(preset):
        prefill, decode, kv_time = sparse_moe_times(preset, in_lens, out_lens, rates)
        per_token_bytes = sparse_moe_elementwise_bytes(hub_config(preset))
    elif isinstance(p, HubPreset):
        prefill, decode, kv_time = deepseek_times(preset, in_lens, out_lens, rates)
        per_token_bytes = deepseek_elementwise_bytes(hub_config(preset))
    else:
        prefill, decode, kv_time = dense_times(p, in_lens, out_lens, rates)
        per_token_bytes = elementwise_bytes(p)
    total = prefill + decode + kv_time
    tokens = int(in_lens.sum()) + int(out_lens.sum())  # every token passes each layer once
    elementwise = (tokens * per_token_bytes + int(out_lens.sum()) * 2 * p.vocab_size * 2) / read
    return {"prefill_s": prefill, "decode_gemm_s": decode, "decode_kv_s": kv_time, "total_s": total,
            "output_tok_s": float(out_lens.sum()) / total, "output_tokens": int(out_lens.sum()),
            "elementwise_s": elementwise,
            "output_tok_s_with_elementwise": float(out_lens.sum()) / (total + elementwise)}


def decode_steps(in_lens: np.ndarray, out_lens: np.ndarray) -> Iterator[tuple[int, float]]:
    """(live sequences, their context tokens) of every decode step: the first token of
    each request comes from its prefill, so step 1 makes the second."""
    for step in range(1, int(out_lens.max())):
        live = out_lens > step
        yield int(live.sum()), float(np.sum(in_lens[live] + step))


def gemm_s(n: int, k: int, batch: int, read: float, rate: float, weight_bytes: float = 2) -> float:
    """One [n, k] weight applied to `batch` rows: it cannot beat reading the weight, nor its FLOPs."""
    return max(weight_bytes * n * k / read, 2 * batch * n * k / rate)


def gemm_list_s(gemms: list[tuple[int, int, int, float]], batch: int, rates: Rates) -> float:
    """`gemm_s` over (N, K, count, bytes per weight) entries; those stored in the
    projections' format (`rates.weight_bytes`) at the projections' rate, others (the
    bf16 LM head, an fp32 router) at the bf16 rate."""
    return sum(count * gemm_s(n, k, batch, rates.read, rates.gemm if size == rates.weight_bytes else rates.bf16, size)
               for n, k, count, size in gemms)


def dense_times(p: RandomPreset, in_lens: np.ndarray, out_lens: np.ndarray,
                rates: Rates) -> tuple[float, float, float]:
    """(prefill, decode GEMMs, KV reads) seconds of a dense decoder: fused QKV, o_proj,
    fused gate/up and down per layer; the LM head in decode only (a prompt's last row
    through it is left out of prefill, under 0.1 % of its FLOPs)."""
    h, q, kv = p.hidden_size, p.num_heads * p.head_dim, p.num_kv_heads * p.head_dim
    projections = [(q + 2 * kv, h), (h, q), (2 * p.intermediate_size, h), (h, p.intermediate_size)]  # (N, K)
    per_token = 2 * p.num_layers * sum(n * k for n, k in projections)  # FLOPs of one token's projections
    attn = 4 * p.num_layers * p.num_heads * p.head_dim * causal_pairs(in_lens)
    prefill = per_token * int(in_lens.sum()) / rates.gemm + attn / rates.bf16
    kv_bytes = 2 * p.num_layers * kv * rates.kv_bytes  # K and V per cached token
    gemms = [(n, k, p.num_layers, rates.weight_bytes) for n, k in projections] + [(p.vocab_size, h, 1, 2)]
    decode = kv_time = 0.0
    for b, context in decode_steps(in_lens, out_lens):
        decode += gemm_list_s(gemms, b, rates)
        kv_time += context * kv_bytes / rates.read
    return prefill, decode, kv_time


def causal_pairs(in_lens: np.ndarray) -> float:
    """(query, key) pairs of causal attention over every prompt."""
    return float(np.sum(in_lens * (in_lens + 1) / 2))


@functools.lru_cache(maxsize=None)
def hub_config(preset: str) -> ModelConfig:
    """The engine's config of a preset written from a hub config.json (DeepSeek, Qwen3-MoE)."""
    return ModelConfig.from_dict(hf_config(get_preset(preset)))


def is_sparse_moe(preset: str) -> bool:
    """A Qwen3-MoE or Mixtral preset: GQA attention and a mixture of routed experts."""
    return isinstance(get_preset(preset), HubPreset) and isinstance(hub_config(preset).family, SparseMoeFamilyConfig)


def deepseek_gemms(cfg: ModelConfig) -> list[tuple[int, int, int, int]]:
    """(N, K, layers, bytes per weight) of every GEMM but the routed experts and the LM
    head. kv_b_proj [heads x (nope + v), latent] is one entry for both paths: prefill
    applies it to every token's latent, decode its halves W_UK to the query and W_UV to
    the attention's output; the weight and the FLOPs per row are the same. The router's
    weights are fp32 (its FLOPs are counted at the bf16 rate, a few ms in all)."""
    f, h, layers = cfg.family, cfg.hidden_size, cfg.num_layers
    heads, latent, rope = f.num_heads, f.kv_lora_rank, f.qk_rope_head_dim
    q = heads * (f.qk_nope_head_dim + rope)
    moe = sum(f.is_moe_layer(i) for i in range(layers))
    shared = f.moe_intermediate_size * f.n_shared_experts
    q_rows = q if f.q_lora_rank is None else f.q_lora_rank
    gemms = [(q_rows + latent + rope, h, layers, 2)]  # q_proj or q_a_proj with kv_a_proj_with_mqa: x's two, fused
    if f.q_lora_rank is not None:
        gemms.append((q, f.q_lora_rank, layers, 2))
    gemms += [(heads * (f.qk_nope_head_dim + f.v_head_dim), latent, layers, 2), (h, heads * f.v_head_dim, layers, 2),
              (2 * f.intermediate_size, h, layers - moe, 2), (h, f.intermediate_size, layers - moe, 2),
              (f.n_routed_experts, h, moe, 4)]
    if shared:
        gemms += [(2 * shared, h, moe, 2), (h, shared, moe, 2)]
    return gemms


def routed_flops(cfg: ModelConfig) -> int:
    """FLOPs of one token through its top-k routed experts (gate/up and down) in every MoE layer."""
    f = cfg.family
    moe = sum(f.is_moe_layer(i) for i in range(cfg.num_layers))
    return 2 * moe * f.router.top_k * 3 * cfg.hidden_size * f.moe_intermediate_size


@functools.lru_cache(maxsize=None)
def decode_weight_bytes(preset: str, batch: int) -> float:
    """bf16 bytes of the weights a decode step of `batch` sequences reads, as
    `decode_weight_params` counts them (at batch 0: all but the routed experts). Cached:
    building the model to count costs ~20 ms, and the batch takes a few hundred values."""
    return 2 * decode_weight_params(hub_config(preset), batch)


def sparse_moe_times(preset: str, in_lens: np.ndarray, out_lens: np.ndarray,
                     rates: Rates) -> tuple[float, float, float]:
    """(prefill, decode GEMMs, KV reads) seconds of a Qwen3-MoE or Mixtral model: per layer
    fused QKV and o_proj as `dense_times` counts them, then in a sparse layer the router
    (fp32 weights) and the top-k routed experts, counted as `deepseek_times` counts them
    (prefill: every token's top-k at the GEMM rate; decode: the experts the step's tokens
    touch as one group at max(their bytes, the live tokens' FLOPs)), in a dense layer its
    MLP. KV reads as a dense model's."""
    cfg = hub_config(preset)
    f, h, layers = cfg.family, cfg.hidden_size, cfg.num_layers
    q, kv = f.num_heads * f.head_dim, f.num_kv_heads * f.head_dim
    sparse = sum(f.sparse_layers)
    w = rates.weight_bytes
    gemms = [(q + 2 * kv, h, layers, w), (h, q, layers, w), (f.router.num_experts, h, sparse, 4),
             (2 * f.intermediate_size, h, layers - sparse, w), (h, f.intermediate_size, layers - sparse, w)]
    routed = 2 * sparse * f.router.top_k * 3 * h * f.moe_intermediate_size  # FLOPs of one token's experts
    per_token = 2 * sum(n * k * count for n, k, count, _ in gemms) + routed
    prefill = per_token * int(in_lens.sum()) / rates.gemm + 4 * layers * q * causal_pairs(in_lens) / rates.bf16
    gemms.append((cfg.vocab_size, h, 1, 2))
    kv_bytes = 2 * layers * kv * rates.kv_bytes  # K and V per cached token
    decode = kv_time = 0.0
    for b, context in decode_steps(in_lens, out_lens):
        decode += gemm_list_s(gemms, b, rates) + routed_s(preset, b, routed, rates)
        kv_time += context * kv_bytes / rates.read
    return prefill, decode, kv_time


def routed_s(preset: str, batch: int, token_flops: float, rates: Rates) -> float:
    """The routed experts of a decode step of `batch` tokens as one group: the experts
    they touch read once (in the projections' format) against the tokens' FLOPs."""
    touched = decode_weight_bytes(preset, batch) - decode_weight_bytes(preset, 0)  # bf16 bytes
    return max(touched * rates.weight_bytes / 2 / rates.read, batch * token_flops / rates.gemm)


def deepseek_times(preset: str, in_lens: np.ndarray, out_lens: np.ndarray,
                   rates: Rates) -> tuple[float, float, float]:
    """(prefill, decode GEMMs, KV reads) seconds of a DeepSeek model as the engine runs it.

    Prefill: every prompt token through `deepseek_gemms` and its top-k routed experts, at
    the GEMM rate, plus causal attention over the K and V up-projected per head: 2 x heads
    x (nope + rope) FLOPs per (query, key) pair for QK and 2 x heads x v for PV.
    The LM head runs in decode only, as in `dense_times`.
    Decode, per step: each of `deepseek_gemms` and the LM head at max(weight bytes, FLOPs);
    the routed experts as one group at max(the touched experts' bytes, the FLOPs of the
    live tokens' top-k); attention over the latent cache at max(its bytes, its FLOPs):
    (kv_lora + rope) bf16 values per cached token and layer, read once for all heads, and
    2 x heads x (kv_lora + rope + kv_lora) FLOPs per key and layer (QK over the absorbed
    query, PV over the latent). Norm weights (a few hundred kB) and V3's router bias are
    left out."""
    cfg = hub_config(preset)
    f, layers = cfg.family, cfg.num_layers
    gemms = [(n, k, count, rates.weight_bytes if size == 2 else size) for n, k, count, size in deepseek_gemms(cfg)]
    per_token = 2 * sum(n * k * count for n, k, count, _ in gemms) + routed_flops(cfg)
    attn = 2 * layers * f.num_heads * (f.qk_nope_head_dim + f.qk_rope_head_dim + f.v_head_dim) * causal_pairs(in_lens)
    prefill = per_token * int(in_lens.sum()) / rates.gemm + attn / rates.bf16
    gemms.append((cfg.vocab_size, cfg.hidden_size, 1, 2))
    row = f.kv_lora_rank + f.qk_rope_head_dim
    kv_bytes = layers * row * rates.kv_bytes  # per cached token
    key_flops = layers * 2 * f.num_heads * (row + f.kv_lora_rank)  # per cached token
    decode = kv_time = 0.0
    for b, context in decode_steps(in_lens, out_lens):
        decode += gemm_list_s(gemms, b, rates) + routed_s(preset, b, routed_flops(cfg), rates)
        kv_time += max(context * kv_bytes / rates.read, context * key_flops / rates.bf16)
    return prefill, decode, kv_time


def elementwise_bytes(p: RandomPreset) -> int:
    """bf16 bytes one token moves through the kernels between the GEMMs, all layers: per
    layer two add + RMSNorms (read x and the residual, write both), q/k-norm + RoPE + KV
    write (read q, k, v; write q and the cache's k, v) and SiLU-and-mul (read gate and up,
    write one); then the final RMSNorm."""
    h, q, kv, i = p.hidden_size, p.num_heads * p.head_dim, p.num_kv_heads * p.head_dim, p.intermediate_size
    per_layer = 2 * 4 * h + 2 * (q + 2 * kv) + 3 * i
    return 2 * (p.num_layers * per_layer + 2 * h)


def sparse_moe_elementwise_bytes(cfg: ModelConfig) -> int:
    """As `elementwise_bytes`, with SiLU-and-mul over the top-k experts' intermediates in a
    sparse layer (routing, the gather to experts and the weighted sum not counted, as in
    `deepseek_elementwise_bytes`)."""
    f, h = cfg.family, cfg.hidden_size
    q, kv = f.num_heads * f.head_dim, f.num_kv_heads * f.head_dim
    attention = 2 * 4 * h + 2 * (q + 2 * kv)
    total = 2 * h
    for sparse in f.sparse_layers:
        total += attention + 3 * (f.moe_intermediate_size * f.router.top_k if sparse else f.intermediate_size)
    return 2 * total


def deepseek_elementwise_bytes(cfg: ModelConfig) -> int:
    """As `elementwise_bytes`, for DeepSeek: per layer two add + RMSNorms; q_a_layernorm
    (read and write the q latent) where q is low-rank; the latent store (read kv_a, RMS-
    normalise the latent, rotate the RoPE key, write the cache row; read and write the
    query's RoPE part); SiLU-and-mul over the dense MLP's intermediate, or over the top-k
    routed and the shared experts' in a MoE layer; then the final RMSNorm. Not counted:
    routing (softmax / top-k over the fp32 logits), the tokens' gather to their experts
    and the weighted sum of the experts' outputs, which a fused MoE kernel can fold into
    its GEMMs."""
    f, h = cfg.family, cfg.hidden_size
    row = f.kv_lora_rank + f.qk_rope_head_dim
    attention = 2 * 4 * h + 2 * (f.q_lora_rank or 0) + 2 * row + 2 * f.num_heads * f.qk_rope_head_dim
    total = 2 * h
    for i in range(cfg.num_layers):
        if f.is_moe_layer(i):
            total += attention + 3 * f.moe_intermediate_size * (f.router.top_k + f.n_shared_experts)
        else:
            total += attention + 3 * f.intermediate_size
    return 2 * total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-8b")
    parser.add_argument("--workload", default="nano-vllm", choices=sorted(WORKLOADS))
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--read-tbs", type=float, default=4.5, help="HBM read rate (H200: 4.50 measured)")
    parser.add_argument("--tflops", type=float, nargs="+", default=[790.0, 705.0], help="bf16 GEMM rate(s)")
    parser.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                        help="the projections' and experts' format (the LM head stays bf16)")
    parser.add_argument("--fp8-tflops", type=float, default=1130.0,
                        help="fp8 GEMM rate of the projections with --weights fp8 (H200: cuBLAS's rowwise fp8 "
                             "GEMM at 8,192 rows, docs/PERFORMANCE.md)")
    parser.add_argument("--kv-cache-dtype", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--target", type=float, default=None,
                        help=f"output tok/s to compare with the floor (default {DENSE_TARGET:,.0f} for dense "
                             f"presets, {DEEPSEEK_TARGET:,.0f} for DeepSeek, none for sparse MoE)")
    args = parser.parse_args()
    target = args.target
    if target is None and not is_sparse_moe(args.preset):  # no goal set for the sparse-MoE shape
        target = DEEPSEEK_TARGET if isinstance(get_preset(args.preset), HubPreset) else DENSE_TARGET

    def share(floor_tok_s: float) -> str:
        return "" if target is None else f" ({target:,.0f} tok/s is {100 * target / floor_tok_s:.0f} % of it)"

    fp8 = args.weights == "fp8"
    for tflops in args.tflops:
        rates = Rates(read=args.read_tbs * 1e12, gemm=(args.fp8_tflops if fp8 else tflops) * 1e12, bf16=tflops * 1e12,
                      weight_bytes=1 if fp8 else 2, kv_bytes=1 if args.kv_cache_dtype == "fp8" else 2)
        f = floor(args.preset, args.workload, args.num_seqs, args.min_len, args.max_len, args.seed, rates)
        gemm_rates = f"fp8 GEMMs at {args.fp8_tflops:.0f} TFLOP/s, bf16 at {tflops:.0f}" if fp8 else \
            f"GEMMs at {tflops:.0f} TFLOP/s"
        print(f"{args.preset} ({args.weights} weights, {args.kv_cache_dtype} KV cache), reads at {args.read_tbs} TB/s, "
              f"{gemm_rates}: prefill "
              f"{f['prefill_s']:.2f} s + decode GEMMs {f['decode_gemm_s']:.2f} s + KV reads {f['decode_kv_s']:.2f} s "
              f"= {f['total_s']:.2f} s; {f['output_tokens']} output tokens: {f['output_tok_s']:,.0f} tok/s"
              f"{share(f['output_tok_s'])}")
        with_ew = f["output_tok_s_with_elementwise"]
        print(f"  + the other kernels' bytes {f['elementwise_s']:.2f} s = {f['total_s'] + f['elementwise_s']:.2f} s: "
              f"{with_ew:,.0f} tok/s{share(with_ew)}")


if __name__ == "__main__":
    main()
