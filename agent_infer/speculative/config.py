"""`--speculative-config` / `LLM(speculative_config=...)`: vLLM's keys, validated by name."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from agent_infer.checkpoint_files import ConfigError

METHODS = ("ngram", "mtp")
# vLLM's older name for DeepSeek's MTP drafter.
_ALIASES = {"deepseek_mtp": "mtp"}
# vLLM keys for drafters this engine does not have: refused by name, not ignored.
_UNSUPPORTED = {
    "model": "a separate draft model",
    "quantization": "a quantized draft model",
    "draft_tensor_parallel_size": "a draft model with its own tensor-parallel size",
    "max_model_len": "a draft model with its own context length",
    "revision": "a draft model revision",
    "code_revision": "a draft model revision",
    "speculative_token_tree": "tree drafts",
}
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size",
         "disable_logprobs", "disable_log_stats"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """How many tokens to draft per step and where they come from.

    `ngram`: the longest suffix of the sequence (prompt_lookup_max tokens down to
    prompt_lookup_min) found earlier in its prompt or output proposes the tokens that
    followed it. `mtp`: the checkpoint's multi-token-prediction layer (DeepSeek-V3's),
    run once per drafted token. `disable_by_batch_size`: no drafting while this many
    sequences or more decode (None: decided by measurement alone).

    `chain_verify_steps` (not one of vLLM's keys, so Python only): whether the step after
    a verify step is launched before that one is read back, its rows moved on the device
    by the drafts accepted (on by default); False reads every verify step back first."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 0
    disable_by_batch_size: int | None = None
    chain_verify_steps: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("speculative_config: num_speculative_tokens must be an integer in [1, 16], got "
                              f"{self.num_speculative_tokens!r}")
        if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("speculative_config: 1 <= prompt_lookup_min <= prompt_lookup_max is needed, got "
                              f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.method == "mtp" and self.num_speculative_tokens != 1:
            raise ConfigError("speculative_config: method mtp drafts one token per step (the checkpoint's first "
                              f"multi-token-prediction layer), so num_speculative_tokens must be 1, got "
                              f"{self.num_speculative_tokens}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 2:
            raise ConfigError(f"speculative_config: disable_by_batch_size must be >= 2, got {self.disable_by_batch_size}")
        if not isinstance(self.chain_verify_steps, bool):
            raise ConfigError(f"speculative_config: chain_verify_steps must be true or false, got "
                              f"{self.chain_verify_steps!r}")

    @staticmethod
    def parse(value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """From vLLM's dict (or its JSON text, as --speculative-config takes it)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        return SpeculativeConfig._from_dict(value)

    @staticmethod
    def _from_dict(d: dict[str, Any]) -> "SpeculativeConfig":
        for key in d:
            if key in _UNSUPPORTED:
                raise ConfigError(f"speculative_config: {key!r} ({_UNSUPPORTED[key]}) is not supported; methods "
                                  f"here: {', '.join(METHODS)}")
            if key not in _KEYS:
                raise ConfigError(f"speculative_config: unknown key {key!r}; known: {', '.join(sorted(_KEYS))}")
        if "method" not in d:
            raise ConfigError(f"speculative_config needs a method ({', '.join(METHODS)})")
        if d.get("disable_logprobs") is True:
            raise ConfigError("speculative_config: disable_logprobs=true is not supported: logprobs are always the "
                              "target model's")
        method = _ALIASES.get(d["method"], d["method"])
        if "num_speculative_tokens" not in d:
            raise ConfigError("speculative_config needs num_speculative_tokens")
        lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
        if method == "ngram":
            # vLLM's defaults: one bound given sets the other; neither gives 5 and 5.
            lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
        elif lo is not None or hi is not None:
            raise ConfigError("speculative_config: prompt_lookup_min/max apply to method 'ngram' only")
        return SpeculativeConfig(method, d["num_speculative_tokens"], hi or 0, lo or 0, d.get("disable_by_batch_size"))
