"""OpenAIServing: what every endpoint shares — reading and validating a request, turning
it into token ids (chat templates and long texts in the text workers, never on the event
loop), sampling settings, handing it to the engine core, and the small endpoints
(/v1/models, /health, /metrics, /tokenize, /detokenize).

Request bodies are parsed here, not by FastAPI, so that invalid UTF-8, invalid JSON and
wrong types all get OpenAI's error shape. One HTTP request becomes one RequestGroup: `n`
engine requests per prompt, sharing the prompt (the prefix cache makes the copies
cheap). If the client goes away, the group is aborted and its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass, replace

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from agent_infer import __version__
from agent_infer.core.client import CoreClient, EngineRequest, RequestGroup
from agent_infer.core.metrics import CONTENT_TYPE, unavailable_text
from agent_infer.engine.outputs import RequestOutput, TokenLogprob
from agent_infer.loader.tokenizer import ChatFormatter
from agent_infer.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from agent_infer.server import protocol as P
from agent_infer.server.errors import ApiError, ShuttingDownError, engine_error
from agent_infer.server.reasoning import ThinkParser
from agent_infer.server.streaming import DISCONNECTED, finite, json_response, sse_response, unless_disconnected
from agent_infer.server.text_workers import TemplateError, TextWorkers
from agent_infer.structured.grammar import GrammarCompiler, GrammarError

log = logging.getLogger(__name__)

# Keys the chat template call sets itself; passing them through would change what
# apply_chat_template returns, not what the template renders.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tokenize", "add_generation_prompt", "return_dict", "return_tensors",
     "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs",
     "continue_final_message", "tools", "chat_template"}
)

# A template that tests a message's role against "function" (OpenAI's legacy role for a
# function's result) renders such messages itself; others get them as tool messages.
_FUNCTION_ROLE_TEST = re.compile(r"""role['"]?\]?\s*(?:==|!=|in)\s*[^%}]{0,60}?['"]function['"]""")


def knows_function_role(template: str | None) -> bool:
    """Whether a chat template handles OpenAI's legacy `function` role itself."""
    return bool(_FUNCTION_ROLE_TEST.search(template or ""))


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    retry_after_s: int = 1  # Retry-After on 503 (queue full, shutting down)
    max_body_bytes: int = 32 * 2**20
    tool_call_parser: str | None = None  # None / "auto": from the chat template and model family
    reasoning_parser: str | None = None  # None / "auto": when the chat template knows <think>; "none": off
    # A request's own chat_template is code the server runs: refused unless trusted.
    trust_request_chat_template: bool = False


@dataclass(frozen=True)
class Prompt:
    text: str | None  # None when the client sent token ids
    ids: list[int]


class FrontEndState:
    """What a front end's endpoints share beyond the request: whether it still admits
    requests (no, once it drains for shutdown)."""

    def __init__(self) -> None:
        self.draining = False


