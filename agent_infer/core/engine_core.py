"""EngineCore: the engine's own process loop, fed by front ends over ZMQ.

The core owns the LLMEngine (scheduler, KV cache, model runner, TP workers) and does no
text work: requests arrive as token ids, outputs leave as token ids. Its loop is

    poll (block only when the engine is idle) -> apply the front ends' messages -> step

and a step's outputs go out to each front end as one message right after the *next*
step is launched (`LLMEngine.on_launched`), so encoding and sending overlap the
device's work. A front end that falls behind never slows the loop: its socket queues
without a limit, and it coalesces what piled up.

Failures: a step that raises fails the requests in flight (each front end is told) and
the loop carries on with the engine's requests aborted; if even that fails, or a TP
worker is gone, the core tells every front end it is dead and exits non-zero. A front
end that goes away (its process exits) has its requests aborted at once.

Signals: SIGTERM stops the loop (the supervisor sends it once the front ends have
drained); SIGINT is ignored, since a Ctrl-C reaches the whole process group and the
front ends must finish their requests first.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field

import zmq

from agent_infer.core import protocol as P
from agent_infer.core.config import CoreConfig
from agent_infer.core.metrics import CoreMetrics, StepInfo
from agent_infer.core.response_store import RUNNING, ResponseStore
from agent_infer.core.watch import ProcessWatch
from agent_infer.distributed.control import WorkerError
from agent_infer.engine.llm_engine import LLMEngine, RequestError
from agent_infer.engine.outputs import RequestOutput

log = logging.getLogger(__name__)

_NO_PROGRESS_BACKOFF_MS = 5
# With a watched process that has no pidfd (old kernels), how often to look at it.
_WATCH_POLL_MS = 500


@dataclass
class _Client:
    """One front end, known by its ZMQ identity."""

    identity: bytes
    number: int
    name: str
    watch: ProcessWatch | None = None
    outbox: P.Outputs = field(default_factory=P.Outputs)
    live: set[str] = field(default_factory=set)  # engine request ids

    def take_outbox(self) -> P.Outputs | None:
        box = self.outbox
        if not (box.deltas or box.admitted or box.refused or box.failed):
            return None
        self.outbox = P.Outputs()
        return box


@dataclass
class _Live:
    """What the core keeps per request in flight."""

    client: _Client
    id: int  # the front end's id
    submit_time: float
    num_prompt_tokens: int
    last_token_time: float | None = None
    sent_logprobs: int = 0
    sent_prompt_logprobs: bool = False
    finish_reason: str | None = None  # how it ended, when its front end ended it
    tag: str | None = None  # the stored response it runs for (see response_cancel)


class _Fatal(Exception):
    """The engine could not be brought back to a clean state; the loop must stop."""


class EngineCore:
    def __init__(self, engine: LLMEngine, config: CoreConfig, address: str, parent_pid: int | None = None):
        self.engine = engine
        self.config = config
        self.metrics = CoreMetrics(self.snapshot)
        self.responses = ResponseStore()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        # No high-water mark: a message is never dropped (a ROUTER drops at the mark), and
        # a front end that reads slowly queues on its side, not in the loop's way.
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._encode = P.encoder().encode
        self._decode = P.core_decoder().decode
        self._clients: dict[bytes, _Client] = {}
        self._live: dict[str, _Live] = {}
        self._numbers = 0
        self._launches = 0
        self._stop = False
        self._exit_code = 0
        self._parent = ProcessWatch.of(parent_pid) if parent_pid else None
        engine.on_launched = self._after_launch
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._wakeup_r, self._wakeup_w = os.pipe()
        os.set_blocking(self._wakeup_r, False)
        os.set_blocking(self._wakeup_w, False)
        self._poller.register(self._wakeup_r, zmq.POLLIN)
        if self._parent is not None and self._parent.fd is not None:
            self._poller.register(self._parent.fd, zmq.POLLIN)

    # ---- lifecycle --------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """Main thread only. SIGTERM stops the loop; SIGINT is left to the front ends."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, lambda *_: self.request_stop())
        signal.set_wakeup_fd(self._wakeup_w, warn_on_full_buffer=False)

    def request_stop(self) -> None:
        """Thread- and signal-safe: the loop stops after the current step."""
        self._stop = True
        try:
            os.write(self._wakeup_w, b"\0")
        except OSError:
            pass

    def run(self) -> int:
        """The loop; returns the process's exit code (0 after a requested stop)."""
        engine = self.engine
        reason = "the server is shutting down"
        try:
            progressed = True
            while not self._stop:
                busy = engine.has_unfinished_requests()
                if not busy:
                    timeout = self._idle_timeout_ms()
                else:
                    timeout = 0 if progressed else _NO_PROGRESS_BACKOFF_MS
                if timeout != 0:
                    self._flush()  # about to wait: no output may be left behind
                self._poll(timeout)
                if self._stop:
                    break
                if engine.has_unfinished_requests():
                    progressed = self._step()
        except _Fatal as e:
            reason = f"the engine stopped after an unrecoverable error ({type(e.__cause__).__name__})"
            self._exit_code = 1
        except BaseException:
            log.exception("engine core loop crashed")
            reason = "the engine core crashed; see the server log"
            self._exit_code = 1
        finally:
            self._fail_all(reason)
            self._flush()
            for client in self._clients.values():
                self._send(client, P.Dead(reason))
            self._close(reason)
        return self._exit_code

    def _close(self, reason: str) -> None:
        try:
            self.engine.shutdown()
        except Exception:
            log.exception("engine shutdown failed")
        for client in self._clients.values():
            if client.watch is not None:
                client.watch.close()
        self._sock.close(linger=1000)  # let the last messages (Dead) leave
        self._ctx.term()
        log.info("engine core stopped (%s)", reason)

    def _idle_timeout_ms(self) -> int | None:
        watches = [c.watch for c in self._clients.values() if c.watch is not None]
        if self._parent is not None:
            watches.append(self._parent)
        return _WATCH_POLL_MS if any(w.fd is None for w in watches) else None

    # ---- messages -----------------------------------------------------------------------------

    def _poll(self, timeout_ms: int | None) -> None:
        events = dict(self._poller.poll(timeout_ms))
        if self._sock in events:
            self._drain_socket()
        if self._wakeup_r in events:
            try:
                os.read(self._wakeup_r, 4096)
            except BlockingIOError:
                pass
        self._check_processes()

    def _drain_socket(self) -> None:
        while True:
            try:
                identity, payload = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = self._decode(payload)
            except Exception:
                log.exception("undecodable message from a front end; ignored")
                continue
            self._handle(identity, message)

    def _handle(self, identity: bytes, message) -> None:
        client = self._clients.get(identity)
        if isinstance(message, P.Hello):
            if client is None:
                self._numbers += 1
                client = _Client(identity, self._numbers, message.name, ProcessWatch.of(message.pid))
                self._clients[identity] = client
                if client.watch.fd is not None:
                    self._poller.register(client.watch.fd, zmq.POLLIN)
                log.info("front end %s connected (pid %d)", client.name, message.pid)
            return
        if client is None:
            log.warning("message from a front end that did not say hello; ignored")
            return
        if isinstance(message, P.Add):
            self._add(client, message)
        elif isinstance(message, P.Abort):
            for fe_id in message.ids:
                rid = _engine_id(client, fe_id)
                live = self._live.get(rid)
                if live is not None:
                    live.finish_reason = message.reason
                self.engine.abort(rid)
        elif isinstance(message, P.Call):
            self._call(client, message)

    def _add(self, client: _Client, message: P.Add) -> None:
        items = message.items
        waiting = self.engine.num_waiting
        if waiting + len(items) > self.config.max_waiting:
            text = (f"the server is busy: {waiting} requests are waiting to start and this request would add "
                    f"{len(items)} (the limit is {self.config.max_waiting}); retry later")
            client.outbox.refused.append(P.Refusal(message.group, "queue_full", text))
            return
        client.outbox.admitted.append(message.group)
        self.metrics.on_requests_added(len(items), client.name)
        for item in items:
            rid = _engine_id(client, item.id)
            try:
                self.engine.add_request(item.prompt_token_ids, item.params, request_id=rid, cache_salt=item.cache_salt)
            except RequestError as e:
                client.outbox.deltas.append(P.Delta(item.id, [], error=str(e)))
                self.metrics.on_request_finished("rejected", 0.0, len(item.prompt_token_ids), 0)
                continue
            except Exception as e:
                log.exception("adding request %s failed", rid)
                client.outbox.failed.append(P.Failure([item.id], f"the engine could not add the request "
                                                                 f"({type(e).__name__})"))
                self.metrics.on_request_finished("error", 0.0, len(item.prompt_token_ids), 0)
                continue
            self._live[rid] = _Live(client, item.id, message.submit_time, len(item.prompt_token_ids), tag=message.tag)
            client.live.add(rid)

    def _call(self, client: _Client, call: P.Call) -> None:
        try:
            if call.method == "snapshot":
                result = self.snapshot()
            elif call.method == "metrics":
                result = self.metrics.render()
            elif call.method == "http_error":
                self.metrics.on_http_error(int(call.args[0]))
                result = None
            elif call.method.startswith("response_"):
                result = self._response_call(call.method, call.args)
            else:
                raise ValueError(f"unknown call {call.method!r}")
        except Exception as e:
            log.exception("call %s failed", call.method)
            reply = P.Reply(call.call_id, error=f"{type(e).__name__}: {e}")
        else:
            reply = P.Reply(call.call_id, result)
        if call.call_id:  # 0: the caller wants no answer
            self._send(client, reply)

    def _response_call(self, method: str, args: list):
        """The stored responses: put (-> the status kept), get and cancel (-> [status, blob]
        or None), delete (-> bool). Cancelling a running response aborts its requests."""
        store = self.responses
        if method == "response_put":
            key, status, blob = args
            return store.put(key, status, blob)
        if method == "response_get":
            entry = store.get(args[0])
            return None if entry is None else [entry.status, entry.blob]
        if method == "response_cancel":
            entry = store.cancel(args[0])
            if entry is not None and entry.status in RUNNING:
                for rid, live in list(self._live.items()):
                    if live.tag == args[0]:
                        live.finish_reason = "abort"
                        self.engine.abort(rid)
            return None if entry is None else [entry.status, entry.blob]
        if method == "response_delete":
            return store.delete(args[0])
        raise ValueError(f"unknown call {method!r}")

    def _check_processes(self) -> None:
        if self._parent is not None and self._parent.exited():
            log.error("the server's supervisor is gone; stopping the engine core")
            self._stop = True
            self._exit_code = 1
        for client in [c for c in self._clients.values() if c.watch is not None and c.watch.exited()]:
            self._drop_client(client)

    def _drop_client(self, client: _Client) -> None:
        """A front end's process is gone: abort its requests (their blocks are freed now)."""
        del self._clients[client.identity]
        if client.watch.fd is not None:
            self._poller.unregister(client.watch.fd)
        client.watch.close()
        now = time.monotonic()
        for rid in list(client.live):
            live = self._live.pop(rid, None)
            self.engine.abort(rid)
            if live is not None:
                self.metrics.on_request_finished("abort", now - live.submit_time, live.num_prompt_tokens, 0)
        log.warning("front end %s (pid %d) went away; %d of its requests aborted", client.name, client.watch.pid,
                    len(client.live))
        client.live.clear()

    # ---- stepping ---------------------------------------------------------------------------

    def _step(self) -> bool:
        """One engine step; False when it neither ran a batch nor reported anything."""
        engine = self.engine
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
            # Prefill: the prompts that finished; decode: the batch (a verify step's
            # sequences may yield several tokens each).
            num_seqs = stats.last_batch_prompts_done if is_prefill else stats.last_batch_size
            num_tokens = stats.prompt_tokens - prompt0 if is_prefill else stats.generation_tokens - gen0
            self.metrics.on_step(StepInfo(is_prefill, num_seqs, num_tokens, seconds))
        self._route(outputs)
        # These outputs go out right after the next launch (see _after_launch), unless this
        # step launched nothing (then the next one may not either) or nothing follows.
        if self._launches == launches0 or not engine.has_unfinished_requests():
            self._flush()
        return bool(outputs) or stats.steps != steps0

    def _route(self, outputs: list[RequestOutput]) -> None:
        """Turn outputs into deltas in their front ends' outboxes; time the tokens, and
        count them as vLLM's iteration histogram does (a first token brings its prompt)."""
        now = time.monotonic()
        first_token: list[float] = []
        inter_token: list[float] = []
        iteration_tokens = 0
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue  # e.g. the abort output of a request its front end dropped
            if out.delta_token_ids:
                iteration_tokens += len(out.delta_token_ids)
                if live.last_token_time is None:
                    first_token.append(now - live.submit_time)
                    iteration_tokens += live.num_prompt_tokens
                else:
                    inter_token.append(now - live.last_token_time)
                live.last_token_time = now
            live.client.outbox.deltas.append(self._delta(live, out))
            if out.finished or out.rejected:
                del self._live[out.request_id]
                live.client.live.discard(out.request_id)
                self._finished(live, out, now)
        if first_token or inter_token:
            self.metrics.on_token_latencies(first_token, inter_token)
        if iteration_tokens:
            self.metrics.on_iteration(iteration_tokens)

    @staticmethod
    def _delta(live: _Live, out: RequestOutput) -> P.Delta:
        logprobs = None
        if out.logprobs is not None and len(out.logprobs) > live.sent_logprobs:
            logprobs = out.logprobs[live.sent_logprobs:]
            live.sent_logprobs = len(out.logprobs)
        prompt_logprobs = None
        if out.prompt_logprobs is not None and not live.sent_prompt_logprobs:
            prompt_logprobs = out.prompt_logprobs
            live.sent_prompt_logprobs = True
        stop_token = out.stop_reason if isinstance(out.stop_reason, int) else None
        return P.Delta(live.id, out.delta_token_ids, out.finish_reason if out.finished else None, stop_token,
                       out.num_cached_tokens, logprobs, prompt_logprobs, out.error)

    def _finished(self, live: _Live, out: RequestOutput, now: float) -> None:
        reason = "rejected" if out.rejected else (live.finish_reason or out.finish_reason or "stop")
        self.metrics.on_request_finished(reason, now - live.submit_time, live.num_prompt_tokens, len(out.token_ids))
        if out.scheduled_time is not None and out.first_token_time is not None and out.finish_time is not None:
            self.metrics.on_request_phases(out.scheduled_time - out.arrival_time,
                                           out.first_token_time - out.scheduled_time,
                                           out.finish_time - out.first_token_time,
                                           out.finish_time - out.scheduled_time)

    def _after_launch(self) -> None:
        """Called inside `engine.step()` right after it launched a step: the moment to send
        the previous step's outputs, while the device computes. Never calls the engine."""
        self._launches += 1
        self._flush()

    def _flush(self) -> None:
        for client in self._clients.values():
            box = client.take_outbox()
            if box is not None:
                self._send(client, box)

    def _send(self, client: _Client, message) -> None:
        try:
            self._sock.send_multipart([client.identity, self._encode(message)], copy=False)
        except zmq.ZMQError as e:  # the socket is closing; nobody is left to read it
            log.debug("could not send to front end %s: %s", client.name, e)

    # ---- failures -------------------------------------------------------------------------------

    def _recover(self, exc: Exception) -> None:
        """A step raised: fail every request in flight and abort it in the engine so its
        blocks are freed. If even that fails, or a tensor-parallel worker is gone (the
        engine has already stopped the rest), the engine is unusable: stop the loop."""
        log.error("engine step failed; failing %d request(s) in flight", len(self._live), exc_info=exc)
        ids = list(self._live)
        self._fail_all("the engine failed while running this request; see the server log")
        self._flush()
        if isinstance(exc, WorkerError):
            raise _Fatal() from exc
        try:
            for rid in ids:
                self.engine.abort(rid)
        except Exception as e:
            log.exception("could not abort requests after an engine failure")
            raise _Fatal() from e

    def _fail_all(self, message: str) -> None:
        now = time.monotonic()
        by_client: dict[int, tuple[_Client, list[int]]] = {}
        for live in self._live.values():
            by_client.setdefault(live.client.number, (live.client, []))[1].append(live.id)
            live.client.live.clear()
            self.metrics.on_request_finished("error", now - live.submit_time, live.num_prompt_tokens, 0)
        self._live.clear()
        for client, ids in by_client.values():
            client.outbox.failed.append(P.Failure(ids, message))

    # ---- state ----------------------------------------------------------------------------------

    def snapshot(self) -> P.EngineSnapshot:
        e = self.engine
        bm = e.block_manager
        spec = e.draft_policy.stats if e.drafter is not None else None
        return P.EngineSnapshot(
            num_running=e.num_running, num_waiting=e.num_waiting, num_blocks=bm.num_blocks,
            num_used_blocks=bm.num_used_blocks, prefix_cache_queries=bm.stats.queries,
            prefix_cache_hits=bm.stats.hits, prompt_tokens=e.stats.prompt_tokens,
            generation_tokens=e.stats.generation_tokens, steps=e.stats.steps,
            max_decode_batch=e.stats.max_decode_batch, num_preemptions=e.scheduler.num_preemptions,
            num_live=len(self._live), num_front_ends=len(self._clients),
            spec_num_drafts=spec.num_drafts if spec else None,
            spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
            spec_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            spec_accepted_per_pos=list(spec.accepted_per_pos) if spec else [])

    def info(self) -> P.CoreInfo:
        e = self.engine
        return P.CoreInfo(
            pid=os.getpid(), model_path=e.config.model,
            tokenizer_path=(e.config.tokenizer or e.config.model) if e.tokenizer is not None else None,
            model_type=e.model_config.model_type, max_model_len=e.max_model_len,
            vocab_size=e.model_config.vocab_size, eos_token_ids=sorted(e.eos_token_ids),
            num_kv_blocks=e.block_manager.num_blocks, block_size=e.block_manager.block_size,
            max_waiting=self.config.max_waiting)


def _engine_id(client: _Client, fe_id: int) -> str:
    return f"{client.number}-{fe_id}"
