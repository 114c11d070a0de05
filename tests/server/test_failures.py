"""Overload and failure: a full queue answers 503 + Retry-After; an engine exception fails
the requests in flight with a clean 500 (no internals) and the server keeps serving; a dead
engine makes /health fail."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, running_server

SECRET = "secret-internal-detail-4711"


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
            if predicate(srv.async_engine.snapshot):
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"timed out: {srv.async_engine.snapshot}")

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
                still_running = srv.async_engine.snapshot.num_running
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


class _FailingStep:
    """Replaces LLMEngine.step on one instance: raises on the chosen calls."""

    def __init__(self, engine, fail_on: set[int]):
        self.engine = engine
        self.real = engine.step
        self.fail_on = fail_on
        self.calls = 0

    def __call__(self):
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError(f"CUDA went sideways: {SECRET}")
        return self.real()

    def __enter__(self):
        self.engine.step = self
        return self

    def __exit__(self, *exc):
        del self.engine.step


def test_engine_exception_is_a_clean_500_and_the_server_recovers(idle_server):
    body = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 8, "temperature": 0}
    with idle_server.client() as c:
        ok_before = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        with _FailingStep(idle_server.engine, fail_on={1}):
            r = c.post("/v1/completions", json=body)
        assert r.status_code == 500
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "server_error" and err["code"] == "engine_error"
        assert SECRET not in r.text and "Traceback" not in r.text and "RuntimeError" not in r.text
        idle_server.wait_idle()  # the failed request's blocks were freed
        assert c.get("/health").status_code == 200
        again = c.post("/v1/completions", json=body)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == ok_before


def test_engine_exception_mid_stream_ends_the_stream_with_an_error_event(idle_server):
    body = {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 20, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with idle_server.client() as c:
        with _FailingStep(idle_server.engine, fail_on={4}):
            r = c.post("/v1/completions", json=body)
    assert r.status_code == 200  # headers were sent before the failure
    events = [e[len("data: "):] for e in r.text.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert any(ch.get("choices") and ch["choices"][0]["text"] for ch in chunks)  # tokens came first
    assert chunks[-1]["error"]["code"] == "engine_error"
    assert SECRET not in r.text and "Traceback" not in r.text
    idle_server.wait_idle()


def test_unexpected_exception_in_a_handler_is_a_bare_500(idle_server, monkeypatch):
    serving = idle_server.app.state.serving

    def broken(req):
        raise KeyError(SECRET)

    monkeypatch.setattr(serving, "_completion_prompts", broken)
    with idle_server.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 500
        assert r.json() == {"error": {"message": "internal server error", "type": "server_error", "param": None,
                                      "code": "internal_error"}}
        monkeypatch.undo()
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1}).status_code == 200


def test_unrecoverable_engine_makes_health_fail(default_model_dir):
    """If the engine cannot even abort its requests after a failure, the loop stops:
    in-flight and new requests get 503, /health turns 503."""
    with running_server(default_model_dir, num_kv_blocks=64, max_model_len=256) as srv:
        engine = srv.engine

        def broken_abort(request_id):
            raise RuntimeError(SECRET)

        engine.abort = broken_abort
        with srv.client() as c, _FailingStep(engine, fail_on={1}):
            r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 3})
            assert r.status_code == 500 and SECRET not in r.text
            health = c.get("/health")
            assert health.status_code == 503
            assert SECRET not in health.text and health.json()["error"]["code"] == "engine_unavailable"
            r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 3})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
            assert srv.metrics()["agent_infer_engine_healthy"] == 0.0
