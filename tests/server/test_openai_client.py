"""The official `openai` Python client against our server: completions and chat,
streaming and not, n > 1, stop strings, include_usage, logprobs, echo, seeds."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME

PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name three fruits."}]


def test_completion_non_streaming(oai, idle_server):
    r = oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL_NAME and r.id.startswith("cmpl-")
    assert r.created > 0
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and c.finish_reason == "length" and c.text.strip()
    prompt_tokens = len(idle_server.tokenizer.encode(PROMPT))
    assert r.usage.prompt_tokens == prompt_tokens
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == prompt_tokens + 12


def test_completion_streaming_matches_non_streaming(oai, idle_server):
    full = oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stream=True))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
    assert len(chunks) > 3  # really streamed, not one blob


def test_streamed_deltas_never_split_a_character(oai, idle_server):
    # Greedy output here is Japanese / emoji, whose characters span several byte-level tokens.
    for prompt in ("In Japanese, hello is こんにちは and thank you is", "Emoji for happy: 😀, emoji for sad:"):
        full = oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
        assert any(ord(ch) > 0x3000 for ch in full)
        chunks = [ch.choices[0].text for ch in oai.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0, stream=True) if ch.choices]
        assert all("\ufffd" not in c for c in chunks)
        assert "".join(chunks) == full
        assert len([c for c in chunks if c]) < 16  # some tokens were held until their character was complete


def test_chat_non_streaming(oai, idle_server):
    r = oai.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 10 and r.usage.prompt_tokens > 5


def test_chat_streaming_shape_and_include_usage(oai, idle_server):
    full = oai.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=10, temperature=0)
    chunks = list(oai.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    first = chunks[0]
    assert first.object == "chat.completion.chunk"
    assert first.choices[0].delta.role == "assistant"  # the first chunk carries the role
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    with_reason = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(with_reason) == 1 and with_reason[0].choices[0].finish_reason == full.choices[0].finish_reason
    usage_chunk = chunks[-1]  # the extra usage chunk comes last, with no choices
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == full.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_stream_ends_with_done_marker(idle_server):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    with idle_server.client() as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.text.split("\n\n") if line.strip()]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_n_choices_with_seed_are_distinct_and_reproducible(oai, idle_server):
    kw = dict(model=MODEL_NAME, prompt="My favourite animal is the", max_tokens=8, temperature=1.0, seed=1234, n=4,
              extra_body={"ignore_eos": True})
    a = oai.completions.create(**kw)
    b = oai.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2, 3]
    texts_a = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    texts_b = [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert texts_a == texts_b  # seeded: reproducible
    assert len(set(texts_a)) > 1  # per-choice seeds differ
    assert a.usage.completion_tokens == 4 * 8
    # Choice 0 uses the request's seed itself: same as n=1 with that seed.
    single = oai.completions.create(**{**kw, "n": 1})
    assert single.choices[0].text == texts_a[0]


def test_seeds_are_int64_and_never_wrap(oai, idle_server):
    """Seeds span int64, negative ones included; n > 1 near the edges wraps within it. A
    seed outside int64 is a 400: it used to wrap (2**63 gave seed 0's text)."""
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True})
    texts = {}
    for seed in (0, -1, 2**63 - 1, -(2**63)):
        r = oai.completions.create(seed=seed, n=2, **kw)
        assert len(r.choices) == 2
        texts[seed] = r.choices[0].text
    assert len(set(texts.values())) == 4
    for seed in (2**63, -(2**63) - 1, 2**70):
        with pytest.raises(openai.BadRequestError) as info:
            oai.completions.create(seed=seed, **kw)
        assert info.value.body["param"] == "seed"


def test_n_choices_streaming_chat(oai, idle_server):
    chunks = list(oai.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=6, temperature=0.8, seed=7, n=3, stream=True,
        stream_options={"include_usage": True}))
    roles = {ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].delta.role == "assistant"}
    assert roles == {0, 1, 2}
    finished = {ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason}
    assert finished == {0, 1, 2}
    texts = {i: "" for i in range(3)}
    for ch in chunks:
        if ch.choices:
            texts[ch.choices[0].index] += ch.choices[0].delta.content or ""
    r = oai.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=6, temperature=0.8, seed=7, n=3)
    assert {c.index: c.message.content for c in r.choices} == texts
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_multiple_prompts_in_one_completion_request(oai, idle_server):
    prompts = ["One, two,", "Red, green,"]
    r = oai.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    singles = [oai.completions.create(model=MODEL_NAME, prompt=p, max_tokens=5, temperature=0).choices[0].text
               for p in prompts]
    assert [c.text for c in r.choices] == [singles[0], singles[0], singles[1], singles[1]]


