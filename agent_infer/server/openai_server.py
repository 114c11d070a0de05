"""OpenAI-compatible HTTP API over an AsyncEngine (FastAPI + any ASGI server).

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /v1/models/{id}, GET /health, GET /metrics, POST /tokenize, POST /detokenize.

Every error is OpenAI's JSON, `{"error": {"message", "type", "param", "code"}}`: 400 for
bad input, 404 for an unknown model or route, 503 + Retry-After when the waiting queue
is full, 415 for a body that is not application/json, 500 (with no internals) when
something broke. Request bodies are parsed here,
not by FastAPI, so that invalid UTF-8, invalid JSON and wrong types all get that shape.

One HTTP request becomes one RequestGroup: `n` engine requests per prompt, sharing the
prompt (the prefix cache makes the copies cheap). If the client goes away, the group is
aborted and its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from json.encoder import encode_basestring as _encode_json_str
from typing import AsyncIterator, Awaitable, TypeVar

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from agent_infer.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineFailedError,
    EngineRequest,
    QueueFullError,
    RequestGroup,
    RequestRejectedError,
)
from agent_infer.engine.outputs import RequestOutput, TokenLogprob
from agent_infer.loader.tokenizer import ChatFormatter
from agent_infer.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from agent_infer.server import protocol as P
from agent_infer.server.chat_output import ChoiceParser, message_of
from agent_infer.server.metrics import ServerMetrics
from agent_infer.server.reasoning import ThinkParser, reasoning_parser_for
from agent_infer.server.tool_parsers import JsonArrayToolParser, NamedToolParser, ToolParser, tool_parser_for
from agent_infer.structured.grammar import GrammarError, close_objects

log = logging.getLogger(__name__)

T = TypeVar("T")

# Keys the chat template call sets itself; passing them through would change what
# apply_chat_template returns, not what the template renders.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict", "return_tensors",
     "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs",
     "continue_final_message", "tools", "chat_template"}
)
# Logprobs of masked tokens are -inf, which JSON cannot carry; OpenAI clients expect numbers.
_MIN_LOGPROB = -9999.0
_DISCONNECTED = 499  # nginx's "client closed request"; nobody reads it


class ApiError(Exception):
    """An error to send to the client as OpenAI's error JSON."""

    _TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
              413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or self._TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers

    def body(self) -> dict:
        info = P.ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return P.ErrorResponse(error=info).model_dump()


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    retry_after_s: int = 1  # Retry-After on 503 when the queue is full
    max_body_bytes: int = 32 * 2**20
    tool_call_parser: str | None = None  # None / "auto": from the chat template and model family
    reasoning_parser: str | None = None  # None / "auto": when the chat template knows <think>; "none": off


@dataclass(frozen=True)
class _Prompt:
    text: str | None  # None when the client sent token ids
    ids: list[int]


