"""Offline benchmarks: `agent-infer bench latency` and `agent-infer bench throughput`.

latency: B sequences of `--input-len` random token ids generate `--output-len` tokens
each (greedy, EOS ignored). The engine is driven step by step: TTFT is the time until
every sequence has its first token (the prefill step at B = 1), decode time is the rest,
for the `output_len - 1` tokens after the first. Warm-up runs come first (graph capture,
Triton compilation); the figures are medians over `--num-iters` timed runs. Every run
uses fresh random prompts so the prefix cache never serves one.

throughput: nano-vllm's own benchmark workload by default (its bench.py's draw, in its
order: 256 prompts of randint(100, 1024) ids randint(0, 10000), then each max_tokens
randint(100, 1024); EOS ignored, temperature 0.6), `--workload uniform` for lengths drawn
with NumPy over the whole vocabulary. The headline is the first batch after start-up:
what a user's first `generate()` gets. `--rounds` more batches of the same lengths with
fresh ids (no prefix-cache hits) are reported beside it. Output tok/s = output tokens /
wall time of the whole batch. The engine's per-step timeline of the first round goes into
the JSON (results.step_trace) and a table of where its wall time went, by step kind and
decode batch size, is printed after the main one (step_trace.py); on a GPU each round
also lists the Triton kernel variants it compiled (none, when start-up covered them).

Both can run Hugging Face transformers on the same checkpoint first (`--compare-hf`),
then free it, so the engine sizes its KV cache on an empty GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone

import numpy as np
import torch

from agent_infer.bench.monitor import GpuMonitor, format_monitor
from agent_infer.bench.roofline import copy_rate_tbs, decode_roofline, gpu_bandwidth_tbs
from agent_infer.bench.step_trace import format_step_summary, summarise_step_trace, trace_for_json
from agent_infer.bench.table import render_table
from agent_infer.bench.workloads import (  # noqa: F401 - re-exported for existing callers
    NANO_VLLM_MAX_TOKEN_ID, WORKLOADS, nano_vllm_workload, uniform_workload,
)
from agent_infer.config import ConfigError, EngineConfig, ModelConfig
from agent_infer.sampling_params import SamplingParams


def _say(msg: str) -> None:
    print(f"agent-infer bench: {msg}", file=sys.stderr, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- set-up shared by both benchmarks ---------------------------------------------------


@dataclass
class Setup:
    config: EngineConfig
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype


def prepare(args: argparse.Namespace) -> Setup:
    """Resolve --random-weights into --model, and the engine config, device and dtype."""
    if args.random_weights:
        if args.model:
            raise ConfigError("give either --model or --random-weights, not both")
        from agent_infer.bench.random_weights import ensure_random_model, random_model_ready

        fp8_blocks = args.random_weights_layout == "fp8-block"
        ready = random_model_ready(args.random_weights, fp8_blocks=fp8_blocks)
        tokenizer = None if ready else default_tokenizer_source()
        args.model = ensure_random_model(args.random_weights, tokenizer_from=tokenizer, fp8_blocks=fp8_blocks)
    from agent_infer.arguments import engine_config_from_args

    config = engine_config_from_args(args)
    device = config.resolve_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return Setup(config, ModelConfig.from_hf(config.model, config.model_impl), device, config.resolve_dtype(device))


def default_tokenizer_source() -> str | None:
    """The default model's directory (SmolLM2's tokenizer), converting it once when its
    package is installed; None when it cannot be had: benchmarks use token ids anyway."""
    from agent_infer.loader.default_model import ensure_default_model

    try:
        return ensure_default_model()
    except Exception as e:  # noqa: BLE001 - a tokenizer is a convenience here, never required
        _say(f"no tokenizer copied into the random checkpoint ({type(e).__name__}: {e})")
        return None


def build_engine(setup: Setup):
    from agent_infer.engine.launch import launch_engine

    t0 = time.perf_counter()
    engine = launch_engine(setup.config)
    seconds = time.perf_counter() - t0
    _say(f"engine ready in {seconds:.1f} s (max_model_len {engine.max_model_len}, "
         f"{engine.block_manager.num_blocks} KV blocks of {engine.block_manager.block_size} tokens)")
    return engine, seconds


def random_prompts(rng: np.random.Generator, lengths, vocab_size: int) -> list[list[int]]:
    return [rng.integers(0, vocab_size, int(n)).tolist() for n in lengths]


def model_label(setup: Setup) -> str:
    return f"{os.path.basename(setup.config.model.rstrip('/'))}, {str(setup.dtype).replace('torch.', '')}"


def mode_label(setup: Setup) -> str:
    if setup.device.type != "cuda":
        return setup.device.type
    return "eager" if setup.config.enforce_eager else "CUDA graphs"


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---- latency ------------------------------------------------------------------------------


@dataclass
class LatencyRun:
    ttft_s: float  # until every sequence has its first token
    decode_s: float  # the rest
    decode_steps: int
    output_lens: list[int]


def run_latency_iteration(engine, prompts: list[list[int]], params: SamplingParams) -> LatencyRun:
    """One run of `prompts` to completion, stepping the engine by hand. step() returns host
    token ids (the step's one device->host read), so clocks read after it are synchronised."""
    _sync(engine.device)
    decode_before = engine.stats.decode_steps
    t0 = time.perf_counter()
    ids = {engine.add_request(p, params).request_id for p in prompts}
    started: set[str] = set()
    lens: dict[str, int] = {}
    t_first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in ids:
                continue
            if out.error:
                raise RuntimeError(f"request rejected: {out.error}")
            if out.token_ids:
                started.add(out.request_id)
            if out.finished:
                lens[out.request_id] = len(out.token_ids)
        if t_first is None and len(started) == len(ids):
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    if t_first is None:
        raise RuntimeError("the engine went idle before every request produced a token")
    return LatencyRun(t_first - t0, t_end - t_first, engine.stats.decode_steps - decode_before, list(lens.values()))


def summarise_latency(runs: list[LatencyRun], batch: int, output_len: int, input_len: int) -> dict:
    decode_tokens = output_len - 1  # per sequence, after the first
    ttft = statistics.median(r.ttft_s for r in runs)
    decode = statistics.median(r.decode_s for r in runs)
    per_seq = statistics.median(decode_tokens / r.decode_s for r in runs)
    return {
        "ttft_ms": ttft * 1e3,
        "prefill_tok_s": batch * input_len / ttft,
        "decode_tok_s_per_seq": per_seq,
        "decode_tok_s_total": per_seq * batch,
        "decode_step_ms": statistics.median(r.decode_s / max(r.decode_steps, 1) for r in runs) * 1e3,
        "decode_steps": runs[0].decode_steps,
        "e2e_s": statistics.median(r.ttft_s + r.decode_s for r in runs),
        "decode_s": decode,
        "iterations": [asdict(r) | {"output_lens": sorted(set(r.output_lens))} for r in runs],
    }


def cmd_latency(args: argparse.Namespace) -> int:
    if args.output_len < 2:
        raise ConfigError("--output-len must be at least 2: decode speed is measured after the first token")
    if args.max_num_seqs is None:  # latency needs no more slots (and CUDA graphs) than its batch
        args.max_num_seqs = args.batch_size
    setup = prepare(args)
    rng = np.random.default_rng(args.seed)
    B, n_in, n_out = args.batch_size, args.input_len, args.output_len

    def fresh() -> list[list[int]]:  # new prompts every run: the prefix cache must never serve one
        return random_prompts(rng, [n_in] * B, setup.model_config.vocab_size)

    hf = None
    if args.compare_hf:
        from agent_infer.bench.hf_baseline import hf_latency, run_with_hf_model

        _say(f"transformers baseline: batch {B}, {n_in} -> {n_out} tokens, {args.hf_iters} timed run(s)")
        prompts = fresh()
        hf = run_with_hf_model(setup.config.model, setup.device, setup.dtype,
                               lambda m: hf_latency(m, prompts, n_out, args.hf_iters, log=_say))

    bandwidth, bandwidth_source = roofline_bandwidth(args, setup)  # before the engine takes the memory
    engine, init_s = build_engine(setup)
    try:
        if n_in + n_out > engine.max_model_len:
            raise ConfigError(f"--input-len + --output-len = {n_in + n_out} exceeds max_model_len {engine.max_model_len}")
        params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
        runs, monitor = time_latency(engine, fresh, params, args.num_warmup, args.num_iters, args.monitor_interval_ms)
        results = summarise_latency(runs, B, n_out, n_in)
        # The cache a decode step reads: every sequence's context, at its mean length over the run.
        tp = setup.config.tensor_parallel_size
        cache_bytes = round(B * (n_in + n_out / 2) * engine.runner.cache_bytes_per_token() * tp)
        roofline = latency_roofline(setup, bandwidth, results, B, cache_bytes) if bandwidth else None
        if roofline:
            roofline["bandwidth_source"] = bandwidth_source
        payload = report_payload("latency", args, setup, engine, init_s, results, hf, roofline, monitor)
        save_json(args, payload)  # before profiling: a crash there must not lose the figures
        payload["profile"] = maybe_profile(args, engine, fresh(), params, "latency")
        title = (f"latency: {model_label(setup)}, batch {B}, {n_in} -> {n_out} tokens, {mode_label(setup)}, "
                 f"median of {args.num_iters}\nroofline: " + (
                     f"{roofline['bytes_per_token'] / 1e9:.3f} GB of weights read per decode step at "
                     f"{roofline['bandwidth_tbs']} TB/s x {roofline['tp']} device(s) ({bandwidth_source})"
                     if roofline else
                     "none on a CPU without --bandwidth-tbs"))
        finish(args, title, latency_rows(results, hf, roofline, monitor, B, n_in), payload)
    finally:
        engine.shutdown()  # TP workers end with it
    return 0


def time_latency(engine, fresh, params: SamplingParams, warmup: int, iters: int, interval_ms: float):
    """Warm-up runs, then timed runs under the GPU monitor: (runs, monitor summary)."""
    n_out = params.max_tokens
    for i in range(warmup):
        r = run_latency_iteration(engine, fresh(), params)
        _say(f"warm-up {i + 1}/{warmup}: TTFT {r.ttft_s * 1e3:.1f} ms, decode {(n_out - 1) / r.decode_s:.1f} tok/s/seq")
    runs = []
    with GpuMonitor(interval_ms / 1e3) as mon:
        for i in range(iters):
            runs.append(run_latency_iteration(engine, fresh(), params))
            r = runs[-1]
            _say(f"iteration {i + 1}/{iters}: TTFT {r.ttft_s * 1e3:.2f} ms, decode {(n_out - 1) / r.decode_s:.1f} tok/s/seq")
    short = [n for r in runs for n in r.output_lens if n != n_out]
    if short:
        raise RuntimeError(f"some sequences generated {short[0]} tokens instead of {n_out}")
    return runs, mon.summary()


def roofline_bandwidth(args: argparse.Namespace, setup: Setup) -> tuple[float | None, str]:
    """The roofline's TB/s per device and its source: --bandwidth-tbs, else on a GPU its
    model's stored copy rate or one measured now; on a CPU none (a GPU's figure says
    nothing of it)."""
    if args.bandwidth_tbs:
        return args.bandwidth_tbs, "--bandwidth-tbs"
    if setup.device.type != "cuda":
        return None, ""
    return gpu_bandwidth_tbs(torch.cuda.get_device_name(setup.device), lambda: copy_rate_tbs(setup.device))


def latency_roofline(setup: Setup, bandwidth_tbs: float, results: dict, batch: int, cache_bytes: int) -> dict:
    """The weights' roofline, and beside it the weights' and the KV cache's together
    (`cache_bytes`: what a step reads of the cache, all ranks together), the one that
    matters at long contexts."""
    roof = decode_roofline(setup.model_config, dtype_bytes(setup.dtype), bandwidth_tbs, setup.config.tensor_parallel_size,
                           batch, setup.config.resolve_quantization(setup.model_config.quantization))
    with_cache = replace(roof, bytes_per_token=roof.bytes_per_token + cache_bytes)
    return {
        "cache_bytes_per_step": cache_bytes,
        "decode_tok_s_per_seq_with_cache": with_cache.tokens_per_second(1),
        "achieved_fraction_with_cache": results["decode_tok_s_total"] / with_cache.tokens_per_second(batch),
        "bytes_per_token": roof.bytes_per_token,
        "bandwidth_tbs": roof.bandwidth_tbs,
        "tp": roof.tp,
        "step_ms": roof.step_seconds * 1e3,
        "decode_tok_s_per_seq": roof.tokens_per_second(1),
        "decode_tok_s_total": roof.tokens_per_second(batch),
        "achieved_fraction": results["decode_tok_s_total"] / roof.tokens_per_second(batch),
    }


def latency_rows(results: dict, hf: dict | None, roof: dict | None, monitor: dict, B: int, n_in: int) -> list[tuple]:
    """The latency table's rows; `roof` None: no roofline column."""
    def hfv(key):
        return hf[key] if hf else None

    def roof_rate(key: str, fraction: str) -> str | None:
        return f"{roof[key]:,.1f} ({roof[fraction] * 100:.1f} %)" if roof else None

    rows = [
        (f"TTFT ms ({n_in}-token prompt{'s' if B > 1 else ''}, batch {B})", results["ttft_ms"], hfv("ttft_ms"), "time", None),
        ("decode tok/s per sequence", results["decode_tok_s_per_seq"], hfv("decode_tok_s_per_seq"), "rate",
         roof_rate("decode_tok_s_per_seq", "achieved_fraction")),
    ]
    if roof:
        rows.append((f"  roofline with the cache's {roof['cache_bytes_per_step'] / 1e9:.3f} GB a step", None, None,
                     "rate", roof_rate("decode_tok_s_per_seq_with_cache", "achieved_fraction_with_cache")))
    if B > 1:
        rows.append(("decode tok/s total", results["decode_tok_s_total"], hfv("decode_tok_s_total"), "rate",
                     roof_rate("decode_tok_s_total", "achieved_fraction")))
    rows += [
        ("decode step ms", results["decode_step_ms"], hfv("decode_step_ms"), "time",
         f"{roof['step_ms']:.3f}" if roof else None),
        ("end-to-end s", results["e2e_s"], hfv("e2e_s"), "time", None),
    ]
    rows += memory_rows(monitor)
    return rows


# ---- throughput -----------------------------------------------------------------------


def fresh_prompts(prompts: list[list[int]], vocab: int, seed: int) -> list[list[int]]:
    """Prompts of the same lengths with new random ids: a later round of the same shape
    that the prefix cache cannot serve."""
    rng = np.random.default_rng(seed)
    return random_prompts(rng, [len(p) for p in prompts], min(vocab, NANO_VLLM_MAX_TOKEN_ID + 1))


def run_throughput(engine, prompts: list[list[int]], out_lens: list[int], temperature: float, seed: int) -> dict:
    params = [
        SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True, seed=seed + i)
        for i, n in enumerate(out_lens)
    ]
    before = _step_counts(engine.stats)
    _sync(engine.device)
    trace = engine.stats.start_trace()
    t0 = trace.origin  # the first step's period starts with the clock
    try:
        with compile_watch(engine.device) as watch:
            outs = engine.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0  # generate() ends on a step's host read: synchronised
    finally:
        engine.stats.stop_trace()
    bad = [(o, n) for o, n in zip(outs, out_lens) if o.error or len(o.token_ids) != n]
    if bad:
        o, n = bad[0]
        raise RuntimeError(f"{len(bad)} requests did not complete as asked, e.g. {o.request_id}: "
                           f"{o.error or f'{len(o.token_ids)} tokens instead of {n}'}")
    stats = {k: v - before[k] for k, v in _step_counts(engine.stats).items()}
    n_out = sum(len(o.token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    return {
        "num_requests": len(prompts),
        "input_tokens": n_in,
        "output_tokens": n_out,
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs),
        "wall_s": wall,
        "output_tok_s": n_out / wall,
        "total_tok_s": (n_in + n_out) / wall,
        "requests_s": len(prompts) / wall,
        "engine_steps": stats["steps"],
        "prefill_steps": stats["prefill_steps"],
        "decode_steps": stats["decode_steps"],
        "max_decode_batch": engine.stats.max_decode_batch,
        "kernel_compiles": None if watch is None else [c.kernel for c in watch.compiles],
        "ttft_ms": ttft_stats(outs),
        "step_trace": trace_for_json(trace.columns()),
    }


@contextmanager
def compile_watch(device: torch.device):
    """The Triton kernel variants compiled inside the block (GPU); None elsewhere."""
    if device.type != "cuda":
        yield None
        return
    from agent_infer.kernels.triton.compile_watch import CompileWatch

    with CompileWatch() as watch:
        yield watch


def _step_counts(stats) -> dict[str, int]:
    return {"steps": stats.steps, "prefill_steps": stats.prefill_steps, "decode_steps": stats.decode_steps}


def cmd_throughput(args: argparse.Namespace) -> int:
    if not 1 <= args.min_len <= args.max_len:
        raise ConfigError("need 1 <= --min-len <= --max-len")
    setup = prepare(args)
    vocab = setup.model_config.vocab_size
    prompts, out_lens = WORKLOADS[args.workload](args.num_seqs, args.min_len, args.max_len, vocab, args.seed)

    hf = None
    if args.compare_hf:
        from agent_infer.bench.hf_baseline import hf_throughput, run_with_hf_model

        k = min(args.hf_num_seqs, len(prompts))
        new_tokens = max(1, round(sum(out_lens[:k]) / k))
        _say(f"transformers baseline: the first {k} requests in one left-padded batch, {new_tokens} new tokens each "
             f"(their mean output length), greedy")
        hf = run_with_hf_model(setup.config.model, setup.device, setup.dtype,
                               lambda m: hf_throughput(m, prompts[:k], new_tokens, log=_say))

    engine, init_s = build_engine(setup)
    try:
        if 2 * args.max_len > engine.max_model_len:
            raise ConfigError(f"2 x --max-len = {2 * args.max_len} exceeds max_model_len {engine.max_model_len}")
        for i in range(args.num_warmup):
            # Same prompt shapes, short outputs, before the clock starts.
            w_out = np.random.default_rng(args.seed + 2000 + i).integers(1, min(16, args.max_len) + 1, len(prompts))
            t0 = time.perf_counter()
            run_throughput(engine, fresh_prompts(prompts, vocab, args.seed + 1000 + i), [int(n) for n in w_out],
                           args.temperature, args.seed)
            _say(f"warm-up {i + 1}/{args.num_warmup}: {time.perf_counter() - t0:.1f} s")
        # The headline is the first batch the engine meets (after any --num-warmup); later
        # rounds run the same lengths with fresh ids, so none is served by the prefix cache.
        rounds = []
        with GpuMonitor(args.monitor_interval_ms / 1e3) as mon:
            for r in range(args.rounds):
                batch_prompts = prompts if r == 0 else fresh_prompts(prompts, vocab, args.seed + 100 + r)
                rounds.append(run_throughput(engine, batch_prompts, out_lens, args.temperature, args.seed))
                _say(f"round {r + 1}/{args.rounds}: {rounds[-1]['output_tokens']} output tokens in "
                     f"{rounds[-1]['wall_s']:.2f} s ({rounds[-1]['output_tok_s']:,.0f} tok/s)")
        results = rounds[0]
        results["later_rounds"] = [{k: v for k, v in r.items() if k != "step_trace"} for r in rounds[1:]]
        if len(rounds) > 1:
            results["later_output_tok_s"] = statistics.median(r["output_tok_s"] for r in rounds[1:])
            results["first_vs_later"] = results["output_tok_s"] / results["later_output_tok_s"]
        bands = summarise_step_trace(results["step_trace"])
        results["step_summary"] = [b.as_dict() for b in bands]
        monitor = mon.summary()
        payload = report_payload("throughput", args, setup, engine, init_s, results, hf, None, monitor)
        save_json(args, payload)  # before profiling: a crash there must not lose the figures
        # Profile at the full batch the workload reaches, prompts of the mean length.
        batch = min(args.num_seqs, setup.config.max_num_seqs)
        prof_prompts = random_prompts(np.random.default_rng(args.seed + 3000), [(args.min_len + args.max_len) // 2] * batch, vocab)
        prof_params = SamplingParams(max_tokens=args.max_len, temperature=args.temperature, ignore_eos=True, seed=args.seed)
        payload["profile"] = maybe_profile(args, engine, prof_prompts, prof_params, "throughput")
        # And a prefill of as many prompts of that length: the workload's other big share of
        # time. New prompts: the decode trace's would come from the prefix cache.
        pre_prompts = random_prompts(np.random.default_rng(args.seed + 4000), [len(p) for p in prof_prompts], vocab)
        payload["profile_prefill"] = maybe_profile(args, engine, pre_prompts, prof_params, "throughput-prefill",
                                                   phase="prefill")
        title = (f"throughput: {model_label(setup)}, {args.workload} workload: {args.num_seqs} requests, input and "
                 f"output lengths uniform in [{args.min_len}, {args.max_len}], temperature {args.temperature}, "
                 f"{mode_label(setup)}; engine start-up {init_s:.1f} s")
        if hf:
            title += (f"\nHF column: transformers on the first {hf['num_requests']} requests as one batch (prompts "
                      f"left-padded to {hf['padded_prompt_len']}, {hf['new_tokens_per_request']} new tokens each, greedy)")
        finish(args, title, throughput_rows(results, hf, monitor), payload)
        print(f"\nwhere the first round's wall time went, by step (prefill includes mixed steps; decode by batch "
              f"size):\n{format_step_summary(bands, results['wall_s'])}", flush=True)
    finally:
        engine.shutdown()  # TP workers end with it
    return 0


def ttft_stats(outs) -> dict[str, float]:
    """Median and p99 of the requests' times to first token (arrival, when `generate`
    queued them all, to the first token), in ms: what a server's clients would see."""
    waits = sorted((o.first_token_time - o.arrival_time) * 1e3 for o in outs if o.first_token_time is not None)
    if not waits:
        return {"median": 0.0, "p99": 0.0}
    return {"median": statistics.median(waits), "p99": waits[min(len(waits) - 1, round(0.99 * (len(waits) - 1)))]}


def throughput_rows(results: dict, hf: dict | None, monitor: dict) -> list[tuple]:
    rows = [
        ("output tok/s, first batch", results["output_tok_s"], hf["output_tok_s"] if hf else None, "rate", None),
    ]
    later = results.get("later_rounds") or []
    if later:
        rows += [
            (f"output tok/s, later rounds (median of {len(later)})", results["later_output_tok_s"], None, "rate", None),
            ("first batch / later rounds", results["first_vs_later"], None, "info", None),
        ]
    rows += [
        ("total tok/s (input + output), first batch", results["total_tok_s"], None, "rate", None),
        ("requests/s, first batch", results["requests_s"], None, "rate", None),
        ("wall s, first batch", results["wall_s"], None, "time", None),
        ("TTFT ms, first batch, median", results["ttft_ms"]["median"], None, "info", None),
        ("TTFT ms, first batch, p99", results["ttft_ms"]["p99"], None, "info", None),
    ]
    if results.get("kernel_compiles") is not None:
        rows.append(("Triton kernel compiles, first batch", len(results["kernel_compiles"]), None, "info", None))
        if later:
            rows.append(("Triton kernel compiles, later rounds", sum(len(r["kernel_compiles"]) for r in later),
                         None, "info", None))
    return rows + memory_rows(monitor)


# ---- report --------------------------------------------------------------------------


def memory_rows(monitor: dict) -> list[tuple]:
    rows = []
    for g in monitor.get("gpus", []):
        if g["peak_memory_gib"] is not None:
            rows.append((f"peak memory GiB, gpu {g['index']} (NVML)", g["peak_memory_gib"], None, "info", None))
    for dev, gib in monitor.get("torch_peak_allocated_gib", {}).items():
        rows.append((f"peak torch allocated GiB, {dev}", gib, None, "info", None))
    return rows


def format_table(rows: list[tuple]) -> str:
    """metric | agent-infer | HF | ratio | roofline. The ratio is how many times faster
    agent-infer is: ours / HF for rates, HF / ours for times."""

    def num(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, str):
            return v
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"

    table = [("metric", "agent-infer", "HF", "ratio", "roofline")]
    for metric, ours, hf, kind, roof in rows:
        ratio = "-"
        if hf and ours and kind == "rate":
            ratio = f"{ours / hf:,.2f}x"
        elif hf and ours and kind == "time":
            ratio = f"{hf / ours:,.2f}x"
        table.append((metric, num(ours), num(hf), ratio, roof or "-"))
    return render_table(table)


def maybe_profile(args, engine, prompts, params, tag: str, phase: str = "decode") -> dict | None:
    if not args.profile:
        return None
    from agent_infer.bench.profiling import profile_steps

    try:
        return profile_steps(engine, prompts, params, args.profile_steps, args.profile, tag, phase)
    except Exception as e:  # noqa: BLE001 - a failed trace must not lose the measured figures
        _say(f"profiling failed: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {e}"}


def git_commit() -> dict:
    """The checkout's commit (AGENT_INFER_GIT_COMMIT overrides, for copies without .git)."""
    if os.environ.get("AGENT_INFER_GIT_COMMIT"):
        return {"commit": os.environ["AGENT_INFER_GIT_COMMIT"], "dirty": None}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        status = subprocess.run(["git", "-C", root, "status", "--porcelain"],
                                capture_output=True, text=True, timeout=10)
        return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def environment(device: torch.device) -> dict:
    from importlib import metadata

    env = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "device": str(device),
    }
    for pkg in ("transformers", "triton", "nvidia-ml-py"):
        try:
            env[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            env[pkg] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(cuda=torch.version.cuda, gpu_name=props.name, gpu_count=torch.cuda.device_count(),
                   gpu_memory_gib=round(props.total_memory / 2**30, 1))
    return env


def _jsonable(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None), list))}


