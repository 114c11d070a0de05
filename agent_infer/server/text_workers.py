"""Worker processes for the front end's heavy text work: chat templates and long prompts.

A chat template is code, and a request may bring its own: it can loop for hours or build a
string larger than the machine's memory. A thread cannot be stopped, so every render runs in
a worker process, which is killed (and replaced) when it overruns its wall-clock limit; its
output is counted while it is produced and stopped at a limit. Long texts are tokenized
there too, so that a tokenizer never blocks the event loop for long. Short texts are
tokenized inline, where the round trip would cost more than the work.

The workers are `spawn`ed: like any such process they re-import the parent's main module,
so a script that starts a pool must keep its top level behind `if __name__ == "__main__"`.

The parent talks to each worker over its own socket pair, as asyncio streams on its side:
waiting for a worker costs no thread and no polling, and a request or answer of megabytes
is written and read a piece at a time between the event loop's other work.

This module imports neither torch nor transformers: the workers (and `start()`, for the
inline tokenizer) import the tokenizer's module when they need it.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

logger = logging.getLogger(__name__)

# A worker imports transformers (and with it torch) and loads the tokenizer before it
# answers: slow on a cold disk, so generous.
_START_TIMEOUT_S = 300.0
# How long close() waits after SIGTERM, then after SIGKILL.
_TERMINATE_GRACE_S = 1.0
_KILL_GRACE_S = 2.0
# How often a killed worker is checked for having exited, so that it is reaped.
_REAP_POLL_S = 0.02
_REAP_TIMEOUT_S = 10.0
# A replacement that fails to start is retried after this, doubling up to the cap.
_RESTART_DELAY_S = 0.5
_RESTART_DELAY_CAP_S = 30.0
# How often a worker checks that its parent is still alive (a busy worker reads no socket).
_ORPHAN_POLL_S = 0.5
# Every message is its pickle's length, then the pickle.
_HEADER = struct.Struct("!Q")
# The parent's stream buffers this much of a worker's output before it stops reading.
_STREAM_LIMIT = 1 << 20
# A prompt's text and ids come back in messages of at most these many, so that unpickling
# one message never holds the event loop for long, however long the prompt.
_TEXT_CHARS_PER_MESSAGE = 1 << 16
_IDS_PER_MESSAGE = 1 << 14
WORKER_NICENESS = 10  # added to the front end's: see _worker_main
# Error messages cross to clients; some (transformers' continue_final_message check)
# quote the whole rendered chat.
_MAX_MESSAGE_CHARS = 2_000


@dataclass(frozen=True)
class TextLimits:
    template_timeout_s: float = 5.0  # wall-clock limit of one render (its tokenization: encode_timeout_s)
    # Far more than a prompt filling the longest context windows takes, and far less than
    # would strain a worker's memory (the string, and the tokenizer's work on it, are a
    # small multiple of it in bytes).
    max_template_output_chars: int = 16 * 1024 * 1024
    inline_encode_chars: int = 16_384  # texts up to this long are encoded inline in the caller's process
    # Tokenizing runs no client code and takes time in proportion to the text, which the
    # server's body limit bounds: this only catches a worker that stopped answering, so it
    # is sized for the largest prompt a server accepts, not for templates.
    encode_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.template_timeout_s <= 0 or self.encode_timeout_s <= 0:
            raise ValueError("TextLimits timeouts must be positive")
        if self.max_template_output_chars < 1 or self.inline_encode_chars < 0:
            raise ValueError("TextLimits sizes must be positive")


class TemplateError(ValueError):
    """A chat template (or a text) that could not be turned into a prompt; `str()` is
    meant for the client. `code`: template_error, template_timeout,
    template_output_too_large, encode_error, encode_timeout, worker_died."""

    def __init__(self, message: str, code: str = "template_error"):
        super().__init__(message)
        self.code = code


class TextWorkers:
    """A pool of worker processes that render chat templates and tokenize long texts,
    used from one asyncio event loop (the one `start()` runs on)."""

    def __init__(self, tokenizer_path: str, *, num_workers: int = 2, limits: TextLimits = TextLimits()):
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self._path = tokenizer_path
        self._num_workers = num_workers
        self._limits = limits
        self._ctx = multiprocessing.get_context("spawn")
        self._tokenizer = None
        self._workers: set[_Worker] = set()  # every started process not yet reaped
        self._idle: asyncio.Queue[_Worker | None] | None = None  # None: the pool closed
        self._tasks: set[asyncio.Task] = set()  # replacements and reapers
        self._closed = False

    @property
    def tokenizer(self) -> Any:
        """The tokenizer loaded in this process, for inline work (None before start())."""
        return self._tokenizer

    @property
    def pids(self) -> list[int]:
        """The process ids of the workers in service or starting."""
        return [w.proc.pid for w in self._workers if not w.retired and w.proc.pid is not None]

    @property
    def num_idle(self) -> int:
        """Workers started and waiting for work."""
        return sum(1 for w in self._workers if w.in_service and not w.retired and not w.busy)

    async def start(self) -> None:
        """Spawn the workers and wait until each has loaded its tokenizer; load the inline one."""
        if self._idle is not None:
            raise RuntimeError("TextWorkers.start() was already called")
        loop = asyncio.get_running_loop()
        self._idle = asyncio.Queue()
        inline = loop.run_in_executor(None, _load_tokenizer, self._path)
        try:
            workers = [await self._spawn() for _ in range(self._num_workers)]
            self._tokenizer = await inline
            await asyncio.gather(*(w.wait_ready(_START_TIMEOUT_S) for w in workers))
        except BaseException:
            await self.close()
            raise
        for w in workers:
            self._put_in_service(w)

    async def close(self) -> None:
        """Stop every worker: SIGTERM, then SIGKILL for any still there; bounded in time."""
        if self._closed:
            return
        self._closed = True
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        workers = list(self._workers)
        for w in workers:
            w.stop(kill=False)
        await _wait_exited([w.proc for w in workers], _TERMINATE_GRACE_S)
        for w in workers:
            w.stop(kill=True)
        await _wait_exited([w.proc for w in workers], _KILL_GRACE_S)
        self._workers.clear()
        if self._idle is not None:
            self._idle.put_nowait(None)  # wakes any caller waiting for a worker

    async def render_chat(self, messages: list[dict], *, add_generation_prompt: bool, continue_final_message: bool,
                          tools: list[dict] | None, chat_template: str | None,
                          template_kwargs: dict) -> tuple[str, list[int]]:
        """The rendered prompt and its ids (encoded with add_special_tokens=False: the
        template carries any BOS), as ChatFormatter.render and tokenizer.encode give them."""
        request = ("render", {"messages": messages, "add_generation_prompt": add_generation_prompt,
                              "continue_final_message": continue_final_message, "tools": tools,
                              "chat_template": chat_template, "template_kwargs": dict(template_kwargs or {})})
        text, ids = await self._call(request, rendering=True)
        return text, ids

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The ids of `text`: inline when it is short, in a worker when it is long."""
        if len(text) <= self._limits.inline_encode_chars:
            return self._encode_inline(text, add_special_tokens)
        _, ids = await self._call(("encode", text, add_special_tokens), rendering=False)
        return ids

    def _encode_inline(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._tokenizer is None:
            raise RuntimeError("TextWorkers.start() has not been called")
        try:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as e:  # the same error a worker would give for a long text
            raise TemplateError(*_encode_failure(e)) from None

    async def _call(self, request: tuple, *, rendering: bool) -> tuple[Any, list[int]]:
        data = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)  # a bad request fails here, at once
        worker = await self._acquire()
        exchange = asyncio.ensure_future(self._exchange(worker, data, rendering))
        # A caller cancelled mid-way (a client gone) must not strand the worker: the
        # exchange goes on, then hands the worker back or kills it at its deadline.
        exchange.add_done_callback(_retrieve_exception)
        return await asyncio.shield(exchange)

    async def _acquire(self) -> _Worker:
        if self._idle is None:
            raise RuntimeError("TextWorkers.start() has not been called")
        while True:
            if self._closed:
                raise RuntimeError("the text workers are closed")
            worker = await self._idle.get()
            if worker is None:
                self._idle.put_nowait(None)  # pass the wake-up on to the next waiter
                continue
            if not worker.retired:  # a worker that died while idle was already replaced
                worker.busy = True
                return worker

    async def _exchange(self, worker: _Worker, data: bytes, rendering: bool) -> tuple[str | None, list[int]]:
        limits = self._limits
        while True:
            try:
                # Sending takes as long as the request is large, never as long as a template runs.
                rendered, reply = await asyncio.wait_for(worker.ask(data), limits.encode_timeout_s)
                break
            except (OSError, asyncio.TimeoutError):
                # It died (or stopped reading) while idle, before that was seen: the
                # request never reached a live worker, so another may take it.
                logger.warning("text worker %s was found dead; its request goes to another", worker.proc.pid)
                self._retire(worker)
                worker = await self._acquire()
        try:
            if rendering:
                await _within(rendered, limits.template_timeout_s, lambda: TemplateError(
                    f"the chat template did not finish rendering within {limits.template_timeout_s} s",
                    code="template_timeout"))
            message, text, ids = await _within(reply, limits.encode_timeout_s, lambda: TemplateError(
                f"tokenizing the {'rendered prompt' if rendering else 'text'} did not finish within "
                f"{limits.encode_timeout_s} s", code="encode_timeout"))
        except TemplateError:
            logger.warning("killing text worker %s: it overran its time limit", worker.proc.pid)
            self._retire(worker)
            raise
        except _WorkerDied:
            raise self._lost(worker, rendering) from None
        self._release(worker)
        if message[0] == "error":
            raise TemplateError(message[2], code=message[1])
        return (text if message[1] else None), ids

    def _lost(self, worker: _Worker, rendering: bool) -> Exception:
        """Retire a worker that died under a request; the error for its caller."""
        self._retire(worker)
        if self._closed:
            return RuntimeError("the text workers were closed")
        what = "rendering the chat template" if rendering else "tokenizing the text"
        return TemplateError(f"the text worker stopped while {what} (it may have run out of memory)",
                             code="worker_died")

    def _release(self, worker: _Worker) -> None:
        worker.busy = False
        if worker.retired or self._closed or self._idle is None:
            return
        self._idle.put_nowait(worker)

    async def _spawn(self) -> _Worker:
        worker = _Worker(self._ctx, self._path, self._limits.max_template_output_chars, on_death=self._retire)
        self._workers.add(worker)  # from here on close() stops it, whatever happens next
        try:
            await worker.start()
        except BaseException:
            self._retire(worker)
            raise
        return worker

    def _put_in_service(self, worker: _Worker) -> None:
        worker.in_service = True
        self._release(worker)

    def _retire(self, worker: _Worker) -> None:
        """Kill a worker (if it still runs), reap it, and start a replacement. Idempotent."""
        if worker.retired:
            return
        worker.retired = True
        if self._closed:  # close() signals and reaps every process itself
            worker.detach()
            return
        worker.stop(kill=True)
        self._background(self._reap(worker))
        if worker.in_service:
            self._background(self._replace())

    async def _reap(self, worker: _Worker) -> None:
        await _wait_exited([worker.proc], _REAP_TIMEOUT_S)
        if worker.proc.exitcode is not None:
            self._workers.discard(worker)
            if worker.in_service:
                logger.info("text worker %s exited with code %s", worker.proc.pid, worker.proc.exitcode)

    async def _replace(self) -> None:
        delay = _RESTART_DELAY_S
        while not self._closed:
            worker = None
            try:
                worker = await self._spawn()
                await worker.wait_ready(_START_TIMEOUT_S)
            except Exception as e:  # e.g. no memory to fork: try again later, not never
                logger.warning("a replacement text worker failed to start (retrying in %.1f s): %s", delay, e)
                if worker is not None:
                    self._retire(worker)
                await asyncio.sleep(delay)
                delay = min(2 * delay, _RESTART_DELAY_CAP_S)
                continue
            self._put_in_service(worker)
            return

    def _background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_retrieve_exception)


