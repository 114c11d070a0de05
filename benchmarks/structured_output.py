"""Structured outputs on the GPU: decode tok/s with every request constrained to a JSON
schema against the same requests unconstrained, at batch 1 and batch 64, in one process
on one engine (same CUDA graphs, same prompts' shape), plus the host time the masks take
per step and, with --profile, a trace of constrained decode steps.

    python benchmarks/structured_output.py --random-weights qwen3-8b [--batch-sizes 1,64] \
        [--output-len 256] [--schema FILE] [--profile DIR] [--output-json PATH]

The default schema (an array of records: bounded strings, integers in a range, an enum,
a nested array; at least 1000 records) cannot be completed within --output-len tokens, so
every constrained request runs its full length like the unconstrained ones, and its masks
go through keys, strings, numbers and enums. Greedy decoding (temperature 0) in both
modes, so the sampler takes the same path and the difference is the constraint alone.
On a random checkpoint with SmolLM2's tokenizer (49,152 tokens) the masks cover the
model's 151,936 logits, the tokens beyond the tokenizer banned.

Targets (issue): constrained at most 5 % slower at batch 1 and 10 % at batch 64.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_infer.bench.offline import (  # noqa: E402
    build_engine, mode_label, prepare, random_prompts, run_latency_iteration,
)
from agent_infer.arguments import add_engine_args  # noqa: E402
from agent_infer.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

DEFAULT_SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 1000, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "city": {"enum": ["Paris", "Tokyo", "Lima", "Oslo"]},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
        "required": ["name", "age", "city", "tags"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False,
}


def _say(msg: str) -> None:
    print(f"structured_output: {msg}", file=sys.stderr, flush=True)


def measure(engine, fresh, params: SamplingParams, warmup: int, iters: int) -> dict:
    """Median decode tok/s over `iters` runs, and the constraint stats of those runs."""
    n_out = params.max_tokens
    for _ in range(warmup):
        run_latency_iteration(engine, fresh(), params)
    stats = engine.constraints.stats
    before = (stats.steps, stats.host_seconds, stats.wait_seconds, stats.masked_rows)
    runs = []
    for i in range(iters):
        r = run_latency_iteration(engine, fresh(), params)
        short = [n for n in r.output_lens if n != n_out]
        if short:
            raise RuntimeError(f"a request generated {short[0]} tokens instead of {n_out} (did the grammar complete?)")
        runs.append(r)
        _say(f"  run {i + 1}/{iters}: {(n_out - 1) * len(r.output_lens) / r.decode_s:,.1f} tok/s")
    steps = stats.steps - before[0]
    batch = len(runs[0].output_lens)
    return {
        "decode_tok_s": statistics.median((n_out - 1) * batch / r.decode_s for r in runs),
        "decode_step_ms": statistics.median(r.decode_s / max(r.decode_steps, 1) for r in runs) * 1e3,
        "constrained_steps": steps,
        "mask_host_us_per_step": (stats.host_seconds - before[1]) / steps * 1e6 if steps else 0.0,
        "readback_wait_us_per_step": (stats.wait_seconds - before[2]) / steps * 1e6 if steps else 0.0,
        "masked_rows": stats.masked_rows - before[3],
    }


def profile(engine, prompts, params: SamplingParams, out_dir: str) -> dict:
    """A torch.profiler trace of constrained decode steps; the mask kernel's device time
    and the host ranges of the mask step per call."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with tprofile(activities=activities) as prof:
        run_latency_iteration(engine, prompts, params)
    path = str(Path(out_dir) / f"structured_b{len(prompts)}.json")
    prof.export_chrome_trace(path)
    found = {}
    for e in prof.key_averages():
        if "apply_bitmask" in e.key or e.key == "structured.masks":
            found[e.key] = {"calls": e.count, "cpu_us_per_call": e.cpu_time_total / max(e.count, 1),
                            "device_us_per_call": getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0))
                            / max(e.count, 1)}
    _say(f"  trace: {path}")
    return {"trace": path, "ops": found}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    g = ap.add_argument_group("benchmark")
    g.add_argument("--random-weights", default=None, help="a random checkpoint of a real shape (e.g. qwen3-8b)")
    g.add_argument("--batch-sizes", default="1,64")
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=256)
    g.add_argument("--num-iters", type=int, default=3)
    g.add_argument("--num-warmup", type=int, default=1)
    g.add_argument("--schema", default=None, help="a JSON schema file (default: the records schema above)")
    g.add_argument("--profile", default=None, metavar="DIR", help="also trace constrained decode steps into DIR")
    g.add_argument("--output-json", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if args.max_num_seqs is None:
        args.max_num_seqs = max(batches)
    schema = json.loads(Path(args.schema).read_text()) if args.schema else DEFAULT_SCHEMA
    setup = prepare(args)
    engine, _ = build_engine(setup)
    if engine.grammar is None:
        raise SystemExit("the checkpoint has no tokenizer: structured outputs need one")
    rng = np.random.default_rng(args.seed)
    vocab = min(setup.model_config.vocab_size, len(engine.tokenizer))  # prompts of real tokens
    plain = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    t0 = time.perf_counter()
    engine.grammar.compile(constrained.structured_outputs)
    _say(f"schema compiled in {(time.perf_counter() - t0) * 1e3:.1f} ms (with the tokenizer's set-up on first use)")
    results = {}
    try:
        for b in batches:
            def fresh(b=b):
                return random_prompts(rng, [args.input_len] * b, vocab)

            row = {}
            for name, params in (("unconstrained", plain), ("json_schema", constrained)):
                _say(f"batch {b}, {name}")
                row[name] = measure(engine, fresh, params, args.num_warmup, args.num_iters)
            row["slowdown_pct"] = (1 - row["json_schema"]["decode_tok_s"] / row["unconstrained"]["decode_tok_s"]) * 100
            if args.profile:
                row["profile"] = profile(engine, fresh(), constrained, args.profile)
            results[b] = row
    finally:
        engine.shutdown()
    print(f"\n{setup.model_config.architecture} {setup.dtype}, {args.input_len} -> {args.output_len} tokens, "
          f"{mode_label(setup)}")
    print(f"{'batch':>5} {'plain tok/s':>12} {'json tok/s':>11} {'slower':>7} {'mask host us/step':>18} "
          f"{'read-back wait us/step':>23}")
    for b, row in results.items():
        c = row["json_schema"]
        print(f"{b:>5} {row['unconstrained']['decode_tok_s']:>12,.1f} {c['decode_tok_s']:>11,.1f} "
              f"{row['slowdown_pct']:>6.1f}% {c['mask_host_us_per_step']:>18.1f} {c['readback_wait_us_per_step']:>23.1f}")
        for op, v in (row.get("profile") or {}).get("ops", {}).items():
            print(f"      {op}: {v['calls']} calls, {v['cpu_us_per_call']:.1f} us host, "
                  f"{v['device_us_per_call']:.1f} us device per call")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
