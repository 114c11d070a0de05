"""Greedy decoding with Hugging Face transformers, the reference for every parity test.

A plain loop over the model's forward with its KV cache, no logits processors, so the
pick at each step is exactly argmax of the model's logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HFResult:
    tokens: list[int]
    # per step: {token: logprob} of the top few candidates
    top: list[dict[int, float]]


def load_hf_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The checkpoint in transformers, with SDPA attention and, for mixtures of experts,
    the plain loop over experts (its grouped-GEMM path needs 16-byte-aligned strides,
    which tiny odd shapes do not have)."""
    import json
    import os

    from transformers import AutoModelForCausalLM

    kwargs = {}
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
        if {"n_routed_experts", "num_experts", "num_local_experts"} & cfg.keys():
            kwargs["experts_implementation"] = "eager"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", **kwargs)
    return model.to(device).eval()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, top_k: int = 5) -> HFResult:
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    out = model(input_ids=ids, use_cache=True)
    past = out.past_key_values
    tokens: list[int] = []
    tops: list[dict[int, float]] = []
    logits = out.logits[0, -1]
    for _ in range(max_new_tokens):
        lp = torch.log_softmax(logits.float(), dim=-1)
        vals, idx = lp.topk(top_k)
        tops.append(dict(zip(idx.tolist(), vals.tolist())))
        nxt = int(logits.argmax())
        tokens.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]], device=device), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1]
    return HFResult(tokens, tops)


def check_greedy_close(
    ours: list[int],
    ours_top: list[dict[int, float]] | None,
    ref: HFResult,
    tie_tolerance: float,
    name: str = "",
) -> int:
    """vLLM's logprob-closeness rule: tokens must match until the first difference; there,
    both picks must be near-tied in the reference distribution (gap <= tie_tolerance) and
    each must be among the other engine's top candidates. Comparison stops after it (the
    continuations diverge). Returns the number of tokens that matched."""
    n = min(len(ours), len(ref.tokens))
    for i in range(n):
        a, b = ours[i], ref.tokens[i]
        if a == b:
            continue
        ref_top = ref.top[i]
        assert a in ref_top, f"{name} step {i}: ours picked {a}, not in transformers' top {ref_top}"
        gap = ref_top[b] - ref_top[a]
        assert gap <= tie_tolerance, (
            f"{name} step {i}: ours {a} vs transformers {b}, logprob gap {gap:.2e} > {tie_tolerance:.0e}: not a tie"
        )
        if ours_top is not None:
            assert b in ours_top[i], f"{name} step {i}: transformers' pick {b} not in our top {ours_top[i]}"
        return i
    return n