def build_app(
    async_engine: AsyncEngine,
    served_model_name: str,
    *,
    retry_after_s: int = 1,
    max_body_bytes: int = 32 * 2**20,
    manage_engine: bool = True,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The FastAPI app. With `manage_engine`, the app's lifespan starts the engine loop
    and shuts it down (bounded) when the server stops."""
    metrics = ServerMetrics(async_engine)
    config = ServerConfig(served_model_name, retry_after_s, max_body_bytes, tool_call_parser, reasoning_parser)
    serving = OpenAIServing(async_engine, config, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_engine:
            async_engine.start()
        yield
        if manage_engine:
            await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="agent-infer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving
    app.state.metrics = metrics

    app.add_api_route("/v1/completions", _guarded(serving.completions), methods=["POST"])
    app.add_api_route("/v1/chat/completions", _guarded(serving.chat_completions), methods=["POST"])
    app.add_api_route("/v1/models", _guarded(serving.models), methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", _guarded(serving.model), methods=["GET"])
    app.add_api_route("/health", _guarded(serving.health), methods=["GET"])
    app.add_api_route("/metrics", _guarded(serving.metrics_text), methods=["GET"])
    app.add_api_route("/tokenize", _guarded(serving.tokenize), methods=["POST"])
    app.add_api_route("/detokenize", _guarded(serving.detokenize), methods=["POST"])

    def send_error(err: ApiError) -> JSONResponse:
        metrics.count_error(err.status)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return send_error(exc)

    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.url.path}", 405: f"method {request.method} is not allowed on {request.url.path}"}
        return send_error(ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail)),
                                   headers=getattr(exc, "headers", None)))

    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return send_error(ApiError(400, "invalid request", code="invalid_value"))

    async def on_internal_error(request: Request, exc: Exception) -> JSONResponse:
        # Last resort (endpoints are _guarded): Starlette logs the traceback server side
        # and then re-raises; the client learns nothing internal.
        return send_error(ApiError(500, "internal server error", code="internal_error"))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_internal_error)
    return app


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, config: ServerConfig, metrics: ServerMetrics):
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        template = getattr(self.tokenizer, "chat_template", None) if self.tokenizer is not None else None
        # Parsers are chosen once from the model (or the flags); a request that brings its
        # own chat_template gets them chosen again from that template.
        self.tool_parser_cls = tool_parser_for(config.tool_call_parser, _template_text(template), engine.model_type)
        self.reasoning_cls = reasoning_parser_for(config.reasoning_parser, _template_text(template))
        self._think_ids: tuple[int, int] | None | bool = False  # resolved on first use

    # ---- endpoints -----------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        req = await self._parse(request, P.CompletionRequest)
        self._check_model(req.model)
        self._check_stream_options(req)
        prompts = self._completion_prompts(req)
        for p in prompts:
            self._check_length(len(p.ids), req.max_tokens, "prompt")
        constraint = self._output_constraint(req)
        await self._compile(constraint, "response_format" if req.response_format else "structured_outputs")
        # OpenAI's default is 16 tokens (the engine stops earlier at the context's end).
        max_tokens = req.max_tokens if req.max_tokens is not None else P.DEFAULT_COMPLETION_MAX_TOKENS
        params = self._sampling_params(req, max_tokens, req.logprobs, constraint)
        if req.echo and req.logprobs is not None:  # OpenAI's echo + logprobs covers the prompt too
            params = replace(params, prompt_logprobs=max(req.logprobs, params.prompt_logprobs or 0))
        rid = f"cmpl-{uuid.uuid4().hex}"
        group = self._submit(self._fan_out(prompts, params, req.n, rid, req.stream))
        view = _CompletionView(self, req, rid, int(time.time()), prompts)
        if req.stream:
            return _sse_response(view.stream(group), group)
        finals = await self._collect_unless_disconnected(request, group)
        if finals is None:
            return Response(status_code=_DISCONNECTED)
        return _json(view.response(finals))

    async def chat_completions(self, request: Request) -> Response:
        req = await self._parse(request, P.ChatCompletionRequest)
        self._check_model(req.model)
        self._check_stream_options(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs", code="invalid_value")
        tools = _ToolSetup.of(req)
        text, ids = self._chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message,
                                      req.chat_template_kwargs, tools.template_tools, req.chat_template)
        ids = self._truncate(ids, req.truncate_prompt_tokens)
        max_tokens = req.resolved_max_tokens
        self._check_length(len(ids), max_tokens, "messages")
        reasoning_cls = self.reasoning_cls
        tool_parser_cls = self.tool_parser_cls
        if req.chat_template is not None:
            reasoning_cls = reasoning_parser_for(self.config.reasoning_parser, req.chat_template)
            tool_parser_cls = tool_parser_for(self.config.tool_call_parser, req.chat_template, self.engine.model_type)
        if ThinkParser.prompt_state(text) is False:
            reasoning_cls = None  # the prompt closed the block: the model was told not to think
        prompt_in_reasoning = bool(reasoning_cls and ThinkParser.prompt_state(text))
        constraint = self._output_constraint(req)
        if tools.constraint is not None:
            if constraint is not None:
                raise ApiError(400, f"tool_choice {tools.choice_label} and response_format/structured_outputs "
                                    f"cannot be combined", param="tool_choice", code="invalid_value")
            constraint = tools.constraint
        if constraint is not None and reasoning_cls is not None:
            think = self._think_token_ids()
            if think is not None:  # the constraint waits out a reasoning block
                constraint = replace(constraint, reasoning=think)
        param = "tools" if tools.constraint is not None else (
            "response_format" if req.response_format else "structured_outputs")
        await self._compile(constraint, param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self._sampling_params(req, max_tokens, logprobs, constraint)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        group = self._submit(self._fan_out([_Prompt(None, ids)], params, req.n, rid, req.stream))

        def choice_parser() -> ChoiceParser | None:
            reasoning = reasoning_cls(prompt_in_reasoning) if reasoning_cls is not None else None
            parser = tools.parser(tool_parser_cls)
            return ChoiceParser(reasoning, parser) if reasoning is not None or parser is not None else None

        view = _ChatView(self, req, rid, int(time.time()), ids, choice_parser)
        if req.stream:
            return _sse_response(view.stream(group), group)
        finals = await self._collect_unless_disconnected(request, group)
        if finals is None:
            return Response(status_code=_DISCONNECTED)
        return _json(view.response(finals))

    def _card(self) -> P.ModelCard:
        # root is the served name, never the model's path on this machine.
        name = self.config.served_model_name
        return P.ModelCard(id=name, created=self.created, root=name, max_model_len=self.engine.max_model_len)

    async def models(self) -> Response:
        return _json(P.ModelList(data=[self._card()]))

    async def model(self, model_id: str) -> Response:
        self._check_model(model_id)
        return _json(self._card())

    async def health(self) -> Response:
        if not self.engine.is_running:
            reason = self.engine.dead_reason or "the engine is not running"
            raise ApiError(503, reason, code="engine_unavailable")
        return JSONResponse({"status": "ok"})

    async def metrics_text(self) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    async def tokenize(self, request: Request) -> Response:
        req = await self._parse(request, P.TokenizeRequest)
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' or 'messages'", param="prompt", code="invalid_value")
        if req.prompt is not None:
            ids = self._encode(req.prompt, req.add_special_tokens, "prompt")
        else:
            if not req.messages:
                raise ApiError(400, "'messages' is empty", param="messages", code="invalid_value")
            tools = [t.model_dump(by_alias=True, exclude_none=True) for t in req.tools] if req.tools else None
            _, ids = self._chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message,
                                       req.chat_template_kwargs, tools, req.chat_template)
        return _json(P.TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids))

    async def detokenize(self, request: Request) -> Response:
        req = await self._parse(request, P.DetokenizeRequest)
        self._check_model(req.model)
        self._check_token_ids(req.tokens, "tokens")
        return _json(P.DetokenizeResponse(prompt=self._require_tokenizer().decode(req.tokens)))

    # ---- request parsing -------------------------------------------------------------------

    async def _parse(self, request: Request, model: type[BaseModel]):
        content_type = request.headers.get("content-type")
        if content_type is not None and not _is_json_type(content_type):
            raise ApiError(415, f"the request body must be application/json, not {content_type.split(';')[0]}",
                           code="unsupported_media_type")
        body = await self._read_body(request)
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ApiError(400, f"the request body is not valid UTF-8 (bad byte at offset {e.start})",
                           code="invalid_encoding") from None
        try:
            obj = json.loads(text, parse_constant=_reject_json_constant)
        except json.JSONDecodeError as e:
            raise ApiError(400, f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})",
                           code="invalid_json") from None
        except (ValueError, RecursionError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(obj, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        refused = P.refusal(obj)
        if refused is not None:
            raise ApiError(400, refused[1], param=refused[0], code="unsupported_parameter")
        try:
            return model.model_validate(obj)
        except ValidationError as e:
            message, param = P.describe_validation_error(model, e)
            raise ApiError(400, message, param=param, code="invalid_value") from None

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the request body is larger than {limit} bytes", code="body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is larger than {limit} bytes", code="body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise ApiError(404, f"The model `{name}` does not exist. This server serves `{self.config.served_model_name}`.",
                           param="model", code="model_not_found")

    @staticmethod
    def _check_stream_options(req: P._SamplingFields) -> None:
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options is only allowed together with stream=true", param="stream_options",
                           code="invalid_value")

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send token ids instead of text", code="no_tokenizer")
        return self.tokenizer

    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        tokenizer = self._require_tokenizer()
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, f"'{param}' contains an unpaired UTF-16 surrogate", param=param,
                           code="invalid_value") from None
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.engine.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token ids must be in [0, {vocab}); got {bad[:3]}", param=param, code="invalid_value")

    def _truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep the last `keep` tokens (-1: the context)."""
        if keep is None:
            return ids
        if keep == 0:
            raise ApiError(400, "truncate_prompt_tokens must be -1 or >= 1", param="truncate_prompt_tokens",
                           code="invalid_value")
        limit = self.engine.max_model_len if keep == -1 else keep
        return ids[-limit:]

    def _completion_prompts(self, req: P.CompletionRequest) -> list[_Prompt]:
        p = req.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            items = [p]
        else:
            items = list(p)
        if not items:
            raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")
        prompts = []
        for item in items:
            if isinstance(item, str):
                ids = self._encode(item, req.add_special_tokens, "prompt") if item else []
                truncated = self._truncate(ids, req.truncate_prompt_tokens)
                # A cut prompt's text is no longer the client's: echo decodes the ids.
                prompt = _Prompt(item if len(truncated) == len(ids) else None, truncated)
            else:
                self._check_token_ids(item, "prompt")
                prompt = _Prompt(None, self._truncate(list(item), req.truncate_prompt_tokens))
            if not prompt.ids:
                raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")
            prompts.append(prompt)
        return prompts

    def _chat_prompt(self, messages: list[P.ChatMessage], add_generation_prompt: bool | None,
                     continue_final_message: bool, template_kwargs: dict | None, tools: list[dict] | None,
                     chat_template: str | None) -> tuple[str, list[int]]:
        """The rendered prompt and its ids. continue_final_message leaves the last
        (assistant) message open for the model to continue: an assistant prefill."""
        tokenizer = self._require_tokenizer()
        kwargs = dict(template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise ApiError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs",
                           code="invalid_value")
        if continue_final_message:
            if add_generation_prompt:
                raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true",
                               param="continue_final_message", code="invalid_value")
            if messages[-1].role != "assistant":
                raise ApiError(400, "continue_final_message needs the last message to be the assistant's",
                               param="continue_final_message", code="invalid_value")
        formatter = ChatFormatter(tokenizer, chat_template)
        try:
            text = formatter.render(
                [m.as_template_message(formatter.tool_arguments_as_dict) for m in messages],
                add_generation_prompt=not continue_final_message if add_generation_prompt is None else add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools, **kwargs)
        except jinja2.TemplateError as e:
            raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages",
                           code="invalid_value") from None
        except ValueError as e:  # no chat template, or a final message that cannot be continued
            raise ApiError(400, str(e), param="messages", code="invalid_value") from None
        # The template already carries any BOS: do not add special tokens again.
        ids = self._encode(text, False, "messages")
        if not ids:
            raise ApiError(400, "the rendered chat prompt is empty", param="messages", code="invalid_value")
        return text, ids

    def _check_length(self, num_prompt: int, max_tokens: int | None, param: str) -> None:
        limit = self.engine.max_model_len
        if num_prompt >= limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens, but the prompt has "
                                f"{num_prompt} tokens, which leaves no room for the completion. Shorten the prompt.",
                           param=param, code="context_length_exceeded")
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the "
                                f"completion). Reduce the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")

    @staticmethod
    def _output_constraint(req: P._SamplingFields) -> StructuredOutputsParams | None:
        try:
            return req.output_constraint()
        except SamplingParamsError as e:
            raise ApiError(400, str(e), param=e.param, code="invalid_value") from None

    async def _compile(self, spec: StructuredOutputsParams | None, param: str) -> None:
        """Compile (and cache) the request's grammar now, so that a bad schema, regex or
        grammar is a 400 naming the problem before anything is queued."""
        if spec is None:
            return
        if self.engine.grammar is None:
            raise ApiError(400, "structured outputs need a tokenizer, and this model has none", param=param,
                           code="invalid_value")
        try:
            await asyncio.to_thread(self.engine.grammar.compile, spec)
        except GrammarError as e:
            raise ApiError(400, str(e), param=param, code="invalid_value") from None

    def _think_token_ids(self) -> tuple[int, int] | None:
        """(<think>, </think>) ids when both are single tokens (else a constraint cannot
        tell where a reasoning block ends, and applies from the first token)."""
        if self._think_ids is False:
            g = self.engine.grammar
            start, end = g.token_id(ThinkParser.start), g.token_id(ThinkParser.end)
            self._think_ids = (start, end) if start is not None and end is not None else None
        return self._think_ids

    def _sampling_params(self, req: P._SamplingFields, max_tokens: int | None, logprobs: int | None,
                         structured: StructuredOutputsParams | None = None) -> SamplingParams:
        try:
            params = req.sampling_params(max_tokens, logprobs, structured)
        except SamplingParamsError as e:
            raise ApiError(400, str(e), param=e.param, code="invalid_value") from None
        for name, ids in params.token_ids_to_check.items():
            self._check_token_ids(ids, name)
        return params

    # ---- running requests --------------------------------------------------------------------

    def _fan_out(self, prompts: list[_Prompt], params: SamplingParams, n: int, rid: str,
                 stream: bool) -> list[EngineRequest]:
        """`n` engine requests per prompt; choice k = prompt_index * n + j. With a seed,
        choice j samples with seed + j (wrapped within int64): reproducible, and distinct
        across choices and from any other seed's."""
        total = len(prompts) * n
        if total > self.engine.config.max_waiting:
            raise ApiError(400, f"the request asks for {total} completions but the server queues at most "
                                f"{self.engine.config.max_waiting}", param="n", code="invalid_value")
        requests = []
        for i, prompt in enumerate(prompts):
            for j in range(n):
                sp = params if params.seed is None else replace(params, seed=_wrap_int64(params.seed + j))
                requests.append(EngineRequest(prompt.ids, sp, prompt.text, f"{rid}-{i * n + j}", stream))
        return requests

    def _submit(self, requests: list[EngineRequest]) -> RequestGroup:
        try:
            return self.engine.submit(requests)
        except QueueFullError as e:
            raise ApiError(503, str(e), code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from None
        except EngineDeadError as e:
            raise ApiError(503, f"the engine is not available: {e}", code="engine_unavailable") from None

    async def _collect(self, group: RequestGroup) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(group.request_ids)
        try:
            async with group:
                async for k, out in group:
                    if out.finished:
                        finals[k] = out
        except Exception as e:
            raise _engine_error(e) from None
        return finals  # type: ignore[return-value]

    async def _collect_unless_disconnected(self, request: Request, group: RequestGroup) -> list[RequestOutput] | None:
        """Collect a non-streaming result; None if the client went away first (the group
        is then aborted, freeing its blocks)."""
        return await _unless_disconnected(request, self._collect(group))

    # ---- output helpers ---------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)
            self._token_text[token_id] = text
        return text

    def logprob_token(self, token_id: int, as_ids: bool) -> str:
        """A token as logprobs name it: its text, or "token_id:<id>" (return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if as_ids else self.token_text(token_id)

    def prompt_text(self, prompt: _Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.ids) if self.tokenizer is not None else ""

    def prompt_logprobs(self, lps: list[TokenLogprob | None] | None) -> P.PromptLogprobs | None:
        """vLLM's prompt_logprobs: per prompt position None (the first) or {id: {logprob,
        rank, decoded_token}} for the prompt's token and the top alternatives."""
        if lps is None:
            return None
        out: P.PromptLogprobs = []
        for lp in lps:
            if lp is None:
                out.append(None)
                continue
            entry = {str(t): P.PromptLogprob(logprob=_finite(v), rank=r + 1, decoded_token=self.token_text(t))
                     for r, (t, v) in enumerate(lp.top)}
            if str(lp.token_id) not in entry:
                entry[str(lp.token_id)] = P.PromptLogprob(logprob=_finite(lp.logprob),
                                                          decoded_token=self.token_text(lp.token_id))
            out.append(entry)
        return out


