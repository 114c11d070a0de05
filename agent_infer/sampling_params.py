"""Per-request generation settings."""

from __future__ import annotations

from dataclasses import dataclass, field


class SamplingParamsError(ValueError):
    """A sampling field is out of range; the message names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's `structured_outputs`): exactly one of
    a JSON schema (`json`, a dict or its text), `json_object` (any JSON object), a
    `regex`, a `choice` among literal strings, or a `grammar` (Lark, or GBNF: rules
    written `name ::= ...`). Tokens are masked so that the output always matches.

    `strict` closes every object of a JSON schema that leaves `additionalProperties`
    unset (OpenAI's strict mode). `reasoning` = (start, end) token ids of a reasoning
    block (Qwen3's <think>, </think>): the constraint then starts once the block ends
    (or at once, if the model does not open one); the server sets it."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    strict: bool = False
    reasoning: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise SamplingParamsError(
                "structured_outputs",
                "structured_outputs needs exactly one of json, json_object, regex, choice, grammar; got "
                + (", ".join(given) or "none"),
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise SamplingParamsError("structured_outputs", "structured_outputs.choice must be a non-empty list of "
                                                            "non-empty strings")

    @property
    def kind(self) -> str:
        return "json_object" if self.json_object else next(
            k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)


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
    # EOS and stop_token_ids are masked until this many tokens were generated.
    min_tokens: int = 0
    # token id -> value added to its logit before sampling, in [-100, 100] (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled.
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None

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
        if self.seed is not None and (not isinstance(self.seed, int) or not INT64_MIN <= self.seed <= INT64_MAX):
            # A wider integer would wrap around to another seed's samples.
            raise SamplingParamsError("seed", f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", "stop_token_ids must be non-negative")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise SamplingParamsError("min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logit_bias:
            for token, value in self.logit_bias.items():
                if not isinstance(token, int) or token < 0:
                    raise SamplingParamsError("logit_bias", f"logit_bias keys must be token ids >= 0, got {token!r}")
                if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                    raise SamplingParamsError("logit_bias", f"logit_bias values must be in [-100, 100], got {value}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise SamplingParamsError("allowed_token_ids", "allowed_token_ids must not be empty")
            if any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids):
                raise SamplingParamsError("allowed_token_ids", "allowed_token_ids must be token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def token_ids_to_check(self) -> dict[str, list[int]]:
        """The token ids this request names, by field (checked against the vocabulary)."""
        return {"stop_token_ids": self.stop_token_ids, "logit_bias": list(self.logit_bias or ()),
                "allowed_token_ids": list(self.allowed_token_ids or ())}

    @property
    def constrained(self) -> bool:
        """Needs a per-step mask or bias (agent_infer/structured): such a request's rows are
        processed between the forward pass and sampling."""
        return bool(self.min_tokens or self.logit_bias or self.allowed_token_ids is not None
                    or self.structured_outputs is not None)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
