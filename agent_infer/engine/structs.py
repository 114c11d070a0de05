"""Request state: a Sequence moves WAITING -> RUNNING_PREFILL -> RUNNING_DECODE -> FINISHED,
or WAITING -> REJECTED when it can never run (e.g. a prompt longer than the context)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from agent_infer.sampling_params import SamplingParams


# An output token whose value is still on the device (its step is in flight).
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING_PREFILL = "running_prefill"
    RUNNING_DECODE = "running_decode"
    FINISHED = "finished"
    REJECTED = "rejected"

    @property
    def done(self) -> bool:
        return self in (SequenceStatus.FINISHED, SequenceStatus.REJECTED)


_DONE = frozenset({SequenceStatus.FINISHED, SequenceStatus.REJECTED})


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled by the caller (e.g. the client went away)


_ALLOWED = {
    SequenceStatus.WAITING: {SequenceStatus.RUNNING_PREFILL, SequenceStatus.REJECTED, SequenceStatus.FINISHED},
    SequenceStatus.RUNNING_PREFILL: {
        SequenceStatus.RUNNING_PREFILL,
        SequenceStatus.RUNNING_DECODE,
        SequenceStatus.WAITING,  # recompute preemption
        SequenceStatus.FINISHED,
    },
    SequenceStatus.RUNNING_DECODE: {SequenceStatus.WAITING, SequenceStatus.FINISHED},
    SequenceStatus.FINISHED: set(),
    SequenceStatus.REJECTED: set(),
}


@dataclass
class Sequence:
    """One request's tokens, blocks and progress.

    `num_computed_tokens` counts tokens whose K/V are in the cache. During prefill it
    advances by the chunk computed each step; prefix-cache hits advance it at admission.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never None, and never past the context length
    seed: int
    prompt: str | None = None
    cache_salt: str | None = None  # prefix-cache isolation: blocks are shared only under the same salt
    arrival_time: float = field(default_factory=time.monotonic)

    status: SequenceStatus = SequenceStatus.WAITING
    # May end in tokens not yet read back: PLACEHOLDERs, and a verify row's drafts (taken
    # as accepted until its step is read back).
    output_token_ids: list[int] = field(default_factory=list)
    num_resolved: int = 0  # leading output tokens whose values are known
    pending_row: int = -1  # row of the last placeholder in its step's sampled tokens
    pending_drafts: int = 0  # drafts of the row that placeholder ends (0: a one-token row)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finish_reason: FinishReason | None = None
    error: str | None = None
    scheduled_time: float | None = None  # first admitted (the end of its queue time)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    # Per generated token: (sampled logprob, top-k [(token, logprob)], rank) when asked for.
    output_logprobs: list[tuple[float, list[tuple[int, float]], int | None]] = field(default_factory=list)
    # Prompt tokens 1, 2, ... in order as their prefill chunks finish (token 0 has none).
    prompt_logprobs: list[tuple[float, list[tuple[int, float]], int]] = field(default_factory=list)
    # Speculative decoding: tokens proposed to follow the output, for the next step to
    # verify (the scheduler may take fewer); set before each schedule.
    draft_token_ids: list[int] = field(default_factory=list)
    # Drafted while a row of this sequence is in flight: the tokens the host knows, to
    # which the device adds what that row gives before it looks the drafts up (the ids
    # in draft_token_ids hold their places until then); None otherwise. Set with them.
    draft_history: np.ndarray | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        """Token `i` of prompt + output, without building the concatenated list."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def max_total_tokens(self) -> int:
        """Tokens this sequence may hold at most: the K/V of all but the last sampled one."""
        return self.num_prompt_tokens + self.max_tokens - 1

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in _DONE

    def transition_to(self, status: SequenceStatus) -> None:
        if status not in _ALLOWED[self.status]:
            raise RuntimeError(f"request {self.request_id}: illegal transition {self.status.name} -> {status.name}")
        self.status = status

    def finish(self, reason: FinishReason) -> None:
        self.transition_to(SequenceStatus.FINISHED)
        self.finish_reason = reason
        self.finish_time = time.monotonic()

    def reject(self, message: str) -> None:
        self.transition_to(SequenceStatus.REJECTED)
        self.error = message
        self.finish_time = time.monotonic()
