"""CoreClient: a front end's side of the engine core, used from one asyncio event loop.

`submit()` sends a group of requests (token ids and sampling settings) and returns a
`RequestGroup`, an async iterator of `(index, RequestOutput)`. The text side of every
request runs here, in the front end, not in the core: incremental detokenization, stop
strings (a request that meets one is finished here and aborted in the core), and the
final text of requests that do not stream. The core sends token ids only.

One reader task takes the core's messages off the socket: each is one engine step's
deltas for this front end, handed to their groups in one go. A group whose consumer
goes away (it leaves `async with group`, normally, by an exception or cancelled) aborts
its requests, which frees their KV blocks in the core at once.

If the core's process exits (killed, crashed), or it says it is dead, every request in
flight fails with EngineDeadError at once and new ones are refused; `on_dead` callbacks
let the front end act on it (answer 503s, then exit).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from agent_infer.core import protocol as P
from agent_infer.core.watch import ProcessWatch
from agent_infer.engine.detokenizer import RequestText
from agent_infer.engine.outputs import RequestOutput
from agent_infer.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# After the core's process exits: how long the reader must have been quiet before requests
# in flight are failed, and the longest wait (a killed core sends nothing more).
_DRAIN_QUIET_S = 0.1
_DRAIN_MAX_S = 1.0


# ---- errors --------------------------------------------------------------------------------


class QueueFullError(RuntimeError):
    """The core refused the group: it would overflow the waiting queue."""


class EngineDeadError(RuntimeError):
    """The engine core is not running (shut down, crashed or killed)."""


class EngineFailedError(RuntimeError):
    """The engine raised while this request was in flight; details are in the server log."""


class RequestRejectedError(ValueError):
    """The engine refused the request (e.g. a prompt as long as the context)."""


# ---- requests and their outputs ---------------------------------------------------------


@dataclass(frozen=True)
class EngineRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the text, when the prompt was text (reported back in outputs)
    request_id: str | None = None  # reported back in outputs; drawn when None
    stream: bool = True  # text per token (False: decoded once at the end)
    cache_salt: str | None = None  # prefix-cache blocks are shared only under the same salt


class _Stream:
    """One request's state in the front end: its tokens so far and its text."""

    __slots__ = ("group", "index", "request_id", "request", "text", "token_ids", "logprobs", "prompt_logprobs")

    def __init__(self, group: "RequestGroup", index: int, request_id: str, request: EngineRequest, tokenizer):
        self.group = group
        self.index = index
        self.request_id = request_id
        self.request = request
        self.text = RequestText(tokenizer, request.prompt_token_ids, request.params, request.stream)
        self.token_ids: list[int] = []
        self.logprobs = [] if request.params.logprobs is not None else None
        self.prompt_logprobs = None

    def apply(self, d: P.Delta) -> tuple[RequestOutput, bool]:
        """The output after this delta, and whether a stop string ended the request here
        (then the core does not know yet, and later tokens are dropped)."""
        req = self.request
        if d.error is not None:
            return RequestOutput(self.request_id, req.prompt, req.prompt_token_ids, [], "", True, error=d.error), False
        new = d.token_ids
        stopped = False
        if self.text.detok is not None:
            for k, token in enumerate(new):
                if self.text.add_token(token) is not None:
                    new, stopped = new[:k + 1], True
                    break
        self.token_ids.extend(new)
        if d.logprobs and self.logprobs is not None:
            self.logprobs.extend(d.logprobs[:len(new)])
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        finish_reason = "stop" if stopped else d.finish_reason
        finished = finish_reason is not None
        stop_reason = self.text.stopped_by if stopped else (d.stop_token if finish_reason == "stop" else None)
        text, delta = self.text.texts(self.token_ids, finished)
        out = RequestOutput(
            request_id=self.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            token_ids=self.token_ids, text=text, finished=finished, finish_reason=finish_reason,
            delta_text=delta, delta_token_ids=new, num_cached_tokens=d.num_cached_tokens, logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs, stop_reason=stop_reason)
        return out, stopped


