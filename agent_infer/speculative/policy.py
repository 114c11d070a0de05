"""When to draft, and what drafting has done (the spec-decode metrics).

Drafting must never cost. Two rules keep it so:
* a sequence whose drafts keep failing, or that keeps having none (looking for drafts
  costs host time), stops drafting for a while, twice as long each time it fails again
  (text that stops repeating itself), and resumes on its own;
* per decode batch size (in powers of two), the engine times plain steps and drafting
  steps (those that verified drafts, or whose lookup cost them their overlap; a lookup
  that found nothing leaves a plain step: `LLMEngine._time_for_policy`), each from the
  read-back of the step before it to its own with the tokens it gave (whichever call read
  it back), and drafts only while a drafting step yields more tokens per second than a
  plain one: at large batches a step is compute-bound, a verify step costs up to k + 1
  plain ones, and drafting turns itself off. The times compared are the medians of the
  last few steps of each kind, and the rule waits for three drafting steps, so that one
  stalled step (a compilation, a collection) cannot turn drafting off for the rest of a
  run. While off it probes now and then, as rarely as keeps the probes' cost near 1 % of
  the steps' time (and at least every 512 steps), so a change in the workload turns it
  back on: a probe's yield weighs six times a verify step's in the rule's average, so a
  few probes on text that repeats again suffice.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

FAILS_BEFORE_PAUSE = 3  # verify steps in a row that accept nothing
MAX_PAUSE_STEPS = 16  # at most this many tokens go undrafted once the text repeats again
PLAIN_PROBE_EVERY = 64  # while drafting pays: a plain step when none was timed in this many steps
MIN_PROBE_GAP = 16  # while it does not: a drafting step at most this often
PROBE_BUDGET = 0.01  # ... and no more often than keeps their extra cost near this share
PRIOR_TOKENS_PER_ROW = 2.0  # what a verify step is assumed to yield per sequence before it is seen
# Weight of a verify step in the yield's moving average: slow enough that a stretch of
# drafts that fail (which the pause rule answers) does not turn drafting off for the copy
# after it (docs/PERFORMANCE.md, the replay)...
_EMA = 0.05
# ... and of a probe's, while the rule has drafting off: probes are rare (up to 512 steps
# apart), and at the weight above a run of text that repeats again would need dozens of
# them to turn drafting back on.
PROBE_EMA = 0.3
TIMING_WINDOW = 15  # steps of each kind whose median wall time the batch rule compares
MIN_VERIFY_TIMINGS = 3  # drafting steps timed before the rule may turn drafting off (one may stall)
MAX_PROBE_GAP = 512  # steps between probes at most, whatever the last timings said


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters: verify rows (a sequence with drafts in a step), their
    draft tokens, the accepted ones, and the accepted ones by draft position; and this
    engine's chained verify rows (drafted behind a verify row still in flight)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    num_chained_rows: int = 0

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
    pause: int = 0  # the last pause's length, in tokens
    resume_at: int = 0  # the sequence's length at which it may draft again


@dataclass
class _Bucket:
    plain: deque = field(default_factory=lambda: deque(maxlen=TIMING_WINDOW))  # plain decode steps' wall times
    verify: deque = field(default_factory=lambda: deque(maxlen=TIMING_WINDOW))  # drafting steps'
    tokens_per_row: float = PRIOR_TOKENS_PER_ROW  # EMA of the tokens a decode row yields in a verify step
    steps: int = 0
    next_probe: int = 0  # while drafting does not pay (else 0): the step of the next drafting probe
    last_plain: int = 0  # the step count when a plain step was last timed
    kept_plain: int = 0  # steps this rule kept plain because drafting did not pay


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
        if not b.plain:
            return False  # measure a plain step first
        if len(b.verify) < MIN_VERIFY_TIMINGS:
            return True
        plain_s, verify_s = statistics.median(b.plain), statistics.median(b.verify)
        if b.tokens_per_row * plain_s >= verify_s:  # more tokens per second than a plain step
            b.next_probe = 0
            # A plain step only where none came on its own (a pause, a lookup that found
            # nothing) for a while: its timing would otherwise go stale.
            return b.steps - b.last_plain < PLAIN_PROBE_EVERY
        if b.steps < b.next_probe:
            b.kept_plain += 1
            return False
        extra = verify_s / plain_s - 1.0  # what a probe costs, in plain steps
        b.next_probe = b.steps + min(MAX_PROBE_GAP, max(MIN_PROBE_GAP, math.ceil(extra / PROBE_BUDGET)))
        return True

    def record_step(self, num_decoding: int, seconds: float, drafting: bool, tokens: int) -> None:
        """A decode step's wall time and the tokens it yielded; `drafting`: it looked for
        drafts (found or not)."""
        if num_decoding == 0:
            return
        b = self._bucket(num_decoding)
        if drafting:
            b.verify.append(seconds)
            # A drafting step while a next probe is set (drafting off) is a probe.
            weight = PROBE_EMA if b.next_probe else _EMA
            b.tokens_per_row += weight * (tokens / num_decoding - b.tokens_per_row)
        else:
            b.plain.append(seconds)
            b.last_plain = b.steps

    def _bucket(self, n: int) -> _Bucket:
        return self._buckets.setdefault(n.bit_length(), _Bucket())

    def batch_rule(self) -> dict[int, dict]:
        """What the batch rule saw and did, by the smallest batch size of each bucket: its
        steps, those it kept plain because drafting did not pay, and the medians and yield
        it compared (benchmarks read it; a decision is not visible in the metrics)."""
        return {1 << (key - 1): {
            "steps": b.steps, "kept_plain": b.kept_plain, "tokens_per_row": b.tokens_per_row,
            "plain_ms": statistics.median(b.plain) * 1e3 if b.plain else None,
            "drafting_ms": statistics.median(b.verify) * 1e3 if b.verify else None,
        } for key, b in sorted(self._buckets.items())}

    # ---- per sequence ---------------------------------------------------------------

    def may_draft(self, request_id: str, length: int) -> bool:
        """Whether the sequence, `length` tokens long now, may look for drafts. Its own
        length is the clock of a pause, so steps that draft for no one cost nothing here."""
        s = self._seqs.get(request_id)
        return s is None or length >= s.resume_at

    def on_verified(self, request_id: str, drafted: int, accepted: int, length: int) -> None:
        """A verify row's outcome, the sequence `length` tokens long after it; `drafted` = 0:
        the drafter had nothing to propose."""
        if drafted:
            self.stats.record(drafted, accepted)
        s = self._seqs.setdefault(request_id, _Backoff())
        if accepted:
            s.fails, s.pause, s.resume_at = 0, 0, 0
            return
        s.fails += 1
        if s.fails >= FAILS_BEFORE_PAUSE:
            s.pause = min(MAX_PAUSE_STEPS, 2 * s.pause or 2)
            s.resume_at = length + s.pause  # the next `pause` tokens come without drafts
            s.fails = 0

    def forget(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
