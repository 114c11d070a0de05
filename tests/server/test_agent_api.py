"""The agent API through the official `openai` client on the default model: structured
outputs (json_schema strict, json_object, choice, regex, grammar), tool calling (named,
required, streamed, none, a conversation with a tool result), and one test per field
clients send (logit_bias, min_tokens, prompt_logprobs, return_tokens_as_token_ids,
allowed_token_ids, truncate_prompt_tokens, continue_final_message, continuous usage,
cached tokens, models.retrieve, the default max_tokens)."""

from __future__ import annotations

import json
import re

import openai
import pydantic
import pytest

from tests.server.conftest import MODEL_NAME

ASK = [{"role": "user", "content": "Describe a person: their name, age and home city."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
    },
    "required": ["name", "age", "city"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}  # no parameters


def _is_person(obj) -> bool:
    return (set(obj) == {"name", "age", "city"} and isinstance(obj["name"], str) and len(obj["name"]) <= 24
            and isinstance(obj["age"], int) and 0 <= obj["age"] <= 120 and obj["city"] in ("Paris", "Tokyo", "Lima"))


def _is_weather_args(args: dict) -> bool:
    return set(args) == {"city", "unit"} and isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit")


# ---- structured outputs --------------------------------------------------------------------


def test_json_schema_strict(oai, idle_server):
    r = oai.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"  # the grammar completed: no EOS needed, nothing cut
    assert _is_person(json.loads(choice.message.content))  # strict: no property beyond the schema's


def test_json_schema_sampled_n_and_streamed(oai, idle_server):
    """Sampling (n = 3, seeded) and streaming keep the constraint; a stream reassembles
    into the non-streamed text."""
    kw = dict(model=MODEL_NAME, messages=ASK, max_tokens=60, temperature=1.0, seed=11, n=3,
              response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}})
    r = oai.chat.completions.create(**kw)
    texts = {c.index: c.message.content for c in r.choices}
    assert all(_is_person(json.loads(t)) for t in texts.values())
    streamed = {i: "" for i in range(3)}
    for ch in oai.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts


def test_json_object(oai, idle_server):
    r = oai.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=80, temperature=0,
                                    response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_parse_with_a_pydantic_model(oai, idle_server):
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=24)
        age: int = pydantic.Field(ge=0, le=120)

    r = oai.chat.completions.parse(model=MODEL_NAME, messages=ASK, max_tokens=60, temperature=0,
                                   response_format=Person)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_choice_and_regex(oai, idle_server, endpoint):
    options = ["yes", "no", "it depends"]
    pattern = r"\d{3}-\d{4}"
    for constraint, check in (({"choice": options}, lambda t: t in options),
                              ({"regex": pattern}, lambda t: re.fullmatch(pattern, t) is not None)):
        extra = {"structured_outputs": constraint}
        if endpoint == "chat":
            r = oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Well?"}],
                                            max_tokens=12, temperature=0, extra_body=extra)
            text = r.choices[0].message.content
        else:
            text = oai.completions.create(model=MODEL_NAME, prompt="Answer:", max_tokens=12, temperature=0,
                                          extra_body=extra).choices[0].text
        assert check(text), (constraint, text)


def test_grammar_and_legacy_guided_fields(oai, idle_server):
    gbnf = 'root ::= "color: " ("red" | "green" | "blue")'
    r = oai.completions.create(model=MODEL_NAME, prompt="Pick one.", max_tokens=8, temperature=0,
                               extra_body={"structured_outputs": {"grammar": gbnf}})
    assert r.choices[0].text in ("color: red", "color: green", "color: blue")
    r = oai.completions.create(model=MODEL_NAME, prompt="Pick one.", max_tokens=8, temperature=0,
                               extra_body={"guided_choice": ["up", "down"]})
    assert r.choices[0].text in ("up", "down")


def test_constraints_stop_strings_and_unconstrained_neighbours(oai, idle_server):
    """A stop string still cuts constrained text; the server keeps serving plain requests."""
    r = oai.completions.create(model=MODEL_NAME, prompt="Number:", max_tokens=12, temperature=0, stop=["-"],
                               extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    plain = oai.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=5, temperature=0)
    assert plain.choices[0].finish_reason == "length"