class RequestGroup:
    """The outputs of requests submitted together (e.g. the `n` choices of one HTTP
    request), as an async iterator of `(index, RequestOutput)`.

    `await group.admitted()` first: it raises QueueFullError or EngineDeadError if the core
    refused the group. Use it as `async with group:` — leaving the block aborts every
    member that has not finished. A RequestOutput's `token_ids` (and `logprobs`) is the
    request's list, which grows as it runs: copy it to keep one step's state.
    """

    def __init__(self, client: "CoreClient", request_ids: list[str], ids: list[int]):
        self._client = client
        self.request_ids = request_ids
        self._ids = ids  # the core's names for the members
        # Outputs not read yet, and the future a reader waits on while there are none: a
        # plain deque and one future cost less than an asyncio.Queue per token.
        self._items: deque[tuple[int, object]] = deque()
        self._waiter: asyncio.Future | None = None
        self._open = set(range(len(request_ids)))
        self._error: Exception | None = None  # raised by the next read (see next_batch)
        self._admission: asyncio.Future = asyncio.get_running_loop().create_future()

    @property
    def finished(self) -> bool:
        return not self._open

    async def admitted(self) -> None:
        await asyncio.shield(self._admission)

    def __aiter__(self) -> "RequestGroup":
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if self._error is not None:
            raise self._error
        if not self._open:
            raise StopAsyncIteration
        if not self._items:
            await self._wait()
        return self._accept(*self._items.popleft())

    async def next_batch(self) -> list[tuple[int, RequestOutput]]:
        """At least one output, plus every other one already queued, so that a consumer
        that fell behind catches up in one go. Empty once every member has finished."""
        if self._error is not None:
            raise self._error
        if not self._open:
            return []
        if not self._items:
            await self._wait()
        items = self._items
        batch = [self._accept(*items.popleft())]
        while self._open and items:
            try:
                batch.append(self._accept(*items.popleft()))
            except Exception as e:  # hand out what came before it first
                self._error = e
                break
        return batch

    async def _wait(self) -> None:
        while not self._items:
            if self._waiter is None or self._waiter.done():
                self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    def _accept(self, index: int, item) -> tuple[int, RequestOutput]:
        if isinstance(item, BaseException):
            self._open.discard(index)
            raise item
        if item.rejected:
            self._open.discard(index)
            raise RequestRejectedError(item.error)
        if item.finished:
            self._open.discard(index)
        return index, item

    def abort(self) -> None:
        """Abort the members that have not finished (harmless for those that just did)."""
        if self._open:
            self._client._abort([self._ids[i] for i in sorted(self._open)])
            self._open.clear()

    async def __aenter__(self) -> "RequestGroup":
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()

    def _put(self, index: int, item) -> None:
        self._items.append((index, item))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _settle(self, error: BaseException | None) -> None:
        if not self._admission.done():
            if error is None:
                self._admission.set_result(None)
            else:
                self._admission.set_exception(error)


# ---- the client ---------------------------------------------------------------------------


