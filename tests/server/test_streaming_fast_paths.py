"""The cheap per-token paths of serving give exactly what the plain ones gave: stream
chunks spliced from a template are the bytes pydantic writes, the Rust-backed incremental
detokenizer gives the Hugging Face wrapper's text, the bulk inter-token histogram exports
what prometheus_client's Histogram does, and the engine thread hands a step's outputs to
the event loop only after launching the next step, without ever leaving one behind."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from agent_infer.config import EngineConfig
from agent_infer.engine.async_engine import (
    AsyncEngine,
    AsyncEngineConfig,
    EngineRequest,
)
from agent_infer.engine.detokenizer import IncrementalDetokenizer, _fast_decoder
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.sampling_params import SamplingParams
from agent_infer.server import protocol as P
from agent_infer.server.metrics import _LATENCY_BUCKETS, _BulkHistogram
from agent_infer.server.openai_server import _ChatView, _CompletionView
from tests.server.conftest import MODEL_NAME

TEXTS = ["", "hello", " world", 'say "hi" \\ back/slash', "".join(chr(i) for i in range(0x20)) + "\x7f",
         "Café ☕ naïve 日本語 🙂", "\u2028\u2029\u0085\ufeff", "</script><!--", "\ud7ff\ue000\uffff"]


def _serving(name: str = 'model "quoted" \\ é'):
    return SimpleNamespace(config=SimpleNamespace(served_model_name=name), tokenizer=object())


@pytest.mark.parametrize("text", TEXTS)
def test_completion_text_chunk_is_the_pydantic_chunk(text):
    req = P.CompletionRequest.model_validate({"prompt": "x", "stream": True})
    view = _CompletionView(_serving(), req, "cmpl-1", 1700000000, [])
    for k in (0, 3):
        expected = view._chunk(P.CompletionChoice(index=k, text=text))
        assert view._text_chunk(k, text) == expected


@pytest.mark.parametrize("text", [t for t in TEXTS if t])  # an empty delta is never sent as content
def test_chat_text_chunk_is_the_pydantic_chunk(text):
    req = P.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "stream": True})
    view = _ChatView(_serving(), req, "chatcmpl-1", 1700000000, [1] * 5, lambda: None)
    for k in (0, 2):
        expected = view._chunk(P.ChatChunkChoice(index=k, delta=P.ChatDelta(content=text)))
        assert view._text_chunk(k, text) == expected


def _events(text: str) -> list[str]:
    return [e[len("data: "):] for e in text.split("\n\n") if e.strip()]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streamed_chunks_are_byte_for_byte_the_models(idle_server, endpoint):
    """Every chunk the server streams re-serialises to the same bytes through its model."""
    body = {"model": MODEL_NAME, "max_tokens": 24, "temperature": 0, "stream": True, "n": 2, "seed": 1,
            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "Say something in French and Japanese."}]
        model = P.ChatCompletionChunk
    else:
        body["prompt"] = "Emoji and quotes: \"😀\" and"
        model = P.CompletionChunk
    with idle_server.client() as c:
        r = c.post(f"/v1/{endpoint}" if endpoint == "completions" else "/v1/chat/completions", json=body)
    assert r.status_code == 200
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) > 6
    for raw in chunks:
        assert model.model_validate_json(raw).model_dump_json() == raw
    assert json.loads(chunks[-1])["usage"]["completion_tokens"] > 0


class _WrapperOnly:
    """The HF tokenizer without its Rust backend: forces the wrapper's decode."""

    def __init__(self, tok):
        self.decode = tok.decode


def _deltas(tok, prompt, ids, skip_special_tokens=True, stop=None):
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens, stop=stop)
    out = []
    for i, t in enumerate(ids):
        hit = d.add_token(t)
        out.append(d.take_delta(hit is not None or i == len(ids) - 1))
        if hit:
            break
    return out, d.text


def test_fast_detokenizer_gives_the_wrappers_text(idle_server):
    tok = idle_server.engine.tokenizer
    assert _fast_decoder(tok) is not None  # the default model's tokenizer takes the fast path
    slow = _WrapperOnly(tok)
    assert _fast_decoder(slow) is None
    rng = random.Random(0)
    vocab = len(tok)
    special = sorted(tok.all_special_ids)
    cases = [(tok.encode("Hi there"), tok.encode(" Café ☕ naïve 日本語 🙂 done <|im_end|> ok"))]
    for _ in range(30):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        ids = [rng.choice(special) if rng.random() < 0.05 else rng.randrange(vocab) for _ in range(40)]
        cases.append((prompt, ids))
    for prompt, ids in cases:
        for skip in (True, False):
            assert _deltas(tok, prompt, ids, skip) == _deltas(slow, prompt, ids, skip)
        assert _deltas(tok, prompt, ids, stop=["e", "🙂"]) == _deltas(slow, prompt, ids, stop=["e", "🙂"])


