"""The command line: the README's main job, and one-line errors without tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "agent_infer.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_generate_chat_answers_paris(default_model_dir):
    r = cli("generate", "--chat", "--prompt", "What is the capital of France?", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "Traceback" not in r.stderr


def test_generate_plain_prompt_with_explicit_model(default_model_dir):
    r = cli("generate", "--model", default_model_dir, "--prompt", "1, 2, 3,", "--temperature", "0",
            "--max-tokens", "6", "--device", "cpu", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert "4" in r.stdout


def test_missing_model_directory_is_one_clear_line(tmp_path):
    r = cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "model directory not found" in lines[0]


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    """An architecture neither native nor in transformers; then one that transformers has
    (served through the backend) but whose directory holds no weights."""
    config = {"architectures": ["NoSuchLMHeadModel"], "num_attention_heads": 2, "hidden_size": 8,
              "num_hidden_layers": 1, "vocab_size": 10}
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = cli("generate", "--model", str(tmp_path), "--prompt", "hi", "--device", "cpu")
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "NoSuchLMHeadModel" in lines[0] and "Qwen3ForCausalLM" in lines[0]
    (tmp_path / "config.json").write_text(json.dumps(dict(config, architectures=["GPT2LMHeadModel"])))
    r = cli("generate", "--model", str(tmp_path), "--prompt", "hi", "--device", "cpu")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "no .safetensors weights" in lines[0], r.stderr


def test_bad_flag_is_one_line():
    r = cli("generate", "--prompt", "x", "--temperature", "hot")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--temperature" in lines[0] and "Traceback" not in r.stderr


def test_bad_sampling_value_is_one_line(default_model_dir):
    r = cli("generate", "--prompt", "x", "--top-p", "0")
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "top_p" in r.stderr
