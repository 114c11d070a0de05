"""`agent-infer bench latency | throughput | serve`.

Wired into the main CLI with `add_bench_parser(sub, add_engine_args)`; also runnable on
its own as `python -m agent_infer.bench.cli latency ...`. Handlers import torch and the
engine only when called, so `agent-infer --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable

PRESETS = ("qwen3-8b", "qwen3-0.6b", "llama3-8b", "qwen2-7b", "smollm2-135m", "tiny", "deepseek-v2-lite",
           "deepseek-v3-small", "qwen3-30b-a3b")  # agent_infer.bench.random_weights.PRESETS


def _latency(args: argparse.Namespace) -> int:
    from agent_infer.bench.offline import cmd_latency

    return cmd_latency(args)


def _throughput(args: argparse.Namespace) -> int:
    from agent_infer.bench.offline import cmd_throughput

    return cmd_throughput(args)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_common_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("benchmark")
    g.add_argument("--random-weights", default=None, choices=PRESETS, metavar="NAME",
                   help=f"use a random checkpoint of a real shape, written once under $AGENT_INFER_CACHE/random "
                        f"({', '.join(PRESETS)}); replaces --model")
    g.add_argument("--random-weights-layout", default="bf16", choices=("bf16", "fp8-block"),
                   help="fp8-block: the random checkpoint laid out as DeepSeek-V3's and Qwen3's FP8 releases are "
                        "(e4m3 projections, experts included, with one scale per 128 x 128 block)")
    g.add_argument("--compare-hf", action="store_true",
                   help="run Hugging Face transformers on the same checkpoint first and print the ratio")
    g.add_argument("--profile", default=None, metavar="DIR",
                   help="write a torch.profiler chrome trace of a few decode steps into DIR and print the top "
                        "kernels (throughput: also a trace of a batch's first steps, its prefill)")
    g.add_argument("--profile-steps", type=_positive, default=10, help="steps traced by --profile, per trace")
    g.add_argument("--output-json", default=None, metavar="PATH", help="write every figure and the set-up as JSON")
    g.add_argument("--bandwidth-tbs", type=float, default=None,
                   help="memory bandwidth for the roofline, TB/s per device (default on a GPU: its model's "
                        "measured copy rate, 4.26 on an H200, or the copy rate measured before the run on "
                        "another; on a CPU there is no roofline unless this gives the machine's)")
    g.add_argument("--monitor-interval-ms", type=float, default=100.0, help="GPU memory/utilisation sampling period")


def add_bench_parser(subparsers, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    bench = subparsers.add_parser("bench", help="benchmarks: latency, throughput, serve")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    lat = bsub.add_parser("latency", help="batch-1 (or --batch-size) decode tok/s and time to first token")
    add_engine_args(lat)
    _add_common_args(lat)
    g = lat.add_argument_group("latency")
    g.add_argument("--input-len", type=_positive, default=512)
    g.add_argument("--output-len", type=_positive, default=256)
    g.add_argument("--batch-size", type=_positive, default=1)
    g.add_argument("--num-iters", type=_positive, default=5, help="timed runs (the median is reported)")
    g.add_argument("--num-warmup", type=int, default=2, help="untimed runs first (graph capture, Triton compilation)")
    g.add_argument("--hf-iters", type=_positive, default=1, help="timed transformers runs with --compare-hf")
    # No more sequence slots (and captured graphs) than the batch, unless asked.
    lat.set_defaults(handler=_latency, max_num_seqs=None)

    thr = bsub.add_parser("throughput", help="nano-vllm's workload: output tok/s of many requests, first batch first")
    add_engine_args(thr)
    _add_common_args(thr)
    g = thr.add_argument_group("throughput")
    g.add_argument("--workload", default="nano-vllm", choices=["nano-vllm", "uniform"],
                   help="nano-vllm: its bench.py's exact draw (Python random, ids < 10,000); uniform: NumPy "
                        "lengths, ids over the whole vocabulary")
    g.add_argument("--num-seqs", type=_positive, default=256)
    g.add_argument("--min-len", type=_positive, default=100, help="input and output lengths are uniform in [min, max]")
    g.add_argument("--max-len", type=_positive, default=1024)
    g.add_argument("--temperature", type=float, default=0.6)
    g.add_argument("--rounds", type=_positive, default=3,
                   help="timed batches: the first after start-up (the headline), then the same lengths with fresh ids")
    g.add_argument("--num-warmup", type=int, default=0,
                   help="untimed batches before the first timed one (same prompt lengths, short outputs)")
    g.add_argument("--hf-num-seqs", type=_positive, default=32,
                   help="requests transformers runs (as one left-padded batch) with --compare-hf")
    thr.set_defaults(handler=_throughput)

    try:
        serve = importlib.import_module("agent_infer.bench.serve")  # written by the serving benchmark
    except ModuleNotFoundError as e:
        if e.name != "agent_infer.bench.serve":
            raise
    else:
        serve.add_parser(bsub)
    return bench


def main(argv: list[str] | None = None) -> int:
    """`python -m agent_infer.bench.cli latency ...`: the bench commands without the main CLI."""
    import os

    from agent_infer.arguments import add_engine_args
    from agent_infer.config import ConfigError

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(prog="python -m agent_infer.bench.cli")
    add_bench_parser(parser.add_subparsers(dest="command", required=True), add_engine_args)
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.handler(args)
    except ConfigError as e:
        print(f"agent-infer: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
