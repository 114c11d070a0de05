"""Bodies of the OpenAI Responses API (POST /v1/responses and its stored objects).

The request is read as OpenAI defines it, with vLLM's sampling extras; its input items
are turned into chat messages by `serving_responses.py`, so that a response runs through
the chat path (templates, parsers, grammars). The response object and its output items
are written with the fields the official clients read; unset optional fields are sent as
null, as OpenAI does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from agent_infer.sampling_params import MAX_LOGPROBS
from agent_infer.server.protocol import Bool, ChatTokenLogprob, SamplingExtras, _Request, _Response

# ---- request ----------------------------------------------------------------------------


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text.format.type must be 'text', 'json_object' or 'json_schema'")
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: Bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: str | None = None  # a hint to OpenAI's own models; nothing here reads it


class ReasoningConfig(_Request):
    effort: str | None = None  # passed to the chat template as reasoning_effort
    summary: str | None = None  # reasoning comes back whole, as reasoning text, never summarised
    generate_summary: str | None = None


class ResponsesRequest(SamplingExtras):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(description="input must be a string or a list of input items")
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = Field(
        None, description="tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}")
    parallel_tool_calls: Bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = None
    stream: Bool = False
    store: Bool = True
    background: Bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description="truncation must be 'auto' or 'disabled'")
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a routing hint for OpenAI's caches; the prefix cache needs none
    service_tier: str | None = None
    max_tool_calls: int | None = None  # bounds built-in tool calls, of which there are none here
    stream_options: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None  # refused: conversations are not kept here
    prompt: dict[str, Any] | None = None  # refused: no stored prompt templates here
    chat_template_kwargs: dict[str, Any] | None = None


# Fields of a response request passed to the chat path under the same name.
PASSED_TO_CHAT = ("temperature", "top_p", "parallel_tool_calls", *SamplingExtras.model_fields)

# What `include` may ask for, and what it does here.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
INCLUDE_IGNORED = frozenset({  # nothing to add: no such tools, no encrypted reasoning (it is sent in the clear)
    "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
    "web_search_call.action.sources", "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs"})


# ---- response ---------------------------------------------------------------------------


class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] | None = None


class OutputMessage(_Response):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class ReasoningText(_Response):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(_Response):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list = Field(default_factory=list)
    content: list[ReasoningText]
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(_Response):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | ReasoningItem | FunctionCallItem


class InputTokensDetails(_Response):
    cached_tokens: int = 0


class OutputTokensDetails(_Response):
    reasoning_tokens: int = 0


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Response):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(_Response):
    code: str
    message: str


class ResponseObject(_Response):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    background: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    text: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    service_tier: str = "default"
