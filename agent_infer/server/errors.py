"""OpenAI's error JSON, and how the engine's errors map onto it.

Every error is `{"error": {"message", "type", "param", "code"}}`: 400 for bad input, 404
for an unknown model or route, 503 + Retry-After when the waiting queue is full or the
server is shutting down, 503 when the engine core is gone, 415 for a body that is not
application/json, 500 (with no internals) when something broke.
"""

from __future__ import annotations

import functools
import json
import logging

from starlette.exceptions import HTTPException as StarletteHTTPException

from agent_infer.core.client import EngineDeadError, EngineFailedError, QueueFullError, RequestRejectedError
from agent_infer.server import protocol as P

log = logging.getLogger(__name__)


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


class ShuttingDownError(RuntimeError):
    """The server stopped this request: it is shutting down and the drain time is over."""


def guarded(endpoint):
    """Turn an unexpected exception of an endpoint into a logged, bare 500 ApiError (the
    traceback goes to the server log, never to the client)."""

    @functools.wraps(endpoint)
    async def wrapper(*args, **kwargs):
        try:
            return await endpoint(*args, **kwargs)
        except (ApiError, StarletteHTTPException):
            raise
        except Exception:
            log.exception("%s failed", endpoint.__name__)
            raise ApiError(500, "internal server error", code="internal_error") from None

    return wrapper


def engine_error(e: Exception, retry_after_s: int = 1) -> ApiError:
    """The ApiError for an exception raised while a request group runs."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RequestRejectedError):
        return ApiError(400, str(e), param="prompt", code="context_length_exceeded")
    if isinstance(e, QueueFullError):
        return ApiError(503, str(e), code="queue_full", headers={"Retry-After": str(retry_after_s)})
    if isinstance(e, EngineDeadError):
        return ApiError(503, f"the engine is not available: {e}", code="engine_unavailable")
    if isinstance(e, ShuttingDownError):
        return ApiError(503, str(e), code="server_shutting_down", headers={"Retry-After": str(retry_after_s)})
    if isinstance(e, EngineFailedError):
        return ApiError(500, str(e), code="engine_error")
    log.error("request failed", exc_info=e)
    return ApiError(500, "internal server error", code="internal_error")


def sse_error(e: Exception) -> str:
    """An error inside a stream that has already sent its headers: one error event."""
    return f"data: {json.dumps(engine_error(e).body())}\n\n"
