"""`serve` on the command line: flags and their defaults, and a bad one as a one-line
error (the running process tree, its signals and exit codes: test_lifecycle.py)."""

from __future__ import annotations

import argparse
import subprocess
import sys

from agent_infer.arguments import add_engine_args
from agent_infer.server.cli import add_serve_parser, cmd_serve


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="agent-infer")
    add_serve_parser(parser.add_subparsers(dest="command", required=True), add_engine_args)
    return parser.parse_args(["serve", *argv])


def test_serve_flags_and_defaults():
    args = _parse()
    assert args.handler is cmd_serve
    assert args.model is None  # the default model
    assert (args.host, args.port, args.max_waiting, args.served_model_name) == ("127.0.0.1", 8000, 1024, None)
    args = _parse("--port", "0", "--max-waiting", "7", "--served-model-name", "m", "--max-num-seqs", "3",
                  "--dtype", "float32")
    assert (args.port, args.max_waiting, args.served_model_name, args.max_num_seqs, args.dtype) == (0, 7, "m", 3,
                                                                                                    "float32")
    defaults = _parse()
    assert (defaults.api_server_count, defaults.shutdown_timeout, defaults.trust_request_chat_template,
            defaults.chat_template_timeout) == (1, 30.0, False, 5.0)
    args = _parse("--api-server-count", "4", "--shutdown-timeout", "2.5", "--trust-request-chat-template",
                  "--chat-template-timeout", "1", "--max-chat-template-output", "1000")
    assert (args.api_server_count, args.shutdown_timeout, args.trust_request_chat_template, args.chat_template_timeout,
            args.max_chat_template_output) == (4, 2.5, True, 1.0, 1000)


def test_serve_bad_config_is_one_line_error():
    r = subprocess.run([sys.executable, "-m", "agent_infer.server.cli", "--max-waiting", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "max_waiting must be >= 1" in r.stderr and "Traceback" not in r.stderr
