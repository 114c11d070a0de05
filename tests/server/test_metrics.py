"""/metrics: Prometheus text from a registry of the app's own, tracking what the engine did."""

from __future__ import annotations

import json

import httpx
from prometheus_client import REGISTRY

from tests.server.conftest import MODEL_NAME, running_server


def test_metrics_follow_a_request(idle_server):
    before = idle_server.metrics()
    with idle_server.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello world, this is", "max_tokens": 5,
                                            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
    idle_server.wait_idle()
    after = idle_server.metrics()

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("agent_infer_requests_received_total") == 1
    assert delta("agent_infer_requests_finished_total{finish_reason=length}") == 1
    assert delta("agent_infer_time_to_first_token_seconds_count") == 1
    assert delta("agent_infer_inter_token_latency_seconds_count") == 4  # 5 tokens, 4 gaps
    assert delta("agent_infer_e2e_request_latency_seconds_count") == 1
    assert delta("agent_infer_e2e_request_latency_seconds_sum") >= delta("agent_infer_time_to_first_token_seconds_sum")
    assert delta("agent_infer_generation_tokens_total") == 5
    assert delta("agent_infer_prefix_cache_queries_total") == prompt_tokens
    assert delta("agent_infer_prompt_tokens_total") + delta("agent_infer_prefix_cache_hits_total") == prompt_tokens
    assert delta("agent_infer_decode_batch_size_count") == 4
    assert delta("agent_infer_request_generation_tokens_sum") == 5
    assert after["agent_infer_kv_cache_total_blocks"] == idle_server.core.info.num_kv_blocks
    assert after["agent_infer_kv_cache_usage_ratio"] == 0.0
    assert after["agent_infer_engine_healthy"] == 1.0


def test_prefix_cache_hits_are_counted(idle_server):
    prompt = "A long shared preamble about the history of tea, its origins, its trade routes and its rituals. " * 3
    with idle_server.client() as c:
        before = idle_server.metrics()["agent_infer_prefix_cache_hits_total"]
        for _ in range(2):
            assert c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1}).status_code == 200
    assert idle_server.metrics()["agent_infer_prefix_cache_hits_total"] - before >= 16  # at least one block


def test_kv_usage_is_visible_while_a_request_runs(idle_server):
    with idle_server.client() as c, c.stream("POST", "/v1/completions", json={
            "model": MODEL_NAME, "prompt": "Count slowly:", "max_tokens": 40, "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                m = idle_server.metrics()
                assert m["agent_infer_num_requests_running"] == 1
                assert m["agent_infer_kv_cache_used_blocks"] >= 1 and m["agent_infer_kv_cache_usage_ratio"] > 0
                break


def test_metrics_use_their_own_registry(idle_server):
    names = {m.name for m in REGISTRY.collect()}
    assert not any(n.startswith("agent_infer_") for n in names)
    text = httpx.get(idle_server.url + "/metrics", trust_env=False).text
    assert "# TYPE agent_infer_time_to_first_token_seconds histogram" in text


def test_vllm_names_and_request_phases(idle_server):
    """vLLM's metric names (from the same data), per-phase request histograms, the
    iteration-token histogram, the preemption counter and the cached-token counter."""
    from agent_infer.core.metrics import VLLM_NAMES

    prompt = "A shared preamble long enough to fill a couple of KV blocks, about tea and its history. " * 2
    before = idle_server.metrics()
    with idle_server.client() as c:
        for _ in range(2):
            r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4,
                                                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    idle_server.wait_idle()
    after = idle_server.metrics()

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"vllm:request_{phase}_time_seconds_count") == 2
        assert delta(f"agent_infer_request_{phase}_time_seconds_count") == 2
    assert delta("vllm:request_inference_time_seconds_sum") >= delta("vllm:request_decode_time_seconds_sum")
    assert delta("vllm:request_success_total{finished_reason=length}") == 2
    assert delta("vllm:generation_tokens_total") == 8
    assert delta("vllm:prefix_cache_hits_total") >= cached > 0  # the second request's cached prompt tokens
    assert 0 < delta("vllm:iteration_tokens_total_count") <= delta("agent_infer_engine_steps_total")
    # vLLM's count: each whole prompt (cached part included) in the step of its first token,
    # and every token generated (that first one included)
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert delta("vllm:iteration_tokens_total_sum") == 2 * prompt_tokens + 2 * 4
    assert delta("vllm:time_per_output_token_seconds_count") == delta("vllm:inter_token_latency_seconds_count") == 6
    assert "vllm:num_preemptions_total" in after and after["vllm:num_requests_running"] == 0
    text = httpx.get(idle_server.url + "/metrics", trust_env=False).text
    for names in VLLM_NAMES.values():
        for name in names:
            if name.startswith("vllm:spec_decode"):
                continue  # exported only with speculative decoding on (tested below)
            assert f"# TYPE {name} " in text or f"# TYPE {name}_total counter" in text, name


def test_speculative_decoding_metrics_count_what_happened(default_model_dir):
    """vLLM's spec-decode counters over a server with prompt lookup: drafts, draft tokens,
    accepted ones by position; every token generated counted once; a stream that gets
    several tokens in one step says the same as the whole answer."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    body = {"model": MODEL_NAME, "prompt": "1 2 3 4 5 1 2 3 4 5 1 2 3 4 5 1 2", "max_tokens": 30, "temperature": 0,
            "ignore_eos": True}
    with running_server(default_model_dir, speculative_config=spec) as srv:
        with srv.client() as c:
            whole = c.post("/v1/completions", json=body).json()
            with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        srv.wait_idle()
        m = srv.metrics()
    pieces = [ch["choices"][0]["text"] for ch in chunks]
    assert "".join(pieces) == whole["choices"][0]["text"]
    drafts, tokens, accepted = (m[f"vllm:spec_decode_num_{k}_total"] for k in ("drafts", "draft_tokens", "accepted_tokens"))
    per_pos = [m[f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}"] for i in range(3)]
    assert drafts > 0 and tokens >= accepted > 0 and tokens <= 3 * drafts
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert m["agent_infer_spec_decode_num_accepted_tokens_total"] == accepted
    assert m["vllm:generation_tokens_total"] == 2 * whole["usage"]["completion_tokens"] == 60
    # Fewer steps than tokens: accepted drafts came out several to a step, and the stream saw it.
    assert m["agent_infer_engine_steps_total"] < 60 and len(pieces) < 30


def test_no_spec_decode_metrics_without_speculation(idle_server):
    assert not any(k.startswith("vllm:spec_decode") for k in idle_server.metrics())
