"""What the engine reports about a request after a step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    # The token's place in its row's distribution: 1 + how many vocabulary entries have a
    # strictly larger logprob (vLLM's Logprob.rank); computed on the device.
    rank: int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated so far
    text: str  # all generated text so far (complete once finished)
    finished: bool
    finish_reason: str | None = None  # stop | length | abort
    delta_text: str = ""  # new since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # set when the request was rejected
    num_cached_tokens: int = 0
    # All so far, when asked for: one list per request that grows as it runs (copy it to
    # keep the state of one step).
    logprobs: list[TokenLogprob] | None = None
    # With SamplingParams.prompt_logprobs, once the prompt is computed: None for the first
    # prompt token (nothing precedes it), then each token's logprob given those before.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_reason: str | int | None = None  # the stop string or token that ended it
    arrival_time: float = 0.0
    scheduled_time: float | None = None  # first admitted by the scheduler
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def rejected(self) -> bool:
        return self.error is not None
