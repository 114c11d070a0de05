"""Behaviour that vLLM's own OpenAI-server tests check, written from those tests: tool
schemas with $defs under tool_choice "required", forced calls cut by max_tokens,
continuous usage stats, and cache_salt's isolation of the prefix cache."""

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
