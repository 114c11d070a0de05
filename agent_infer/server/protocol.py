"""Request and response bodies of the OpenAI-compatible API.

What clients send is taken as OpenAI and vLLM define it: `null` means the default (the
SDKs send explicit nulls), a field we do not know is ignored with a log line (SDKs and
agent frameworks add their own), and only a field whose meaning we cannot honour is
refused (`REFUSED`, a 400 that says so). Types are still checked strictly (no coercion:
"5" is not 5), except that booleans also take the strings "true" and "false". Value
ranges that the engine defines (temperature, penalties, ...) are checked by
SamplingParams so that there is one source of truth for them.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_serializer, model_validator

from agent_infer.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError, StructuredOutputsParams

log = logging.getLogger(__name__)

MAX_N = 128  # OpenAI's bound on choices per request
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


def _bool_text(value):
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


Bool = Annotated[bool, BeforeValidator(_bool_text)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _defaults_for_nulls(cls, data):
        if not isinstance(data, dict):
            return data
        known = {f.alias or name for name, f in cls.model_fields.items()} | set(cls.model_fields)
        unknown = sorted(k for k in data if k not in known)
        if unknown:
            log.info("ignoring unknown field(s) %s in a %s", ", ".join(map(str, unknown)), cls.__name__)
        return {k: v for k, v in data.items() if v is not None and k in known}


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _Compact(_Response):
    """A response part whose unset optional fields are left out (OpenAI omits them)."""

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None or k in self._KEEP_NULL}

    _KEEP_NULL: frozenset = frozenset()


# Fields whose meaning we cannot honour: refused with this reason when set to anything
# but their default (checked on the raw body, see refusal()).
REFUSED: dict[str, tuple[object, str]] = {
    "functions": (None, "the legacy 'functions' field is not supported; send 'tools' instead"),
    "function_call": (None, "the legacy 'function_call' field is not supported; send 'tool_choice' instead"),
    "suffix": (None, "'suffix' (insertion) is not supported"),
    "best_of": (1, "best_of > 1 is not supported"),
    "audio": (None, "audio output is not supported"),
    "prediction": (None, "predicted outputs are not supported"),
    # vLLM's fields that we do not implement, whose absence a client would not notice
    "logprob_token_ids": (None, "logprob_token_ids (logprobs of chosen token ids) is not supported; "
                                "use logprobs with top_logprobs"),
    "use_beam_search": (False, "beam search is not supported"),
    "bad_words": (None, "bad_words is not supported; use logit_bias to ban tokens"),
    "logits_processors": (None, "custom logits processors are not supported"),
    "prompt_embeds": (None, "prompt embeddings are not supported"),
}


# Refused even when empty: vLLM rejects an empty list there, so it is no harmless default.
_REFUSED_WHEN_EMPTY = frozenset({"logprob_token_ids"})


def refusal(body: dict) -> tuple[str, str] | None:
    """(param, message) for the first field of a raw body that we cannot honour (set to
    anything but its default or, for most, an empty value)."""
    for name, (default, message) in REFUSED.items():
        value = body.get(name)
        if value is None or value == default:
            continue
        if name in _REFUSED_WHEN_EMPTY or value not in ("", [], {}):
            return name, message
    modalities = body.get("modalities")
    if isinstance(modalities, list) and any(m != "text" for m in modalities):
        return "modalities", "only text output is supported"
    return None


# ---- requests --------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False  # vLLM: usage in every chunk

    @property
    def is_empty(self) -> bool:
        """Nothing set (`{}`, or only nulls): vLLM lets that through without stream."""
        return not self.model_fields_set


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="response_format.type must be 'text', 'json_object' or 'json_schema'")
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs` (and its older `guided_*` fields)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: Bool | None = None
    structural_tag: Any = None  # refused: not supported


class SamplingExtras(_Request):
    """vLLM's sampling fields beyond OpenAI's, on every endpoint that generates (the
    Responses API passes them to the chat path as they are)."""

    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = Field(None, description="stop must be a string or a list of strings")
    stop_token_ids: list[int] | None = None
    ignore_eos: Bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's: prefix-cache blocks are shared only between requests of the same salt.
    cache_salt: str | None = Field(None, min_length=1, description="cache_salt must be a non-empty string")


class _SamplingFields(SamplingExtras):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for compatibility; not used
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_tokens_as_token_ids: Bool = False  # logprob tokens as "token_id:<id>"
    return_token_ids: Bool = False  # choices carry token_ids (and prompt_token_ids)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep k prompt tokens (-1: the context)
    # Which end truncate_prompt_tokens keeps: "left" (the default) cuts the start, keeping
    # the last tokens; "right" cuts the end, keeping the first.
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="truncation_side must be 'left' or 'right'")
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """Raises SamplingParamsError (which names the field) for out-of-range values."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            min_tokens=self.min_tokens,
            logit_bias=self._logit_bias(),
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            structured_outputs=structured,
        )

    def _logit_bias(self) -> dict[int, float] | None:
        """logit_bias with token-id keys; every key that is not one is named in the error."""
        if not self.logit_bias:
            return None
        bad = [key for key in self.logit_bias if not _is_int_text(key)]
        if bad:
            raise SamplingParamsError("logit_bias", f"logit_bias keys must be token ids, got "
                                                    f"{', '.join(map(repr, bad))}")
        return {int(key): value for key, value in self.logit_bias.items()}

    def output_constraint(self) -> StructuredOutputsParams | None:
        """The constraint asked for by response_format, structured_outputs or guided_*
        (at most one of them). Raises SamplingParamsError."""
        found: list[tuple[str, StructuredOutputsParams]] = []
        rf = self.response_format
        if rf is not None and rf.type != "text":
            if rf.type == "json_object":
                found.append(("response_format", StructuredOutputsParams(json_object=True)))
            else:
                js = rf.json_schema
                if js is None or js.schema_ is None:
                    raise SamplingParamsError("response_format",
                                              "response_format json_schema needs json_schema.schema")
                found.append(("response_format", StructuredOutputsParams(json=js.schema_, strict=bool(js.strict))))
        so = self.structured_outputs
        if so is not None:
            if so.structural_tag is not None:
                raise SamplingParamsError("structured_outputs", "structured_outputs.structural_tag is not supported")
            found.append(("structured_outputs", StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                json_object=bool(so.json_object))))
        for name, kw in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                         ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append((name, StructuredOutputsParams(**{kw: value})))
        if len(found) > 1:
            names = ", ".join(n for n, _ in found)
            raise SamplingParamsError(found[1][0], f"give one output constraint, not several ({names})")
        return found[0][1] if found else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's rule: usage in every chunk only when both include_usage and
        continuous_usage_stats are set."""
        return self.include_usage and self.stream_options.continuous_usage_stats


def _is_int_text(key: str) -> bool:
    try:
        int(key)
    except ValueError:
        return False
    return True


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
    )
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo (scoring the prompt): see CompletionServing
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Bool = False
    add_special_tokens: Bool = True


class TextPart(_Request):
    type: Literal["text", "input_text"]
    text: str


class RefusalPart(_Request):
    """OpenAI's refusal part, allowed in an assistant message of the history."""

    type: Literal["refusal"]
    refusal: str

    @property
    def text(self) -> str:
        return self.refusal


