"""The command-line arguments every entry point shares: engine and sampling flags, and
the parser that reports usage errors on one line. `agent_infer/cli.py`, `server/cli.py`
and `bench/cli.py` import these; this module imports none of them."""

from __future__ import annotations

import argparse
import math
import sys

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    """argparse, with usage errors on one line (no usage dump) and exit code 2."""

    def error(self, message: str) -> None:
        print(f"agent-infer: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32"])
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None, help="most sequences in one batch (default 256)")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    g.add_argument("--kv-cache-gib", type=float, default=None, help="explicit KV cache budget in GiB")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="auto: the model's dtype; fp8: float8 e4m3 K/V, scaled per layer by the checkpoint's "
                        "k_scale/v_scale where it has them (else 1, or computed: --calculate-kv-scales), saturating "
                        "at +-448 (half the bytes per cached token)")
    g.add_argument("--calculate-kv-scales", action="store_true",
                   help="with --kv-cache-dtype fp8 and a checkpoint without KV scales: compute each layer's at "
                        "start-up from one prefill of a fixed text (the largest |K| at 200, |V| at 100)")
    g.add_argument("--quantization", "-q", default=None, choices=["fp8"],
                   help="fp8: quantize a bf16/fp32 checkpoint's projections as they load (e4m3 weights, one scale "
                        "per output row, activations per token at run time); fp8 checkpoints need no flag")
    g.add_argument("--model-impl", default="auto", choices=["auto", "native", "transformers"],
                   help="auto: the native implementation where there is one, else transformers' own model class "
                        "on the paged cache; native; transformers")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--preemption", default="none", choices=["none", "recompute"])
    g.add_argument("--mixed-batches", action="store_true",
                   help="steps that prefill also carry every running decode (default: prefill-only steps)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="decode and verify steps compute each sequence's row as a step of that row alone would: "
                        "its tokens then do not depend on the rest of the batch or on speculation (dense models, "
                        "one device; slower at larger batches)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (pure eager mode)")
    g.add_argument("--no-warmup", action="store_true",
                   help="skip the start-up requests that compile kernels before the first real one (GPU)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    g.add_argument("--all-reduce", default="auto", choices=["auto", "nccl", "symm_mem", "symm_mem_fused"],
                   help="TP all-reduce: auto = symmetric memory, each row-parallel all-reduce fused with the "
                        "residual add + RMSNorm after it, where both work (else NCCL); or force one")
    g.add_argument("--moe-parallel", default="ep", choices=["ep", "tp"],
                   help="mixture-of-experts models with --tp: ep = whole routed experts per rank (each rank loads only "
                        "its own), tp = every expert's intermediate dimension split")
    g.add_argument("--seed", type=int, default=0, help="engine seed (per-request seeds are drawn from it)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (prompt lookup) or \'{"method": "mtp", '
                        '"num_speculative_tokens": 1}\' (the checkpoint\'s multi-token-prediction layer)')


def kv_cache_bytes_from_gib(gib: float | None) -> int | None:
    """--kv-cache-gib in bytes; None (flag not given) keeps the default budget. Zero, a
    negative or a non-finite value is refused rather than read as "the default"."""
    from agent_infer.config import ConfigError

    if gib is None:
        return None
    if not gib > 0:  # NaN included
        raise ConfigError(f"--kv-cache-gib must be > 0, got {gib:g}; leave it out for the default budget")
    if not math.isfinite(gib):
        raise ConfigError(f"--kv-cache-gib must be > 0 and finite, got {gib:g}")
    return int(gib * 2**30)


def engine_config_from_args(args: argparse.Namespace):
    from agent_infer.config import EngineConfig
    from agent_infer.loader.default_model import ensure_default_model

    kv_cache_bytes = kv_cache_bytes_from_gib(args.kv_cache_gib)  # before the default model is fetched
    return EngineConfig(
        model=args.model or ensure_default_model(),
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=256 if args.max_num_seqs is None else args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_bytes=kv_cache_bytes,
        kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.calculate_kv_scales,
        quantization=args.quantization,
        model_impl=args.model_impl,
        enable_prefix_caching=not args.no_prefix_caching,
        preemption_mode=args.preemption,
        mixed_batches=args.mixed_batches,
        batch_invariant=args.batch_invariant,
        enforce_eager=args.enforce_eager,
        warmup=not args.no_warmup,
        attention_backend=args.attention_backend,
        tensor_parallel_size=args.tp,
        all_reduce=args.all_reduce,
        moe_parallel=args.moe_parallel,
        seed=args.seed,
        speculative_config=args.speculative_config,
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sample-seed", type=int, default=None, dest="sample_seed", help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_args(args: argparse.Namespace):
    from agent_infer.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.sample_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
