"""Server fixtures: the real default model behind our FastAPI app, served by uvicorn in a
thread of the test process on a free port (the socket is bound here to port 0)."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_infer.config import EngineConfig
from agent_infer.engine.async_engine import AsyncEngine, AsyncEngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.server.openai_server import build_app

MODEL_NAME = "smol-test"
# Small context so that overlong prompts are cheap to build; enough blocks that the
# banker's admission never limits concurrency in these tests.
MAX_MODEL_LEN = 512


@dataclass
class ServerHandle:
    url: str  # http://127.0.0.1:PORT
    async_engine: AsyncEngine
    engine: LLMEngine
    app: object

    @property
    def api(self) -> str:
        return self.url + "/v1"

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, trust_env=False, timeout=kwargs.pop("timeout", 60.0), **kwargs)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as {'name{label=value,...}': value}."""
        text = httpx.get(self.url + "/metrics", trust_env=False, timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine tracks no request and holds no KV block."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.async_engine.snapshot
            if s.num_live == 0 and s.num_running == 0 and s.num_waiting == 0 and s.num_used_blocks == 0:
                return
            time.sleep(0.02)
        raise AssertionError(f"engine not idle after {timeout}s: {self.async_engine.snapshot}")


@contextmanager
def serve_app(app):
    """Run `app` on uvicorn in a daemon thread; yields the base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=3))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextmanager
def running_server(model_dir: str, *, max_waiting: int = 512, **engine_kwargs):
    kwargs = dict(device="cpu", dtype="float32", num_kv_blocks=600, max_model_len=MAX_MODEL_LEN, max_num_seqs=32)
    kwargs.update(engine_kwargs)
    engine = LLMEngine(EngineConfig(model=model_dir, **kwargs))
    async_engine = AsyncEngine(engine, AsyncEngineConfig(max_waiting=max_waiting, shutdown_timeout_s=10))
    app = build_app(async_engine, MODEL_NAME)
    with serve_app(app) as url:
        yield ServerHandle(url, async_engine, engine, app)
    assert not async_engine.is_running  # the app's lifespan shut the loop down


@pytest.fixture(scope="session")
def server(default_model_dir):
    with running_server(default_model_dir) as handle:
        yield handle


@pytest.fixture
def idle_server(server):
    """The shared server, checked idle (no request, no KV block in use) before and after."""
    server.wait_idle()
    yield server
    server.wait_idle()


@pytest.fixture
def oai(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)
    yield client
    client.close()
