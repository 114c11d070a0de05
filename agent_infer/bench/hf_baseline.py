"""Hugging Face transformers on the same checkpoint, in the same run: the anchor every
figure is compared with.

How it runs: `AutoModelForCausalLM` in the engine's dtype (bf16 on GPU, fp32 on CPU)
with SDPA attention, `model.generate` greedy with its default dynamic KV cache (its
static cache + compile measured slower on the GPU machine), and
`min_new_tokens = max_new_tokens` so every row generates exactly the asked length.
All rows of a batch have one shape: prompts are left-padded to the longest.
"""

from __future__ import annotations

import gc
import importlib.util
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_hf_model(path: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    kwargs = dict(dtype=dtype, attn_implementation="sdpa")
    if device.type == "cuda" and importlib.util.find_spec("accelerate") is not None:
        # Loads straight onto the GPU; transformers needs accelerate for any device_map.
        model = AutoModelForCausalLM.from_pretrained(path, device_map={"": device}, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device)
    return model.eval()


def run_with_hf_model(path: str, device: torch.device, dtype: torch.dtype, fn: Callable[[object], dict]) -> dict:
    """Load the model, return fn(model), and free it: only this frame holds the model, so
    its GPU memory is really given back before the engine sizes its KV cache."""
    model = load_hf_model(path, device, dtype)
    try:
        result = fn(model)
        result["description"] = hf_description(model)
        return result
    finally:
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            left = torch.cuda.memory_allocated(device) / 2**30
            if left > 0.5:
                print(f"agent-infer bench: {left:.1f} GiB still allocated after freeing transformers", file=sys.stderr)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] left-padded
    attention_mask: torch.Tensor  # [B, L], 0 on padding


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> Batch:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return Batch(ids.to(device), mask.to(device))


def _pad_id(model) -> int:
    cfg = model.generation_config
    for value in (cfg.pad_token_id, cfg.eos_token_id, model.config.eos_token_id):
        if isinstance(value, list) and value:
            return int(value[0])
        if isinstance(value, int):
            return value
    return 0


@torch.inference_mode()
def timed_generate(model, batch: Batch, new_tokens: int) -> float:
    """Seconds for one generate call of exactly `new_tokens` tokens per row."""
    device = batch.input_ids.device
    pad = _pad_id(model)
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=pad,
    )
    _sync(device)
    seconds = time.perf_counter() - t0
    got = out.shape[1] - batch.input_ids.shape[1]
    if got != new_tokens:
        raise RuntimeError(f"transformers generated {got} tokens per row, not the {new_tokens} asked")
    return seconds


def hf_latency(
    model, prompts: list[list[int]], output_len: int, iters: int, log=print
) -> dict:
    """TTFT = a generate of 1 token (prefill + first sample); decode time = a generate of
    `output_len` tokens minus that, for the `output_len - 1` tokens after the first,
    the same split the engine's figures use."""
    device = next(model.parameters()).device
    batch = left_pad(prompts, _pad_id(model), device)
    timed_generate(model, batch, min(4, output_len))  # warm-up: kernels, allocator
    first = [timed_generate(model, batch, 1) for _ in range(3)]
    full = []
    for i in range(iters):
        full.append(timed_generate(model, batch, output_len))
        log(f"  HF iteration {i + 1}/{iters}: {full[-1]:.2f} s for {output_len} tokens x {len(prompts)}")
    ttft = statistics.median(first)
    decode = max(statistics.median(full) - ttft, 1e-9)
    per_seq = (output_len - 1) / decode
    return {
        "ttft_ms": ttft * 1e3,
        "decode_tok_s_per_seq": per_seq,
        "decode_tok_s_total": per_seq * len(prompts),
        "decode_step_ms": decode / (output_len - 1) * 1e3,
        "e2e_s": statistics.median(full),
        "iterations_s": full,
    }


def hf_throughput(model, prompts: list[list[int]], new_tokens: int, log=print) -> dict:
    """One batch of all `prompts`, left-padded, `new_tokens` tokens each."""
    device = next(model.parameters()).device
    batch = left_pad(prompts, _pad_id(model), device)
    timed_generate(model, left_pad(prompts[:2], _pad_id(model), device), min(4, new_tokens))  # warm-up
    seconds = timed_generate(model, batch, new_tokens)
    out_tokens = len(prompts) * new_tokens
    log(f"  HF: {len(prompts)} requests x {new_tokens} tokens in {seconds:.2f} s")
    return {
        "num_requests": len(prompts),
        "padded_prompt_len": int(batch.input_ids.shape[1]),
        "prompt_tokens": sum(len(p) for p in prompts),
        "new_tokens_per_request": new_tokens,
        "output_tokens": out_tokens,
        "seconds": seconds,
        "output_tok_s": out_tokens / seconds,
    }


def hf_description(model) -> str:
    import transformers

    dev = next(model.parameters()).device
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    return f"transformers {transformers.__version__}, {dtype}, {dev.type}, SDPA, generate greedy (dynamic cache)"
