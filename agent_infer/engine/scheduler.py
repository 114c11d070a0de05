"""Continuous batching: which sequences run in the next step, and what their results mean.

Policy: prefill first; a step is either a prefill batch (several
prompts, ragged, up to `max_num_batched_tokens`; a prompt larger than the budget is cut
into chunks) or a decode batch of every running sequence. With `mixed_batches` a step
that prefills also carries every running decode, one token each and first in the batch,
and the prefill gets what is left of the token budget: arriving prompts no longer stall
the sequences already generating.

No preemption by default, and no deadlock: a request is admitted only while the running
set stays *safe* in the banker's sense: some order exists in which every running request
reaches its `max_tokens` using the free blocks plus the blocks released by those that
finish before it. Decode growth is granted under the same rule, so a running request is
never starved forever and nothing is ever evicted. With `preemption_mode="recompute"`
admission is optimistic instead, and when blocks run out the newest request is sent
back to the queue, its KV dropped, to be recomputed later (its tokens are kept).

Speculative decoding: a decoding sequence may bring draft tokens (`draft_token_ids`,
set before scheduling). It then computes its last token and k drafts in one step, as
k + 1 decode rows (each attends up to its own position), and samples at all of them;
`on_result` keeps the drafts the target agrees with plus the target's own next token,
and rolls `num_computed_tokens` back over the rest, whose K/V (already written) are
overwritten later and never published to the prefix cache. Drafts never reach past
`max_tokens`, and they get blocks only when that is safe.

A step may be scheduled while a verify row of the same sequence is still in flight: its
row is placed as if every draft is accepted, and the device moves it back by those that
were not (`ops.resolve_rows`) before it runs, and looks its drafts up on the text that
row really gave (`ops.lookup_drafts`); `on_result` then drops the rejected drafts' slots
from between the two rows, so the host's view follows the device's.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from agent_infer.engine.block_manager import BlockManager
from agent_infer.engine.structs import PLACEHOLDER, FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    preemption_mode: str = "none"
    mixed_batches: bool = False
    one_prompt_per_prefill: bool = False  # EngineConfig.batch_invariant


@dataclass
class ScheduledBatch:
    """One step's work. `num_new_tokens[i]` tokens of `seqs[i]` are computed, starting at
    `seqs[i].num_computed_tokens`; a sequence samples a token only when that reaches its end."""

    seqs: list[Sequence]
    is_prefill: bool
    num_new_tokens: list[int]
    samples: list[bool] = field(default_factory=list)
    # A mixed batch (is_prefill): its first num_decode sequences are decode rows.
    num_decode: int = 0
    # Per sequence, the draft tokens it verifies (a verify row: a decode row whose last
    # token and drafts are computed and sampled at every position); empty for the others.
    # A row drafted behind one in flight has its drafts looked up on the device: its
    # `draft_history` (Sequence), else None (empty when no row has one). The engine puts
    # the drafts it verified in `drafts` when the step is read back.
    drafts: list[list[int]] = field(default_factory=list)
    draft_histories: list[np.ndarray | None] = field(default_factory=list)
    # Filled by `on_result`: per verify row, how many of its drafts were accepted.
    accepted: list[int] = field(default_factory=list)
    # Set by the engine for the draft policy's timing: when the call that launched the
    # step began, and whether that call read the step in flight back before looking for
    # drafts (the lookup cost the step its overlap).
    started_s: float = 0.0
    looked_serially: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(d) for d in self.drafts)

    @property
    def num_decode_seqs(self) -> int:
        """Decode (and verify) rows: the first num_decode of a prefill batch, else all."""
        return self.num_decode if self.is_prefill else len(self.seqs)

    @property
    def num_prompt_rows(self) -> int:
        """Sequences computing prompt tokens."""
        return len(self.seqs) - self.num_decode_seqs

    def sampling_drafts(self) -> list[list[int]] | None:
        """The drafts of the sampling sequences, in order (None: no drafts in the batch)."""
        return [d for d, samples in zip(self.drafts, self.samples) if samples] if self.drafts else None

    def drafts_of(self, i: int) -> list[int]:
        return self.drafts[i] if self.drafts else []

    def sample_rows(self, i: int) -> int:
        """Logit rows sequence i samples: 1 + its drafts, or 0."""
        return (1 + len(self.drafts_of(i))) if self.samples[i] else 0

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, eos_token_ids: set[int]):
        self.config = config
        self.bm = block_manager
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # hold blocks; in admission order
        self.num_preemptions = 0

    # ---- requests ------------------------------------------------------------------

    def add(self, seq: Sequence) -> bool:
        """Queue `seq`; reject it at once (and return False) if it can never run."""
        limit = self.config.max_model_len
        if seq.num_prompt_tokens >= limit:
            seq.reject(
                f"prompt has {seq.num_prompt_tokens} tokens but the context length is {limit}: "
                f"no room for a single generated token"
            )
            return False
        need = self.bm.blocks_for(seq.max_total_tokens)
        if need > self.bm.num_blocks:
            seq.reject(
                f"request needs {need} KV blocks ({seq.max_total_tokens} tokens) but the pool holds "
                f"{self.bm.num_blocks}; lower max_tokens or give the KV cache more memory"
            )
            return False
        self.waiting.append(seq)
        return True

    def abort(self, seq: Sequence) -> None:
        if seq.is_finished:
            return
        del seq.output_token_ids[seq.num_resolved :]
        if seq in self.running:
            self.running.remove(seq)
            self.bm.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.finish(FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ----------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        if self.config.mixed_batches:
            return self._schedule_mixed()
        batch = self._schedule_prefill(self.config.max_num_batched_tokens)
        if batch is None:
            batch = self._schedule_decode()
        return batch

    def _schedule_mixed(self) -> ScheduledBatch | None:
        """Every decode that can grow, then prefill in the budget they leave."""
        decode = self._schedule_decode()
        used = decode.num_tokens if decode is not None else 0
        prefill = self._schedule_prefill(self.config.max_num_batched_tokens - used)
        if prefill is None or decode is None:
            return prefill or decode
        drafts = decode.drafts + [[] for _ in prefill.seqs] if decode.drafts else []
        histories = decode.draft_histories + [None] * len(prefill) if decode.draft_histories else []
        return ScheduledBatch(
            decode.seqs + prefill.seqs, True, decode.num_new_tokens + prefill.num_new_tokens,
            decode.samples + prefill.samples, num_decode=len(decode), drafts=drafts, draft_histories=histories,
        )

    def _schedule_prefill(self, budget: int) -> ScheduledBatch | None:
        seqs: list[Sequence] = []
        counts: list[int] = []
        computing: set[int] = set()  # keys of the prompt blocks this batch fills

        def take(seq: Sequence) -> bool:
            nonlocal budget
            remaining = seq.num_uncomputed_tokens
            n = min(remaining, budget)
            if n <= 0 or (n < remaining and seqs):
                return False  # only the first sequence of a batch is ever cut into chunks
            if seqs and self.config.one_prompt_per_prefill:
                return False  # a prompt prefilled beside others rounds apart from it alone
            seqs.append(seq)
            counts.append(n)
            budget -= n
            if self.bm.enable_prefix_caching:
                bs = self.bm.block_size
                end = min(seq.num_computed_tokens + n, seq.num_prompt_tokens) // bs
                computing.update(self.bm.prompt_block_keys(seq, seq.num_computed_tokens // bs, end))
            return True

        # Prompts already admitted and half computed go first, in admission order.
        for seq in self.running:
            if seq.status == SequenceStatus.RUNNING_PREFILL and not take(seq):
                break
        else:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                hits = self.bm.match_prefix(seq)
                if self.bm.next_uncached_key(seq, hits) in computing:
                    # A request in this batch computes the next block of this prompt (n > 1
                    # choices, a burst with one system prompt): wait a step and reuse it.
                    break
                if not self._can_admit(seq, hits):
                    break
                self.waiting.popleft()
                self.bm.allocate(seq, hits, seq.num_tokens)
                seq.transition_to(SequenceStatus.RUNNING_PREFILL)
                if seq.scheduled_time is None:
                    seq.scheduled_time = time.monotonic()
                self.running.append(seq)
                if not take(seq):
                    break
        if not seqs:
            return None
        samples = [seq.num_computed_tokens + n == seq.num_tokens for seq, n in zip(seqs, counts)]
        return ScheduledBatch(seqs, True, counts, samples)

    def _schedule_decode(self) -> ScheduledBatch | None:
        # A sequence whose placeholder already is its last allowed token is done growing.
        decoding = [
            s for s in self.running
            if s.status == SequenceStatus.RUNNING_DECODE and len(s.output_token_ids) < s.max_tokens
        ]
        # When the free pool covers every outstanding need at once (the usual case) any
        # grant is safe, and stays so: a grant lowers the free count and one need alike.
        plenty = sum(self._need(s) for s in decoding) <= self.bm.get_num_free_blocks()
        seqs: list[Sequence] = []
        drafts: list[list[int]] = []
        histories: list[np.ndarray | None] = []
        budget = self.config.max_num_batched_tokens - len(decoding)  # for drafts
        for seq in decoding:
            if seq.status != SequenceStatus.RUNNING_DECODE:
                continue  # preempted by an earlier grant this step
            # Drafts stop where max_tokens does: k + 1 tokens come out at most.
            proposed, seq.draft_token_ids = seq.draft_token_ids, []  # this step's, or none
            history, seq.draft_history = seq.draft_history, None
            k = min(len(proposed), seq.max_tokens - len(seq.output_token_ids) - 1, max(0, budget))
            if k > 0 and self._grow(seq, plenty, extra_tokens=k, preempt=False):
                seqs.append(seq)
                drafts.append(proposed[:k])
                histories.append(history)
                budget -= k
            elif self._grow(seq, plenty):
                seqs.append(seq)
                drafts.append([])
                histories.append(None)
        if not seqs:
            return None
        return ScheduledBatch(seqs, False, [1 + len(d) for d in drafts], [True] * len(seqs),
                              drafts=drafts if any(drafts) else [],
                              draft_histories=histories if any(h is not None for h in histories) else [])

    # ---- admission and growth ------------------------------------------------------

    def _can_admit(self, seq: Sequence, hits: list[int]) -> bool:
        take = self.bm.num_blocks_to_take(seq, hits, seq.num_tokens)
        free = self.bm.get_num_free_blocks()
        if take > free:
            return False
        if self.config.preemption_mode == "recompute":
            return True
        # Banker's check with `seq` admitted.
        need = self.bm.blocks_for(seq.max_total_tokens) - self.bm.blocks_for(seq.num_tokens)
        if need + sum(self._need(s) for s in self.running) <= free - take:
            return True  # every request could even run to the end at once
        hit_set = set(hits)
        jobs = [(self._need(s), self._release(s, hit_set)) for s in self.running]
        jobs.append((need, take))
        return _is_safe(free - take, jobs)

    def _grow(self, seq: Sequence, plenty: bool, extra_tokens: int = 0, preempt: bool = True) -> bool:
        """Make room for the token `seq` computes next (and `extra_tokens` drafts after it).
        False: it sits this step out (or, without `preempt`, goes without drafts)."""
        num_tokens = seq.num_tokens + extra_tokens
        extra = self.bm.blocks_needed_for(seq, num_tokens)
        if extra == 0:
            return True
        if not preempt and extra > self.bm.get_num_free_blocks():
            return False
        if self.config.preemption_mode == "recompute":
            while self.bm.get_num_free_blocks() < extra:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    return False
            return self.bm.ensure_capacity(seq, num_tokens)
        free = self.bm.get_num_free_blocks()
        if extra > free:
            return False
        if not plenty:
            # Granting within a request's declared need can still make the state unsafe.
            trial = [
                (self._need(s) - extra, self._release(s) + extra) if s is seq else (self._need(s), self._release(s))
                for s in self.running
            ]
            if not _is_safe(free - extra, trial):
                return False
        return self.bm.ensure_capacity(seq, num_tokens)

    def _need(self, seq: Sequence) -> int:
        """Blocks `seq` may still need to reach its max_tokens."""
        return max(0, self.bm.blocks_for(seq.max_total_tokens) - len(seq.block_table))

    def _release(self, seq: Sequence, extra_shared: set[int] = frozenset()) -> int:
        """Blocks that return to the pool when `seq` finishes (held by it alone)."""
        return sum(1 for b in seq.block_table if self.bm.ref_count[b] == 1 and b not in extra_shared)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.transition_to(SequenceStatus.WAITING)
        self.waiting.appendleft(seq)

    # ---- results -------------------------------------------------------------------

    def on_launch(self, batch: ScheduledBatch) -> None:
        """The step is on its way to the device: advance the computed counts, and give each
        sampling sequence a placeholder output token that `on_result` fills in (after a
        verify row's drafts, taken as accepted until then). The next step can then be
        scheduled before this one's tokens are known."""
        row = 0
        for i, (seq, n, samples) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.samples)):
            seq.num_computed_tokens += n
            if batch.is_prefill:
                # Prompt blocks this step fills can serve requests scheduled from now on:
                # the device runs steps in order, so they are computed before any reader.
                self.bm.commit_full_blocks(seq, limit=seq.num_prompt_tokens)
            if samples:
                if seq.status == SequenceStatus.RUNNING_PREFILL:
                    seq.transition_to(SequenceStatus.RUNNING_DECODE)
                drafts = batch.drafts_of(i)
                seq.output_token_ids += drafts
                seq.output_token_ids.append(PLACEHOLDER)
                seq.pending_row = row + len(drafts)  # the target's token after the drafts
                seq.pending_drafts = len(drafts)
                row += batch.sample_rows(i)

    def on_result(self, batch: ScheduledBatch, token_ids: list[int]) -> list[tuple[Sequence, int, int]]:
        """Fill in the step's sampled tokens and apply stop conditions; returns each
        sequence that got tokens with the output index of its first new one and the
        row of `token_ids` it came from. `token_ids` holds the sampling sequences' rows in
        order: one each, 1 + k for a verify row, whose tokens are its accepted drafts and
        then the target's own."""
        sampled: list[tuple[Sequence, int, int]] = []
        row = 0
        batch.accepted = []
        for i, (seq, samples) in enumerate(zip(batch.seqs, batch.samples)):
            if not samples:
                if not seq.is_finished:
                    self.bm.commit_full_blocks(seq)
                continue
            drafts = batch.drafts_of(i)
            first_row, row = row, row + 1 + len(drafts)
            rows = token_ids[first_row:row]
            if drafts:
                accepted = _num_accepted(drafts, rows)
                batch.accepted.append(accepted)
                rows = rows[: accepted + 1]
            if seq.is_finished:  # aborted, or stopped by an earlier token, while this step ran
                continue
            first = seq.num_resolved
            # The rejected drafts' slots. A row launched since stays in flight: the device
            # moved it back by as many.
            del seq.output_token_ids[first + len(rows) : first + 1 + len(drafts)]
            for j, token in enumerate(rows):
                index = first + j
                seq.output_token_ids[index] = token
                seq.num_resolved = index + 1
                reason = self._stop_reason(seq, token, index)
                if reason is not None:
                    self.finish(seq, reason)
                    break
            if drafts and not seq.is_finished:
                seq.num_computed_tokens = seq.num_tokens - 1  # the rejected drafts' K/V are void
            self.bm.commit_full_blocks(seq, limit=seq.num_prompt_tokens + seq.num_resolved)
            sampled.append((seq, first, first_row))
        return sampled

    def postprocess(self, batch: ScheduledBatch, token_ids: list[int]) -> list[tuple[Sequence, int, int]]:
        """on_launch and on_result at once (a step run synchronously)."""
        self.on_launch(batch)
        return self.on_result(batch, token_ids)

    def _stop_reason(self, seq: Sequence, token: int, index: int) -> FinishReason | None:
        sp = seq.sampling_params
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if index + 1 >= seq.max_tokens:
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence, reason: FinishReason, keep: int | None = None) -> None:
        """End `seq`; `keep`: only its first `keep` output tokens stand (a stop string or a
        complete grammar inside a verify row's accepted run)."""
        if keep is not None and keep < seq.num_resolved:
            seq.num_resolved = keep
            if seq.is_finished:  # by a later token of the same run (EOS, max_tokens): this came first
                del seq.output_token_ids[keep:]
                seq.finish_reason = reason
                return
        if seq.is_finished:
            return
        del seq.output_token_ids[seq.num_resolved :]  # placeholders of steps still in flight
        if seq in self.running:
            self.running.remove(seq)
            self.bm.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.finish(reason)


def _num_accepted(drafts: list[int], sampled: list[int]) -> int:
    """Leading drafts the target sampled itself. With one draft per position (a point
    mass q), this is exact rejection sampling: a draft d survives with probability p(d),
    and on a mismatch the target's own sample is one from p given "not d", which is the
    residual distribution max(p - q, 0) normalised."""
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return n


def _is_safe(free: int, jobs: list[tuple[int, int]]) -> bool:
    """Banker's check for one resource: finish jobs smallest-need first (optimal for a
    single resource, since finishing one only adds free blocks)."""
    for need, release in sorted(jobs):
        if need > free:
            return False
        free += need + release
    return True
