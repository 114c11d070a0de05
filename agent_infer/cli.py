"""Command line: agent-infer generate | chat | serve | bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from agent_infer.arguments import (
    Parser, add_engine_args, add_sampling_args, engine_config_from_args, sampling_params_from_args,
)
from agent_infer.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="agent-infer", description="A lean, fast LLM inference engine.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine start-up details")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

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
    from agent_infer.engine.launch import launch_engine

    params = sampling_params_from_args(args)
    engine = launch_engine(engine_config_from_args(args))
    messages = None
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
    _stream(engine, _prompt_ids(engine, args.prompt, messages), params)
    engine.shutdown()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from agent_infer.engine.launch import launch_engine

    params = sampling_params_from_args(args)
    engine = launch_engine(engine_config_from_args(args))
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
