"""`--quantization fp8` at the real shapes of Qwen3-8B and DeepSeek-V2-Lite (random weights
written on the GPU by agent_infer.bench.random_weights, no download), against the
reference arithmetic under vLLM's closeness rule, with CUDA graphs:
- one prompt alone (the batch-1 GEMVs and, for V2-Lite, the experts' one-token path,
  which read x unquantized) and four together (the W8A8 GEMMs, activations quantized per
  token and group; the experts' tensor-core tiles);
- the mean absolute logprob difference of the greedy tokens against the reference and
  against the bf16 weights is printed (run with -s), as docs/PERFORMANCE.md states it,
  and beside each comparison the steps where bf16 itself, summed in another order (cuBLAS
  for the GEMVs, eagerly), first departs from the bf16 engine: the noise floor of a
  random model of this depth.

Random weights give flat next-token distributions (Qwen3-8B's shape: the top five within
0.6 of a logprob near -7), so the rule is strict here: the ranks of close candidates
must survive the arithmetic's differences. About five minutes on an H200: four engines
per batch, the references eager."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from agent_infer.sampling_params import SamplingParams
from tests.gpu.test_fp8_engine import _compare, _engine, _mean_diff, _reference_outputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)


def _generate(path: str, prompts, **kw):
    engine = _engine(path, max_model_len=2048, **kw)
    try:
        return engine.generate(prompts, PARAMS)
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("preset", ["qwen3-8b", "deepseek-v2-lite"])
def test_fp8_on_load_close_to_the_reference_at_real_shapes(preset, monkeypatch):
    from agent_infer.bench.random_weights import ensure_random_model

    path = ensure_random_model(preset)
    rng = random.Random(7)
    batches = {"alone": [[rng.randrange(3, 30000) for _ in range(57)]],
               "four": [[rng.randrange(3, 30000) for _ in range(n)] for n in (5, 40, 130, 300)]}
    for name, prompts in batches.items():
        fp8 = _generate(path, prompts, quantization="fp8")
        ref = _reference_outputs(path, prompts, monkeypatch, PARAMS, quantization="fp8", max_model_len=2048)
        bf16 = _generate(path, prompts)
        # The same model in bf16 through the same patches (GEMV off: cuBLAS, eager): only
        # summation order differs, which shows how far this random model carries rounding.
        bf16_ref = _reference_outputs(path, prompts, monkeypatch, PARAMS, max_model_len=2048)
        gc.collect()
        torch.cuda.empty_cache()
        top1 = sum(o.logprobs[0].logprob for o in ref) / len(ref)
        print(f"{preset}, {name}: first differing step, fp8 against its reference {_first_differences(fp8, ref)}, "
              f"bf16 against bf16 summed in another order {_first_differences(bf16, bf16_ref)} "
              f"(the reference's first greedy logprob {top1:.3f})")
        err = _compare(fp8, ref, f"{preset} {name}")
        print(f"{preset}, {name}: mean |logprob diff| of fp8 against the reference arithmetic {err:.4f}, "
              f"against bf16 weights {_mean_diff(fp8, bf16):.4f}")


def _first_differences(ours, ref) -> list[int | None]:
    """Each prompt's first step where the greedy tokens differ (None: none do)."""
    return [next((i for i, (a, b) in enumerate(zip(x.token_ids, y.token_ids)) if a != b), None)
            for x, y in zip(ours, ref)]
