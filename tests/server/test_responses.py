"""The Responses API through the official `openai` client and the OpenAI Agents SDK on the
default model: plain and streamed responses (every event parsed by the client's own
stream state), text.format, function tools with a function_call_output round trip,
previous_response_id, storage, background responses and their cancellation."""

from __future__ import annotations

import json
import time

import openai
import pydantic
import pytest

from tests.server.conftest import MODEL_NAME

WEATHER = {
    "type": "function", "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False},
    "strict": True,
}


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)


def _message_text(r) -> str:
    return "".join(p.text for item in r.output if item.type == "message" for p in item.content)


def test_plain_response_is_stored_and_retrievable(oai, idle_server):
    r = oai.responses.create(model=MODEL_NAME, input="Name a fruit.", max_output_tokens=8, temperature=0,
                             instructions="Answer in one word.")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL_NAME
    assert r.status in ("completed", "incomplete") and r.output_text == _message_text(r) and r.output_text
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert r.usage.output_tokens <= 8 and r.usage.input_tokens > 5
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.usage.output_tokens == 8 and r.incomplete_details.reason == "max_output_tokens"
    assert r.instructions == "Answer in one word." and r.max_output_tokens == 8 and r.store is True
    again = oai.responses.retrieve(r.id)
    assert again.model_dump() == r.model_dump()
    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)


def test_unstored_response_cannot_be_found(oai, idle_server):
    r = oai.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=MODEL_NAME, input="And?", max_output_tokens=2, previous_response_id=r.id)


def test_streamed_events_match_the_whole_response(oai, idle_server):
    kw = dict(model=MODEL_NAME, input="Tell me about the sea.", max_output_tokens=12, temperature=0)
    whole = oai.responses.create(**kw)
    events = list(oai.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    ending = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          ending]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 3 and "".join(deltas) == whole.output_text
    final = events[-1].response
    assert final.status == whole.status and final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if e.type == "response.output_text.delta")
    assert final.output[0].id == item_id  # the final response holds the streamed items
    assert oai.responses.retrieve(final.id).output_text == whole.output_text


def test_stream_helper_parses_every_event_and_the_typed_output(oai, idle_server):
    seen = []
    with oai.responses.stream(model=MODEL_NAME, input="A city in France, as JSON.", text_format=City,
                              temperature=0, max_output_tokens=60) as stream:
        for event in stream:
            seen.append(event.type)
        final = stream.get_final_response()
    assert seen[0] == "response.created" and seen[-1] == "response.completed"
    assert "response.output_text.done" in seen
    assert final.status == "completed" and isinstance(final.output_parsed, City)
    assert City.model_validate_json(final.output_text) == final.output_parsed


def test_text_format_json_schema(oai, idle_server):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    r = oai.responses.create(model=MODEL_NAME, input="What is 2 + 2?", temperature=0, max_output_tokens=30,
                             text={"format": {"type": "json_schema", "name": "sum", "schema": schema, "strict": True}})
    assert r.status == "completed"
    value = json.loads(r.output_text)
    assert set(value) == {"answer"} and isinstance(value["answer"], int)
    assert r.text.format.type == "json_schema"
    obj = oai.responses.create(model=MODEL_NAME, input="A JSON object about a cat.", temperature=0,
                               max_output_tokens=40, text={"format": {"type": "json_object"}})
    assert obj.status == "incomplete" or isinstance(json.loads(obj.output_text), dict)


def test_function_call_and_its_output_round_trip(oai, idle_server):
    ask = [{"role": "user", "content": "What is the weather in Lima?"}]
    r = oai.responses.create(model=MODEL_NAME, input=ask, tools=[WEATHER], tool_choice="required", temperature=0,
                             max_output_tokens=40, parallel_tool_calls=False)
    calls = [item for item in r.output if item.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    args = json.loads(call.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)
    follow = oai.responses.create(
        model=MODEL_NAME, tools=[WEATHER], temperature=0, max_output_tokens=20,
        input=ask + [call.model_dump(exclude_none=True),
                     {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}])
    assert follow.output_text and not [item for item in follow.output if item.type == "function_call"]
    assert follow.usage.input_tokens > r.usage.input_tokens  # the call and its result are in the prompt
    named = oai.responses.create(model=MODEL_NAME, input=ask, tools=[WEATHER], temperature=0, max_output_tokens=40,
                                 tool_choice={"type": "function", "name": "get_weather"})
    assert [item.name for item in named.output if item.type == "function_call"] == ["get_weather"]


def test_streamed_function_call(oai, idle_server):
    events = list(oai.responses.create(model=MODEL_NAME, input="Weather in Oslo?", tools=[WEATHER], stream=True,
                                       tool_choice="required", temperature=0, max_output_tokens=40,
                                       parallel_tool_calls=False))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"] and added[0].item.name == "get_weather"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == deltas and set(json.loads(deltas)) == {"city"}
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].arguments == deltas


def test_previous_response_id_carries_the_conversation(oai, idle_server):
    first = oai.responses.create(model=MODEL_NAME, input="My name is Ada. Say hello.", temperature=0,
                                 max_output_tokens=10, instructions="Be brief.")
    second = oai.responses.create(model=MODEL_NAME, input="What is my name?", temperature=0, max_output_tokens=10,
                                  previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # The first exchange is in the second prompt (without the first's instructions), and
    # the prefix cache serves it.
    lone = oai.responses.create(model=MODEL_NAME, input="What is my name?", temperature=0, max_output_tokens=1,
                                store=False)
    assert second.usage.input_tokens > lone.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_background_response_completes_and_can_be_cancelled(oai, idle_server):
    done = oai.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=4, background=True)
    assert done.status in ("queued", "in_progress") and done.background is True
    deadline = time.monotonic() + 60
    while (got := oai.responses.retrieve(done.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert got.status in ("completed", "incomplete") and got.output_text and got.usage.output_tokens <= 4
    long = oai.responses.create(model=MODEL_NAME, input="Count to a thousand.", max_output_tokens=400,
                                background=True, extra_body={"ignore_eos": True})
    cancelled = oai.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    idle_server.wait_idle()  # its request was aborted: no KV block left behind
    assert oai.responses.retrieve(long.id).status == "cancelled"
    foreground = oai.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="background"):
        oai.responses.cancel(foreground.id)


def test_openai_agents_sdk_runs_an_agent_with_a_tool(idle_server):
    """The Agents SDK's default model speaks the Responses API: a tool call, the tool's
    result sent back, then the final answer."""
    import agents
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    client = AsyncOpenAI(base_url=idle_server.api, api_key="unused", max_retries=0)
    agent = agents.Agent(
        name="weather", instructions="Use the tool, then answer.", tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=MODEL_NAME, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=40))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert len(calls) == 1 and isinstance(calls[0], str)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, str) and result.final_output
