"""Start-up mistakes end in one line that says what to change: a KV budget beyond the
machine's memory, a damaged tokenizer, --model naming a file, a zero or negative KV
budget. Checked in process, and through `agent-infer generate` / `agent-infer serve` /
`python -m agent_infer.server.cli` as the user sees them (exit 1, one line, no traceback)."""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from agent_infer.arguments import engine_config_from_args
from agent_infer.config import ConfigError, EngineConfig, ModelConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.kvcache import pool as pool_module
from agent_infer.kvcache.layouts import DenseKVLayout
from agent_infer.kvcache.pool import KVMemoryPool, kv_memory_available
from agent_infer.loader.tokenizer import has_tokenizer, load_tokenizer

HUGE_GIB = 10**6  # far beyond any host: must be refused before anything is allocated
CPU = ("--device", "cpu", "--dtype", "float32")

# How each front end is started, and the flags it needs besides the engine's.
ENTRY_POINTS = {
    "generate": ("agent_infer.cli", "generate", "--prompt", "hi", "--max-tokens", "1"),
    "serve": ("agent_infer.cli", "serve", "--port", "0"),
    "server.cli": ("agent_infer.server.cli", "--port", "0"),
}


def one_error_line(r: subprocess.CompletedProcess) -> str:
    """The single `agent-infer: error:` line a failed start-up printed."""
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("agent-infer: error: "), lines[0]
    return lines[0]


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


@pytest.fixture()
def tiny(tiny_model_dirs) -> str:
    return tiny_model_dirs["llama"]


# ---- 1. a KV budget beyond the machine's memory --------------------------------------


def test_kv_budget_beyond_host_memory_is_refused_before_allocating(tiny, monkeypatch):
    def no_allocation(*args, **kwargs):
        raise AssertionError("the pool must not be allocated for a budget that cannot fit")

    monkeypatch.setattr(KVMemoryPool, "__init__", no_allocation)
    with pytest.raises(ConfigError) as e:
        LLMEngine(EngineConfig(model=tiny, device="cpu", dtype="float32", kv_cache_bytes=HUGE_GIB << 30))
    msg = str(e.value)
    assert "\n" not in msg
    assert f"kv_cache_bytes={HUGE_GIB << 30}" in msg and "GiB is available on this host" in msg
    assert "room for" in msg and "tokens" in msg and "--kv-cache-gib" in msg


def test_kv_block_count_beyond_host_memory_is_refused(tiny, monkeypatch):
    # 1 MiB free, the tiny Llama's blocks take 96 KiB (3 layers x K and V x 2 heads x 128
    # x fp32 x 16 tokens): 4096 blocks do not fit, 10 do.
    monkeypatch.setattr(pool_module, "cpu_memory_available", lambda: 1 << 20)
    with pytest.raises(ConfigError, match=r"num_kv_blocks=4096 asks for 4096 blocks.*room for 10 blocks \(160 tokens\)"):
        LLMEngine(EngineConfig(model=tiny, device="cpu", dtype="float32", num_kv_blocks=4096))


def test_kv_budget_that_fits_still_starts(tiny, monkeypatch):
    monkeypatch.setattr(pool_module, "cpu_memory_available", lambda: 64 << 20)
    eng = LLMEngine(EngineConfig(model=tiny, device="cpu", dtype="float32", num_kv_blocks=16))
    assert eng.runner.pool.num_blocks == 16


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                 "you tried to allocate 107374181990400 bytes. Error code 12 (Cannot allocate memory)"),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 93.13 GiB."),
])
def test_kv_allocation_failure_is_one_line(monkeypatch, error):
    # The second line of defence, for memory the up-front check could not see.
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(pool_module.torch, "zeros", fail)
    layout = DenseKVLayout(num_kv_heads=2, head_dim=64)
    with pytest.raises(ConfigError) as e:
        KVMemoryPool([layout] * 3, 16, 1000, torch.float32, torch.device("cpu"))
    msg = str(e.value)
    assert "\n" not in msg and "cannot allocate the KV cache" in msg
    assert "1000 blocks" in msg and "16000 tokens" in msg and "--kv-cache-gib" in msg