@dataclass
class _ToolSetup:
    """What a chat request's tools and tool_choice ask of the template, the grammar and
    the output parser."""

    template_tools: list[dict] | None
    choice: str  # none | auto | required | named
    named: str | None = None
    constraint: StructuredOutputsParams | None = None

    @property
    def choice_label(self) -> str:
        return f"{{'function': {self.named!r}}}" if self.choice == "named" else repr(self.choice)

    @staticmethod
    def of(req: P.ChatCompletionRequest) -> "_ToolSetup":
        tools = req.tools or []
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        named = None
        if isinstance(choice, P.NamedToolChoice):
            named, choice = choice.function.name, "named"
        if choice != "none" and not tools:
            raise ApiError(400, f"tool_choice {choice!r} needs 'tools'", param="tool_choice", code="invalid_value")
        template_tools = [t.model_dump(by_alias=True, exclude_none=True) for t in tools] or None
        by_name = {t.function.name: t.function for t in tools}
        setup = _ToolSetup(template_tools, choice, named)
        if choice == "named":
            if named not in by_name:
                raise ApiError(400, f"tool_choice names {named!r}, which is not among the tools "
                                    f"({', '.join(by_name)})", param="tool_choice", code="invalid_value")
            setup.constraint = StructuredOutputsParams(json=_parameters_schema(by_name[named]))
        elif choice == "required":
            setup.constraint = StructuredOutputsParams(json=_required_calls_schema(tools, req.parallel_tool_calls))
        return setup

    def parser(self, auto_cls) -> ToolParser | None:
        if self.choice == "auto":
            return auto_cls()
        if self.choice == "required":
            return JsonArrayToolParser()
        if self.choice == "named":
            return NamedToolParser(self.named)
        return None


