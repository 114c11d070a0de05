"""Behaviour that vLLM's own OpenAI-server tests check, written from those tests: tool
schemas with $defs under tool_choice "required", forced calls cut by max_tokens,
continuous usage stats, cache_salt's isolation of the prefix cache; and fields and
endpoints as vLLM defines them (streamed prompt_token_ids, /tokenize's token_strs, echo
with max_tokens 0, chat echo, any chat role, refusal parts, prompt-logprob ranks,
/version, /ping, /invocations, truncation_side)."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import MODEL_NAME

ASK = [{"role": "user", "content": "What is the weather in Lima?"}]
# A tool whose parameters refer to their own $defs (pydantic writes schemas this way).
DEFS_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "options": {"$ref": "#/$defs/WeatherOptions"}},
    "required": ["city", "options"],
    "$defs": {"WeatherOptions": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                                 "required": ["unit"]}},
}}}
OTHER_DEFS_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/Zone"}}, "required": ["zone"],
    "$defs": {"Zone": {"enum": ["UTC", "CET"]}},
}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tools", [[DEFS_TOOL], [DEFS_TOOL, OTHER_DEFS_TOOL]], ids=["one", "two"])
def test_required_tool_choice_resolves_refs_inside_each_tool(oai, idle_server, tools):
    r = oai.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=tools, tool_choice="required",
                                    temperature=0, max_tokens=80)
    assert r.choices[0].finish_reason == "tool_calls"
    for call in r.choices[0].message.tool_calls:
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert args["options"]["unit"] in ("celsius", "fahrenheit") and isinstance(args["city"], str)
        else:
            assert args == {"zone": args["zone"]} and args["zone"] in ("UTC", "CET")


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_call_cut_by_max_tokens_is_text_not_a_call(oai, idle_server, tool_choice):
    r = oai.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[DEFS_TOOL], tool_choice=tool_choice,
                                    temperature=0, max_completion_tokens=3)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is None
    assert choice.message.content and choice.message.content.lstrip()[0] in "[{"  # the cut JSON, as text
    assert r.usage.completion_tokens == 3
    chunks = list(oai.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[DEFS_TOOL], stream=True,
                                              tool_choice=tool_choice, temperature=0, max_completion_tokens=3))
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["length"]


def _chat_chunks(oai, **stream_options):
    return list(oai.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=5, temperature=0,
                                            stream=True, stream_options=stream_options))


def test_continuous_usage_needs_include_usage_and_covers_every_chunk(oai, idle_server):
    assert all(ch.usage is None for ch in _chat_chunks(oai, continuous_usage_stats=True))
    plain = _chat_chunks(oai, include_usage=True)
    assert all(ch.usage is None for ch in plain[:-1]) and plain[-1].usage.completion_tokens == 5
    chunks = _chat_chunks(oai, include_usage=True, continuous_usage_stats=True)
    assert all(ch.usage is not None for ch in chunks)
    first = chunks[0]
    assert first.choices[0].delta.role == "assistant" and first.usage.completion_tokens == 0
    assert first.usage.prompt_tokens == first.usage.total_tokens > 0
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert counts == sorted(counts) and counts[-1] == 5 and not chunks[-1].choices


def _cached(oai, prompt: str, salt: str | None, endpoint: str = "completions") -> int:
    extra = {"cache_salt": salt} if salt is not None else {}
    if endpoint == "completions":
        r = oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens
    if endpoint == "chat":
        r = oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                        max_tokens=1, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens
    r = oai.responses.create(model=MODEL_NAME, input=prompt, max_output_tokens=1, store=False, extra_body=extra)
    return r.usage.input_tokens_details.cached_tokens


@pytest.mark.parametrize("endpoint", ["completions", "chat", "responses"])
def test_cache_salt_keeps_prefixes_apart(oai, idle_server, endpoint):
    prompt = f"A {endpoint} preamble about lighthouses, their keepers, lenses and storms. " * 5
    assert _cached(oai, prompt, f"{endpoint}-a", endpoint) == 0
    full = _cached(oai, prompt, f"{endpoint}-a", endpoint)  # same salt: every full block of the prompt is shared
    assert full >= 4 * idle_server.core.info.block_size
    assert _cached(oai, prompt, f"{endpoint}-b", endpoint) == 0  # another salt: nothing, not even the first block
    # Unsalted requests share only with each other (other tests' chats left the chat
    # template's opening in the cache, but nothing of this prompt).
    assert _cached(oai, prompt, None, endpoint) <= full - 3 * idle_server.core.info.block_size
    assert _cached(oai, prompt, None, endpoint) == full
    assert _cached(oai, prompt, f"{endpoint}-b", endpoint) == full


# ---- fields and endpoints as vLLM defines them -------------------------------------------

PROMPT = "The capital of France is"


def _events(client, path: str, body: dict) -> list[dict]:
    """The JSON events of a stream (without [DONE])."""
    r = client.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]


def test_streamed_completion_sends_prompt_token_ids_in_each_choices_first_chunk(idle_server):
    ids = idle_server.tokenizer.encode(PROMPT)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 5,
            "ignore_eos": True, "return_token_ids": True}
    with idle_server.client() as c:
        whole = c.post("/v1/completions", json=body).json()
        events = _events(c, "/v1/completions", body)
    for k in range(2):
        chunks = [ch for e in events for ch in e["choices"] if ch["index"] == k]
        assert chunks[0]["prompt_token_ids"] == ids
        assert all("prompt_token_ids" not in ch for ch in chunks[1:])
        assert all(isinstance(ch["token_ids"], list) for ch in chunks)  # every chunk, even one with no new id
        assert [t for ch in chunks for t in ch["token_ids"]] == whole["choices"][k]["token_ids"]


def test_streamed_chat_sends_prompt_token_ids_with_each_role_chunk(idle_server):
    body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 5,
            "ignore_eos": True, "return_token_ids": True}
    with idle_server.client() as c:
        whole = c.post("/v1/chat/completions", json=body).json()
        events = _events(c, "/v1/chat/completions", body)
    with_ids = [e for e in events if "prompt_token_ids" in e]
    assert [e["choices"][0]["delta"].get("role") for e in with_ids] == ["assistant", "assistant"]
    assert sorted(e["choices"][0]["index"] for e in with_ids) == [0, 1]
    assert all(e["prompt_token_ids"] == whole["prompt_token_ids"] for e in with_ids)
    for k in range(2):
        later = [ch for e in events if "prompt_token_ids" not in e for ch in e["choices"] if ch["index"] == k]
        assert all(isinstance(ch["token_ids"], list) for ch in later)
        assert [t for ch in later for t in ch["token_ids"]] == whole["choices"][k]["token_ids"]


def test_tokenize_token_strs(idle_server):
    tok = idle_server.tokenizer
    with idle_server.client() as c:
        plain = c.post("/tokenize", json={"prompt": "Hello world, café"}).json()
        strs = c.post("/tokenize", json={"prompt": "Hello world, café", "return_token_strs": True}).json()
        chat = c.post("/tokenize", json={"messages": ASK, "return_token_strs": True}).json()
    assert "token_strs" in plain and plain["token_strs"] is None  # present, null, as in vLLM
    assert strs["token_strs"] == tok.convert_ids_to_tokens(strs["tokens"]) and len(strs["token_strs"]) == strs["count"]
    assert chat["token_strs"] == tok.convert_ids_to_tokens(chat["tokens"])


def test_echo_with_max_tokens_zero_returns_the_scored_prompt(oai, idle_server):
    """Prompt-only scoring (eval harnesses): the prompt back with its logprobs (the first
    null), nothing generated; the same logprobs as the prompt part of echo with a token."""
    n = len(idle_server.tokenizer.encode(PROMPT))
    r = oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == n
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == n and lp.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    longer = oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1)
    assert lp.tokens == longer.choices[0].logprobs.tokens[:n]
    assert lp.token_logprobs[1:] == pytest.approx(longer.choices[0].logprobs.token_logprobs[1:n], abs=1e-5)
    chunks = list(oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                         stream=True))
    assert "".join(c.text for ch in chunks for c in ch.choices) == PROMPT
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["length"]
    assert [t for ch in chunks for c in ch.choices if c.logprobs for t in c.logprobs.tokens] == lp.tokens
    bare = oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True)
    assert bare.choices[0].text == PROMPT and bare.choices[0].logprobs is None


PREFILL = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite colour is"}]


def test_chat_echo_starts_the_content_with_the_assistant_prefill(oai, idle_server):
    kw = dict(model=MODEL_NAME, messages=PREFILL, max_tokens=5, temperature=0,
              extra_body={"continue_final_message": True, "add_generation_prompt": False})
    plain = oai.chat.completions.create(**kw).choices[0].message.content
    kw["extra_body"]["echo"] = True
    echoed = oai.chat.completions.create(**kw).choices[0].message.content
    assert echoed == PREFILL[-1]["content"] + plain
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    contents = [c.delta.content for ch in chunks for c in ch.choices if c.delta.content]
    assert contents[0] == PREFILL[-1]["content"]  # the echo goes first, as a chunk of its own
    assert "".join(contents) == echoed
    # After a user message echo adds nothing.
    after_user = dict(model=MODEL_NAME, messages=ASK, max_tokens=5, temperature=0)
    assert oai.chat.completions.create(**after_user, extra_body={"echo": True}).choices[0].message.content == \
        oai.chat.completions.create(**after_user).choices[0].message.content


def test_any_role_reaches_the_template(oai, idle_server):
    """A role the API does not know goes to the template as it is; the legacy `function`
    role (a function's result) is rendered as a tool message where the template does not
    handle it."""
    messages = [{"role": "user", "content": "What is 6 times 7?"},
                {"role": "function", "name": "multiply", "content": "42"},
                {"role": "narrator", "content": "The assistant answers."}]
    r = oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=3)
    assert r.choices[0].finish_reason in ("length", "stop")
    with idle_server.client() as c:
        tokens = c.post("/tokenize", json={"messages": messages}).json()["tokens"]
    text = idle_server.tokenizer.decode(tokens)
    assert "<|im_start|>tool\n42<|im_end|>" in text and "<|im_start|>narrator\nThe assistant answers." in text


def test_function_role_is_kept_for_templates_that_know_it():
    from agent_infer.server.protocol import ChatMessage
    from agent_infer.server.serving import knows_function_role

    assert knows_function_role("{% if message['role'] == 'function' %}{{ message.content }}{% endif %}")
    assert knows_function_role('{% if m.role in ["tool", "function"] %}')
    assert not knows_function_role("{{ m.tool_calls[0].function.name }}{% if m.role == 'tool' %}{% endif %}")
    msg = ChatMessage.model_validate({"role": "function", "name": "f", "content": "1"})
    assert msg.as_template_message(function_as_tool=True) == {"role": "tool", "content": "1", "name": "f"}
    assert msg.as_template_message()["role"] == "function"


def test_assistant_refusal_parts_are_rendered_as_content(oai, idle_server):
    messages = [{"role": "user", "content": "Tell me a secret."},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot share that."}]},
                {"role": "user", "content": "Then a joke."}]
    assert oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2).choices
    with idle_server.client() as c:
        tokens = c.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert "<|im_start|>assistant\nI cannot share that.<|im_end|>" in idle_server.tokenizer.decode(tokens)


def _prompt_logprobs(client, k: int) -> list:
    r = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT + " Paris, and", "max_tokens": 1,
                                             "prompt_logprobs": k})
    return r.json()["choices"][0]["prompt_logprobs"]


def test_prompt_logprobs_give_every_entry_its_rank(idle_server):
    """Each entry is {logprob, rank, decoded_token}; the prompt token's rank is its real
    one, also when it is not among the top-k (always, for prompt_logprobs=0)."""
    ids = idle_server.tokenizer.encode(PROMPT + " Paris, and")
    with idle_server.client() as c:
        bare, top = _prompt_logprobs(c, 0), _prompt_logprobs(c, 5)
    assert bare[0] is None and top[0] is None
    beyond_top = 0
    for i, (entry, full) in enumerate(zip(bare[1:], top[1:]), start=1):
        (token, only), = entry.items()
        assert token == str(ids[i]) and set(only) == {"logprob", "rank", "decoded_token"}
        assert full[token]["rank"] == only["rank"] >= 1
        others = [e for t, e in full.items() if t != token]
        if only["rank"] <= 5:  # among the top 5, at its place
            assert sorted(e["rank"] for e in full.values()) == [1, 2, 3, 4, 5]
        else:  # below all of them
            beyond_top += 1
            assert sorted(e["rank"] for e in others) == [1, 2, 3, 4, 5]
            assert only["logprob"] < min(e["logprob"] for e in others)
    assert beyond_top  # some prompt token lies outside its top 5: its rank came from the engine


def test_version_ping_and_invocations(idle_server):
    from agent_infer import __version__

    with idle_server.client() as c:
        assert c.get("/version").json() == {"version": __version__}
        assert c.get("/ping").status_code == 200 and c.post("/ping").status_code == 200
        chat = c.post("/invocations", json={"messages": ASK, "max_tokens": 2}).json()
        assert chat["object"] == "chat.completion"
        completion = c.post("/invocations", json={"prompt": PROMPT, "max_tokens": 2}).json()
        assert completion["object"] == "text_completion"
        response = c.post("/invocations", json={"input": PROMPT, "max_output_tokens": 2, "store": False}).json()
        assert response["object"] == "response"
        bad = c.post("/invocations", json={"max_tokens": 2})
        assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": ASK, "top_logprobs": 0}),  # no logprobs: 0 more asks for nothing
    ("/v1/completions", {"prompt": PROMPT, "stream_options": {}}),  # no stream: an empty object asks for nothing
], ids=["top_logprobs-0", "empty-stream_options"])
def test_values_that_ask_for_nothing_are_accepted(idle_server, path, body):
    with idle_server.client() as c:
        r = c.post(path, json={"model": MODEL_NAME, "max_tokens": 2, **body})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_counts_each_choices_own_tokens(idle_server, endpoint):
    body = {"model": MODEL_NAME, "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 3, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update({"prompt": PROMPT} if endpoint == "completions" else {"messages": ASK})
    with idle_server.client() as c:
        events = _events(c, f"/v1/{'completions' if endpoint == 'completions' else 'chat/completions'}", body)
    for k in range(2):
        counts = [e["usage"]["completion_tokens"] for e in events if e["choices"] and e["choices"][0]["index"] == k]
        assert counts == sorted(counts) and counts[-1] == 4  # this choice's tokens, not both choices'
    assert events[-1]["usage"]["completion_tokens"] == 8 and not events[-1]["choices"]  # the final chunk: totals


def test_truncation_side_right_keeps_the_first_tokens(idle_server):
    ids = idle_server.tokenizer.encode(PROMPT + " Paris, and the capital of Spain is")
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 4,
            "return_token_ids": True}
    with idle_server.client() as c:
        right = c.post("/v1/completions", json={**body, "truncation_side": "right"}).json()
        left = c.post("/v1/completions", json={**body, "truncation_side": "left"}).json()
        chat = c.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": ASK, "max_tokens": 1,
                                                    "truncate_prompt_tokens": 4, "truncation_side": "right",
                                                    "return_token_ids": True}).json()
        rendered = c.post("/tokenize", json={"messages": ASK}).json()["tokens"]
    assert right["choices"][0]["prompt_token_ids"] == ids[:4]
    assert left["choices"][0]["prompt_token_ids"] == ids[-4:]
    assert chat["prompt_token_ids"] == rendered[:4]