class _WorkerDied(Exception):
    pass


class _Worker:
    """One worker process and the parent's end of its socket, as asyncio streams: sending
    a large request or reading a large answer never blocks the event loop."""

    def __init__(self, ctx, tokenizer_path: str, max_output_chars: int, on_death):
        self._sock, child_sock = socket.socketpair()
        self._child_sock = child_sock
        self.proc = ctx.Process(target=_worker_main, args=(child_sock, tokenizer_path, max_output_chars, os.getpid()),
                                name="agent-infer-text-worker", daemon=True)
        self._on_death = on_death
        self._writer: asyncio.StreamWriter | None = None
        self._read_task: asyncio.Task | None = None
        self._rendered: asyncio.Future | None = None  # a render's text is done; its tokenization runs
        self._reply: asyncio.Future | None = None  # the final message of the current request
        self._text: list[str] = []
        self._ids: list[int] = []
        self.in_service = False  # passed its start: a death is then replaced
        self.busy = False  # handed to a request
        self.retired = False

    async def start(self) -> None:
        # Its first message says whether it loaded the tokenizer.
        self._reply = asyncio.get_running_loop().create_future()
        try:
            self.proc.start()
        finally:
            # The parent must not keep the child's end open, or the socket would never
            # report EOF when the worker dies.
            self._child_sock.close()
        reader, self._writer = await asyncio.open_unix_connection(sock=self._sock, limit=_STREAM_LIMIT)
        self._read_task = asyncio.ensure_future(self._read(reader))

    async def wait_ready(self, timeout: float) -> None:
        try:
            message, _, _ = await asyncio.wait_for(self._reply, timeout)
        except _WorkerDied:
            code = self.proc.exitcode
            raise RuntimeError("a text worker exited while starting"
                               + (f" (exit code {code})" if code is not None else "")) from None
        except asyncio.TimeoutError:
            raise RuntimeError(f"a text worker did not start within {timeout} s") from None
        if message[0] != "ready":
            raise RuntimeError(f"a text worker could not load the tokenizer: {message[1]}")

    async def ask(self, data: bytes) -> tuple[asyncio.Future, asyncio.Future]:
        """Send a pickled request; futures for the end of its rendering and for its final message."""
        if self._writer is None:
            raise ConnectionResetError("the text worker is detached")
        loop = asyncio.get_running_loop()
        self._rendered, self._reply, self._text, self._ids = loop.create_future(), loop.create_future(), [], []
        self._writer.write(_HEADER.pack(len(data)))
        self._writer.write(memoryview(data))  # what the socket does not take at once is copied, once
        await self._writer.drain()
        return self._rendered, self._reply

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                self._dispatch(pickle.loads(await reader.readexactly(size)))
        except Exception:  # EOF (the worker died) or a broken message: the worker is of no use
            pass
        self._read_task = None
        self.detach()
        self._on_death(self)

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "text":
            self._text.append(message[1])
        elif kind == "ids":
            self._ids.extend(message[1])
        elif kind == "rendered":
            _resolve(self._rendered, None)
        else:  # a final message: ready, failed, ok or error
            _resolve(self._rendered, None)
            _resolve(self._reply, (message, "".join(self._text), self._ids))
            self._text, self._ids = [], []

    def _fail_pending(self) -> None:
        for fut in (self._rendered, self._reply):
            if fut is not None and not fut.done():
                fut.set_exception(_WorkerDied())
                fut.exception()  # retrieved here: nobody may be waiting on it any more

    def detach(self) -> None:
        """Stop reading and writing its socket and fail whatever waits on this worker."""
        if self._read_task is not None:
            self._read_task.cancel()
            self._read_task = None
        if self._writer is not None:
            self._writer.transport.abort()
            self._writer = None
        else:
            self._sock.close()  # never handed to a transport (closing twice is harmless)
        self._fail_pending()

    def stop(self, kill: bool) -> None:
        """Detach, and signal the process (SIGKILL, or SIGTERM) unless it has exited."""
        self.detach()
        if self.proc.pid is None or self.proc.exitcode is not None:
            return
        try:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
        except OSError:  # already gone
            pass