def _parameters_schema(function: P.FunctionDefinition) -> dict:
    """A function's parameters schema for the grammar of a forced call: its objects closed
    (no argument the function does not declare, whether or not it said strict), and a
    parameterless function takes exactly {}."""
    params = function.parameters
    if not params:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    schema = dict(params)
    schema.setdefault("type", "object")
    return close_objects(schema)


def _required_calls_schema(tools: list[P.ChatTool], parallel: bool) -> dict:
    """tool_choice "required": a JSON array of one or more calls, each one of the tools
    with arguments that satisfy its schema (one call only without parallel_tool_calls)."""
    options = [{
        "type": "object",
        "properties": {"name": {"const": t.function.name}, "parameters": _parameters_schema(t.function)},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    } for t in tools]
    schema = {"type": "array", "items": options[0] if len(options) == 1 else {"anyOf": options}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _template_text(template) -> str | None:
    if isinstance(template, dict):  # named templates: search them all
        return "\n".join(template.values())
    return template


def _wrap_int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


def _is_json_type(content_type: str) -> bool:
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


# ---- response builders (one per endpoint) -----------------------------------------------------


class _UsageTracker:
    """Usage of a request: prompt tokens once per prompt, the cached part of them (the
    prefix cache's hits; for n > 1 choices of one prompt, the least any of them got, as
    the prompt was computed once), generated tokens over all choices."""

    def __init__(self, prompt_lens: list[int], n: int):
        self.prompt_lens, self.n = prompt_lens, n
        total = len(prompt_lens) * n
        self.generated = [0] * total
        self.cached = [0] * total

    def update(self, k: int, out: RequestOutput) -> None:
        self.generated[k] = len(out.token_ids)
        self.cached[k] = out.num_cached_tokens

    def usage(self) -> P.Usage:
        prompt = sum(self.prompt_lens)
        cached = sum(min(self.cached[i * self.n:(i + 1) * self.n]) for i in range(len(self.prompt_lens)))
        completion = sum(self.generated)
        return P.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached))


