"""Overload and failure: a full queue answers 503 + Retry-After; an engine exception fails
the requests in flight with a clean 500 (no internals) and the server keeps serving; an
engine core that cannot recover stops, and /health fails."""

from __future__ import annotations

import asyncio
import functools
import json
import time

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, running_server
from tests.server.faults import SECRET, failing_engine


@pytest.fixture(scope="module")
def tiny_queue_server(default_model_dir):
    """One request runs at a time and one may wait: the third is refused."""
    with running_server(default_model_dir, max_waiting=1, max_num_seqs=1) as handle:
        yield handle


def test_queue_full_is_503_with_retry_after(tiny_queue_server):
    srv = tiny_queue_server
    long_body = {"model": MODEL_NAME, "prompt": "Tell me a story", "max_tokens": 300, "ignore_eos": True,
                 "temperature": 0, "stream": True}
    short_body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "temperature": 0}

    async def wait_for(predicate, timeout: float = 20.0) -> None:
        for _ in range(int(timeout / 0.02)):
            if predicate(await asyncio.to_thread(srv.snapshot)):
                return
            await asyncio.sleep(0.02)
        raise AssertionError("timed out")

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, trust_env=False, timeout=60) as client:
            async with client.stream("POST", "/v1/completions", json=long_body) as running:
                generating = asyncio.Event()

                async def read_all() -> None:  # keep A's stream drained while we test
                    async for line in running.aiter_lines():
                        if line.startswith("data: {"):
                            generating.set()

                reader = asyncio.create_task(read_all())
                await generating.wait()  # A is generating; B will have to wait
                waiting = asyncio.create_task(client.post("/v1/completions", json=short_body))
                await wait_for(lambda s: s.num_waiting == 1)
                refused = await client.post("/v1/completions", json=short_body)
                refused_n = await client.post("/v1/chat/completions", json={
                    "model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
                health = await client.get("/health")
                still_running = (await asyncio.to_thread(srv.snapshot)).num_running
                reader.cancel()
            # A's connection is closed: it is aborted, and B gets its turn.
            waited = await waiting
            after = await client.post("/v1/completions", json=short_body)
            return refused, refused_n, health, waited, after, still_running

    refused, refused_n, health, waited, after, still_running = asyncio.run(main())
    assert still_running == 1  # A was generating the whole time
    for r in (refused, refused_n):
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == "queue_full" and err["type"] == "server_error"
        assert "limit is 1" in err["message"]
    assert health.status_code == 200
    assert waited.status_code == 200 and waited.json()["usage"]["completion_tokens"] == 2
    assert after.status_code == 200
    srv.wait_idle()
    assert srv.metrics()["agent_infer_http_errors_total{status=503}"] == 2


def test_more_choices_than_the_queue_can_ever_hold_is_400(tiny_queue_server):
    with tiny_queue_server.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


FAIL_AT_ONCE = (7, 77, 777, 17)  # a request with this prompt makes the step fail at once
FAIL_MID_STREAM = (8, 88, 888, 18)  # ... after 4 tokens


@pytest.fixture(scope="module")
def failing_server(default_model_dir):
    factory = functools.partial(failing_engine, fail_at={FAIL_AT_ONCE: 0, FAIL_MID_STREAM: 4})
    with running_server(default_model_dir, engine_factory=factory) as handle:
        yield handle


def test_engine_exception_is_a_clean_500_and_the_server_recovers(failing_server):
    body = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 8, "temperature": 0}
    with failing_server.client() as c:
        ok_before = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        r = c.post("/v1/completions", json={**body, "prompt": list(FAIL_AT_ONCE)})
        assert r.status_code == 500
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "server_error" and err["code"] == "engine_error"
        assert SECRET not in r.text and "Traceback" not in r.text and "RuntimeError" not in r.text
        failing_server.wait_idle()  # the failed request's blocks were freed
        assert c.get("/health").status_code == 200
        again = c.post("/v1/completions", json=body)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == ok_before


def test_engine_exception_mid_stream_ends_the_stream_with_an_error_event(failing_server):
    body = {"model": MODEL_NAME, "prompt": list(FAIL_MID_STREAM), "max_tokens": 20, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with failing_server.client() as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200  # headers were sent before the failure
    events = [e[len("data: "):] for e in r.text.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert any(ch.get("choices") and ch["choices"][0]["text"] for ch in chunks)  # tokens came first
    assert chunks[-1]["error"]["code"] == "engine_error"
    assert SECRET not in r.text and "Traceback" not in r.text
    failing_server.wait_idle()


def test_unexpected_exception_in_a_handler_is_a_bare_500(idle_server, monkeypatch):
    serving = idle_server.app.state.completions

    def broken(req):
        raise KeyError(SECRET)

    monkeypatch.setattr(serving, "_prompts", broken)
    with idle_server.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 500
        assert r.json() == {"error": {"message": "internal server error", "type": "server_error", "param": None,
                                      "code": "internal_error"}}
        monkeypatch.undo()
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1}).status_code == 200


def test_unrecoverable_engine_makes_health_fail(default_model_dir):
    """If the engine cannot even abort its requests after a failure, the core stops: the
    request in flight gets a 500, then /health and new requests get 503 and the metrics
    say the engine is down."""
    factory = functools.partial(failing_engine, fail_at={FAIL_AT_ONCE: 0}, break_abort=True)
    with running_server(default_model_dir, engine_factory=factory, num_kv_blocks=64, max_model_len=256) as srv:
        with srv.client() as c:
            r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": list(FAIL_AT_ONCE), "max_tokens": 3})
            assert r.status_code == 500 and SECRET not in r.text
            deadline = time.monotonic() + 5
            while (health := c.get("/health")).status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert health.status_code == 503
            assert SECRET not in health.text and health.json()["error"]["code"] == "engine_unavailable"
            r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 3})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
            assert srv.metrics()["agent_infer_engine_healthy"] == 0.0
        assert srv.core.proc.wait(10) == 1  # the core exited, saying it failed
