"""When to draft, and what drafting has done (the spec-decode metrics).

Drafting must never cost. Two rules keep it so:
* a sequence whose drafts keep failing, or that keeps having none (looking for drafts
  costs a step its overlap with the previous one), stops drafting for a while, twice as
  long each time it fails again (text that stops repeating itself), and resumes on its own;
* per decode batch size (in powers of two), the engine times plain steps and verify
  steps and drafts only while a verify step yields more tokens per second than a plain
  one: at large batches a step is compute-bound, a verify step costs up to k + 1 plain
  ones, and drafting turns itself off. It re-measures now and then, so a change in the
  workload turns it back on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FAILS_BEFORE_PAUSE = 3  # verify steps in a row that accept nothing
MAX_PAUSE_STEPS = 16  # at most this many tokens go undrafted once the text repeats again
PLAIN_PROBE_EVERY = 64  # while drafting pays: one plain step in this many refreshes its timing
MAX_PROBE_GAP = 4096  # while it does not: verify probes ever rarer, down to one in this many steps
PRIOR_TOKENS_PER_ROW = 2.0  # what a verify step is assumed to yield per sequence before it is seen
_EMA = 0.1


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters: verify rows (a sequence with drafts in a step), their
    draft tokens, the accepted ones, and the accepted ones by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos += [0] * (drafted - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify row yields on average: the accepted drafts plus the target's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class _Backoff:
    fails: int = 0
    pause: int = 0  # the last pause's length, in decode steps
    resume_at: int = 0  # the sequence's step count at which it may draft again
    steps: int = 0  # decode steps the sequence has taken part in


@dataclass
class _Bucket:
    plain_s: float | None = None  # EMA of a plain decode step's wall time
    verify_s: float | None = None  # EMA of a verify step's
    tokens_per_row: float = PRIOR_TOKENS_PER_ROW  # EMA of the tokens a decode row yields in a verify step
    steps: int = 0
    probe_gap: int = 0  # steps between verify probes while drafting does not pay (0: it pays)
    next_probe: int = 0


class DraftPolicy:
    def __init__(self, disable_by_batch_size: int | None = None):
        self.disable_by_batch_size = disable_by_batch_size
        self._seqs: dict[str, _Backoff] = {}
        self._buckets: dict[int, _Bucket] = {}
        self.stats = SpecDecodeStats()

    # ---- per step -------------------------------------------------------------------

    def batch_drafts(self, num_decoding: int) -> bool:
        """Whether a decode step of `num_decoding` sequences should carry drafts."""
        if num_decoding == 0 or (self.disable_by_batch_size is not None
                                 and num_decoding >= self.disable_by_batch_size):
            return False
        b = self._bucket(num_decoding)
        b.steps += 1
        if b.plain_s is None:
            return False  # measure a plain step first
        if b.verify_s is None:
            return True
        if b.tokens_per_row * b.plain_s >= b.verify_s:  # more tokens per second than a plain step
            b.probe_gap = 0
            return b.steps % PLAIN_PROBE_EVERY != 0
        if b.steps < b.next_probe:
            return False
        b.probe_gap = min(MAX_PROBE_GAP, 2 * b.probe_gap or PLAIN_PROBE_EVERY)
        b.next_probe = b.steps + b.probe_gap
        return True

    def record_step(self, num_decoding: int, seconds: float, verify: bool, tokens: int) -> None:
        """A decode step's wall time (`verify`: it carried drafts) and the tokens it yielded."""
        if num_decoding == 0:
            return
        b = self._bucket(num_decoding)
        if verify:
            b.verify_s = _ema(b.verify_s, seconds)
            b.tokens_per_row = _ema(b.tokens_per_row, tokens / num_decoding)
        else:
            b.plain_s = _ema(b.plain_s, seconds)

    def _bucket(self, n: int) -> _Bucket:
        return self._buckets.setdefault(n.bit_length(), _Bucket())

    # ---- per sequence ---------------------------------------------------------------

    def may_draft(self, request_id: str) -> bool:
        s = self._seqs.setdefault(request_id, _Backoff())
        s.steps += 1
        return s.steps >= s.resume_at

    def on_verified(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verify row's outcome; `drafted` = 0: the drafter had nothing to propose."""
        if drafted:
            self.stats.record(drafted, accepted)
        s = self._seqs.setdefault(request_id, _Backoff())
        if accepted:
            s.fails, s.pause, s.resume_at = 0, 0, 0
            return
        s.fails += 1
        if s.fails >= FAILS_BEFORE_PAUSE:
            s.pause = min(MAX_PAUSE_STEPS, 2 * s.pause or 2)
            s.resume_at = s.steps + s.pause + 1  # the next `pause` steps go without drafts
            s.fails = 0

    def forget(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + _EMA * (new - old)