def _resolve(fut: asyncio.Future | None, value: Any) -> None:
    if fut is not None and not fut.done():
        fut.set_result(value)


async def _within(fut: asyncio.Future, timeout: float, error) -> Any:
    try:
        return await asyncio.wait_for(fut, timeout)
    except asyncio.TimeoutError:
        raise error() from None


async def _wait_exited(procs: list, timeout: float) -> None:
    """Until every process has exited (and is reaped: is_alive() waits for it), or timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while any(p.pid is not None and p.is_alive() for p in procs) and loop.time() < deadline:
        await asyncio.sleep(_REAP_POLL_S)


def _retrieve_exception(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


def _load_tokenizer(path: str):
    from agent_infer.loader.tokenizer import load_tokenizer

    return load_tokenizer(path)


# ---------------------------------------------------------------------------------------
# The worker process


class _OutputTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"the chat template's output exceeds the limit of {limit:,} characters")


def _worker_main(sock: socket.socket, tokenizer_path: str, max_output_chars: int, parent_pid: int) -> None:
    # Ctrl-C reaches the whole process group: the parent decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_when_orphaned(parent_pid)
    # Bulk work (a long template, a huge text) yields the CPU to the front end's event
    # loop and the engine core, which answer every other client meanwhile.
    os.nice(WORKER_NICENESS)
    try:
        from agent_infer.loader.tokenizer import load_tokenizer, tokenizers_only

        tokenizers_only()
        tokenizer = load_tokenizer(tokenizer_path)
        _bound_template_output(max_output_chars)
    except Exception as e:
        _send(sock, ("failed", _clip(_describe(e))))
        return
    _send(sock, ("ready",))
    try:
        while True:
            for message in _serve(tokenizer, _receive(sock)):
                _send(sock, message)
    except (EOFError, OSError):  # the parent closed its end: it is closing or gone
        return


def _send(sock: socket.socket, message: tuple) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)))
    sock.sendall(data)


def _receive(sock: socket.socket) -> Any:
    (size,) = _HEADER.unpack(_receive_exactly(sock, _HEADER.size))
    return pickle.loads(_receive_exactly(sock, size))


def _receive_exactly(sock: socket.socket, size: int) -> bytearray:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError
        got += n
    return buf


def _exit_when_orphaned(parent_pid: int) -> None:
    """A busy worker reads no socket, so it would not see its parent's end close: a thread
    watches for the parent going away instead."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_ORPHAN_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