class ToolCallFunction(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    # Any role goes to the chat template as it is (as in vLLM: templates may know roles
    # of their own); system, developer, user, assistant and tool are the ones we read.
    role: str = Field(min_length=1, description="role must be a non-empty string")
    content: str | list[TextPart | RefusalPart] | None = Field(
        None, description="content must be a string or a list of {'type': 'text', 'text': ...} parts "
                          "({'type': 'refusal', 'refusal': ...} parts too, in assistant messages)"
    )
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _refusals_only_from_the_assistant(self):
        if self.role != "assistant" and isinstance(self.content, list) and \
                any(isinstance(p, RefusalPart) for p in self.content):
            raise ValueError("refusal parts are only allowed in assistant messages")
        return self

    @property
    def text(self) -> str:
        """The content as one text (parts joined by newlines; a refusal part gives its text)."""
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""

    def as_template_message(self, arguments_as_dict: bool = True, function_as_tool: bool = False) -> dict:
        """The message as chat templates take it: text content, tool calls with their
        arguments as a mapping (or the JSON text, for templates that paste it in).
        `function_as_tool`: OpenAI's legacy `function` role (a function's result) becomes
        a tool message, for templates that know tool results but not that role."""
        import json

        role = "tool" if function_as_tool and self.role == "function" else self.role
        msg: dict[str, Any] = {"role": role, "content": self.text}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                args = call.function.arguments
                if arguments_as_dict and isinstance(args, str):
                    try:
                        parsed = json.loads(args)
                        args = parsed if isinstance(parsed, dict) else args
                    except json.JSONDecodeError:
                        pass
                elif not arguments_as_dict and isinstance(args, dict):
                    args = json.dumps(args, ensure_ascii=False)
                entry = {"type": "function", "function": {"name": call.function.name, "arguments": args}}
                if call.id is not None:
                    entry["id"] = call.id
                calls.append(entry)
            msg["tool_calls"] = calls
        return msg


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: Bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: Bool | None = None  # default: True, unless continue_final_message
    continue_final_message: Bool = False
    echo: Bool = False  # vLLM's: the last message's text, when the assistant's, starts the content
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                          "{'name': ...}}")
    parallel_tool_calls: Bool = True

    @property
    def resolved_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool | None = None
    continue_final_message: Bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: Bool = False  # vLLM's: each token's vocabulary string too


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---- responses -------------------------------------------------------------------------


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