class CoreClient:
    def __init__(self, info: P.CoreInfo, address: str, tokenizer=None, name: str = "0"):
        self.info = info
        self.address = address
        self.name = name  # this front end, in the core's metrics
        # Text work is the front end's: its own tokenizer (None: token ids only).
        self.tokenizer = tokenizer
        self._ctx: zmq.asyncio.Context | None = None
        self._sock = None
        self._encode = P.encoder().encode
        self._decode = P.front_end_decoder().decode
        self._streams: dict[int, _Stream] = {}
        self._admitting: dict[int, RequestGroup] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._id_prefix = uuid.uuid4().hex[:8]
        self._reader: asyncio.Task | None = None
        self._watch: ProcessWatch | None = None
        self._watcher: asyncio.Task | None = None
        self._dead_reason: str | None = "the engine core is not connected yet"
        self._received = 0  # messages read from the core (the drain after its exit watches it)
        self._on_dead: list[Callable[[str], None]] = []

    # ---- facts about the engine --------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def model_type(self) -> str:
        return self.info.model_type

    @property
    def max_waiting(self) -> int:
        return self.info.max_waiting

    @property
    def is_running(self) -> bool:
        return self._dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    @property
    def num_in_flight(self) -> int:
        """Requests this front end has in the core (or on their way there)."""
        return len(self._streams)

    def on_dead(self, callback: Callable[[str], None]) -> None:
        self._on_dead.append(callback)

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and start reading; from the loop that will use the client."""
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        self._sock = sock
        self._dead_reason = None
        self._send(P.Hello(os.getpid(), self.name))
        self._reader = asyncio.create_task(self._read(), name="agent-infer-core-reader")
        self._watch = ProcessWatch.of(self.info.pid)
        self._watcher = asyncio.create_task(self._watch_core(), name="agent-infer-core-watch")

    async def close(self) -> None:
        self._die("the front end is shutting down", notify=False)
        tasks = [t for t in (self._reader, self._watcher) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._watch is not None:
            self._watch.close()
        if self._sock is not None:
            self._sock.close(linger=200)  # the last aborts may still be on their way
            self._ctx.term()
            self._sock = None

    # ---- requests -----------------------------------------------------------------------------

    def submit(self, requests: list[EngineRequest], tag: str | None = None) -> RequestGroup:
        """Send requests as one group, all or none; from the client's loop. Await the
        group's `admitted()` before reading it. Raises EngineDeadError at once when the
        core is known to be gone. `tag`: the stored response the group runs for."""
        if not requests:
            raise ValueError("submit() needs at least one request")
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        ids = [next(self._ids) for _ in requests]
        names = [r.request_id or f"req-{self._id_prefix}-{i}" for r, i in zip(requests, ids)]
        group = RequestGroup(self, names, ids)
        for index, (req, fe_id, name) in enumerate(zip(requests, ids, names)):
            self._streams[fe_id] = _Stream(group, index, name, req, self.tokenizer)
        group_id = ids[0]
        self._admitting[group_id] = group
        items = [P.AddItem(fe_id, req.prompt_token_ids, req.params, req.cache_salt)
                 for fe_id, req in zip(ids, requests)]
        self._send(P.Add(group_id, items, time.monotonic(), tag))
        return group

    def _abort(self, ids: list[int]) -> None:
        for fe_id in ids:
            self._streams.pop(fe_id, None)
        if self._dead_reason is None:
            self._send(P.Abort(ids))

    def abort_all(self, error: Exception) -> int:
        """End every request in flight with `error` and abort them in the core (a front end
        whose time to drain is up); the number ended."""
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.group._put(stream.index, error)
        if streams and self._dead_reason is None:
            self._send(P.Abort(list(streams)))
        return len(streams)

    async def call(self, method: str, *args, timeout_s: float = 10.0):
        """A utility call to the core (`snapshot`, `metrics`); EngineDeadError if it is gone."""
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(P.Call(call_id, method, list(args)))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._calls.pop(call_id, None)

    async def snapshot(self) -> P.EngineSnapshot:
        return msgspec.convert(await self.call("snapshot"), P.EngineSnapshot)

    def notify(self, method: str, *args) -> None:
        """A call that needs no answer (e.g. counting an HTTP error in the core's metrics)."""
        if self._dead_reason is None:
            self._send(P.Call(0, method, list(args)))

    def _send(self, message) -> None:
        # HWM 0: a send never waits, so the returned future is done (or failed on close).
        self._sock.send(self._encode(message), copy=False)

    # ---- the reader ---------------------------------------------------------------------------

    async def _read(self) -> None:
        try:
            while True:
                message = self._decode((await self._sock.recv(copy=False)).buffer)
                self._received += 1
                if isinstance(message, P.Outputs):
                    self._on_outputs(message)
                elif isinstance(message, P.Reply):
                    self._on_reply(message)
                elif isinstance(message, P.Dead):
                    self._die(f"the engine core stopped: {message.reason}")
                    return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("reading from the engine core failed")
            self._die("the connection to the engine core broke")

    def _on_outputs(self, msg: P.Outputs) -> None:
        for group_id in msg.admitted:
            group = self._admitting.pop(group_id, None)
            if group is not None:
                group._settle(None)
        for refusal in msg.refused:
            group = self._admitting.pop(refusal.group, None)
            if group is not None:
                for fe_id in group._ids:
                    self._streams.pop(fe_id, None)
                error = QueueFullError(refusal.message) if refusal.code == "queue_full" else EngineDeadError(
                    refusal.message)
                group._open.clear()
                group._settle(error)
        for failure in msg.failed:
            for fe_id in failure.ids:
                stream = self._streams.pop(fe_id, None)
                if stream is not None:
                    stream.group._put(stream.index, EngineFailedError(failure.message))
        stopped, broken = [], []
        streams = self._streams
        for delta in msg.deltas:
            stream = streams.get(delta.id)
            if stream is None:
                continue  # aborted here already (the client left, or a stop string)
            try:
                out, hit_stop = stream.apply(delta)
            except Exception:  # a bug in one request's text must not take the others down
                log.exception("processing the output of request %s failed", stream.request_id)
                del streams[delta.id]
                broken.append(delta.id)
                stream.group._put(stream.index, EngineFailedError("the server could not process this request's "
                                                                  "output; see the server log"))
                continue
            if out.finished:
                del streams[delta.id]
                if hit_stop and delta.finish_reason is None:
                    stopped.append(delta.id)
            stream.group._put(stream.index, out)
        if self._dead_reason is None:
            if stopped:
                self._send(P.Abort(stopped, reason="stop"))
            if broken:
                self._send(P.Abort(broken))

    def _on_reply(self, reply: P.Reply) -> None:
        future = self._calls.get(reply.call_id)
        if future is None or future.done():
            return
        if reply.error is not None:
            future.set_exception(RuntimeError(reply.error))
        else:
            future.set_result(reply.result)

    # ---- the core going away --------------------------------------------------------------------

    async def _watch_core(self) -> None:
        watch = self._watch
        if watch.fd is not None:
            ready = asyncio.get_running_loop().create_future()
            loop = asyncio.get_running_loop()
            loop.add_reader(watch.fd, lambda: ready.done() or ready.set_result(None))
            try:
                await ready
            finally:
                loop.remove_reader(watch.fd)
        else:
            while not watch.exited():
                await asyncio.sleep(0.25)
        await self._drain()
        self._die("the engine core process exited")

    async def _drain(self) -> None:
        """Let the reader take the core's last messages before failing what is in flight:
        a core that fails a request (or says why it stops) and exits sends those words
        first, but they cross a socket while its exit is seen at once. A request the core
        failed must end with that failure, not with "the engine is gone". Waits until the
        reader has been quiet for a moment, bounded, since a killed core says nothing."""
        deadline = time.monotonic() + _DRAIN_MAX_S
        while self._dead_reason is None and time.monotonic() < deadline:
            seen = self._received
            await asyncio.sleep(_DRAIN_QUIET_S)
            if self._received == seen:
                return

    def _die(self, reason: str, notify: bool = True) -> None:
        """Fail everything in flight; with `notify`, the core is gone (log it, tell the
        on_dead callbacks) rather than this front end closing."""
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        if notify:
            log.error("%s; failing %d request(s) in flight", reason, len(self._streams))
        error = EngineDeadError(reason)
        for group in self._admitting.values():
            group._settle(error)
        self._admitting.clear()
        for stream in self._streams.values():
            stream.group._put(stream.index, error)
        self._streams.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        for callback in self._on_dead if notify else ():
            try:
                callback(reason)
            except Exception:
                log.exception("on_dead callback failed")