def report_payload(kind, args, setup: Setup, engine, init_s, results, hf, roofline, monitor) -> dict:
    from agent_infer.bench.roofline import decode_weight_params

    cfg = asdict(setup.config)
    return {
        "benchmark": kind,
        "command": shlex.join(sys.argv),
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git": git_commit(),
        "environment": environment(setup.device),
        "engine_config": cfg,
        "bench_args": _jsonable(args),
        "model": {
            "path": setup.config.model,
            "random_weights": args.random_weights,
            "architecture": setup.model_config.architecture,
            "dtype": str(setup.dtype).replace("torch.", ""),
            "decode_weight_params": decode_weight_params(setup.model_config),
            "max_model_len": engine.max_model_len,
        },
        "engine_init_s": init_s,
        "results": results,
        "hf": hf,
        "roofline": roofline,
        "gpu_monitor": monitor,
        "profile": None,
        "speculative": speculative_summary(engine),
    }


def speculative_summary(engine) -> dict | None:
    """What speculative decoding did over the engine's life (None: it is off): the
    acceptance per draft position (accepted / verify rows), and tokens per verify row."""
    if getattr(engine, "drafter", None) is None:
        return None
    s = engine.draft_policy.stats
    return {
        "config": asdict(engine.config.speculative_config),
        "num_drafts": s.num_drafts,
        "num_draft_tokens": s.num_draft_tokens,
        "num_accepted_tokens": s.num_accepted_tokens,
        "acceptance_rate": s.acceptance_rate,
        "mean_acceptance_length": s.mean_acceptance_length,
        "acceptance_per_position": [a / s.num_drafts for a in s.accepted_per_pos] if s.num_drafts else [],
        "num_chained_rows": s.num_chained_rows,
    }


