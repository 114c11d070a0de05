"""`bench serve` against our server: exact token counts, sane latencies, JSON results."""

from __future__ import annotations

import argparse
import json
import math

from agent_infer.bench.serve import BenchConfig, PromptSpec, _percentile, add_parser, run_benchmark, summarize


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
    report = capsys.readouterr().out
    assert "Output token throughput" in report and "TTFT" in report


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


def test_summary_statistics():
    from agent_infer.bench.serve import RequestResult

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
