"""Incremental detokenization with stop strings.

Text grows one token at a time; a piece that ends in an incomplete UTF-8 character
("\ufffd") is held until the next token completes it, so a delta never splits a character.
Deltas also hold back the last `len(longest stop string) - 1` characters until the
request ends, so a stop string is never half-emitted.

This runs for every streamed token of every request (in the server's front ends; offline,
in the engine between two step launches), so it calls the Rust tokenizer directly when that gives the same text
as the Hugging Face wrapper (which costs several times more per call).
"""

from __future__ import annotations

# Decoding starts a few prompt tokens back so the first output token gets its proper
# leading space from tokenizers that decide spacing from context.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode_ids = _fast_decoder(tokenizer) or tokenizer.decode
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.tokens: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""
        self.emitted = 0
        self.stopped_by: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string it completed, if any."""
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        new = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        start = max(0, len(self.text) - self.hold)
        self.text += new
        return self._check_stop(start)

    def _check_stop(self, search_from: int) -> str | None:
        best = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.stopped_by = s
        return s

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; while running, keep back what could start a stop string."""
        end = len(self.text) if finished or not self.stop else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta


def _fast_decoder(tokenizer):
    """The backing `tokenizers.Tokenizer.decode` of a Hugging Face fast tokenizer, when the
    wrapper's decode is exactly that call: no clean-up of tokenization spaces (which the
    wrapper would apply on top). None otherwise (slow tokenizers, test doubles)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True) is not False:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return backend.decode if isinstance(backend, Tokenizer) else None


class RequestText:
    """The text side of one request: incremental text with stop strings when the request
    streams or has stop strings, else one decode at the end. Both the in-process engine
    and the server's front ends (which do all text work for the engine core) use it."""

    __slots__ = ("tokenizer", "skip_special_tokens", "detok")

    def __init__(self, tokenizer, prompt_token_ids: list[int], params, stream: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.detok = None
        if tokenizer is not None and (stream or params.stop):
            self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                                                params.include_stop_str_in_output)

    def add_token(self, token_id: int) -> str | None:
        """Feed one generated token; returns the stop string it completed, if any."""
        return self.detok.add_token(token_id) if self.detok is not None else None

    @property
    def stopped_by(self) -> str | None:
        return self.detok.stopped_by if self.detok is not None else None

    def texts(self, token_ids: list[int], finished: bool) -> tuple[str, str]:
        """(all text so far, the text not handed out before). Without incremental text,
        nothing until the request finishes, then everything at once."""
        detok = self.detok
        if detok is not None:
            delta = detok.take_delta(finished)
            return (detok.text if finished else detok.text[: detok.emitted]), delta
        if finished and self.tokenizer is not None:
            text = self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
            return text, text
        return "", ""
