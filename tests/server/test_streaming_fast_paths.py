"""The cheap per-token paths of serving give exactly what the plain ones gave: stream
chunks spliced from a template are the bytes pydantic writes, the Rust-backed incremental
detokenizer gives the Hugging Face wrapper's text, the bulk inter-token histogram exports
what prometheus_client's Histogram does (the core's own handing out of a step's outputs
after the next launch is tested in test_engine_core.py)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from agent_infer.core.metrics import _LATENCY_BUCKETS, _BulkHistogram
from agent_infer.engine.detokenizer import IncrementalDetokenizer, _fast_decoder
from agent_infer.server import protocol as P
from agent_infer.server.serving_chat import ChatView
from agent_infer.server.serving_completions import CompletionView
from tests.server.conftest import MODEL_NAME

TEXTS = ["", "hello", " world", 'say "hi" \\ back/slash', "".join(chr(i) for i in range(0x20)) + "\x7f",
         "Café ☕ naïve 日本語 🙂", "\u2028\u2029\u0085\ufeff", "</script><!--", "\ud7ff\ue000\uffff"]


def _serving(name: str = 'model "quoted" \\ é'):
    return SimpleNamespace(config=SimpleNamespace(served_model_name=name), tokenizer=object())


@pytest.mark.parametrize("text", TEXTS)
def test_completion_text_chunk_is_the_pydantic_chunk(text):
    req = P.CompletionRequest.model_validate({"prompt": "x", "stream": True})
    view = CompletionView(_serving(), req, "cmpl-1", 1700000000, [])
    for k in (0, 3):
        expected = view._chunk(P.CompletionChoice(index=k, text=text))
        assert view._text_chunk(k, text) == expected


@pytest.mark.parametrize("text", [t for t in TEXTS if t])  # an empty delta is never sent as content
def test_chat_text_chunk_is_the_pydantic_chunk(text):
    req = P.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "stream": True})
    view = ChatView(_serving(), req, "chatcmpl-1", 1700000000, [1] * 5, lambda: None)
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
    tok = idle_server.tokenizer
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
    tok = idle_server.tokenizer
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
