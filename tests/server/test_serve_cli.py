"""`serve` on the command line: flags, the default model, a real process on a free port,
and a clean stop on SIGINT."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time

import httpx

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


def test_serve_process_answers_and_stops_cleanly(default_model_dir):
    env = dict(os.environ, PYTHONUNBUFFERED="1", NO_PROXY="*")
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent_infer.server.cli", "--port", "0", "--device", "cpu", "--dtype", "float32",
         "--max-model-len", "256", "--kv-cache-gib", "0.05", "--served-model-name", "cli-model",
         "--log-level", "warning"],
        stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )
    try:
        seen = ""
        while not (match := re.search(r"serving cli-model on (http://[\d.]+:\d+)", seen)):
            line = proc.stderr.readline()  # the supervisor names the address once every process is up
            assert line, seen
            seen += line
        url = match.group(1)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", trust_env=False, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "server did not come up"
            time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", trust_env=False, timeout=60,
                       json={"model": "cli-model", "prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        models = httpx.get(url + "/v1/models", trust_env=False).json()
        assert models["data"][0]["id"] == "cli-model" and models["data"][0]["max_model_len"] == 256
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, err
    assert "Traceback" not in err


def test_serve_bad_config_is_one_line_error():
    r = subprocess.run([sys.executable, "-m", "agent_infer.server.cli", "--max-waiting", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "max_waiting must be >= 1" in r.stderr and "Traceback" not in r.stderr
