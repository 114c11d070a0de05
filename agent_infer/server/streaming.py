"""What every endpoint's responses share: server-sent events, the per-token chunk fast
path, usage accounting, JSON bodies, and noticing that a client went away."""

from __future__ import annotations

import asyncio
import logging
from json.encoder import encode_basestring as _encode_json_str
from typing import AsyncIterator, Awaitable, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from agent_infer.core.client import RequestGroup
from agent_infer.engine.outputs import RequestOutput
from agent_infer.server import protocol as P
from agent_infer.server.errors import ShuttingDownError, sse_error

log = logging.getLogger(__name__)

T = TypeVar("T")

# Logprobs of masked tokens are -inf, which JSON cannot carry; OpenAI clients expect numbers.
MIN_LOGPROB = -9999.0
DISCONNECTED = 499  # nginx's "client closed request"; nobody reads it
DONE = "data: [DONE]\n\n"


def coalesce(batch: list[tuple[int, RequestOutput]]) -> list[tuple[int, str, RequestOutput, list[int]]]:
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


def sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


# A text no tokenizer produces, written into a chunk once to find where the text goes.
MARK = "\x00agent-infer text\x00"


class TextTemplate:
    """A stream chunk whose only variable part is one string: the event pydantic wrote
    for it with `MARK` as the string, cut around the mark. Filling in a text gives the
    same bytes as serialising the models again (pydantic, like `encode_basestring`,
    escapes quotes, backslashes and control characters and writes other characters as
    they are), at a fraction of the cost: streaming builds one chunk per token."""

    __slots__ = ("head", "tail")

    def __init__(self, event: str):
        head, sep, tail = event.partition(_encode_json_str(MARK))
        if not sep or _encode_json_str(MARK) in tail:
            raise ValueError("the chunk must hold the mark exactly once")
        self.head, self.tail = head, tail

    def fill(self, text: str) -> str:
        return self.head + _encode_json_str(text) + self.tail


def is_shutdown(error: Exception) -> bool:
    return isinstance(error, ShuttingDownError)


def last_write(tail: list[str], error: Exception | None = None, abort_chunks: list[str] = ()) -> str:
    """A stream's last write: its last chunks, then, after an error, the chunks that end
    the choices still open (a shutdown ends them with finish_reason "abort") and the error
    event, then [DONE]."""
    if error is not None:
        tail = [*tail, *abort_chunks, sse_error(error)]
    return "".join([*tail, DONE])


def sse_response(body: AsyncIterator[str], group: RequestGroup) -> StreamingResponse:
    async def abort_leftovers() -> None:
        # Runs once the response is over, also when the client disconnected before the
        # body generator ever started (then its own `async with group` never ran).
        group.abort()

    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(abort_leftovers))


def json_response(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def finite(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # also maps -inf and NaN


class UsageTracker:
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

    def choice_usage(self, k: int) -> P.Usage:
        """The usage a chunk of choice k reports with continuous_usage_stats: its own
        prompt and generated tokens so far (vLLM's rule; the final usage chunk totals)."""
        prompt, completion = self.prompt_lens[k // self.n], self.generated[k]
        return P.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=self.cached[k]))


async def wait_for_disconnect(request: Request) -> None:
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


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it (and returning None) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
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