# ---- tool calling ----------------------------------------------------------------------------


def test_named_tool_choice(oai, idle_server):
    r = oai.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Lima?"}], max_tokens=40, temperature=0,
        tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_") and call.type == "function"
    assert _is_weather_args(json.loads(call.function.arguments))


def test_required_tool_choice_and_parameterless_tool(oai, idle_server):
    r = oai.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "What time is it?"}], max_tokens=60, temperature=0,
        tools=[CLOCK, WEATHER], tool_choice="required", parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    args = json.loads(calls[0].function.arguments)
    if calls[0].function.name == "get_time":
        assert args == {}  # a parameterless tool takes exactly {}
    else:
        assert _is_weather_args(args)
    only_clock = oai.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Time?"}], max_tokens=30, temperature=0,
        tools=[CLOCK], tool_choice="required")
    calls = only_clock.choices[0].message.tool_calls
    assert calls and all((c.function.name, c.function.arguments) == ("get_time", "{}") for c in calls)
    assert len({c.id for c in calls}) == len(calls)  # parallel calls are allowed here, each with its id


def test_streamed_tool_call_reassembles(oai, idle_server):
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=60,
              temperature=0, tools=[WEATHER], tool_choice="required")
    full = oai.chat.completions.create(**kw).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = []
    arg_chunks = 0
    for ch in oai.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            finish.append(c.finish_reason)
            for d in c.delta.tool_calls or []:
                if d.index not in calls:  # the first delta of a call carries its id and name
                    assert d.id and d.function.name and d.type == "function"
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and not d.function.name
                if d.function.arguments:
                    calls[d.index]["arguments"] += d.function.arguments
                    arg_chunks += 1
    assert [c for c in finish if c] == ["tool_calls"]
    assert arg_chunks > 1  # the arguments came in fragments
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in full]
    assert all(_is_weather_args(json.loads(c["arguments"])) for c in calls.values())


def test_tool_choice_none_gives_no_call(oai, idle_server):
    r = oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Lima?"}],
                                    max_tokens=10, temperature=0, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.content


def test_conversation_with_a_tool_result(oai, idle_server):
    """The agent loop: the model's call goes back as an assistant message with tool_calls,
    the tool's result as a tool message; the next turn answers."""
    messages = [{"role": "user", "content": "Weather in Lima?"}]
    first = oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=40, temperature=0,
                                        tools=[WEATHER], tool_choice="required")
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 19, "sky": "cloudy"}'})
    second = oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0,
                                         tools=[WEATHER])
    assert second.choices[0].message.content
    with idle_server.client() as c:
        rendered = c.post("/tokenize", json={"messages": messages, "tools": [WEATHER]}).json()
        text = idle_server.tokenizer.decode(rendered["tokens"])
    assert '{"temperature": 19, "sky": "cloudy"}' in text and rendered["count"] == second.usage.prompt_tokens


# ---- fields --------------------------------------------------------------------------------


