"""`agent-infer serve`: the OpenAI-compatible server (agent_infer/server/launcher.py
starts its engine core and front ends).

`agent_infer/cli.py` registers it with `add_serve_parser(sub, add_engine_args)`.
`python -m agent_infer.server.cli [serve flags]` runs the same command on its own.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from agent_infer.server.text_workers import TextLimits

log = logging.getLogger(__name__)


def add_serve_parser(subparsers, add_engine_args) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients must send (default: the model directory's name)")
    g.add_argument("--max-waiting", type=int, default=1024,
                   help="requests allowed to wait for a slot; beyond it the server answers 503 with Retry-After")
    g.add_argument("--retry-after", type=int, default=1, help="seconds sent in Retry-After when the queue is full")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--tool-call-parser", default="auto",
                   choices=["auto", "hermes", "qwen", "llama3_json", "deepseek_v3"],
                   help="format of tool calls in the model's output, for tool_choice 'auto' (auto: from the chat "
                        "template, else the model family)")
    g.add_argument("--reasoning-parser", default="auto", choices=["auto", "none", "qwen3", "deepseek_r1"],
                   help="split <think> blocks into reasoning_content (auto: when the chat template has them)")
    g.add_argument("--api-server-count", type=int, default=1,
                   help="HTTP front-end processes on the one port, all feeding the one engine core (more for "
                        "many streaming clients: each does its own text work)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds requests in flight may still run after SIGTERM / SIGINT before they are aborted")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat_template (code the server runs; refused by default)")
    g.add_argument("--chat-template-timeout", type=float, default=TextLimits.template_timeout_s,
                   help="wall-clock limit of one chat template rendering, seconds (the request then gets a 400)")
    g.add_argument("--max-chat-template-output", type=int, default=TextLimits.max_template_output_chars,
                   help="characters a chat template may write at most (the request then gets a 400)")
    p.set_defaults(handler=cmd_serve)
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    from agent_infer.arguments import engine_config_from_args
    from agent_infer.core.config import CoreConfig
    from agent_infer.distributed.group import torchrun_launch
    from agent_infer.server.launcher import ServeOptions, Supervisor
    from agent_infer.server.serving import ServerConfig

    logging.getLogger("agent_infer").setLevel(getattr(logging, args.log_level.upper()))
    # The server's own settings first: a bad one is refused before anything heavy is imported.
    core_config = CoreConfig(max_waiting=args.max_waiting)
    limits = TextLimits(template_timeout_s=args.chat_template_timeout,
                        max_template_output_chars=args.max_chat_template_output)
    options = ServeOptions(args.host, args.port, args.api_server_count, args.shutdown_timeout, args.log_level)
    config = engine_config_from_args(args)
    launch = torchrun_launch()
    if launch is not None and launch.rank != 0:
        from agent_infer.engine.launch import launch_engine

        launch_engine(config)  # a TP worker of rank 0's engine core: does not return
    name = args.served_model_name or os.path.basename(os.path.normpath(config.model))
    server_config = ServerConfig(name, retry_after_s=args.retry_after, tool_call_parser=args.tool_call_parser,
                                 reasoning_parser=args.reasoning_parser,
                                 trust_request_chat_template=args.trust_request_chat_template)
    return Supervisor(options).run(config, core_config, config=server_config, limits=limits)


def main(argv: list[str] | None = None) -> int:
    from agent_infer.arguments import Parser, add_engine_args

    parser = argparse.ArgumentParser(prog="agent-infer")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    add_serve_parser(sub, add_engine_args)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as e:  # ConfigError and friends: one line, no traceback
        print(f"agent-infer: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
