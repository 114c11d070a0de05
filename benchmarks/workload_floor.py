"""A floor for `bench throughput`'s workload on one GPU (CPU only, no model needed): the
time the run could not beat if every kernel ran at the hardware's rate and nothing else
took time. The workload is regenerated from its seed, as the benchmark draws it
(nano-vllm's draw by default, `--workload uniform` for the other).

    python benchmarks/workload_floor.py [--preset qwen3-8b] [--workload nano-vllm] [--read-tbs 4.5] [--tflops 790 705]

Prefill: the projections' FLOPs (every prompt token through every layer) and causal
attention's, at the GEMM rate. Decode, step by step over the falling batch (every prompt
prefilled first, as the default schedule does): each projection and the LM head at
max(weight bytes at the read rate, FLOPs at the GEMM rate), plus every context's KV
bytes at the read rate. Nothing else: no norms, activations, sampling or launch gaps.
A second total adds the bytes the engine's other kernels must move at the read rate (two
add + RMSNorms, q/k-norm + RoPE + KV write and SiLU-and-mul per token and layer, the
final norm, the logits written and sampled): they run between the GEMMs, so no schedule
hides them; still no launch gaps.
Each --tflops value gives one line: on an H200, 790 TFLOP/s is what a short GEMM
benchmark reaches at boost clock, ~705 what the workload's GEMMs sustain at the 700 W
power limit (the sustained rate: benchmarks/gemm_sustained.py; docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_infer.bench.offline import WORKLOADS  # noqa: E402
from agent_infer.bench.random_weights import get_preset  # noqa: E402


def floor(preset: str, workload: str, num_seqs: int, min_len: int, max_len: int, seed: int, read_tbs: float,
          tflops: float) -> dict[str, float]:
    p = get_preset(preset)
    # The lengths exactly as `bench throughput` draws them.
    prompts, outs = WORKLOADS[workload](num_seqs, min_len, max_len, p.vocab_size, seed)
    in_lens = np.asarray([len(x) for x in prompts])
    out_lens = np.asarray(outs)
    h, q, kv = p.hidden_size, p.num_heads * p.head_dim, p.num_kv_heads * p.head_dim
    projections = [(q + 2 * kv, h), (h, q), (2 * p.intermediate_size, h), (h, p.intermediate_size)]  # (N, K)
    per_token = 2 * p.num_layers * sum(n * k for n, k in projections)  # FLOPs of one token's projections
    read, rate = read_tbs * 1e12, tflops * 1e12
    attn = 4 * p.num_layers * p.num_heads * p.head_dim * float(np.sum(in_lens * (in_lens + 1) / 2))
    prefill = (per_token * int(in_lens.sum()) + attn) / rate
    kv_bytes = 2 * p.num_layers * kv * 2  # K and V, bf16, per cached token
    gemms = [(n, k, p.num_layers) for n, k in projections] + [(p.vocab_size, h, 1)]
    decode = kv_time = 0.0
    for step in range(1, int(out_lens.max())):  # the first token of each request comes from its prefill
        live = out_lens > step
        b = int(live.sum())
        decode += sum(count * max(2 * n * k / read, 2 * b * n * k / rate) for n, k, count in gemms)
        kv_time += float(np.sum(in_lens[live] + step)) * kv_bytes / read
    total = prefill + decode + kv_time
    tokens = int(in_lens.sum()) + int(out_lens.sum())  # every token passes each layer once
    elementwise = (tokens * elementwise_bytes(p) + int(out_lens.sum()) * 2 * p.vocab_size * 2) / read
    return {"prefill_s": prefill, "decode_gemm_s": decode, "decode_kv_s": kv_time, "total_s": total,
            "output_tok_s": float(out_lens.sum()) / total, "output_tokens": int(out_lens.sum()),
            "elementwise_s": elementwise,
            "output_tok_s_with_elementwise": float(out_lens.sum()) / (total + elementwise)}


def elementwise_bytes(p) -> int:
    """bf16 bytes one token moves through the kernels between the GEMMs, all layers: per
    layer two add + RMSNorms (read x and the residual, write both), q/k-norm + RoPE + KV
    write (read q, k, v; write q and the cache's k, v) and SiLU-and-mul (read gate and up,
    write one); then the final RMSNorm."""
    h, q, kv, i = p.hidden_size, p.num_heads * p.head_dim, p.num_kv_heads * p.head_dim, p.intermediate_size
    per_layer = 2 * 4 * h + 2 * (q + 2 * kv) + 3 * i
    return 2 * (p.num_layers * per_layer + 2 * h)


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
    args = parser.parse_args()
    for tflops in args.tflops:
        f = floor(args.preset, args.workload, args.num_seqs, args.min_len, args.max_len, args.seed, args.read_tbs, tflops)
        print(f"{args.preset}, reads at {args.read_tbs} TB/s, GEMMs at {tflops:.0f} TFLOP/s: prefill "
              f"{f['prefill_s']:.2f} s + decode GEMMs {f['decode_gemm_s']:.2f} s + KV reads {f['decode_kv_s']:.2f} s "
              f"= {f['total_s']:.2f} s; {f['output_tokens']} output tokens: {f['output_tok_s']:,.0f} tok/s "
              f"(12,000 tok/s is {100 * 12000 / f['output_tok_s']:.0f} % of it)")
        with_ew = f["output_tok_s_with_elementwise"]
        print(f"  + the other kernels' bytes {f['elementwise_s']:.2f} s = {f['total_s'] + f['elementwise_s']:.2f} s: "
              f"{with_ew:,.0f} tok/s (12,000 tok/s is {100 * 12000 / with_ew:.0f} % of it)")


if __name__ == "__main__":
    main()