def test_fast_detokenizer_only_without_space_clean_up(idle_server):
    tok = idle_server.engine.tokenizer
    cleaning = SimpleNamespace(backend_tokenizer=tok.backend_tokenizer, clean_up_tokenization_spaces=True,
                               decode=tok.decode)
    assert _fast_decoder(cleaning) is None


def test_bulk_histogram_exports_what_a_histogram_does():
    reg_a, reg_b = CollectorRegistry(), CollectorRegistry()
    hist = Histogram("x_seconds", "doc", buckets=_LATENCY_BUCKETS, registry=reg_a)
    bulk = _BulkHistogram("x_seconds", "doc", _LATENCY_BUCKETS)
    reg_b.register(bulk)
    rng = random.Random(1)
    values = [rng.choice(_LATENCY_BUCKETS) for _ in range(200)] + [rng.random() for _ in range(200)] + [0.0, 1e9]
    for v in values:
        hist.observe(v)
    bulk.observe_many(values[:150])
    bulk.observe_many(values[150:])
    a = [line for line in generate_latest(reg_a).decode().splitlines() if "_created" not in line]
    assert generate_latest(reg_b).decode().splitlines() == a


class _LaunchRecorder:
    """Wraps the engine's model runner: records, as each launch starts, how many outputs
    the engine thread had handed to the event loop so far."""

    def __init__(self, runner, posted: list):
        self.runner, self.posted, self.posted_at_launch = runner, posted, []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def launch(self, *args, **kwargs):
        self.posted_at_launch.append(len(self.posted))
        return self.runner.launch(*args, **kwargs)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_outputs_go_out_after_the_next_launch_and_none_stay_behind(default_model_dir, async_scheduling):
    engine = LLMEngine(EngineConfig(model=default_model_dir, device="cpu", dtype="float32", num_kv_blocks=64,
                                    max_model_len=256, max_num_seqs=2, async_scheduling=async_scheduling))
    posted: list = []
    recorder = _LaunchRecorder(engine.runner, posted)
    engine.runner = recorder
    ae = AsyncEngine(engine, AsyncEngineConfig(max_waiting=4))
    post = ae._post

    def counting_post(items):
        posted.extend(items)
        post(items)

    ae._post = counting_post
    ae.start()
    try:
        async def main():
            ids = ae.tokenizer.encode("Count: one, two,")
            outs = []
            for max_tokens in (6, 2):  # the second after the engine went idle: nothing stays behind
                group = ae.submit([EngineRequest(ids, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                     ignore_eos=True))])
                async with group:
                    outs.append([out async for _, out in group])
            return outs

        first, second = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        ae.shutdown()
    assert [len(o.delta_token_ids) for o in first] == [1] * 6 and first[-1].finished
    assert second[-1].finished and len(second[-1].token_ids) == 2
    # Step k's tokens are read back after launch k + 1 (async) or launch k (sync) and are
    # handed out only once the following launch is queued: never while the engine thread
    # still has a launch to make.
    lag = 2 if async_scheduling else 1
    launches = recorder.posted_at_launch[:6]
    assert launches == [max(0, k - lag) for k in range(len(launches))]


def test_switch_interval_flag_is_applied_when_serving(default_model_dir, monkeypatch):
    import uvicorn

    from tests.server.test_serve_cli import _parse

    seen = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: seen.append(sys.getswitchinterval()))
    args = _parse("--model", default_model_dir, "--port", "0", "--device", "cpu", "--dtype", "float32",
                  "--max-model-len", "256", "--kv-cache-gib", "0.05", "--switch-interval-ms", "0.5")
    before = sys.getswitchinterval()
    try:
        assert args.handler(args) == 0
    finally:
        sys.setswitchinterval(before)
    assert seen == [pytest.approx(0.0005)]


def test_switch_interval_must_be_positive():
    from agent_infer.server.cli import cmd_serve
    from tests.server.test_serve_cli import _parse

    with pytest.raises(ValueError, match="switch"):
        cmd_serve(_parse("--switch-interval-ms", "0"))
