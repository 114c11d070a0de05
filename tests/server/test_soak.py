"""Soak: a few hundred mixed requests (completions and chat, streaming or not, n of 1 or 2,
stop strings, shared prefixes, some invalid) with random client cancellations. Every
request that was not cancelled completes correctly, no request is lost inside the
engine, and the KV pool ends fully free."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import httpx
import pytest

from tests.server.conftest import MODEL_NAME

NUM_REQUESTS = 300
CONCURRENCY = 24
SHARED_PREFIX = ("You are a helpful assistant. Answer briefly and precisely, in plain English, without lists. " * 2)
TOPICS = ["the sea", "volcanoes", "bread", "trains", "the moon", "bees", "glass", "rain", "chess", "tea", "paper"]


def _plan(rng: random.Random, i: int) -> dict:
    topic = rng.choice(TOPICS)
    prompt = rng.choice([f"Tell me about {topic}.", SHARED_PREFIX + f"Tell me about {topic}.",
                         f"{topic} " * rng.randint(1, 40)])
    return {
        "i": i,
        "chat": rng.random() < 0.5,
        "stream": rng.random() < 0.5,
        "n": 2 if rng.random() < 0.15 else 1,
        "max_tokens": rng.randint(1, 12),
        "temperature": rng.choice([0.0, 0.8]),
        "seed": rng.randint(0, 2**31) if rng.random() < 0.5 else None,
        "stop": [" the", "."] if rng.random() < 0.3 else None,
        "prompt": prompt,
        "cancel": rng.random() < 0.2,
        "cancel_after_chunks": rng.randint(0, 3),
        "cancel_after_s": rng.uniform(0.0, 0.4),
        "invalid": rng.random() < 0.04,
    }


def _body(p: dict) -> tuple[str, dict]:
    body = {"model": MODEL_NAME, "max_tokens": p["max_tokens"], "temperature": p["temperature"], "n": p["n"],
            "stream": p["stream"]}
    if p["seed"] is not None:
        body["seed"] = p["seed"]
    if p["stop"]:
        body["stop"] = p["stop"]
    if p["stream"]:
        body["stream_options"] = {"include_usage": True}
    if p["invalid"]:
        body["max_tokens"] = -5
    if p["chat"]:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": p["prompt"]}]}
    return "/v1/completions", {**body, "prompt": p["prompt"]}


def _check_choice_text(p: dict, text: str) -> None:
    if p["stop"]:
        assert not any(s in text for s in p["stop"]), (p, text)


def _check_usage(p: dict, reasons: list[str], completion_tokens: int) -> None:
    """A choice that ended on length generated exactly max_tokens tokens, one that
    stopped between 1 and max_tokens: usage must be their sum."""
    assert len(reasons) == p["n"] and all(r in ("stop", "length") for r in reasons), (p, reasons)
    lengths = reasons.count("length") * p["max_tokens"]
    stops = reasons.count("stop")
    assert lengths + stops <= completion_tokens <= lengths + stops * p["max_tokens"], (p, reasons, completion_tokens)


async def _run_one(client: httpx.AsyncClient, p: dict) -> str:
    path, body = _body(p)
    if not p["stream"]:
        req = client.post(path, json=body)
        if p["cancel"]:
            try:
                r = await asyncio.wait_for(req, timeout=p["cancel_after_s"])
            except asyncio.TimeoutError:
                return "cancelled"
        else:
            r = await req
        if p["invalid"]:
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
            return "invalid"
        assert r.status_code == 200, r.text
        data = r.json()
        assert sorted(c["index"] for c in data["choices"]) == list(range(p["n"]))
        for c in data["choices"]:
            _check_choice_text(p, c["message"]["content"] if p["chat"] else c["text"])
        _check_usage(p, [c["finish_reason"] for c in data["choices"]], data["usage"]["completion_tokens"])
        return "ok"

    async with client.stream("POST", path, json=body) as r:
        if p["invalid"]:
            assert r.status_code == 400
            return "invalid"
        assert r.status_code == 200
        finished, texts, usage, done, chunks = {}, {}, None, False, 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            chunks += 1
            if p["cancel"] and chunks > p["cancel_after_chunks"]:
                return "cancelled"  # leaving the block hangs up mid-stream
            if obj.get("usage"):
                usage = obj["usage"]
            for c in obj["choices"]:
                piece = (c["delta"].get("content") or "") if p["chat"] else c["text"]
                texts[c["index"]] = texts.get(c["index"], "") + piece
                if c["finish_reason"]:
                    assert c["index"] not in finished, (p, obj)  # one final chunk per choice
                    finished[c["index"]] = c["finish_reason"]
        assert done and set(finished) == set(range(p["n"])), (p, finished)
        for text in texts.values():
            _check_choice_text(p, text)
        assert usage is not None, p
        _check_usage(p, [finished[k] for k in range(p["n"])], usage["completion_tokens"])
        return "ok"


@pytest.mark.slow
def test_soak_mixed_requests_with_cancellations(idle_server):
    rng = random.Random(20240607)
    plans = [_plan(rng, i) for i in range(NUM_REQUESTS)]
    before = idle_server.metrics()

    async def main() -> list[str]:
        gate = asyncio.Semaphore(CONCURRENCY)
        limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(base_url=idle_server.url, trust_env=False, timeout=120, limits=limits) as client:
            async def gated(p):
                async with gate:
                    return await _run_one(client, p)

            return await asyncio.gather(*(gated(p) for p in plans))

    outcomes = asyncio.run(main())
    counts = Counter(outcomes)
    print("soak outcomes:", dict(counts))
    assert len(outcomes) == NUM_REQUESTS
    # Every request either completed correctly, was refused as invalid, or was cancelled by its client.
    assert set(counts) <= {"ok", "invalid", "cancelled"}
    assert counts["invalid"] == sum(p["invalid"] for p in plans)
    assert counts["ok"] >= sum(1 for p in plans if not p["cancel"] and not p["invalid"])
    assert counts["cancelled"] > 10 and counts["ok"] > 200

    idle_server.wait_idle(timeout=30)  # the whole KV pool is free again
    assert idle_server.snapshot().num_used_blocks == 0
    after = idle_server.metrics()

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    received = delta("agent_infer_requests_received_total")
    finished = {r: delta(f"agent_infer_requests_finished_total{{finish_reason={r}}}")
                for r in ("stop", "length", "abort", "rejected", "error")}
    # No request lost: every engine request that was accepted ended, none by an error.
    assert received == sum(finished.values())
    print("engine requests finished:", finished)
    assert finished["error"] == 0 and finished["rejected"] == 0
    assert finished["abort"] > 0  # the cancellations really reached the engine
    assert received >= counts["ok"]
    assert after["agent_infer_num_requests_running"] == 0 and after["agent_infer_num_requests_waiting"] == 0
    assert after["agent_infer_kv_cache_used_blocks"] == 0
    # Shared prefixes were served from the prefix cache.
    assert delta("agent_infer_prefix_cache_hits_total") > 0