def test_other_runtime_errors_of_the_allocation_pass_through(monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("something else entirely")

    monkeypatch.setattr(pool_module.torch, "zeros", fail)
    with pytest.raises(RuntimeError, match="something else"):
        KVMemoryPool([DenseKVLayout(num_kv_heads=1, head_dim=8)], 16, 4, torch.float32, torch.device("cpu"))


def test_gpu_room_counts_cached_blocks_as_free(monkeypatch):
    # What torch's caching allocator holds unused is free to a new tensor: a budget that
    # fits today (free + cached) must not be refused.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 5 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 << 30)
    room, where = kv_memory_available(torch.device("cuda:0"))
    assert room == 13 << 30 and "cuda:0" in where


@pytest.mark.parametrize("meminfo,room", [
    ("MemTotal:       24683584 kB\nMemFree:        20128916 kB\nMemAvailable:    3145728 kB\n", 3 << 30),
    # No MemAvailable (not Linux, or a very old kernel): nothing is refused up front.
    ("MemTotal:       24683584 kB\n", pool_module.UNKNOWN_ROOM),
])
def test_cpu_room_is_the_hosts_available_memory(monkeypatch, meminfo, room):
    monkeypatch.setattr(pool_module, "open", lambda path: io.StringIO(meminfo), raising=False)
    assert kv_memory_available(torch.device("cpu")) == (room, "available on this host")


# ---- 2. a damaged tokenizer ----------------------------------------------------------


@pytest.fixture()
def good_tokenizer(default_model_dir, tmp_path) -> str:
    dst = tmp_path / "tok"
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(default_model_dir, name), dst / name)
    return str(dst)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_tokenizer_file_that_is_not_json_names_the_file(good_tokenizer, name):
    file = os.path.join(good_tokenizer, name)
    with open(file, "w") as f:
        f.write("not json")
    with pytest.raises(ConfigError) as e:
        load_tokenizer(good_tokenizer)
    msg = str(e.value)
    assert "\n" not in msg and file in msg and "not valid JSON" in msg and "tokenizer" in msg


def test_tokenizer_file_that_is_not_an_object_names_the_file(good_tokenizer):
    file = os.path.join(good_tokenizer, "tokenizer.json")
    with open(file, "w") as f:
        f.write("[1, 2]")
    with pytest.raises(ConfigError, match=rf"{re.escape(file)}.*list, not an object"):
        load_tokenizer(good_tokenizer)


def test_tokenizer_transformers_cannot_build_names_the_directory(good_tokenizer):
    # Valid JSON, but not a tokenizer: whatever the tokenizer library says, on one line.
    with open(os.path.join(good_tokenizer, "tokenizer.json"), "w") as f:
        f.write('{"version": "1.0"}')
    with pytest.raises(ConfigError) as e:
        load_tokenizer(good_tokenizer)
    msg = str(e.value)
    assert "\n" not in msg and good_tokenizer in msg and "tokenizer" in msg


def test_tokenizer_path_that_is_missing_or_a_file(good_tokenizer, tmp_path):
    with pytest.raises(ConfigError, match="tokenizer directory not found"):
        has_tokenizer(str(tmp_path / "nope"))
    file = os.path.join(good_tokenizer, "tokenizer.json")
    with pytest.raises(ConfigError, match=r"is a file.*--tokenizer takes the directory"):
        has_tokenizer(file)
    with pytest.raises(ConfigError, match=r"is a file.*--tokenizer takes the directory"):
        load_tokenizer(file)
    assert has_tokenizer(good_tokenizer) and not has_tokenizer(str(tmp_path))


def test_generation_config_that_is_not_json_names_the_file(tiny, tmp_path):
    path = _copy(tiny, tmp_path / "m")
    file = os.path.join(path, "generation_config.json")
    with open(file, "w") as f:
        f.write("{oops")
    with pytest.raises(ConfigError, match=rf"{re.escape(file)} is not valid JSON"):
        LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=16))


# ---- 3. --model naming a file --------------------------------------------------------


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_model_path_that_is_a_file_says_so(tiny, name):
    file = os.path.join(tiny, name)
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(file)
    msg = str(e.value)
    assert "is a file" in msg and "--model takes the checkpoint's directory" in msg and tiny in msg
    assert "not found" not in msg


