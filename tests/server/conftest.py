"""Server fixtures: the real default model in an engine-core process of its own, and our
front-end app served by uvicorn in a thread of the test process on a free port (so tests
can look at the front end's objects; `tests/server/test_lifecycle.py` runs the whole
`agent-infer serve` process tree instead)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from agent_infer.config import EngineConfig
from agent_infer.core.config import CoreConfig
from agent_infer.core.process import CoreProcess
from agent_infer.core.protocol import EngineSnapshot
from agent_infer.server.app import FrontEndSpec, build_front_end
from agent_infer.server.serving import ServerConfig
from agent_infer.server.text_workers import TextLimits

MODEL_NAME = "smol-test"
# Small context so that overlong prompts are cheap to build; enough blocks that the
# banker's admission never limits concurrency in these tests.
MAX_MODEL_LEN = 512


class _Uvicorn(uvicorn.Server):
    """uvicorn that remembers its event loop (the front end's client lives there)."""

    loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None):
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def run_in_loop(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@dataclass
class ServerHandle:
    url: str  # http://127.0.0.1:PORT
    core: CoreProcess
    app: object
    uvicorn: _Uvicorn

    @property
    def api(self) -> str:
        return self.url + "/v1"

    @property
    def tokenizer(self):
        return self.app.state.client.tokenizer

    @property
    def front_end_client(self):
        return self.app.state.client

    def snapshot(self) -> EngineSnapshot:
        """The core's state now (asked over the same socket the front end uses)."""
        return self.uvicorn.run_in_loop(self.front_end_client.snapshot())

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, trust_env=False, timeout=kwargs.pop("timeout", 60.0), **kwargs)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as {'name{label=value,...}': value}."""
        return parse_metrics(httpx.get(self.url + "/metrics", trust_env=False, timeout=10).text)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the core tracks no request and holds no KV block, and the front end has
        nothing in flight."""
        deadline = time.monotonic() + timeout
        s = None
        while time.monotonic() < deadline:
            s = self.snapshot()
            if (s.num_live == 0 and s.num_running == 0 and s.num_waiting == 0 and s.num_used_blocks == 0
                    and self.front_end_client.num_in_flight == 0):
                return
            time.sleep(0.02)
        raise AssertionError(f"engine not idle after {timeout}s: {s}")


def process_state(pid: int) -> str:
    """A process's state letter from /proc ("R", "S", "T" stopped, "Z" zombie...), or
    "gone"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


@contextmanager
def serve_app(app):
    """Run `app` on uvicorn in a daemon thread; yields (base URL, the _Uvicorn)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = runner = _Uvicorn(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=3))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", runner
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def engine_config(model_dir: str, **engine_kwargs) -> EngineConfig:
    kwargs = dict(device="cpu", dtype="float32", num_kv_blocks=600, max_model_len=MAX_MODEL_LEN, max_num_seqs=32)
    kwargs.update(engine_kwargs)
    return EngineConfig(model=model_dir, **kwargs)


@contextmanager
def running_server(model_dir: str, *, max_waiting: int = 512, engine_factory=None,
                   trust_request_chat_template: bool = False, limits: TextLimits | None = None, **engine_kwargs):
    core = CoreProcess.start(engine_config(model_dir, **engine_kwargs), CoreConfig(max_waiting=max_waiting),
                             engine_factory=engine_factory, log_level="warning")
    try:
        config = ServerConfig(MODEL_NAME, trust_request_chat_template=trust_request_chat_template)
        # One text worker: no test here holds one with a slow template (test_lifecycle.py does).
        spec = FrontEndSpec(core.info, core.address, config, text_workers=1, limits=limits or TextLimits())
        app = build_front_end(spec)
        with serve_app(app) as (url, runner):
            yield ServerHandle(url, core, app, runner)
    finally:
        core.stop(timeout_s=10)


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
