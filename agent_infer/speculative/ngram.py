"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the
sequence's longest matching suffix (between `min_n` and `max_n` tokens long), searched
over its prompt and output. Agents repeat text (a file quoted back with one edit, JSON
echoing its question), and there one match drafts a long correct run for free."""

from __future__ import annotations

import numpy as np


class TokenHistory:
    """A sequence's tokens as a growing int64 array (appends are amortised O(1), so the
    search does not rebuild the token list every step)."""

    def __init__(self, tokens: list[int]):
        self.buf = np.empty(max(64, 2 * len(tokens)), dtype=np.int64)
        self.buf[: len(tokens)] = tokens
        self.n = len(tokens)

    def sync(self, tokens_at, total: int) -> np.ndarray:
        """Bring the array up to `total` tokens (`tokens_at(i)` gives token i); the view."""
        if total > len(self.buf):
            grown = np.empty(2 * total, dtype=np.int64)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        for i in range(self.n, total):
            self.buf[i] = tokens_at(i)
        self.n = total
        return self.buf[:total]


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft tokens for the sequence `tokens` (empty: no match of `min_n` tokens)."""
    size = len(tokens)
    if size <= min_n or k <= 0:
        return []
    # Ends e < size - 1 of earlier occurrences of the suffix, one token longer per round.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    best = ends if min_n <= 1 else ends[:0]
    for j in range(1, max_n):
        ends = ends[ends >= j]
        ends = ends[tokens[ends - j] == tokens[size - 1 - j]]
        if len(ends) == 0:
            break
        if j + 1 >= min_n:
            best = ends
    if len(best) == 0:
        return []
    start = int(best[-1]) + 1  # the latest occurrence: the nearest context
    return tokens[start : start + k].tolist()


class NgramDrafter:
    """Prompt lookup for the engine's sequences: one token history per live request."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._history: dict[str, TokenHistory] = {}

    def propose(self, request_id: str, prompt: list[int], tokens_at, total: int, k: int,
                known: int | None = None) -> list[int]:
        """Up to `k` drafts for a sequence of `total` tokens (`tokens_at(i)`: token i), of
        which the first `known` (default: all) are final; the others are a guess that
        the history forgets after this search."""
        h = self._history.get(request_id)
        if h is None:
            h = self._history[request_id] = TokenHistory(prompt)
        drafts = propose_ngram(h.sync(tokens_at, total), k, self.min_n, self.max_n)
        if known is not None:
            h.n = min(h.n, known)
        return drafts

    def known_tokens(self, request_id: str, known: int) -> np.ndarray:
        """The first `known` tokens of a sequence, all final, that `propose` has seen (a
        view, valid until its next `propose`)."""
        h = self._history[request_id]
        assert h.n >= known, "known_tokens reads what propose has seen"
        return h.buf[:known]

    def after_step(self, batch, row_drafts: list[int] | None) -> None:
        """Nothing to do once a step is read back: drafts come from the tokens alone."""

    def forget(self, request_id: str) -> None:
        self._history.pop(request_id, None)