def _bound_template_output(limit: int) -> None:
    """Make every jinja template in this process stop once its output passes `limit`.

    transformers renders a chat template with `compiled_template.render(...)`, which
    builds the whole string before returning it. Here `render` consumes `generate()`,
    which yields the output piece by piece as it renders, and stops when the count passes
    the limit; sequence repetition (`'x' * n`), which makes one piece as large as it
    likes, is checked before it runs. Replacing these process-wide is safe because this
    process renders nothing but chat templates, all under the same limit.
    """
    import jinja2.environment
    import jinja2.sandbox

    template_cls = jinja2.environment.Template
    generate = template_cls.generate

    def bounded_generate(self, *args: Any, **kwargs: Any) -> Iterator[str]:
        count = 0
        for piece in generate(self, *args, **kwargs):
            count += len(piece)
            if count > limit:
                raise _OutputTooLarge(limit)
            yield piece

    def bounded_render(self, *args: Any, **kwargs: Any) -> str:
        return self.environment.concat(bounded_generate(self, *args, **kwargs))

    template_cls.generate = bounded_generate
    template_cls.render = bounded_render

    sandbox_cls = jinja2.sandbox.SandboxedEnvironment
    call_binop = sandbox_cls.call_binop

    def bounded_call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            _check_repetition(left, right, limit)
        return call_binop(self, context, operator, left, right)

    # Read when a template is compiled: templates compiled from here on call
    # call_binop for `*` (and jinja no longer folds such constants at compile time).
    sandbox_cls.intercepted_binops = frozenset(sandbox_cls.intercepted_binops | {"*"})
    sandbox_cls.call_binop = bounded_call_binop


