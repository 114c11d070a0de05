"""`bench serve` against our server: exact token counts, sane latencies, JSON results."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from agent_infer.bench.serve import (
    BenchConfig, PromptSpec, RequestResult, _body, _percentile, add_parser, make_prompts, run_benchmark, summarize,
)
from agent_infer.bench.workloads import nano_vllm_workload


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agent-infer bench")
    add_parser(parser.add_subparsers(dest="bench_command", required=True))
    return parser


def test_bench_serve_completions_with_concurrency_cap(idle_server, tmp_path, capsys):
    out = tmp_path / "result.json"
    args = _parser().parse_args([
        "serve", "--base-url", idle_server.api, "--num-prompts", "8", "--max-concurrency", "4",
        "--random-input-len", "20", "--random-output-len", "6", "--result-json", str(out),
    ])
    assert args.handler(args) == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 8 and res["failed"] == 0
    assert res["model"] == "smol-test"  # found through /v1/models
    assert res["total_input_tokens"] == 8 * 20  # token-id prompts: exact
    assert res["total_output_tokens"] == 8 * 6  # ignore_eos: exact
    assert res["per_request"]["output_tokens"] == [6] * 8
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(res[key]) == {"mean", "median", "p99", "std"}
        assert res[key]["mean"] > 0 and res[key]["p99"] >= res[key]["median"] > 0
    assert res["e2el_ms"]["mean"] > res["ttft_ms"]["mean"]
    assert math.isclose(res["output_throughput"], 48 / res["duration_s"], rel_tol=1e-9)
    assert res["total_token_throughput"] > res["output_throughput"] > 0
    assert res["config"]["max_concurrency"] == 4 and res["config"]["request_rate"] == "inf"
    assert res["streamed"] is True
    assert res["client_cpu_s"] > 0 and 0 < res["client_cpu_fraction"] == res["client_cpu_s"] / res["duration_s"]
    report = capsys.readouterr().out
    assert "Output token throughput" in report and "TTFT" in report and "Client CPU" in report


def test_bench_serve_chat_with_poisson_arrivals(idle_server):
    cfg = BenchConfig(base_url=idle_server.api, endpoint="chat", num_prompts=6, request_rate=20.0,
                      random_input_len=12, random_output_len=5, seed=3)
    res = _run(cfg)
    assert res["completed"] == 6 and res["failed"] == 0
    assert res["total_output_tokens"] == 30
    assert all(n > 12 for n in res["per_request"]["prompt_tokens"])  # words + chat template


def test_bench_serve_prompts_from_a_file(idle_server, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hello there", "max_tokens": 3}\n{"prompt": "What is tea?"}\n')
    cfg = BenchConfig(base_url=idle_server.api, num_prompts=4, dataset_path=str(path), random_output_len=2)
    res = _run(cfg)
    assert res["completed"] == 4
    assert sorted(res["per_request"]["output_tokens"]) == [2, 2, 3, 3]


def test_bench_serve_reports_failures(idle_server):
    cfg = BenchConfig(base_url=idle_server.api, model="not-served", num_prompts=2, random_input_len=4,
                      random_output_len=2)
    res = _run(cfg)
    assert res["completed"] == 0 and res["failed"] == 2
    assert any("404" in e for e in res["errors"])


def test_bench_serve_nano_vllm_workload_sends_the_offline_draw(idle_server, tmp_path):
    """The same prompts and max_tokens as `bench throughput --workload nano-vllm` draws:
    the server's token counts are the draw's sums, request for request."""
    out = tmp_path / "result.json"
    args = _parser().parse_args([
        "serve", "--base-url", idle_server.api, "--workload", "nano-vllm", "--num-prompts", "6", "--min-len", "5",
        "--max-len", "20", "--vocab-size", "1000", "--max-concurrency", "3", "--temperature", "0.6",
        "--seed-per-request", "--result-json", str(out),
    ])
    assert args.handler(args) == 0
    res = json.loads(out.read_text())
    prompts, out_lens = nano_vllm_workload(6, 5, 20, 1000, seed=0)
    assert res["completed"] == 6 and res["failed"] == 0
    assert res["total_input_tokens"] == sum(len(p) for p in prompts)
    assert res["total_output_tokens"] == sum(out_lens)
    assert sorted(res["per_request"]["prompt_tokens"]) == sorted(len(p) for p in prompts)
    assert sorted(res["per_request"]["output_tokens"]) == sorted(out_lens)
    assert res["config"]["workload"] == "nano-vllm" and res["config"]["temperature"] == 0.6


def test_bench_serve_without_streaming_reports_no_ttft(idle_server, tmp_path, capsys):
    out = tmp_path / "result.json"
    args = _parser().parse_args([
        "serve", "--base-url", idle_server.api, "--num-prompts", "4", "--max-concurrency", "2",
        "--random-input-len", "10", "--random-output-len", "5", "--no-stream", "--result-json", str(out),
    ])
    assert args.handler(args) == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 4 and res["failed"] == 0
    assert res["streamed"] is False
    assert res["total_input_tokens"] == 40 and res["total_output_tokens"] == 20  # from each response's usage
    assert res["ttft_ms"] is None and res["tpot_ms"] is None and res["itl_ms"] is None
    assert res["per_request"]["ttft_s"] is None
    assert res["e2el_ms"]["median"] > 0
    assert res["client_cpu_s"] > 0 and res["client_cpu_fraction"] > 0
    assert "not measured (not streamed)" in capsys.readouterr().out


def test_nano_vllm_prompts_are_the_workload_draw():
    cfg = BenchConfig(base_url="http://x", workload="nano-vllm", num_prompts=5, min_len=3, max_len=9,
                      vocab_size=151936, seed=4)
    prompts, out_lens = nano_vllm_workload(5, 3, 9, 151936, seed=4)
    assert make_prompts(cfg) == [PromptSpec(p, n) for p, n in zip(prompts, out_lens)]


def test_request_bodies_follow_the_options():
    spec = PromptSpec([1, 2, 3], 7)
    streamed = _body(BenchConfig(base_url="http://x", temperature=0.6), "m", spec, index=3)
    assert streamed["stream"] is True and streamed["stream_options"] == {"include_usage": True}
    assert streamed["temperature"] == 0.6 and streamed["ignore_eos"] is True and "seed" not in streamed
    plain = _body(BenchConfig(base_url="http://x", stream=False, seed=10, seed_per_request=True), "m", spec, index=3)
    assert "stream" not in plain and "stream_options" not in plain
    assert plain["seed"] == 13  # bench throughput seeds request i with seed + i
    assert plain["prompt"] == [1, 2, 3] and plain["max_tokens"] == 7


@pytest.mark.parametrize("kwargs", [
    {"workload": "nano-vllm", "endpoint": "chat"},
    {"workload": "nano-vllm", "dataset_path": "prompts.txt"},
    {"workload": "nano-vllm", "min_len": 10, "max_len": 5},
    {"workload": "bogus"},
])
def test_config_refuses_what_cannot_be_sent(kwargs):
    with pytest.raises(ValueError):
        BenchConfig(base_url="http://x", **kwargs)


def test_bench_serve_imports_without_torch():
    code = ("import agent_infer.bench.serve, agent_infer.bench.workloads, sys; "
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_unstreamed_summary_has_null_latencies():
    results = [RequestResult(ok=True, prompt_tokens=4, output_tokens=8, ttft=None, e2e=0.5) for _ in range(2)]
    res = summarize(BenchConfig(base_url="http://x", stream=False), "m", results, duration=1.0, client_cpu_s=0.25)
    assert res["ttft_ms"] is None and res["tpot_ms"] is None and res["itl_ms"] is None
    assert results[0].tpot is None
    assert res["e2el_ms"]["mean"] == 500.0 and res["output_throughput"] == 16.0
    assert res["client_cpu_fraction"] == 0.25


def test_summary_statistics():
    results = [RequestResult(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.1 * (i + 1), e2e=1.0 + i,
                             itl=[0.2] * 4) for i in range(4)]
    res = summarize(BenchConfig(base_url="http://x"), "m", results, duration=2.0)
    assert math.isclose(res["ttft_ms"]["mean"], 250.0) and math.isclose(res["ttft_ms"]["median"], 250.0)
    assert res["request_throughput"] == 2.0 and res["output_throughput"] == 10.0
    assert res["total_token_throughput"] == 30.0
    assert _percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert _percentile([0.0, 100.0], 99) == 99.0
    # TPOT excludes the first token: (e2e - ttft) / (tokens - 1)
    assert math.isclose(results[0].tpot, (1.0 - 0.1) / 4)
    assert PromptSpec("x", 1).max_tokens == 1


def _run(cfg: BenchConfig) -> dict:
    import asyncio

    return asyncio.run(run_benchmark(cfg))