class _CompletionView:
    """Builds /v1/completions responses and stream chunks for one request."""

    def __init__(self, serving: OpenAIServing, req: P.CompletionRequest, rid: str, created: int, prompts: list[_Prompt]):
        self.s = serving
        self.req = req
        self.rid = rid
        self.created = created
        self.prompts = prompts
        self.model = serving.config.served_model_name
        self._templates: dict[int, _TextTemplate] = {}
        # Without a tokenizer there is no text: each step's token ids are sent instead, as
        # they come (vLLM's token_ids), so a stream is still a stream.
        self.ids_mode = serving.tokenizer is None or req.return_token_ids

    def _prompt_of(self, k: int) -> _Prompt:
        return self.prompts[k // self.req.n]

    def _tracker(self) -> _UsageTracker:
        return _UsageTracker([len(p.ids) for p in self.prompts], self.req.n)

    def _logprobs(self, lps: list[TokenLogprob | None], offset: int, prompt_ids: list[int] | None = None
                  ) -> P.CompletionLogprobs:
        """OpenAI's logprobs object; `prompt_ids` with prompt logprobs, whose first entry is
        None (the first prompt token has nothing before it)."""
        as_ids = self.req.return_tokens_as_token_ids
        out = P.CompletionLogprobs()
        for i, lp in enumerate(lps):
            text = self.s.logprob_token(lp.token_id if lp is not None else prompt_ids[i], as_ids)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if lp is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            top = {self.s.logprob_token(t, as_ids): _finite(v) for t, v in lp.top}
            top.setdefault(text, _finite(lp.logprob))
            out.token_logprobs.append(_finite(lp.logprob))
            out.top_logprobs.append(top)
        return out

    def _echo_logprobs(self, k: int, out: RequestOutput) -> P.CompletionLogprobs:
        return self._logprobs(out.prompt_logprobs or [], 0, self._prompt_of(k).ids)

    def _prompt_logprobs(self, out: RequestOutput) -> P.PromptLogprobs | None:
        return self.s.prompt_logprobs(out.prompt_logprobs) if self.req.prompt_logprobs is not None else None

    def response(self, finals: list[RequestOutput]) -> P.CompletionResponse:
        choices = []
        usage = self._tracker()
        for k, out in enumerate(finals):
            usage.update(k, out)
            prefix = self.s.prompt_text(self._prompt_of(k)) if self.req.echo else ""
            logprobs = self._logprobs(out.logprobs, len(prefix)) if self.req.logprobs is not None and out.logprobs is not None else None
            if logprobs is not None and self.req.echo:
                echoed = self._echo_logprobs(k, out)
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    setattr(logprobs, name, getattr(echoed, name) + getattr(logprobs, name))
            choices.append(P.CompletionChoice(
                index=k, text=prefix + out.text, logprobs=logprobs, finish_reason=out.finish_reason,
                stop_reason=out.stop_reason, prompt_logprobs=self._prompt_logprobs(out),
                token_ids=list(out.token_ids) if self.ids_mode else None,
                prompt_token_ids=list(self._prompt_of(k).ids) if self.req.return_token_ids else None))
        return P.CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=choices,
                                    usage=usage.usage())

    def _chunk(self, choice: P.CompletionChoice | None, usage: P.Usage | None = None) -> str:
        return _sse(P.CompletionChunk(id=self.rid, created=self.created, model=self.model,
                                      choices=[choice] if choice else [], usage=usage))

    def _text_chunk(self, k: int, text: str) -> str:
        """The chunk of choice k carrying only new text: `_chunk`'s bytes, without pydantic."""
        template = self._templates.get(k)
        if template is None:
            template = self._templates[k] = _TextTemplate(self._chunk(P.CompletionChoice(index=k, text=_MARK)))
        return template.fill(text)

    async def stream(self, group: RequestGroup) -> AsyncIterator[str]:
        total = len(group.request_ids)
        sent_logprobs = [0] * total
        offsets = [0] * total
        usage = self._tracker()
        continuous = self.req.continuous_usage
        sent_prompt_lp: set[int] = set()  # choices whose prompt logprobs went out (with their first chunk)
        tail: list[str] = []  # sent in the stream's last write
        try:
            async with group:
                # The echo goes first; with logprobs it waits for the prompt's, which come
                # with the request's first output.
                echo_pending = set(range(total)) if self.req.echo else set()
                if self.req.echo and self.req.logprobs is None:
                    for k in range(total):
                        text = self.s.prompt_text(self._prompt_of(k))
                        offsets[k] = len(text)
                        yield self._chunk(P.CompletionChoice(index=k, text=text))
                    echo_pending.clear()
                while batch := await group.next_batch():
                    events = []
                    for k, text, out, ids in _coalesce(batch):
                        usage.update(k, out)
                        extra = {}
                        if k in echo_pending:
                            echo_pending.discard(k)
                            prompt_text = self.s.prompt_text(self._prompt_of(k))
                            offsets[k] = len(prompt_text)
                            events.append(self._chunk(P.CompletionChoice(
                                index=k, text=prompt_text, logprobs=self._echo_logprobs(k, out))))
                        if self.req.prompt_logprobs is not None and out.prompt_logprobs is not None and \
                                k not in sent_prompt_lp:
                            sent_prompt_lp.add(k)
                            extra["prompt_logprobs"] = self._prompt_logprobs(out)
                        logprobs = None
                        if self.req.logprobs is not None and out.logprobs is not None:
                            new = out.logprobs[sent_logprobs[k]:]
                            sent_logprobs[k] = len(out.logprobs)
                            logprobs = self._logprobs(new, offsets[k])
                            offsets[k] += sum(len(t) for t in logprobs.tokens)
                        if self.ids_mode and ids:
                            extra["token_ids"] = ids
                        if not (text or out.finished or (logprobs and logprobs.tokens) or extra):
                            continue  # text held back (partial character or possible stop string)
                        if logprobs is None and not out.finished and not extra and not continuous:
                            events.append(self._text_chunk(k, text))  # the common case, per token
                            continue
                        events.append(self._chunk(P.CompletionChoice(
                            index=k, text=text, logprobs=logprobs,
                            finish_reason=out.finish_reason if out.finished else None,
                            stop_reason=out.stop_reason if out.finished else None, **extra),
                            usage.usage() if continuous else None))
                    if group.finished:  # the last chunks go out in one write with what ends the stream
                        tail = events
                    elif events:
                        yield "".join(events)
            if self.req.include_usage:
                tail.append(self._chunk(None, usage.usage()))
        except Exception as e:
            tail.append(_sse_error(e))
        tail.append("data: [DONE]\n\n")
        yield "".join(tail)