class PromptTokensDetails(_Response):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(_Response):
    """vLLM's prompt logprob entry: one per candidate token of a prompt position."""

    logprob: float
    rank: int  # 1 + the vocabulary entries with a larger logprob
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(_Compact):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobs | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None

    _KEEP_NULL = frozenset({"logprobs", "finish_reason", "stop_reason"})


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Compact):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the same text, under vLLM's newer name
    tool_calls: list[ToolCallOut] | None = None

    _KEEP_NULL = frozenset({"content"})


class ChatChoice(_Compact):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None

    _KEEP_NULL = frozenset({"logprobs", "finish_reason", "stop_reason"})


class ChatCompletionResponse(_Compact):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None

    _KEEP_NULL = frozenset({"system_fingerprint"})


class FunctionCallDelta(_Compact):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Compact):
    """OpenAI streams a call as its id, type and name first, then argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(_Compact):
    # OpenAI's deltas carry only what changed: {"role": ..., "content": ""}, then
    # {"content": ...}, and {} in the final chunk.
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Compact):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None

    _KEEP_NULL = frozenset({"logprobs", "finish_reason", "stop_reason"})


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ChatCompletionFirstChunk(ChatCompletionChunk):
    """A choice's first chunk under return_token_ids: the prompt's ids too, as vLLM sends
    them (a class of its own, so that other chunks carry no null field for it)."""

    prompt_token_ids: list[int]


class CompletionChunk(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "agent-infer"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs; null otherwise, as in vLLM


class DetokenizeResponse(_Response):
    prompt: str


# ---- validation errors -----------------------------------------------------------------

# Pydantic puts the name of the union member it tried into an error's location
# ("prompt", "list[int]", 1); those parts are not fields and are left out of messages.
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_type_tag(part) -> bool:
    return isinstance(part, str) and ("[" in part or part in _TYPE_TAGS or part[:1].isupper())


def describe_validation_error(model: type[BaseModel], err: ValidationError) -> tuple[str, str | None]:
    """(message, param) for the first problem of a request body, in words a client can act on."""
    first = err.errors()[0]
    loc = [p for p in first["loc"] if not _is_type_tag(p)]
    path = ".".join(str(p) for p in loc)
    param = str(loc[0]) if loc else None
    kind = first["type"]
    if kind == "extra_forbidden":
        return f"unknown field '{path}'", param
    if kind == "missing":
        return f"'{path}' is required", param
    if kind == "too_short" and first.get("input") == []:
        return f"'{path}' must not be empty", param
    union_failed = any(_is_type_tag(p) for p in first["loc"])
    if union_failed:
        desc = _field_description(model, first["loc"])
        if desc:
            return f"invalid '{path}': {desc}", param
    return f"invalid '{path}': {first['msg']}", param


def _field_description(model: type[BaseModel], loc) -> str | None:
    """The `description` of the (possibly nested) field that `loc` points into."""
    current: Any = model
    desc = None
    for part in loc:
        if _is_type_tag(part):
            break
        if isinstance(part, int):
            continue
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return desc
        info = fields[part]
        desc = info.description
        current = _inner_model(info.annotation)
    return desc


def _inner_model(annotation) -> Any:
    """The BaseModel inside `list[X]` / `X | None`, if any (to walk nested fields)."""
    stack = [annotation]
    while stack:
        t = stack.pop()
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
        stack.extend(getattr(t, "__args__", ()))
    return None
