"""`agent-infer serve`: the OpenAI-compatible server on uvicorn.

`agent_infer/cli.py` registers it with `add_serve_parser(sub, add_engine_args)`.
`python -m agent_infer.server.cli [serve flags]` runs the same command on its own.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

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
    g.add_argument("--switch-interval-ms", type=float, default=None,
                   help="Python's GIL switch interval in the server process, where the engine thread and the "
                        "event loop share the GIL (sys.setswitchinterval; default: Python's, 5 ms)")
    p.set_defaults(handler=cmd_serve)
    return p


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from agent_infer.arguments import engine_config_from_args
    from agent_infer.engine.async_engine import AsyncEngine, AsyncEngineConfig
    from agent_infer.engine.launch import launch_engine
    from agent_infer.server.openai_server import build_app

    logging.getLogger("agent_infer").setLevel(getattr(logging, args.log_level.upper()))
    async_config = AsyncEngineConfig(max_waiting=args.max_waiting)  # validate before loading a model
    if args.switch_interval_ms is not None:
        if not args.switch_interval_ms > 0:
            raise ValueError(f"--switch-interval-ms must be > 0, got {args.switch_interval_ms}")
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    config = engine_config_from_args(args)
    name = args.served_model_name or os.path.basename(os.path.normpath(config.model))
    engine = launch_engine(config)
    app = build_app(AsyncEngine(engine, async_config), name, retry_after_s=args.retry_after,
                    tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)

    # Bind here, so that --port 0 can report the port it got.
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    print(f"agent-infer: serving {name} on http://{host}:{port} (max_model_len {engine.max_model_len})",
          file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        # uvicorn re-raises the Ctrl-C / SIGINT it handled, after a graceful shutdown.
        pass
    return 0


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