def speculative_rows(summary: dict | None) -> list[tuple]:
    if not summary:
        return []
    per_pos = " / ".join(f"{a:.2f}" for a in summary["acceptance_per_position"]) or "-"
    return [("spec decode: verify rows", summary["num_drafts"], None, "info", None),
            ("spec decode: draft acceptance rate", summary["acceptance_rate"], None, "info", None),
            ("spec decode: tokens per verify row", summary["mean_acceptance_length"], None, "info", None),
            ("spec decode: acceptance by position", per_pos, None, "info", None),
            ("spec decode: chained verify rows", f"{summary['num_chained_rows']}",
             None, "info", None)]


def save_json(args, payload: dict) -> None:
    if not args.output_json:
        return
    folder = os.path.dirname(os.path.abspath(args.output_json))
    os.makedirs(folder, exist_ok=True)
    with open(args.output_json, "w") as f:
        f.write(json_text(payload))


# A list of numbers as indent=2 lays it out, one number per line. JSON strings hold no raw
# newline, so a match that spans lines is never inside a string.
_NUMBER_LIST = re.compile(r"\[\n[-+0-9.eE,\s]*\]")


def json_text(payload: dict) -> str:
    """Indented JSON with each list of numbers on one line: a step trace is thousands of
    numbers, which would otherwise take a line each."""
    text = json.dumps(payload, indent=2, default=str)
    return _NUMBER_LIST.sub(lambda m: "[" + " ".join(m.group(0)[1:-1].split()) + "]", text)


def finish(args, title: str, rows: list[tuple], payload: dict) -> None:
    """Save the JSON (now with the profile), then print; the table last."""
    save_json(args, payload)
    if args.output_json:
        _say(f"results written to {args.output_json}")
    from agent_infer.bench.profiling import format_profile

    for profile in (payload.get("profile"), payload.get("profile_prefill")):
        if profile:
            print("\n".join(format_profile(profile)) if "error" not in profile else f"profile: {profile['error']}")
    print("\n".join(format_monitor(payload["gpu_monitor"])))
    if payload.get("hf"):
        print(f"HF: {payload['hf'].get('description', '')}")
    print()
    print(title)
    print(format_table(rows + speculative_rows(payload.get("speculative"))))
    sys.stdout.flush()
