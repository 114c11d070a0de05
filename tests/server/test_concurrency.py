"""Concurrent clients share engine batches and match offline generation; a client that
goes away has its request aborted and its KV blocks returned, without disturbing others."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from openai import AsyncOpenAI

from agent_infer.sampling_params import SamplingParams
from tests.server.conftest import MODEL_NAME

NUM_CLIENTS = 16
MAX_TOKENS = 24
PROMPTS = [
    f"{subject} is" for subject in (
        "The capital of France", "Water", "A good breakfast", "The tallest mountain", "Python", "The Moon",
        "Music", "A cat", "The ocean", "Gold", "The sun", "Coffee", "A library", "Winter", "The internet", "Chess",
    )
]


def _decode_batch_sizes(metrics: dict[str, float]) -> tuple[float, float]:
    """(number of decode steps, decode steps with a single sequence)."""
    return metrics["agent_infer_decode_batch_size_count"], metrics["agent_infer_decode_batch_size_bucket{le=1.0}"]


def test_16_streaming_clients_match_offline_and_share_batches(idle_server, smol_engine):
    assert len(PROMPTS) == NUM_CLIENTS
    before = idle_server.metrics()

    async def one(client: AsyncOpenAI, prompt: str) -> tuple[str, str | None, int]:
        stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        text, reason, tokens = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return text, reason, tokens

    async def main():
        async with AsyncOpenAI(base_url=idle_server.api, api_key="unused", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    results = asyncio.run(main())
    offline = smol_engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    for prompt, (text, reason, tokens), ref in zip(PROMPTS, results, offline):
        assert text == ref.text, prompt
        assert reason == ref.finish_reason
        assert tokens == len(ref.token_ids)

    after = idle_server.metrics()
    steps0, single0 = _decode_batch_sizes(before)
    steps1, single1 = _decode_batch_sizes(after)
    shared = (steps1 - steps0) - (single1 - single0)
    # 16 requests of up to 24 tokens would take ~370 decode steps one at a time.
    assert steps1 - steps0 < 120, "requests were not batched together"
    assert shared > 0.5 * (steps1 - steps0)
    # The largest decode batch really held many of the clients at once.
    assert idle_server.snapshot().max_decode_batch >= 8


def test_disconnected_stream_is_aborted_and_frees_its_blocks(idle_server):
    """Three long streams; one client hangs up after a few chunks. Its request is aborted
    (blocks freed at once, finish reason `abort` counted), the other two run to the end."""
    body = {"model": MODEL_NAME, "max_tokens": 60, "temperature": 0, "stream": True, "ignore_eos": True}
    aborted_before = idle_server.metrics().get("agent_infer_requests_finished_total{finish_reason=abort}", 0.0)

    started = {name: asyncio.Event() for name in ("b", "c")}

    async def keep_reading(client: httpx.AsyncClient, name: str, prompt: str) -> tuple[str, str | None]:
        text, reason = "", None
        async with client.stream("POST", "/v1/completions", json={**body, "prompt": prompt}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    reason = choice["finish_reason"] or reason
                    started[name].set()
        return text, reason

    async def hang_up(client: httpx.AsyncClient, prompt: str) -> int:
        async with client.stream("POST", "/v1/completions", json={**body, "prompt": prompt}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    # All three are generating now; breaking out closes the connection mid-stream.
                    await asyncio.gather(*(e.wait() for e in started.values()))
                    assert idle_server.snapshot().num_running == 3
                    break
        for _ in range(250):  # the server lets go of the request while the others still run
            snap = idle_server.snapshot()
            if snap.num_running == 2:
                return snap.num_running
            await asyncio.sleep(0.02)
        raise AssertionError(f"aborted request still running: {idle_server.snapshot()}")

    async def main():
        async with httpx.AsyncClient(base_url=idle_server.url, trust_env=False, timeout=60) as client:
            hang = asyncio.create_task(hang_up(client, "Once upon a time"))
            others = [asyncio.create_task(keep_reading(client, n, p))
                      for n, p in (("b", "The weather today"), ("c", "In the year 3000"))]
            during = await hang
            return during, await asyncio.gather(*others)

    during, others = asyncio.run(main())
    assert during == 2
    for text, reason in others:
        assert reason == "length" and text  # unaffected: ran to max_tokens
    idle_server.wait_idle()  # and everything is back in the pool
    aborted_after = idle_server.metrics()["agent_infer_requests_finished_total{finish_reason=abort}"]
    assert aborted_after == aborted_before + 1


def test_disconnected_non_streaming_request_is_aborted(idle_server):
    """A client that times out on a long non-streaming request: the server notices the
    disconnect and aborts the request instead of generating 400 tokens for nobody."""
    body = {"model": MODEL_NAME, "prompt": "Count to a thousand:", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True}
    aborted_before = idle_server.metrics().get("agent_infer_requests_finished_total{finish_reason=abort}", 0.0)
    with idle_server.client(timeout=1.0) as c:
        try:
            c.post("/v1/completions", json=body)
            raise AssertionError("expected a timeout")
        except httpx.ReadTimeout:
            pass
    t0 = time.monotonic()
    idle_server.wait_idle(timeout=5)  # 400 tokens would take ~10 s or more
    assert time.monotonic() - t0 < 5
    assert idle_server.metrics()["agent_infer_requests_finished_total{finish_reason=abort}"] == aborted_before + 1
