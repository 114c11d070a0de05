"""The messages between the front ends and the engine core, encoded with msgpack (msgspec).

A front end sends requests in (token ids and their sampling settings, once per request)
and aborts; the core sends back, once per engine step, one `Outputs` message per front
end with that step's new token ids of each of its requests. Nothing is pickled, and a
token costs a few bytes inside one message per step, not a message of its own.

Front ends name their requests with integers of their own; the core keys them by
(front end, id), so ids never need to be unique across front ends.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from agent_infer.engine.outputs import TokenLogprob
from agent_infer.sampling_params import SamplingParams


class CoreInfo(msgspec.Struct, frozen=True):
    """What a front end needs to know about the engine, sent once when the core is up."""

    pid: int
    model_path: str
    tokenizer_path: str | None  # None: the checkpoint has no tokenizer (token-id prompts only)
    model_type: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_kv_blocks: int
    block_size: int
    max_waiting: int


class EngineSnapshot(msgspec.Struct, frozen=True):
    """The engine's state between two steps (the `snapshot` call, and /metrics)."""

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
    num_live: int = 0  # requests the core is tracking, from every front end
    num_front_ends: int = 0
    # Speculative decoding (None: off): verify rows, their draft tokens, the accepted
    # ones, and the accepted ones by draft position.
    spec_num_drafts: int | None = None
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []


# ---- front end -> core ------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello"):
    """A front end's first message: the core watches `pid` and aborts the front end's
    requests if that process goes away. `name` labels its requests in the metrics."""

    pid: int
    name: str = "0"


class AddItem(msgspec.Struct, array_like=True):
    id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None


class Add(msgspec.Struct, tag="add"):
    """Requests queued as one group, all or none (the `n` choices of one HTTP request);
    the reply is the group's id in `Outputs.admitted` or a `Refusal`."""

    group: int
    items: list[AddItem]
    submit_time: float  # time.monotonic() in the front end (one clock per host)
    tag: str | None = None  # a stored response's id: cancelling it (from any front end) aborts the group


class Abort(msgspec.Struct, tag="abort"):
    ids: list[int]
    # "stop": the front end found a stop string, so the request ended as asked (the
    # core's metrics count it so); "abort": the client went away.
    reason: str = "abort"


class Call(msgspec.Struct, tag="call"):
    """A utility call (metrics text, state snapshot, ...); answered by a `Reply`."""

    call_id: int
    method: str
    args: list[Any] = []


ToCore = Union[Hello, Add, Abort, Call]


# ---- core -> front end ------------------------------------------------------------------


class Delta(msgspec.Struct, array_like=True, gc=False):
    """What one request did in one step."""

    id: int
    token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort, once finished
    stop_token: int | None = None  # the stop token that ended it (not EOS)
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per new token, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, when the whole prompt has them
    error: str | None = None  # the engine refused the request (e.g. longer than the context)


class Refusal(msgspec.Struct, array_like=True):
    group: int
    code: str  # queue_full | engine_unavailable
    message: str


class Failure(msgspec.Struct, array_like=True):
    """The engine failed while these requests were in flight; they are gone."""

    ids: list[int]
    message: str


class Outputs(msgspec.Struct, tag="outputs", gc=False):
    deltas: list[Delta] = []
    admitted: list[int] = []
    refused: list[Refusal] = []
    failed: list[Failure] = []


class Reply(msgspec.Struct, tag="reply"):
    call_id: int
    result: Any = None
    error: str | None = None


class Dead(msgspec.Struct, tag="dead"):
    """The core is going away; every request in flight is lost."""

    reason: str


ToFrontEnd = Union[Outputs, Reply, Dead]


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def core_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ToCore)


def front_end_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ToFrontEnd)