def test_logit_bias_and_allowed_token_ids(oai, idle_server):
    tok = idle_server.tokenizer
    paris = tok.encode(" Paris", add_special_tokens=False)[0]
    r = oai.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=4, temperature=0,
                               logit_bias={str(paris): 100})
    assert r.choices[0].text == " Paris" * 4
    allowed = tok.encode(" red green blue", add_special_tokens=False)
    r = oai.completions.create(model=MODEL_NAME, prompt="Colors:", max_tokens=6, temperature=1.0, seed=3,
                               extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    assert set(r.choices[0].model_extra["token_ids"]) <= set(allowed)


def test_min_tokens_masks_eos(oai, idle_server):
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Say hi."}], max_tokens=50, temperature=0)
    short = oai.chat.completions.create(**kw)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 40
    r = oai.chat.completions.create(extra_body={"min_tokens": 40}, **kw)
    assert r.usage.completion_tokens >= 40


def test_prompt_logprobs_and_token_ids_as_logprob_tokens(oai, idle_server):
    tok = idle_server.tokenizer
    ids = tok.encode("The three primary colors are")
    r = oai.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=2, temperature=0, logprobs=1,
                               extra_body={"prompt_logprobs": 2, "return_tokens_as_token_ids": True})
    c = r.choices[0]
    plps = c.model_extra["prompt_logprobs"]
    assert len(plps) == len(ids) and plps[0] is None
    for pos, entry in enumerate(plps[1:], start=1):
        assert str(ids[pos]) in entry and all(v["logprob"] <= 0 for v in entry.values())
        assert len(entry) >= 2
    assert all(re.fullmatch(r"token_id:\d+", t) for t in c.logprobs.tokens)
    chunks = list(oai.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=2, temperature=0, stream=True,
                                         extra_body={"prompt_logprobs": 2}))
    streamed = [ch.choices[0].model_extra.get("prompt_logprobs") for ch in chunks if ch.choices]
    assert [p for p in streamed if p] == [plps]  # once, with the first chunk
    chat = oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       temperature=0, logprobs=True, extra_body={"prompt_logprobs": 0,
                                                                                 "return_tokens_as_token_ids": True})
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    assert all(i.token.startswith("token_id:") for i in chat.choices[0].logprobs.content)


def test_truncate_prompt_tokens(oai, idle_server):
    long = "one two three four five six seven eight nine ten " * 4
    r = oai.completions.create(model=MODEL_NAME, prompt=long, max_tokens=2, temperature=0,
                               extra_body={"truncate_prompt_tokens": 7})
    assert r.usage.prompt_tokens == 7
    tail = idle_server.tokenizer.encode(long)[-7:]
    same = oai.completions.create(model=MODEL_NAME, prompt=tail, max_tokens=2, temperature=0)
    assert r.choices[0].text == same.choices[0].text


def test_continue_final_message(oai, idle_server):
    """An assistant prefill: the model continues the last message (no new turn opened),
    on /v1/chat/completions and /tokenize alike."""
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    r = oai.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=3, temperature=0,
                                    extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert r.choices[0].message.content.strip().startswith("Paris")
    with idle_server.client() as c:
        tokens = c.post("/tokenize", json={"messages": messages, "continue_final_message": True}).json()["tokens"]
    text = idle_server.tokenizer.decode(tokens)
    assert text.endswith("The capital of France is") and r.usage.prompt_tokens == len(tokens)


def test_continuous_usage_stats(oai, idle_server):
    chunks = list(oai.completions.create(model=MODEL_NAME, prompt="Count: one, two,", max_tokens=5, temperature=0,
                                         stream=True, stream_options={"include_usage": True,
                                                                      "continuous_usage_stats": True}))
    with_choices = [ch for ch in chunks if ch.choices]
    assert all(ch.usage is not None for ch in with_choices)
    counts = [ch.usage.completion_tokens for ch in with_choices]
    assert counts == sorted(counts) and counts[-1] == 5 and chunks[-1].usage.completion_tokens == 5


def test_cached_tokens_are_reported(oai, idle_server):
    prompt = "A long preamble about the tea trade, its routes, its ports and its ships. " * 4
    first = oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
    again = oai.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
    cached = again.usage.prompt_tokens_details.cached_tokens
    block = idle_server.core.info.block_size
    assert first.usage.prompt_tokens_details.cached_tokens < cached
    assert cached >= block and cached % block == 0 and cached < again.usage.prompt_tokens


def test_models_retrieve_and_card(oai, idle_server):
    m = oai.models.retrieve(MODEL_NAME)
    assert m.id == MODEL_NAME and m.model_extra["root"] == MODEL_NAME  # never a path on the server
    assert "/" not in (oai.models.list().data[0].model_extra["root"] or "")
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")


def test_completions_default_to_16_tokens(oai, idle_server):
    r = oai.completions.create(model=MODEL_NAME, prompt="Once upon a time", temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
