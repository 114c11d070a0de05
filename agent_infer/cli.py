"""Command line: agent-infer generate | chat | serve | bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from agent_infer.config import ConfigError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
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
                   help="auto: the model's dtype; fp8: float8 e4m3 K/V, scale 1, saturating at +-448 "
                        "(half the bytes per cached token)")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--preemption", default="none", choices=["none", "recompute"])
    g.add_argument("--mixed-batches", action="store_true",
                   help="steps that prefill also carry every running decode (default: prefill-only steps)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (pure eager mode)")
    g.add_argument("--no-warmup", action="store_true",
                   help="skip the start-up requests that compile kernels before the first real one (GPU)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    g.add_argument("--all-reduce", default="auto", choices=["auto", "nccl", "symm_mem", "symm_mem_fused"],
                   help="TP all-reduce: auto = symmetric memory, each row-parallel all-reduce fused with the "
                        "residual add + RMSNorm after it, where both work (else NCCL); or force one")
    g.add_argument("--seed", type=int, default=0, help="engine seed (per-request seeds are drawn from it)")


def engine_config_from_args(args: argparse.Namespace):
    from agent_infer.config import EngineConfig
    from agent_infer.loader.default_model import ensure_default_model

    return EngineConfig(
        model=args.model or ensure_default_model(),
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs or 256,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_bytes=int(args.kv_cache_gib * 2**30) if args.kv_cache_gib else None,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=not args.no_prefix_caching,
        preemption_mode=args.preemption,
        mixed_batches=args.mixed_batches,
        enforce_eager=args.enforce_eager,
        warmup=not args.no_warmup,
        attention_backend=args.attention_backend,
        tensor_parallel_size=args.tp,
        all_reduce=args.all_reduce,
        seed=args.seed,
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="agent-infer", description="A lean, fast LLM inference engine.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine start-up details")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text for one prompt, streaming it to the terminal")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.set_defaults(handler=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.add_argument("--system", default=None)
    chat.set_defaults(handler=cmd_chat)

    from agent_infer.bench.cli import add_bench_parser
    from agent_infer.server.cli import add_serve_parser

    add_serve_parser(sub, add_engine_args)
    add_bench_parser(sub, add_engine_args)
    return parser


def _stream(engine, prompt_ids: list[int], params, out=sys.stdout) -> str:
    seq = engine.add_request(prompt_ids, params, stream=True)
    text = ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id != seq.request_id:
                continue
            if o.error:
                raise ConfigError(o.error)
            out.write(o.delta_text)
            out.flush()
            text += o.delta_text
    out.write("\n")
    return text


def _prompt_ids(engine, text: str, messages: list[dict] | None) -> list[int]:
    from agent_infer.loader.tokenizer import ChatFormatter

    if engine.tokenizer is None:
        raise ConfigError("this model directory has no tokenizer; text prompts need one")
    if messages is None:
        return engine.tokenizer.encode(text)
    rendered = ChatFormatter(engine.tokenizer).render(messages)
    return engine.tokenizer.encode(rendered, add_special_tokens=False)


def cmd_generate(args: argparse.Namespace) -> int:
    from agent_infer.engine.llm_engine import LLMEngine

    params = sampling_params_from_args(args)
    engine = LLMEngine(engine_config_from_args(args))
    messages = None
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
    _stream(engine, _prompt_ids(engine, args.prompt, messages), params)
    engine.shutdown()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from agent_infer.engine.llm_engine import LLMEngine

    params = sampling_params_from_args(args)
    engine = LLMEngine(engine_config_from_args(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("agent-infer chat: an empty line or Ctrl-D ends it.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        reply = _stream(engine, _prompt_ids(engine, line, messages), params)
        messages.append({"role": "assistant", "content": reply})
    engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        rc = args.handler(args)
        if getattr(args, "tp", 1) > 1:
            # Tearing down NCCL / symmetric-memory state at interpreter exit was seen to
            # abort the process after all work was done; the engine already stopped its
            # workers, so leave without running the C++ destructors.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc or 0)
        return rc
    except KeyboardInterrupt:
        return 130
    except (ConfigError, ValueError, FileNotFoundError, KeyError, NotImplementedError) as e:
        if args.verbose:
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"agent-infer: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