def _check_repetition(left: Any, right: Any, limit: int) -> None:
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > limit:
            raise _OutputTooLarge(limit)


def _serve(tokenizer, request: tuple) -> Iterator[tuple]:
    """The messages that answer one request; the last one is "ok" or "error"."""
    if request[0] == "render":
        yield from _serve_render(tokenizer, **request[1])
    else:
        _, text, add_special_tokens = request
        yield from _serve_encode(tokenizer, text, add_special_tokens, with_text=False)


def _serve_render(tokenizer, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                  tools: list[dict] | None, chat_template: str | None, template_kwargs: dict) -> Iterator[tuple]:
    from agent_infer.loader.tokenizer import ChatFormatter

    try:
        text = ChatFormatter(tokenizer, chat_template).render(
            messages, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tools=tools, **template_kwargs)
    except Exception as e:
        yield ("error", *_template_failure(e))
        return
    yield ("rendered",)
    # The template already carries any BOS: no special tokens are added again.
    yield from _serve_encode(tokenizer, text, False, with_text=True)


def _serve_encode(tokenizer, text: str, add_special_tokens: bool, with_text: bool) -> Iterator[tuple]:
    """The ids of `text` (and the text, if `with_text`), in pieces, then ("ok", with_text)."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except Exception as e:
        yield ("error", *_encode_failure(e))
        return
    if with_text:
        for start in range(0, len(text), _TEXT_CHARS_PER_MESSAGE):
            yield ("text", text[start:start + _TEXT_CHARS_PER_MESSAGE])
    for start in range(0, len(ids), _IDS_PER_MESSAGE):
        yield ("ids", ids[start:start + _IDS_PER_MESSAGE])
    yield ("ok", with_text)


def _template_failure(e: Exception) -> tuple[str, str]:
    """(code, client-facing message) for an exception raised while rendering: plain data,
    since an exception object may not survive pickling."""
    import jinja2

    if isinstance(e, _OutputTooLarge):
        return "template_output_too_large", str(e)
    if isinstance(e, jinja2.TemplateSyntaxError):
        return "template_error", _clip(f"the chat template has a syntax error on line {e.lineno}: {e.message}")
    if isinstance(e, jinja2.TemplateError):  # raise_exception(), undefined names, sandbox refusals
        return "template_error", _clip(f"the chat template rejected the messages: {e}")
    if type(e) is ValueError:  # ChatFormatter's and transformers' checks say what is wrong themselves
        return "template_error", _clip(str(e))
    return "template_error", _clip(f"the chat template failed: {_describe(e)}")


def _encode_failure(e: Exception) -> tuple[str, str]:
    return "encode_error", _clip(f"tokenizing the text failed: {_describe(e)}")


def _describe(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[:_MAX_MESSAGE_CHARS] + " [...]"