class _ChatView:
    """Builds /v1/chat/completions responses and stream chunks for one request."""

    def __init__(self, serving: OpenAIServing, req: P.ChatCompletionRequest, rid: str, created: int,
                 prompt_ids: list[int], choice_parser):
        self.s = serving
        self.req = req
        self.rid = rid
        self.created = created
        self.prompt_ids = prompt_ids
        self.choice_parser = choice_parser  # () -> ChoiceParser | None (reasoning, tool calls)
        self.model = serving.config.served_model_name
        self._templates: dict[int, _TextTemplate] = {}

    def _tracker(self) -> _UsageTracker:
        return _UsageTracker([len(self.prompt_ids)], self.req.n)

    def _logprobs(self, lps: list[TokenLogprob]) -> P.ChatLogprobs:
        as_ids = self.req.return_tokens_as_token_ids
        content = []
        for lp in lps:
            text = self.s.logprob_token(lp.token_id, as_ids)
            top = [P.TopLogprob(token=self.s.logprob_token(t, as_ids), logprob=_finite(v),
                                bytes=list(self.s.token_text(t).encode("utf-8"))) for t, v in lp.top]
            content.append(P.ChatTokenLogprob(token=text, logprob=_finite(lp.logprob),
                                              bytes=list(self.s.token_text(lp.token_id).encode("utf-8")),
                                              top_logprobs=top))
        return P.ChatLogprobs(content=content)

    @staticmethod
    def _finish_reason(out: RequestOutput, num_calls: int) -> str | None:
        return "tool_calls" if num_calls and out.finish_reason == "stop" else out.finish_reason

    def response(self, finals: list[RequestOutput]) -> P.ChatCompletionResponse:
        choices = []
        usage = self._tracker()
        for k, out in enumerate(finals):
            usage.update(k, out)
            parser = self.choice_parser()
            if parser is None:
                message, num_calls = P.ChatResponseMessage(content=out.text), 0
            else:
                reasoning, content, calls = parser.parse(out.text)
                message, num_calls = message_of(reasoning, content, calls), len(calls)
            choices.append(P.ChatChoice(
                index=k, message=message,
                logprobs=self._logprobs(out.logprobs) if self.req.logprobs and out.logprobs is not None else None,
                finish_reason=self._finish_reason(out, num_calls), stop_reason=out.stop_reason,
                token_ids=list(out.token_ids) if self.req.return_token_ids else None))
        first = finals[0] if finals else None
        return P.ChatCompletionResponse(
            id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage.usage(),
            prompt_logprobs=self.s.prompt_logprobs(first.prompt_logprobs)
            if first is not None and self.req.prompt_logprobs is not None else None,
            prompt_token_ids=list(self.prompt_ids) if self.req.return_token_ids else None)

    def _chunk(self, choice: P.ChatChunkChoice | None, usage: P.Usage | None = None) -> str:
        return _sse(P.ChatCompletionChunk(id=self.rid, created=self.created, model=self.model,
                                          choices=[choice] if choice else [], usage=usage))

    def _text_chunk(self, k: int, text: str) -> str:
        """The chunk of choice k carrying only new content: `_chunk`'s bytes, without pydantic."""
        template = self._templates.get(k)
        if template is None:
            template = self._templates[k] = _TextTemplate(
                self._chunk(P.ChatChunkChoice(index=k, delta=P.ChatDelta(content=_MARK))))
        return template.fill(text)

    async def stream(self, group: RequestGroup) -> AsyncIterator[str]:
        total = len(group.request_ids)
        sent_logprobs = [0] * total
        usage = self._tracker()
        continuous = self.req.continuous_usage
        parsers = [self.choice_parser() for _ in range(total)]
        tail: list[str] = []  # sent in the stream's last write
        try:
            async with group:
                for k in range(total):  # OpenAI's first chunk of each choice carries the role
                    yield self._chunk(P.ChatChunkChoice(index=k, delta=P.ChatDelta(role="assistant", content="")))
                while batch := await group.next_batch():
                    events = []
                    for k, text, out, ids in _coalesce(batch):
                        usage.update(k, out)
                        logprobs = None
                        if self.req.logprobs and out.logprobs is not None and len(out.logprobs) > sent_logprobs[k]:
                            logprobs = self._logprobs(out.logprobs[sent_logprobs[k]:])
                            sent_logprobs[k] = len(out.logprobs)
                        parser = parsers[k]
                        if parser is None:
                            delta = P.ChatDelta(content=text) if text else None
                            plain = True
                        else:
                            parts = parser.feed(text, final=out.finished)
                            delta = parts.delta()
                            plain = not (parts.reasoning or parts.tool_events)
                        token_ids = ids if self.req.return_token_ids and ids else None
                        if not (delta or out.finished or logprobs or token_ids):
                            continue
                        if plain and delta and logprobs is None and not out.finished and not continuous \
                                and token_ids is None:
                            events.append(self._text_chunk(k, delta.content))  # the common case, per token
                            continue
                        num_calls = parser.num_calls if parser is not None else 0
                        events.append(self._chunk(P.ChatChunkChoice(
                            index=k, delta=delta or P.ChatDelta(), logprobs=logprobs,
                            finish_reason=self._finish_reason(out, num_calls) if out.finished else None,
                            stop_reason=out.stop_reason if out.finished else None, token_ids=token_ids),
                            usage.usage() if continuous else None))
                    if group.finished:  # the last chunks go out in one write with what ends the stream
                        tail = events
                    elif events:
                        yield "".join(events)
            if self.req.include_usage:
                tail.append(self._chunk(None, usage.usage()))
        except Exception as e:
            tail.append(_sse_error(e))
        tail.append("data: [DONE]\n\n")
        yield "".join(tail)


