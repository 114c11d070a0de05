"""AsyncEngine: an LLMEngine driven by one background thread, fed from asyncio.

The LLMEngine is not thread-safe, so exactly one thread — the engine thread started
here — ever calls into it. Everything else talks to that thread through messages:

* asyncio code calls `submit()` / `abort()`; they put commands on one thread-safe
  queue, which the engine thread drains between steps (never during one);
* the engine thread hands each step's outputs back to the loop that submitted the
  request with one `loop.call_soon_threadsafe` per loop per step, right after it has
  launched the next step (`LLMEngine.on_launched`);
* with no work the engine thread blocks on the command queue, so an idle server
  uses no CPU.

All in-flight requests run through the continuous-batching scheduler together: there
is no lock serialising requests. A request whose consumer goes away (a client
disconnect cancels the consuming task, or the consumer stops iterating) is aborted,
which frees its KV blocks at once. If a step raises, every in-flight request fails
with `EngineFailedError`, the error is logged, and the loop carries on with an
engine whose requests have all been aborted.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import AsyncIterator

from agent_infer.distributed.control import WorkerError
from agent_infer.engine.llm_engine import LLMEngine, RequestError
from agent_infer.engine.outputs import RequestOutput
from agent_infer.loader.tokenizer import load_tokenizer
from agent_infer.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_NO_PROGRESS_BACKOFF_S = 0.005


# ---- errors ------------------------------------------------------------------------


class QueueFullError(RuntimeError):
    """Accepting the request would put more than `max_waiting` requests in the queue."""

    def __init__(self, num_waiting: int, max_waiting: int, num_new: int):
        super().__init__(
            f"the server is busy: {num_waiting} requests are waiting to start and this request would add "
            f"{num_new} (the limit is {max_waiting}); retry later"
        )
        self.num_waiting = num_waiting
        self.max_waiting = max_waiting


class EngineDeadError(RuntimeError):
    """The engine loop is not running (never started, shut down, or crashed)."""


class EngineFailedError(RuntimeError):
    """The engine raised while this request was in flight; details are in the server log."""


class RequestRejectedError(ValueError):
    """The engine refused the request (e.g. a prompt as long as the context)."""


# ---- data passed between the threads ----------------------------------------------


@dataclass(frozen=True)
class AsyncEngineConfig:
    # Requests accepted but not yet running (queued in the scheduler, or submitted and
    # not yet seen by the engine thread). Beyond it, submit() raises QueueFullError.
    max_waiting: int = 1024
    shutdown_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")


@dataclass(frozen=True)
class EngineRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the text, when the prompt was text (reported back in outputs)
    request_id: str | None = None  # unique among live requests; drawn when None
    stream: bool = True  # deltas per token (False: text decoded once at the end)


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after the latest step, published by the engine thread.
    Replaced as a whole (one attribute store), so readers never see a torn state."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_used_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # prompt tokens served from it
    prompt_tokens: int = 0  # prompt tokens computed (prefix hits excluded)
    generation_tokens: int = 0
    steps: int = 0
    max_decode_batch: int = 0
    num_preemptions: int = 0  # requests sent back to the queue (recompute preemption)
    adds_processed: int = 0  # add commands the engine thread has taken off the queue
    num_live: int = 0  # requests the engine thread is tracking


@dataclass(frozen=True)
class StepInfo:
    is_prefill: bool
    num_seqs: int  # prefill: prompts finished in this step; decode: the batch size
    num_tokens: int  # tokens computed (prefill: prompt tokens; decode: one per sequence)
    seconds: float
    batch_tokens: int = 0  # every token the step computed (a mixed step's decode rows too)


class EngineObserver:
    """Hooks called *on the engine thread*; keep them cheap and thread-safe."""

    def on_step(self, info: StepInfo) -> None:
        pass

    def on_request_submitted(self, count: int) -> None:  # called on the submitting thread
        pass

    def on_first_token(self, seconds: float) -> None:  # submit -> first token
        pass

    def on_inter_token(self, seconds: float) -> None:  # between two tokens of one request
        pass

    def on_token_latencies(self, first_token: list[float], inter_token: list[float]) -> None:
        """One step's TTFTs and inter-token gaps at once (a decode step has one gap per
        request in the batch); override to record them in bulk."""
        for seconds in first_token:
            self.on_first_token(seconds)
        for seconds in inter_token:
            self.on_inter_token(seconds)

    def on_request_finished(
        self, reason: str, seconds: float, num_prompt_tokens: int, num_output_tokens: int
    ) -> None:  # reason: stop | length | abort | rejected | error
        pass

    def on_request_phases(self, queue_s: float, prefill_s: float, decode_s: float, inference_s: float) -> None:
        """A request that ran to its end: arrival -> first admitted (queue), -> first
        token (prefill), -> finish (decode); inference = prefill + decode."""
        pass


# ---- the asyncio side of a set of requests ----------------------------------------


class RequestGroup:
    """The outputs of one or more requests submitted together (e.g. the `n` choices
    of one HTTP request), as an async iterator of `(index, RequestOutput)`.

    Use it as `async with group:` — leaving the block (normally, by an exception or by
    cancellation) aborts every member that has not finished, freeing its KV blocks.
    """

    def __init__(self, engine: "AsyncEngine", request_ids: list[str], loop: asyncio.AbstractEventLoop):
        self._engine = engine
        self.request_ids = request_ids
        self.loop = loop
        # Outputs not read yet, and the future a reader waits on while there are none: a
        # plain deque and one future cost less than an asyncio.Queue per token.
        self._items: deque[tuple[int, object]] = deque()
        self._waiter: asyncio.Future | None = None
        self._open = set(range(len(request_ids)))
        self._error: Exception | None = None  # raised by the next read (see next_batch)

    @property
    def finished(self) -> bool:
        return not self._open

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
        """Until an output is queued (a reader that is cancelled meanwhile just leaves)."""
        while not self._items:
            if self._waiter is None or self._waiter.done():
                self._waiter = self.loop.create_future()
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
        for i in sorted(self._open):
            self._engine.abort(self.request_ids[i])
        self._open.clear()

    async def __aenter__(self) -> "RequestGroup":
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()

    def _put(self, index: int, item) -> None:  # on the loop thread
        self._items.append((index, item))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _deliver(items: list[tuple[RequestGroup, int, object]]) -> None:
    """Runs on the consumers' loop: hand one step's outputs to their groups."""
    for group, index, item in items:
        group._put(index, item)


# ---- commands to the engine thread -------------------------------------------------


@dataclass
class _Add:
    group: RequestGroup
    index: int
    request: EngineRequest
    request_id: str
    submit_time: float


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stop:
    pass


@dataclass
class _Live:
    """What the engine thread keeps per in-flight request."""

    group: RequestGroup
    index: int
    submit_time: float
    num_prompt_tokens: int
    last_token_time: float | None = None


class _Fatal(Exception):
    """The engine could not be brought back to a clean state; the loop must stop."""


# ---- the engine thread -------------------------------------------------------------


class AsyncEngine:
    def __init__(self, engine: LLMEngine, config: AsyncEngineConfig | None = None):
        self.config = config or AsyncEngineConfig()
        self._engine = engine
        # Facts the front end may read from any thread; copied once, before the engine
        # thread exists, so nobody else ever touches the engine.
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.model_config.vocab_size
        self.model_path: str = engine.config.model
        self.model_type: str = engine.model_config.model_type
        # Grammars are compiled by the front end (a bad schema is a 400 before anything is
        # queued) into the engine's cache; GrammarCompiler is thread-safe.
        self.grammar = engine.grammar
        self.eos_token_ids: frozenset[int] = frozenset(engine.eos_token_ids)
        self.num_kv_blocks: int = engine.block_manager.num_blocks
        self.block_size: int = engine.block_manager.block_size
        # The front end gets its own tokenizer: the engine thread decodes with the
        # engine's copy while request handlers encode, and sharing one object across
        # threads is not something HF tokenizers promise to survive.
        tok_path = engine.config.tokenizer or engine.config.model
        self.tokenizer = load_tokenizer(tok_path) if engine.tokenizer is not None else None

        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._outbox: list[tuple[RequestGroup, int, object]] = []  # engine thread only: outputs to hand out
        self._launches = 0  # engine thread only: steps launched so far
        # Hand a step's outputs to the event loop right after the next step is launched
        # (see _after_launch).
        engine.on_launched = self._after_launch
        self._observers: tuple[EngineObserver, ...] = ()
        self._adds_processed = 0  # engine thread only
        self._snapshot = self._take_snapshot(0)
        self._submit_lock = threading.Lock()
        self._num_submitted = 0  # under _submit_lock
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:8]
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead_reason: str | None = None

    # ---- lifecycle (any thread) -------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="agent-infer-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping and self._dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    def shutdown(self) -> None:
        """Stop the loop: in-flight requests fail with EngineDeadError; bounded wait."""
        if self._stopping:
            return
        self._stopping = True
        if self._thread is None:
            self._engine.shutdown()
            return
        self._commands.put(_Stop())
        self._thread.join(self.config.shutdown_timeout_s)
        if self._thread.is_alive():
            log.warning("engine thread did not stop within %.0f s", self.config.shutdown_timeout_s)

    def add_observer(self, observer: EngineObserver) -> None:
        # Replaced, not mutated: the engine thread may be iterating the old tuple.
        self._observers = (*self._observers, observer)

    @property
    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    # ---- requests (asyncio side) --------------------------------------------------------

    def submit(self, requests: list[EngineRequest]) -> RequestGroup:
        """Queue requests as one group, all or none. Must be called from a running loop.

        Raises QueueFullError when they would overflow the waiting queue, and
        EngineDeadError when the loop is not running."""
        loop = asyncio.get_running_loop()
        if not requests:
            raise ValueError("submit() needs at least one request")
        now = time.monotonic()
        with self._submit_lock:
            if not self.is_running:
                raise EngineDeadError(self._dead_reason or "the engine is not running")
            snap = self._snapshot
            waiting = snap.num_waiting + (self._num_submitted - snap.adds_processed)
            if waiting + len(requests) > self.config.max_waiting:
                raise QueueFullError(waiting, self.config.max_waiting, len(requests))
            self._num_submitted += len(requests)
            ids = [r.request_id or f"req-{self._id_prefix}-{next(self._ids)}" for r in requests]
            group = RequestGroup(self, ids, loop)
            for i, (req, rid) in enumerate(zip(requests, ids)):
                self._commands.put(_Add(group, i, req, rid, now))
        for obs in self._observers:
            obs.on_request_submitted(len(requests))
        return group

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs. Stopping early (break, aclose, cancellation)
        aborts the request and frees its KV blocks."""
        group = self.submit([EngineRequest(prompt_token_ids, params, prompt, request_id)])
        async with group:
            async for _, out in group:
                yield out

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, idempotent; unknown ids are ignored)."""
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(_Abort(request_id))

    # ---- the loop (engine thread) ----------------------------------------------------------

    def _run(self) -> None:
        engine = self._engine
        reason = "the server is shutting down"
        try:
            _use_engine_device(engine)
            progressed = True
            while True:
                # Block only when the engine has nothing to do: no spinning when idle,
                # and no waiting between steps when busy. A step that did nothing (which
                # the scheduler should never allow) backs off briefly instead of spinning.
                idle = not engine.has_unfinished_requests()
                timeout = None if idle else (0.0 if progressed else _NO_PROGRESS_BACKOFF_S)
                if not self._apply_commands(timeout):
                    break
                if engine.has_unfinished_requests():
                    progressed = self._step()
        except _Fatal as e:
            reason = f"the engine stopped after an unrecoverable error ({type(e.__cause__).__name__})"
            self._dead_reason = reason
        except BaseException:
            log.exception("engine loop crashed")
            reason = "the engine loop crashed; see the server log"
            self._dead_reason = reason
        finally:
            self._fail_all(EngineDeadError(reason), "error")
            self._publish()
            try:
                engine.shutdown()
            except Exception:
                log.exception("engine shutdown failed")

    def _apply_commands(self, timeout: float | None) -> bool:
        """Drain the command queue, first waiting up to `timeout` seconds for a command
        (None: as long as it takes); False when asked to stop."""
        cmds = []
        if timeout is None or timeout > 0:
            self._flush()  # about to wait: no output may be left behind
            try:
                cmds.append(self._commands.get(timeout=timeout))
            except queue.Empty:
                pass
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                break
        if not cmds:
            return True
        # A request aborted before its add was seen never needs to reach the engine.
        aborted = {c.request_id for c in cmds if isinstance(c, _Abort)}
        stop = False
        for cmd in cmds:
            if isinstance(cmd, _Add):
                self._add(cmd, cmd.request_id in aborted)
            elif isinstance(cmd, _Abort):
                self._engine.abort(cmd.request_id)
            else:
                stop = True
        # When a step follows at once, its launch hands out what these commands produced.
        self._publish(flush=stop or not self._engine.has_unfinished_requests())
        return not stop

    def _add(self, cmd: _Add, aborted: bool) -> None:
        self._adds_processed += 1
        req = cmd.request
        if aborted:
            # The consumer left before the engine saw the request: report it as aborted.
            out = RequestOutput(cmd.request_id, req.prompt, req.prompt_token_ids, [], "", True, "abort")
            self._outbox.append((cmd.group, cmd.index, out))
            self._notify_finished("abort", time.monotonic() - cmd.submit_time, len(req.prompt_token_ids), 0)
            return
        try:
            self._engine.add_request(
                req.prompt if req.prompt is not None else req.prompt_token_ids,
                req.params,
                request_id=cmd.request_id,
                stream=req.stream,
                prompt_token_ids=req.prompt_token_ids,
            )
        except RequestError as e:
            self._outbox.append((cmd.group, cmd.index, RequestRejectedError(str(e))))
            self._notify_finished("rejected", 0.0, len(req.prompt_token_ids), 0)
            return
        except Exception as e:
            log.exception("adding request %s failed", cmd.request_id)
            error = EngineFailedError(f"the engine could not add the request ({type(e).__name__})")
            self._outbox.append((cmd.group, cmd.index, error))
            self._notify_finished("error", 0.0, len(req.prompt_token_ids), 0)
            return
        self._live[cmd.request_id] = _Live(cmd.group, cmd.index, cmd.submit_time, len(req.prompt_token_ids))

    def _step(self) -> bool:
        """One engine step; False when it neither ran a batch nor reported anything."""
        engine = self._engine
        before = engine.stats
        prefill0, prompt0, gen0 = before.prefill_steps, before.prompt_tokens, before.generation_tokens
        steps0 = before.steps
        launches0 = self._launches
        t0 = time.perf_counter()
        try:
            outputs = engine.step()
        except Exception as exc:
            self._recover(exc)
            return True
        seconds = time.perf_counter() - t0
        stats = engine.stats
        if stats.steps != steps0:
            is_prefill = stats.prefill_steps != prefill0
            num_seqs = stats.generation_tokens - gen0
            if is_prefill:
                num_seqs -= stats.last_batch_decode_rows  # count the prompts that finished only
            info = StepInfo(is_prefill, num_seqs, stats.prompt_tokens - prompt0 if is_prefill else num_seqs, seconds,
                            stats.last_batch_tokens)
            for obs in self._observers:
                self._safe(obs.on_step, info)
        self._outbox.extend(self._route(outputs))
        # These outputs go out right after the next launch (see _after_launch), unless this
        # step launched nothing (then the next one may not either) or nothing follows.
        self._publish(flush=self._launches == launches0 or not engine.has_unfinished_requests())
        return bool(outputs) or stats.steps != steps0

    def _route(self, outputs: list[RequestOutput]) -> list[tuple[RequestGroup, int, object]]:
        """Match outputs to their groups, update timings and the live set."""
        now = time.monotonic()
        items = []
        first_token: list[float] = []
        inter_token: list[float] = []
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue  # e.g. the abort output of a request already failed or dropped
            if out.delta_token_ids:
                if live.last_token_time is None:
                    first_token.append(now - live.submit_time)
                else:
                    inter_token.append(now - live.last_token_time)
                live.last_token_time = now
            if out.finished or out.rejected:
                del self._live[out.request_id]
                reason = "rejected" if out.rejected else (out.finish_reason or "stop")
                self._notify_finished(reason, now - live.submit_time, live.num_prompt_tokens, len(out.token_ids))
                if out.scheduled_time is not None and out.first_token_time is not None and out.finish_time is not None:
                    phases = (out.scheduled_time - out.arrival_time, out.first_token_time - out.scheduled_time,
                              out.finish_time - out.first_token_time, out.finish_time - out.scheduled_time)
                    for obs in self._observers:
                        self._safe(obs.on_request_phases, *phases)
            items.append((live.group, live.index, out))
        if first_token or inter_token:
            for obs in self._observers:  # once per step, not once per token
                self._safe(obs.on_token_latencies, first_token, inter_token)
        return items

    def _publish(self, flush: bool = True) -> None:
        """Publish the engine state, then (with `flush`) hand out the pending outputs:
        whoever sees an output also sees a snapshot at least as new as the step that
        produced it."""
        try:
            self._snapshot = self._take_snapshot(len(self._live))
        except Exception:  # a broken engine must not keep the outputs (errors) from their owners
            log.exception("could not read the engine state")
        if flush:
            self._flush()

    def _after_launch(self) -> None:
        """Called inside `engine.step()` right after it launched a step: the moment to hand
        out the previous step's outputs. Waking the event loop any earlier would make it
        compete for the GIL with the engine thread's own work before the launch (the
        device would wait for it); now the loop turns the outputs into HTTP writes while
        the device computes and the engine thread waits for the tokens."""
        self._launches += 1
        self._flush()

    def _flush(self) -> None:
        items, self._outbox = self._outbox, []
        if items:
            self._post(items)

    def _post(self, items: list[tuple[RequestGroup, int, object]]) -> None:
        """One call_soon_threadsafe per event loop for the whole batch of items. May run
        inside `engine.step()` (from _after_launch), so it never calls into the engine."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for item in items:
            by_loop[item[0].loop].append(item)
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that loop is closed: nobody will read these outputs
                for group, index, _ in batch:
                    rid = group.request_ids[index]
                    if rid in self._live:
                        del self._live[rid]
                        self._commands.put(_Abort(rid))  # applied before the next step

    def _recover(self, exc: Exception) -> None:
        """A step raised: fail every in-flight request and abort it in the engine so its
        blocks are freed. If even that fails, or a tensor-parallel worker is gone (the
        engine has already stopped the rest), the engine is unusable: stop the loop."""
        log.error("engine step failed; failing %d in-flight request(s)", len(self._live), exc_info=exc)
        ids = list(self._live)
        self._fail_all(EngineFailedError("the engine failed while running this request; see the server log"), "error")
        if isinstance(exc, WorkerError):
            raise _Fatal() from exc
        try:
            for rid in ids:
                self._engine.abort(rid)
        except Exception as e:
            log.exception("could not abort requests after an engine failure")
            raise _Fatal() from e
        self._publish()

    def _fail_all(self, error: Exception, reason: str) -> None:
        now = time.monotonic()
        items = []
        for live in self._live.values():
            items.append((live.group, live.index, error))
            self._notify_finished(reason, now - live.submit_time, live.num_prompt_tokens, 0)
        self._live.clear()
        self._outbox.extend(items)

    def _take_snapshot(self, num_live: int) -> EngineSnapshot:
        e = self._engine
        bm = e.block_manager
        return EngineSnapshot(
            num_running=e.num_running,
            num_waiting=e.num_waiting,
            num_blocks=bm.num_blocks,
            num_used_blocks=bm.num_used_blocks,
            prefix_cache_queries=bm.stats.queries,
            prefix_cache_hits=bm.stats.hits,
            prompt_tokens=e.stats.prompt_tokens,
            generation_tokens=e.stats.generation_tokens,
            steps=e.stats.steps,
            max_decode_batch=e.stats.max_decode_batch,
            num_preemptions=e.scheduler.num_preemptions,
            adds_processed=self._adds_processed,
            num_live=num_live,
        )

    # ---- observer plumbing ------------------------------------------------------------

    def _notify_finished(self, reason: str, seconds: float, num_prompt: int, num_output: int) -> None:
        for obs in self._observers:
            self._safe(obs.on_request_finished, reason, seconds, num_prompt, num_output)

    @staticmethod
    def _safe(fn, *args) -> None:
        # An observer bug (metrics) must never take the engine loop down.
        try:
            fn(*args)
        except Exception:
            log.exception("engine observer %r failed", fn)


def _use_engine_device(engine: LLMEngine) -> None:
    """The current CUDA device is per thread: make it, for this thread, the one the engine was
    built on (LLMEngine set it only on the thread that constructed it)."""
    device = getattr(engine, "device", None)
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