class OpenAIServing:
    def __init__(self, client: CoreClient, config: ServerConfig, text: TextWorkers | None,
                 grammar: GrammarCompiler | None, state: FrontEndState | None = None):
        self.client = client
        self.config = config
        self.text = text  # None: the model has no tokenizer
        self.grammar = grammar
        self.state = state or FrontEndState()
        self.tokenizer = client.tokenizer
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        self._think_ids: tuple[int, int] | None | bool = False  # resolved on first use

    @property
    def template(self) -> str | dict | None:
        return getattr(self.tokenizer, "chat_template", None) if self.tokenizer is not None else None

    # ---- small endpoints --------------------------------------------------------------------

    def _card(self) -> P.ModelCard:
        # root is the served name, never the model's path on this machine.
        name = self.config.served_model_name
        return P.ModelCard(id=name, created=self.created, root=name, max_model_len=self.client.max_model_len)

    async def models(self) -> Response:
        return json_response(P.ModelList(data=[self._card()]))

    async def model(self, model_id: str) -> Response:
        self.check_model(model_id)
        return json_response(self._card())

    async def health(self) -> Response:
        if not self.client.is_running:
            raise ApiError(503, self.client.dead_reason or "the engine is not running", code="engine_unavailable")
        if self.state.draining:
            raise ApiError(503, "the server is shutting down", code="server_shutting_down",
                           headers={"Retry-After": str(self.config.retry_after_s)})
        return JSONResponse({"status": "ok"})

    async def metrics_text(self) -> Response:
        """The core's metrics, the same whichever front end answers; while the core cannot
        answer, just the health gauge at 0."""
        try:
            body = await self.client.call("metrics", timeout_s=5.0)
        except Exception:
            body = unavailable_text()
        return Response(body, media_type=CONTENT_TYPE)

    async def version(self) -> Response:
        return JSONResponse({"version": __version__})

    async def tokenize(self, request: Request) -> Response:
        req = await self.parse(request, P.TokenizeRequest)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' or 'messages'", param="prompt", code="invalid_value")
        if req.prompt is not None:
            ids = await self.encode(req.prompt, req.add_special_tokens, "prompt")
        else:
            if not req.messages:
                raise ApiError(400, "'messages' is empty", param="messages", code="invalid_value")
            tools = [t.model_dump(by_alias=True, exclude_none=True) for t in req.tools] if req.tools else None
            _, ids = await self.chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message,
                                            req.chat_template_kwargs, tools, req.chat_template)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return json_response(P.TokenizeResponse(count=len(ids), max_model_len=self.client.max_model_len, tokens=ids,
                                                token_strs=strs))

    async def detokenize(self, request: Request) -> Response:
        req = await self.parse(request, P.DetokenizeRequest)
        self.check_model(req.model)
        self.check_token_ids(req.tokens, "tokens")
        return json_response(P.DetokenizeResponse(prompt=self.require_tokenizer().decode(req.tokens)))

    # ---- request parsing -------------------------------------------------------------------

    async def read_json(self, request: Request) -> dict:
        """The body as a JSON object, read once (an endpoint that dispatches on it, like
        /invocations, hands the request on to one that reads it again)."""
        cached = getattr(request.state, "json_body", None)
        if cached is not None:
            return cached
        content_type = request.headers.get("content-type")
        if content_type is not None and not _is_json_type(content_type):
            raise ApiError(415, f"the request body must be application/json, not {content_type.split(';')[0]}",
                           code="unsupported_media_type")
        obj = _json_body(await self._read_body(request))
        if not isinstance(obj, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        request.state.json_body = obj
        return obj

    async def parse(self, request: Request, model: type[BaseModel]):
        obj = await self.read_json(request)
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

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise ApiError(404, f"The model `{name}` does not exist. This server serves "
                                f"`{self.config.served_model_name}`.", param="model", code="model_not_found")

    @staticmethod
    def check_stream_options(req: P._SamplingFields) -> None:
        # An empty object asks for nothing: let it through, as vLLM does.
        if req.stream_options is not None and not req.stream_options.is_empty and not req.stream:
            raise ApiError(400, "stream_options is only allowed together with stream=true", param="stream_options",
                           code="invalid_value")

    def require_tokenizer(self):
        if self.tokenizer is None or self.text is None:
            raise ApiError(400, "this model has no tokenizer: send token ids instead of text", code="no_tokenizer")
        return self.tokenizer

    async def encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        self.require_tokenizer()
        try:
            if not text.isascii():  # isascii is O(1) on CPython's ASCII strings: a long prompt costs no scan
                text.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, f"'{param}' contains an unpaired UTF-16 surrogate", param=param,
                           code="invalid_value") from None
        try:
            return await self.text.encode(text, add_special_tokens)
        except TemplateError as e:  # a worker that died or timed out on a huge text
            raise ApiError(400, str(e), param=param, code=e.code) from None

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.client.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token ids must be in [0, {vocab}); got {bad[:3]}", param=param, code="invalid_value")

    def truncate(self, ids: list[int], keep: int | None, side: str | None = None) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep `keep` tokens (-1: the context), the last
        ones (truncation_side "left", the default) or the first ("right")."""
        if keep is None:
            return ids
        if keep == 0:
            raise ApiError(400, "truncate_prompt_tokens must be -1 or >= 1", param="truncate_prompt_tokens",
                           code="invalid_value")
        limit = self.client.max_model_len if keep == -1 else keep
        return ids[:limit] if side == "right" else ids[-limit:]

    async def chat_prompt(self, messages: list[P.ChatMessage], add_generation_prompt: bool | None,
                          continue_final_message: bool, template_kwargs: dict | None, tools: list[dict] | None,
                          chat_template: str | None) -> tuple[str, list[int]]:
        """The rendered prompt and its ids, from a text worker (templates are code: they run
        where a wall-clock and an output limit can stop them). continue_final_message
        leaves the last (assistant) message open for the model to continue."""
        tokenizer = self.require_tokenizer()
        if chat_template is not None and not self.config.trust_request_chat_template:
            raise ApiError(400, "this server does not run chat templates sent with a request; its operator can "
                                "allow them with --trust-request-chat-template", param="chat_template",
                           code="unsupported_parameter")
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
        function_as_tool = not knows_function_role(formatter.template)
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        try:
            text, ids = await self.text.render_chat(
                [m.as_template_message(formatter.tool_arguments_as_dict, function_as_tool) for m in messages],
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools, chat_template=chat_template,
                template_kwargs=kwargs)
        except TemplateError as e:
            raise ApiError(400, str(e), param="chat_template" if chat_template else "messages", code=e.code) from None
        if not ids:
            raise ApiError(400, "the rendered chat prompt is empty", param="messages", code="invalid_value")
        return text, ids

    def check_length(self, num_prompt: int, max_tokens: int | None, param: str) -> None:
        limit = self.client.max_model_len
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
    def output_constraint(req: P._SamplingFields) -> StructuredOutputsParams | None:
        try:
            return req.output_constraint()
        except SamplingParamsError as e:
            raise ApiError(400, str(e), param=e.param, code="invalid_value") from None

    async def compile(self, spec: StructuredOutputsParams | None, param: str) -> None:
        """Compile (and cache) the request's grammar now, so that a bad schema, regex or
        grammar is a 400 naming the problem before anything is queued."""
        if spec is None:
            return
        if self.grammar is None:
            raise ApiError(400, "structured outputs need a tokenizer, and this model has none", param=param,
                           code="invalid_value")
        try:
            await asyncio.to_thread(self.grammar.compile, spec)
        except GrammarError as e:
            raise ApiError(400, str(e), param=param, code="invalid_value") from None

    def think_token_ids(self) -> tuple[int, int] | None:
        """(<think>, </think>) ids when both are single tokens (else a constraint cannot
        tell where a reasoning block ends, and applies from the first token)."""
        if self._think_ids is False:
            start, end = self.grammar.token_id(ThinkParser.start), self.grammar.token_id(ThinkParser.end)
            self._think_ids = (start, end) if start is not None and end is not None else None
        return self._think_ids

    def sampling_params(self, req: P._SamplingFields, max_tokens: int | None, logprobs: int | None,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        try:
            params = req.sampling_params(max_tokens, logprobs, structured)
        except SamplingParamsError as e:
            raise ApiError(400, str(e), param=e.param, code="invalid_value") from None
        for name, ids in params.token_ids_to_check.items():
            self.check_token_ids(ids, name)
        return params

    # ---- running requests --------------------------------------------------------------------

    def fan_out(self, prompts: list[Prompt], params: SamplingParams, n: int, rid: str,
                stream: bool, cache_salt: str | None = None) -> list[EngineRequest]:
        """`n` engine requests per prompt; choice k = prompt_index * n + j. With a seed,
        choice j samples with seed + j (wrapped within int64): reproducible, and distinct
        across choices and from any other seed's. A `cache_salt` keeps their prefix-cache
        blocks apart from every other salt's."""
        total = len(prompts) * n
        if total > self.client.max_waiting:
            raise ApiError(400, f"the request asks for {total} completions but the server queues at most "
                                f"{self.client.max_waiting}", param="n", code="invalid_value")
        requests = []
        for i, prompt in enumerate(prompts):
            for j in range(n):
                sp = params if params.seed is None else replace(params, seed=_wrap_int64(params.seed + j))
                requests.append(EngineRequest(prompt.ids, sp, prompt.text, f"{rid}-{i * n + j}", stream, cache_salt))
        return requests

    async def submit(self, requests: list[EngineRequest], tag: str | None = None) -> RequestGroup:
        """Queue the requests in the core; a full queue, a dead core or a server that is
        shutting down is a 503. `tag`: the stored response they run for."""
        if self.state.draining:
            raise engine_error(ShuttingDownError("the server is shutting down; retry on another instance"),
                               self.config.retry_after_s)
        try:
            group = self.client.submit(requests, tag)
        except Exception as e:
            raise engine_error(e, self.config.retry_after_s) from None
        try:
            await group.admitted()
        except asyncio.CancelledError:  # the client left before the core took the requests
            group.abort()
            raise
        except Exception as e:
            raise engine_error(e, self.config.retry_after_s) from None
        return group

    async def collect(self, group: RequestGroup) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(group.request_ids)
        try:
            async with group:
                async for k, out in group:
                    if out.finished:
                        finals[k] = out
        except Exception as e:
            raise engine_error(e, self.config.retry_after_s) from None
        return finals  # type: ignore[return-value]

    async def respond(self, request: Request, view, group: RequestGroup, stream: bool) -> Response:
        """A request's answer from its view (its `stream(group)` and `response(finals)`):
        the stream, or the whole response unless the client went away first."""
        if stream:
            return sse_response(view.stream(group), group)
        finals = await self.collect_unless_disconnected(request, group)
        if finals is None:
            return Response(status_code=DISCONNECTED)
        return json_response(view.response(finals))

    async def collect_unless_disconnected(self, request: Request, group: RequestGroup) -> list[RequestOutput] | None:
        """Collect a non-streaming result; None if the client went away first (the group
        is then aborted, freeing its blocks)."""
        return await unless_disconnected(request, self.collect(group))

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

    def prompt_text(self, prompt: Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.tokenizer.decode(prompt.ids) if self.tokenizer is not None else ""

    def prompt_logprobs(self, lps: list[TokenLogprob | None] | None) -> P.PromptLogprobs | None:
        """vLLM's prompt_logprobs: per prompt position None (the first) or {id: {logprob,
        rank, decoded_token}} for the top alternatives and the prompt's token (whose rank
        the engine computed: it need not be among them)."""
        if lps is None:
            return None
        out: P.PromptLogprobs = []
        for lp in lps:
            if lp is None:
                out.append(None)
                continue
            entry = {str(t): P.PromptLogprob(logprob=finite(v), rank=r + 1, decoded_token=self.token_text(t))
                     for r, (t, v) in enumerate(lp.top)}
            if str(lp.token_id) not in entry:
                entry[str(lp.token_id)] = P.PromptLogprob(logprob=finite(lp.logprob), rank=lp.rank,
                                                          decoded_token=self.token_text(lp.token_id))
            out.append(entry)
        return out


def template_text(template) -> str | None:
    if isinstance(template, dict):  # named templates: search them all
        return "\n".join(template.values())
    return template


def _wrap_int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


def _is_json_type(content_type: str) -> bool:
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _json_body(body: bytes):
    """The body as JSON. msgspec reads a valid body several times faster than the json
    module (a 10 MB prompt must not hold the event loop for long); anything it refuses is
    read again by the json module, whose errors (and acceptance of, say, 1e999) are the
    ones clients get."""
    try:
        return msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        pass
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (bad byte at offset {e.start})",
                       code="invalid_encoding") from None
    try:
        return json.loads(text, parse_constant=_reject_json_constant)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})",
                       code="invalid_json") from None
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


def _reject_json_constant(name: str):
    raise ValueError(f"{name} is not a valid JSON value")