# ---- small helpers ------------------------------------------------------------------------------


def _guarded(endpoint):
    """Turn an unexpected exception of an endpoint into a logged, bare 500 ApiError (the
    traceback goes to the server log, never to the client)."""

    @functools.wraps(endpoint)
    async def guarded(*args, **kwargs):
        try:
            return await endpoint(*args, **kwargs)
        except (ApiError, StarletteHTTPException):
            raise
        except Exception:
            log.exception("%s failed", endpoint.__name__)
            raise ApiError(500, "internal server error", code="internal_error") from None

    return guarded


def _engine_error(e: Exception) -> ApiError:
    """The ApiError for an exception raised while a request group runs."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RequestRejectedError):
        return ApiError(400, str(e), param="prompt", code="context_length_exceeded")
    if isinstance(e, EngineDeadError):
        return ApiError(503, f"the engine is not available: {e}", code="engine_unavailable")
    if isinstance(e, EngineFailedError):
        return ApiError(500, str(e), code="engine_error")
    log.error("request failed", exc_info=e)
    return ApiError(500, "internal server error", code="internal_error")


def _coalesce(batch: list[tuple[int, RequestOutput]]) -> list[tuple[int, str, RequestOutput, list[int]]]:
    """Merge the outputs of one choice that queued up while the client was being written
    to: (index, all their delta text, the latest output, all their new token ids). One
    chunk per choice instead of one per token keeps a slow connection from falling
    further behind."""
    merged: dict[int, list] = {}
    for k, out in batch:
        if k in merged:
            merged[k][0] += out.delta_text
            merged[k][1] = out
            merged[k][2] = merged[k][2] + out.delta_token_ids
        else:
            merged[k] = [out.delta_text, out, list(out.delta_token_ids)]
    return [(k, text, out, ids) for k, (text, out, ids) in merged.items()]


def _sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


# A text no tokenizer produces, written into a chunk once to find where the text goes.
_MARK = "\x00agent-infer text\x00"


class _TextTemplate:
    """A stream chunk whose only variable part is one string: the event pydantic wrote
    for it with `_MARK` as the string, cut around the mark. Filling in a text gives the
    same bytes as serialising the models again (pydantic, like `encode_basestring`,
    escapes quotes, backslashes and control characters and writes other characters as
    they are), at a fraction of the cost: streaming builds one chunk per token."""

    __slots__ = ("head", "tail")

    def __init__(self, event: str):
        head, sep, tail = event.partition(_encode_json_str(_MARK))
        if not sep or _encode_json_str(_MARK) in tail:
            raise ValueError("the chunk must hold the mark exactly once")
        self.head, self.tail = head, tail

    def fill(self, text: str) -> str:
        return self.head + _encode_json_str(text) + self.tail


def _sse_error(e: Exception) -> str:
    """An error inside a stream that has already sent its headers: one error event."""
    return f"data: {json.dumps(_engine_error(e).body())}\n\n"


def _sse_response(body: AsyncIterator[str], group: RequestGroup) -> StreamingResponse:
    async def abort_leftovers() -> None:
        # Runs once the response is over, also when the client disconnected before the
        # body generator ever started (then its own `async with group` never ran).
        group.abort()

    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(abort_leftovers))


def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def _finite(logprob: float) -> float:
    return logprob if logprob >= _MIN_LOGPROB else _MIN_LOGPROB  # also maps -inf and NaN


def _reject_json_constant(name: str):
    raise ValueError(f"{name} is not a valid JSON value")


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client disconnects. The body has been read, so the next ASGI
    message is the disconnect. A server that cannot tell us (receive() fails) is
    treated as "never": the request then simply runs to its end."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return
    except Exception:
        log.debug("cannot watch for client disconnects", exc_info=True)
    await asyncio.Event().wait()


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it (and returning None) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    return None
