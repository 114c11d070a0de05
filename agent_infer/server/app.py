"""The OpenAI-compatible HTTP API of one front end (FastAPI + any ASGI server).

Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses,
GET and DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel, GET /v1/models,
GET /v1/models/{id}, GET /health, GET and POST /ping (SageMaker's health check),
GET /version, GET /metrics, POST /tokenize, POST /detokenize, and POST /invocations
(SageMaker's one endpoint: chat completions, completions or responses, by the body).

The app holds no engine: it talks to the engine core through a CoreClient, and its
chat templates and long texts go to text workers. Its lifespan connects both and closes
them; `errors.py` says how every failure looks to the client.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agent_infer.core.client import CoreClient
from agent_infer.core.protocol import CoreInfo
from agent_infer.loader.tokenizer import load_tokenizer
from agent_infer.server.errors import ApiError, guarded
from agent_infer.server.serving import FrontEndState, ServerConfig
from agent_infer.server.serving_chat import ChatServing
from agent_infer.server.serving_completions import CompletionServing
from agent_infer.server.serving_responses import ResponsesServing
from agent_infer.server.text_workers import TextLimits, TextWorkers
from agent_infer.structured.grammar import GrammarCompiler


@dataclass(frozen=True)
class FrontEndSpec:
    """Everything one front end needs to build its app: where the core is and what it
    serves, the API's settings, and its text workers'."""

    core: CoreInfo
    address: str  # the core's socket
    config: ServerConfig
    text_workers: int = 2  # one may be held by a slow template while the other serves
    limits: TextLimits = field(default_factory=TextLimits)
    name: str = "0"  # which front end, in the metrics


def build_front_end(spec: FrontEndSpec, state: FrontEndState | None = None) -> FastAPI:
    """The app of one front end, with its own tokenizer, client, text workers and grammar
    compiler (for validation: the core compiles what it decodes with)."""
    path = spec.core.tokenizer_path
    client = CoreClient(spec.core, spec.address, load_tokenizer(path) if path is not None else None, spec.name)
    text = grammar = None
    if path is not None:
        text = TextWorkers(path, num_workers=spec.text_workers, limits=spec.limits)
        grammar = GrammarCompiler(lambda: load_tokenizer(path), spec.core.vocab_size, spec.core.eos_token_ids)
    return build_app(client, spec.config, text=text, grammar=grammar, state=state)


def build_app(client: CoreClient, config: ServerConfig, *, text: TextWorkers | None,
              grammar: GrammarCompiler | None, state: FrontEndState | None = None) -> FastAPI:
    """The FastAPI app. Its lifespan starts the text workers and connects the client (on
    the server's event loop), and closes both when the server stops."""
    state = state or FrontEndState()
    completions = CompletionServing(client, config, text, grammar, state)
    chat = ChatServing(client, config, text, grammar, state)
    responses = ResponsesServing(chat)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if text is not None:
            await text.start()
        await client.start()
        try:
            yield
        finally:
            await client.close()
            if text is not None:
                await text.close()

    app = FastAPI(title="agent-infer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.completions = completions
    app.state.chat = chat
    app.state.responses = responses
    app.state.client = client
    app.state.front_end = state

    app.add_api_route("/v1/completions", guarded(completions.completions), methods=["POST"])
    app.add_api_route("/v1/chat/completions", guarded(chat.chat_completions), methods=["POST"])
    app.add_api_route("/v1/responses", guarded(responses.create), methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", guarded(responses.retrieve), methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", guarded(responses.delete), methods=["DELETE"])
    app.add_api_route("/v1/responses/{response_id}/cancel", guarded(responses.cancel), methods=["POST"])
    app.add_api_route("/v1/models", guarded(chat.models), methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", guarded(chat.model), methods=["GET"])
    app.add_api_route("/health", guarded(chat.health), methods=["GET"])
    app.add_api_route("/ping", guarded(chat.health), methods=["GET", "POST"])
    app.add_api_route("/version", guarded(chat.version), methods=["GET"])
    app.add_api_route("/invocations", guarded(invocations_endpoint(chat, completions, responses)), methods=["POST"])
    app.add_api_route("/metrics", guarded(chat.metrics_text), methods=["GET"])
    app.add_api_route("/tokenize", guarded(chat.tokenize), methods=["POST"])
    app.add_api_route("/detokenize", guarded(chat.detokenize), methods=["POST"])

    def send_error(err: ApiError) -> JSONResponse:
        client.notify("http_error", err.status)  # counted in the core: the same totals on every front end
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
        # Last resort (endpoints are guarded): Starlette logs the traceback server side
        # and then re-raises; the client learns nothing internal.
        return send_error(ApiError(500, "internal server error", code="internal_error"))

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_internal_error)
    return app


def invocations_endpoint(chat: ChatServing, completions: CompletionServing, responses: ResponsesServing):
    """POST /invocations (SageMaker sends every request there): the endpoint whose
    request the body is, told by its one required field."""
    async def invocations(request: Request):
        body = await chat.read_json(request)
        if "messages" in body:
            return await chat.chat_completions(request)
        if "prompt" in body:
            return await completions.completions(request)
        if "input" in body:
            return await responses.create(request)
        raise ApiError(400, "an invocation needs 'messages' (chat completions), 'prompt' (completions) or "
                            "'input' (responses)", code="invalid_value")

    return invocations