def test_token_id_prompts(oai, idle_server):
    tok = idle_server.tokenizer
    ids = tok.encode(PROMPT)
    by_ids = oai.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0)
    by_text = oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    both = oai.completions.create(model=MODEL_NAME, prompt=[ids, ids[:-1]], max_tokens=3, temperature=0)
    assert len(both.choices) == 2 and both.usage.prompt_tokens == 2 * len(ids) - 1


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_is_cut_and_never_emitted(oai, idle_server, stream):
    base = oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0).choices[0].text
    words = base.split()
    assert len(words) >= 4, base
    stop = words[2]  # a word from the middle of the greedy text
    expected = base[: base.index(stop)]
    if stream:
        chunks = list(oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0,
                                             stop=[stop, "never-produced-XYZ"], stream=True))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert all(stop not in (ch.choices[0].text if ch.choices else "") for ch in chunks)
    else:
        r = oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=20, temperature=0, stop=stop)
        text, reasons = r.choices[0].text, [r.choices[0].finish_reason]
        assert r.choices[0].model_extra.get("stop_reason") == stop
    assert text == expected
    assert reasons == ["stop"]


def test_chat_stop_string(oai, idle_server):
    base = oai.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=20, temperature=0)
    content = base.choices[0].message.content
    stop = content.split()[1]
    r = oai.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].message.content == content[: content.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_chat_logprobs(oai, idle_server):
    r = oai.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                    top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.logprob <= 0
        # Greedy: the sampled token is the most likely one.
        assert item.token == item.top_logprobs[0].token
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5)
    assert "".join(i.token for i in content) == r.choices[0].message.content


def test_completion_logprobs_streaming_and_not(oai, idle_server):
    r = oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(t) >= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    chunks = list(oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                         stream=True))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert streamed == lp.tokens


def test_echo_prepends_the_prompt(oai, idle_server):
    plain = oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    r = oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text == PROMPT + plain
    chunks = list(oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                         stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == PROMPT + plain


def test_echo_with_logprobs_covers_the_prompt(oai, idle_server, smol_engine):
    """OpenAI's echo + logprobs: the prompt's tokens come first, the first with a null
    logprob, the others with their logprobs given the tokens before them (the engine's
    prompt logprobs), then the completion's; streaming sends the same tokens."""
    from agent_infer.sampling_params import SamplingParams

    r = oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    ids = idle_server.tokenizer.encode(PROMPT)
    n = len(ids)
    assert len(lp.tokens) == n + 4 and r.choices[0].text.startswith(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = smol_engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    assert all(abs(a - b.logprob) < 1e-4 for a, b in zip(lp.token_logprobs[1:n], ref.prompt_logprobs[1:]))
    assert all(len(t) >= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset[n] == len(PROMPT)
    chunks = list(oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                         logprobs=2, stream=True))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text


def test_vllm_style_extra_fields(oai, idle_server):
    # ignore_eos / top_k / repetition_penalty / stop_token_ids travel in extra_body.
    r = oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=7, temperature=0,
                               extra_body={"ignore_eos": True, "top_k": 5, "repetition_penalty": 1.1})
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"
    greedy = oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=7, temperature=0)
    ids = idle_server.tokenizer.encode(greedy.choices[0].text, add_special_tokens=False)
    assert ids[1] != ids[0]
    r2 = oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=7, temperature=0,
                                extra_body={"stop_token_ids": [ids[1]]})
    assert r2.choices[0].finish_reason == "stop"
    assert r2.usage.completion_tokens == 2
    assert r2.choices[0].model_extra.get("stop_reason") == ids[1]


def test_default_max_tokens_runs_to_the_context_length(oai, idle_server):
    tok = idle_server.tokenizer
    ids = (tok.encode(" apple banana cherry") * 200)[: MAX_MODEL_LEN - 6]
    r = oai.completions.create(model=MODEL_NAME, prompt=ids, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"


def test_models_endpoint(oai, idle_server):
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_unknown_model_is_404_through_the_client(oai, idle_server):
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert info.value.body["code"] == "model_not_found"


def test_tokenize_and_detokenize(idle_server):
    tok = idle_server.tokenizer
    with idle_server.client() as c:
        r = c.post("/tokenize", json={"prompt": "Hello world"}).json()
        assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == MAX_MODEL_LEN
        assert c.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
        chat = c.post("/tokenize", json={"messages": CHAT}).json()
        rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        assert chat["tokens"] == tok.encode(rendered, add_special_tokens=False)


def test_health(idle_server):
    r = httpx.get(idle_server.url + "/health", trust_env=False)
    assert r.status_code == 200
