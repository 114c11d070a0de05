"""POST /v1/responses, GET and DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel:
OpenAI's Responses API on top of the chat path.

A request's input items (with the stored conversation of `previous_response_id` before
them, and `instructions` first) become chat messages; its function tools, tool_choice and
text.format become the chat request's tools, tool_choice and response_format; then it is
prepared, run and parsed exactly as a chat completion is. Responses are stored (unless
`store` is false) in the engine core, so that every front end finds them; `background`
runs a response after its POST has returned, and only such a response can be cancelled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from agent_infer.core.client import RequestGroup
from agent_infer.engine.outputs import RequestOutput
from agent_infer.server import protocol as P
from agent_infer.server import protocol_responses as R
from agent_infer.server.chat_output import ChoiceParts
from agent_infer.server.errors import ApiError, engine_error
from agent_infer.server.responses_input import chat_body, history_messages, output_messages
from agent_infer.server.responses_output import ResponseEvents, output_items
from agent_infer.server.serving import Prompt
from agent_infer.server.serving_chat import ChatServing, ChatView, PreparedChat
from agent_infer.server.streaming import DISCONNECTED, coalesce, json_response, sse_response

log = logging.getLogger(__name__)

_STATUS = {"stop": "completed", "length": "incomplete", "abort": "cancelled"}


class _Run:
    """One response being made: its request, the chat request it became, and the
    conversation to store with it."""

    def __init__(self, req: R.ResponsesRequest, chat: PreparedChat, chat_req: P.ChatCompletionRequest,
                 history: list[dict], rid: str, model: str):
        self.req, self.chat, self.chat_req, self.history, self.rid = req, chat, chat_req, history, rid
        self.created = int(time.time())
        self.model = model

    def response(self, status: str, output: list[R.OutputItem], out: RequestOutput | None = None,
                 reasoning_tokens: int = 0, error: R.ResponseError | None = None) -> R.ResponseObject:
        req = self.req
        usage = None
        if out is not None:
            generated = len(out.token_ids)
            usage = R.ResponseUsage(
                input_tokens=len(self.chat.ids), output_tokens=generated, total_tokens=len(self.chat.ids) + generated,
                input_tokens_details=R.InputTokensDetails(cached_tokens=out.num_cached_tokens),
                output_tokens_details=R.OutputTokensDetails(reasoning_tokens=reasoning_tokens))
        return R.ResponseObject(
            id=self.rid, created_at=self.created, completed_at=int(time.time()) if status == "completed" else None,
            status=status, error=error, model=self.model, output=output, usage=usage,
            incomplete_details=R.IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            parallel_tool_calls=req.parallel_tool_calls, previous_response_id=req.previous_response_id,
            reasoning=req.reasoning.model_dump(exclude_none=True) if req.reasoning else None,
            store=req.store, background=req.background, temperature=req.temperature, top_p=req.top_p,
            top_logprobs=req.top_logprobs,
            text=req.text.model_dump(by_alias=True, exclude_none=True) if req.text else {"format": {"type": "text"}},
            tool_choice=req.tool_choice if req.tool_choice is not None else "auto", tools=req.tools or [],
            truncation=req.truncation or "disabled", user=req.user, metadata=req.metadata or {},
        )

    def record(self, response: R.ResponseObject) -> bytes:
        """What the store keeps: the response, and the conversation it ends (for a later
        previous_response_id)."""
        messages = self.history + output_messages(response.output)
        return json.dumps({"response": response.model_dump(mode="json"), "messages": messages}).encode()


class ResponsesServing:
    def __init__(self, chat: ChatServing):
        self.chat = chat
        self.client = chat.client
        self._background: set[asyncio.Task] = set()

    # ---- endpoints ----------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        s = self.chat
        req = await s.parse(request, R.ResponsesRequest)
        s.check_model(req.model)
        _check_supported(req)
        history: list[dict] = []
        if req.previous_response_id is not None:
            history = await self._conversation(req.previous_response_id)
        history += history_messages(req.input)
        body = chat_body(req, history)
        try:
            chat_req = P.ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            message, param = P.describe_validation_error(P.ChatCompletionRequest, e)
            raise ApiError(400, message, param=_responses_param(param), code="invalid_value") from None
        try:
            chat = await s.prepare(chat_req)
        except ApiError as e:
            e.param = _responses_param(e.param)
            raise
        run = _Run(req, chat, chat_req, history, f"resp_{uuid.uuid4().hex}", s.config.served_model_name)
        group = await s.submit(s.fan_out([Prompt(None, chat.ids)], chat.params, 1, run.rid, req.stream,
                                         req.cache_salt), tag=run.rid if req.background else None)
        if req.background:
            queued = run.response("queued", [])
            await self._store(run, queued)
            task = asyncio.create_task(self._finish_in_background(run, group))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return json_response(queued)
        if req.stream:
            return sse_response(self._stream(run, group), group)
        finals = await s.collect_unless_disconnected(request, group)
        if finals is None:
            return Response(status_code=DISCONNECTED)
        response = self._whole(run, finals[0])
        if req.store:
            await self._store(run, response)
        return json_response(response)

    async def retrieve(self, response_id: str, request: Request) -> Response:
        if request.query_params.get("stream", "false").lower() == "true":
            raise ApiError(400, "streaming a stored response again is not supported; GET it without stream",
                           param="stream", code="unsupported_parameter")
        found = await self._call("response_get", response_id)
        if found is None:
            raise _not_found(response_id)
        return _stored_response(*found)

    async def cancel(self, response_id: str) -> Response:
        found = await self._call("response_cancel", response_id)
        if found is None:
            raise _not_found(response_id)
        status, blob = found
        response = json.loads(blob)["response"]
        if not response.get("background"):
            raise ApiError(400, "only a response created with background=true can be cancelled",
                           param="response_id", code="invalid_value")
        return _stored_response("cancelled" if status in ("queued", "in_progress") else status, blob)

    async def delete(self, response_id: str) -> Response:
        if not await self._call("response_delete", response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    # ---- running ------------------------------------------------------------------------

    def _view(self, run: _Run) -> ChatView:
        return ChatView(self.chat, run.chat_req, run.rid, run.created, run.chat.ids, run.chat.choice_parser,
                        run.chat.forced_call)

    def _whole(self, run: _Run, out: RequestOutput) -> R.ResponseObject:
        """The finished response of one output, parsed as a chat choice is."""
        view = self._view(run)
        reasoning, content, calls = view.parts(out)
        status = _STATUS.get(out.finish_reason or "stop", "completed")
        logprobs = None
        if run.chat_req.logprobs and out.logprobs is not None:
            logprobs = view.logprobs_of(out.logprobs).content
        items = output_items(reasoning, content, calls, "incomplete" if status == "incomplete" else "completed",
                             logprobs)
        return run.response(status, items, out, self._reasoning_tokens(out, bool(reasoning)))

    def _reasoning_tokens(self, out: RequestOutput, has_reasoning: bool) -> int:
        """Tokens up to and including the one that closed the reasoning block."""
        if not has_reasoning:
            return 0
        think = self.chat.think_token_ids() if self.chat.grammar is not None else None
        ids = list(out.token_ids)
        if think is not None and think[1] in ids:
            return ids.index(think[1]) + 1
        return len(ids)

    async def _stream(self, run: _Run, group: RequestGroup):
        events = ResponseEvents()
        view = self._view(run)
        parser = run.chat.choice_parser()
        yield events.lifecycle("response.created", run.response("in_progress", []))
        yield events.lifecycle("response.in_progress", run.response("in_progress", []))
        sent_logprobs = 0
        final: RequestOutput | None = None
        try:
            async with group:
                while batch := await group.next_batch():
                    chunks: list[str] = []
                    for _, text, out, _ids in coalesce(batch):
                        final = out
                        logprobs = None
                        if run.chat_req.logprobs and out.logprobs is not None and len(out.logprobs) > sent_logprobs:
                            logprobs = view.logprobs_of(out.logprobs[sent_logprobs:]).content
                            sent_logprobs = len(out.logprobs)
                        if parser is None:
                            parts = _plain_parts(text)
                        else:
                            parts = parser.feed(text, final=out.finished)
                        chunks += events.feed(parts, logprobs)
                    if chunks:
                        yield "".join(chunks)
        except Exception as e:
            error = engine_error(e, self.chat.config.retry_after_s)
            tail = events.finish("incomplete")
            failed = run.response("failed", events.items, final,
                                  error=R.ResponseError(code=error.code or "server_error", message=error.message))
            yield "".join(tail) + events.lifecycle("response.failed", failed)
            return
        status = _STATUS.get(final.finish_reason or "stop", "completed") if final is not None else "failed"
        tail = events.finish("incomplete" if status == "incomplete" else "completed")
        response = run.response(status, events.items, final,
                                self._reasoning_tokens(final, any(i.type == "reasoning" for i in events.items)))
        if run.req.store:
            try:
                await self._store(run, response)
            except ApiError as e:
                log.warning("could not store response %s: %s", run.rid, e.message)
        kind = {"incomplete": "response.incomplete", "completed": "response.completed"}.get(status, "response.failed")
        yield "".join(tail) + events.lifecycle(kind, response)

    async def _finish_in_background(self, run: _Run, group: RequestGroup) -> None:
        try:
            await self._store(run, run.response("in_progress", []))
            finals = await self.chat.collect(group)
            response = self._whole(run, finals[0])
        except asyncio.CancelledError:
            group.abort()
            raise
        except Exception as e:
            error = engine_error(e, self.chat.config.retry_after_s)
            response = run.response("failed", [], error=R.ResponseError(code=error.code or "server_error",
                                                                       message=error.message))
        try:
            await self._store(run, response)
        except Exception:
            log.exception("could not store background response %s", run.rid)

    # ---- the store ----------------------------------------------------------------------

    async def _call(self, method: str, *args):
        try:
            return await self.client.call(method, *args)
        except Exception as e:
            raise ApiError(503, f"the response store is not available: {e}", code="engine_unavailable") from None

    async def _store(self, run: _Run, response: R.ResponseObject) -> None:
        await self._call("response_put", run.rid, response.status, run.record(response))

    async def _conversation(self, response_id: str) -> list[dict]:
        found = await self._call("response_get", response_id)
        if found is None:
            raise ApiError(404, f"Response with id '{response_id}' not found.", param="previous_response_id",
                           code="not_found")
        status, blob = found
        if status in ("queued", "in_progress"):
            raise ApiError(400, f"response '{response_id}' is still {status.replace('_', ' ')}; wait for it to "
                                f"finish", param="previous_response_id", code="invalid_value")
        return json.loads(blob)["messages"]


def _plain_parts(text: str) -> ChoiceParts:
    return ChoiceParts(content=text)


def _check_supported(req: R.ResponsesRequest) -> None:
    if req.conversation is not None:
        raise ApiError(400, "conversations are not kept by this server; chain responses with previous_response_id",
                       param="conversation", code="unsupported_parameter")
    if req.prompt is not None:
        raise ApiError(400, "stored prompt templates are not supported; send the input", param="prompt",
                       code="unsupported_parameter")
    if req.truncation == "auto":
        raise ApiError(400, "truncation 'auto' (dropping the conversation's oldest items) is not supported; the "
                            "input must fit the context", param="truncation", code="unsupported_parameter")
    if req.background and not req.store:
        raise ApiError(400, "background responses must be stored: set store=true", param="background",
                       code="invalid_value")
    if req.background and req.stream:
        raise ApiError(400, "streaming a background response is not supported; poll GET /v1/responses/{id}",
                       param="stream", code="unsupported_parameter")
    unknown = sorted(set(req.include or ()) - R.INCLUDE_IGNORED - {R.INCLUDE_LOGPROBS})
    if unknown:
        raise ApiError(400, f"include values {unknown} are not supported", param="include",
                       code="unsupported_parameter")


def _responses_param(param: str | None) -> str | None:
    """A chat request's field named as the Responses request calls it."""
    return {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
            "tools": "tools"}.get(param, param) if param else param


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")


def _stored_response(status: str, blob: bytes) -> Response:
    response = json.loads(blob)["response"]
    if status == "cancelled":
        response["status"] = "cancelled"
    return JSONResponse(response)
