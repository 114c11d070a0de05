"""How far the summation order alone moves a deep random model's logprobs, with and without
fp8 activations (CPU or GPU, no checkpoint needed: transformers writes a random Qwen3).

    python benchmarks/fp8_order_sensitivity.py [--layers 36] [--hidden 512] [--device cpu]

One bf16 model, teacher-forced over four prompts (every prompt position scored in one
prefill step), every projection's products summed exactly in fp32 with the whole K at
once, against the same model with K in two halves added at the end; once with the bf16
weights and activations, once with e4m3 weights (per row) and activations quantized per
token, as `--quantization fp8` runs them. Then fp8's exact sums against sums cut as fp8
tensor cores cut them (`reference.fp8_mma_sums`, the model benchmarks/fp8_accumulation.py
checks against the GPU's kernels). Per pair: the share of positions whose top tokens
agree, the share meeting vLLM's closeness rule (each side's top token in the other's top
five) and the mean |logprob difference| of the prompt's token.

Why it matters: a per-token e4m3 quantizer turns an input that differs by one bf16 ulp
into one a whole e4m3 step away wherever the value sits near a rounding boundary, so the
fp8 arithmetic carries differences further than bf16 does; and fp8 tensor cores sum with
fewer bits than fp32, a difference far larger than a change of order. That difference,
not an order change, is the floor an fp8 kernel can be held to against its exact
reference (tests/gpu/test_fp8_real_shapes.py measures it at the real shapes).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from agent_infer.config import EngineConfig  # noqa: E402
from agent_infer.engine.llm_engine import LLMEngine  # noqa: E402
from agent_infer.kernels import ops  # noqa: E402
from agent_infer.kernels import reference  # noqa: E402
from agent_infer.quantization.fp8 import quantize_channel, quantize_token_groups  # noqa: E402
from agent_infer.sampling_params import SamplingParams  # noqa: E402

FORCED = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5)


def write_model(path: str, layers: int, hidden: int) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=32000, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64,
        max_position_embeddings=2048, initializer_range=0.02, tie_word_embeddings=False,
    )
    transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def projection(fp8_activations: bool, order: str):
    """ops.linear's replacement: products in fp32, K whole, in two halves, or (fp8 only)
    summed as the tensor cores sum them (reference.fp8_mma_sums)."""
    def linear(x, weight, bias=None, scale=None, block=None, *rest, **kw):  # rest, kw: row invariance, ...
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        w = weight.float()  # fp8 weights arrive dequantized where there are no fp8 kernels
        if fp8_activations:
            q, s = quantize_token_groups(x2, k)
            xf = q.float() * s
            # e4m3 values and row scales to sum (the dequantized weight quantized again,
            # the same for every order).
            w_fp8, w_scale = quantize_channel(w)
            w = w_fp8.float() * w_scale
        else:
            xf = x2.float()
        if order == "tensor cores":
            y = reference.fp8_mma_sums(q, w_fp8, x_scale=s, w_scale=w_scale)
        elif order == "halves":
            h = k // 2
            y = xf[:, :h] @ w[:, :h].t() + xf[:, h:] @ w[:, h:].t()
        else:
            y = xf @ w.t()
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).view(*x.shape[:-1], -1)
    return linear


def scored(path: str, prompts, device: str, fp8: bool, order: str):
    original = ops.linear
    ops.linear = projection(fp8, order)
    try:
        engine = LLMEngine(EngineConfig(model=path, device=device, dtype="bfloat16", num_kv_blocks=64,
                                        enforce_eager=True, quantization="fp8" if fp8 else None))
        try:
            return engine.generate(prompts, FORCED, use_tqdm=False)
        finally:
            engine.shutdown()
    finally:
        ops.linear = original


def agreement(a, b) -> tuple[float, float, float]:
    top1 = rule = n = 0
    diff = 0.0
    for x, y in zip(a, b):
        for p, q in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            ta, tb = p.top[0][0], q.top[0][0]
            top1 += ta == tb
            rule += ta in dict(q.top) and tb in dict(p.top)
            diff += abs(p.logprob - q.logprob)
            n += 1
    return top1 / n, rule / n, diff / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 30000) for _ in range(n)] for n in (5, 40, 130, 300)]
    rows = [("the same model", "top tokens agree", "vLLM's rule holds", "mean |dlogprob|")]
    with tempfile.TemporaryDirectory() as tmp:
        write_model(tmp, args.layers, args.hidden)
        for fp8, order, name in ((False, "halves", "bf16 weights and activations, K in halves"),
                                 (True, "halves", "e4m3 weights, per-token e4m3 activations, K in halves"),
                                 (True, "tensor cores", "the same, summed as fp8 tensor cores sum")):
            top1, rule, diff = agreement(scored(tmp, prompts, args.device, fp8, "whole"),
                                         scored(tmp, prompts, args.device, fp8, order))
            rows.append((name, f"{top1:.1%}", f"{rule:.1%}", f"{diff:.4f}"))
    from agent_infer.bench.table import render_table

    print(f"random Qwen3, {args.layers} layers, hidden {args.hidden}, {args.device}: exact fp32 sums of K whole against")
    print(render_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
