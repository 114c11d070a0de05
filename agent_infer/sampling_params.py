"""Per-request generation settings."""

from __future__ import annotations

from dataclasses import dataclass, field


class SamplingParamsError(ValueError):
    """A sampling field is out of range; the message names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    temperature 0 means greedy. `max_tokens=None` means "up to the context length".
    `seed=None` draws a fresh seed when the request is added; a given seed makes the
    request's samples reproducible whatever batch it runs in.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top logprobs to return per token (0: only the sampled one)
    # Logprobs of the prompt's own tokens (each given the ones before it), with this many
    # top alternatives; such a request is computed in full (no prefix-cache reuse).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise SamplingParamsError("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (0.0 <= self.temperature <= 100.0):
            raise SamplingParamsError("temperature", f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise SamplingParamsError("top_k", f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise SamplingParamsError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise SamplingParamsError("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise SamplingParamsError("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not (0.0 < self.repetition_penalty <= 2.0):
            raise SamplingParamsError("repetition_penalty", f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise SamplingParamsError("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise SamplingParamsError(
                "prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )
        if self.seed is not None and not isinstance(self.seed, int):
            raise SamplingParamsError("seed", f"seed must be an integer, got {self.seed!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", "stop_token_ids must be non-negative")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