def test_model_path_that_does_not_exist_is_not_found(tmp_path):
    with pytest.raises(ConfigError, match="model directory not found"):
        ModelConfig.from_hf(str(tmp_path / "nope"))


# ---- 4. a zero or negative KV budget -------------------------------------------------


def _engine_args(*flags: str) -> argparse.Namespace:
    from agent_infer.cli import build_parser

    return build_parser().parse_args(["generate", "--prompt", "x", "--model", "m", *flags])


@pytest.mark.parametrize("gib", ["0", "-1", "-0.5", "nan", "inf"])
def test_kv_cache_gib_must_be_positive(gib):
    with pytest.raises(ConfigError, match="--kv-cache-gib must be > 0"):
        engine_config_from_args(_engine_args("--kv-cache-gib", gib))


def test_kv_cache_gib_in_bytes():
    assert engine_config_from_args(_engine_args("--kv-cache-gib", "0.5")).kv_cache_bytes == 1 << 29
    assert engine_config_from_args(_engine_args()).kv_cache_bytes is None


@pytest.mark.parametrize("field,value", [("kv_cache_bytes", 0), ("kv_cache_bytes", -1),
                                         ("num_kv_blocks", 0), ("num_kv_blocks", -3)])
def test_engine_config_refuses_empty_kv_budgets(field, value):
    with pytest.raises(ConfigError, match=rf"{field} must be"):
        EngineConfig(model="m", **{field: value})


# ---- 5. what the user of each front end sees -----------------------------------------


def _front_end_cases(tiny: str, scratch) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Each mistake: the engine flags that make it, and the front ends it is tried on. All
    go through `generate`; `serve` gets one raised while the engine starts, `server.cli`
    one raised while the flags are read: the other mistakes take those same two paths."""
    broken = _copy(tiny, scratch / "broken_tokenizer")
    with open(os.path.join(broken, "tokenizer.json"), "w") as f:
        f.write("not json")
    return {
        "kv budget": (("--model", tiny, *CPU, "--kv-cache-gib", str(HUGE_GIB)), ("generate", "serve")),
        "tokenizer": (("--model", broken, *CPU), ("generate",)),
        "model file": (("--model", os.path.join(tiny, "config.json"), *CPU), ("generate",)),
        "kv gib zero": (("--model", tiny, *CPU, "--kv-cache-gib", "0"), ("generate", "server.cli")),
    }


@pytest.fixture(scope="module")
def front_ends(tiny_model_dirs, tmp_path_factory) -> dict[tuple[str, str], subprocess.CompletedProcess]:
    """Every (mistake, front end) run as a user would, all at once: each is a fresh
    interpreter that spends most of its time importing, so running them side by side
    keeps this file fast. A serve that wrongly started would block: the timeout ends it,
    with the processes it started (each run is a process group of its own)."""
    cases = _front_end_cases(tiny_model_dirs["llama"], tmp_path_factory.mktemp("front_ends"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs = {
        (case, entry): subprocess.Popen([sys.executable, "-m", *ENTRY_POINTS[entry], *flags], env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        for case, (flags, entries) in cases.items() for entry in entries
    }
    done = {}
    for key, p in procs.items():
        try:
            out, err = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
        done[key] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    return done


@pytest.mark.parametrize("entry", ["generate", "serve"])
def test_cli_kv_budget_beyond_host_memory(front_ends, entry):
    line = one_error_line(front_ends["kv budget", entry])
    assert f"kv_cache_bytes={HUGE_GIB << 30}" in line and "available on this host" in line
    assert "--kv-cache-gib" in line


def test_cli_broken_tokenizer(front_ends):
    line = one_error_line(front_ends["tokenizer", "generate"])
    assert "broken_tokenizer/tokenizer.json is not valid JSON" in line


def test_cli_model_path_is_a_file(front_ends):
    line = one_error_line(front_ends["model file", "generate"])
    assert "config.json is a file" in line and "--model takes the checkpoint's directory" in line


@pytest.mark.parametrize("entry", ["generate", "server.cli"])
def test_cli_kv_cache_gib_zero(front_ends, entry):
    line = one_error_line(front_ends["kv gib zero", entry])
    assert "--kv-cache-gib must be > 0" in line
