"""Per-request logits constraints, applied between a step's forward pass and its sampling:
grammars (structured outputs), `allowed_token_ids`, `min_tokens` and `logit_bias`, all
through one mechanism: a packed bitmask of allowed tokens per constrained row, built on
the host into pinned memory and applied on the device for the whole batch in one kernel,
plus a sparse additive bias.

Timing (see LLMEngine._launch): the forward pass of step N+1 is queued first; while the
device runs it, the host reads step N's tokens back (they were sampled before this
forward pass, so they are ready or nearly), advances the matchers, fills the masks and
queues mask + sampling. Async scheduling stays: the device never waits for the host
except for the mask itself, which takes microseconds per row. Rows without a constraint
get no mask, and a batch without any constrained row never comes here.

Only rank 0 samples under tensor parallelism, so this is all rank 0's.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from agent_infer.kernels import ops
from agent_infer.sampling_params import SamplingParams
from agent_infer.structured.grammar import GrammarCompiler, GrammarError

log = logging.getLogger(__name__)


class Sequence(Protocol):
    """What the constraints read of a running sequence (the engine's `structs.Sequence`)."""

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]

    @property
    def num_output_tokens(self) -> int: ...

    num_resolved: int

    @property
    def is_finished(self) -> bool: ...

# Where a constrained row stands with respect to a reasoning block (<think>...</think>):
CONSTRAINED = 0  # the grammar applies
MAYBE = 1  # the model may open a reasoning block first: grammar mask | {start token}
THINKING = 2  # inside the block: no grammar mask until the end token
_TAIL = 8  # prompt tokens looked at to tell whether the prompt opened or closed a block


@dataclass
class _Row:
    matcher: object | None = None  # llguidance LLMatcher
    lexer: tuple[int, int] = (0, 0)  # (shard, grammar): the template the matcher was copied from
    phase: int = CONSTRAINED
    think: tuple[int, int] | None = None
    allowed: np.ndarray | None = None  # packed int32 words: the allowed_token_ids
    min_tokens: int = 0
    early_stop_ids: np.ndarray | None = None  # EOS + stop tokens, banned before min_tokens
    bias_ids: np.ndarray | None = None
    bias_values: np.ndarray | None = None


@dataclass
class ConstraintStats:
    steps: int = 0  # steps that had a constrained row
    masked_rows: int = 0  # row-steps that got a bitmask
    host_seconds: float = 0.0  # matcher fills + mask staging + queueing the apply, on the host
    wait_seconds: float = 0.0  # time spent reading back the previous step inside the hook


def pack_token_ids(ids, words: int) -> np.ndarray:
    """A bitmask [words] int32 with the bits of `ids` set."""
    bits = np.zeros(words * 32, dtype=np.uint8)
    bits[np.asarray(list(ids), dtype=np.int64)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def clear_bits(row: np.ndarray, ids: np.ndarray) -> None:
    flat = row.view(np.uint32)
    np.bitwise_and.at(flat, ids // 32, ~(np.uint32(1) << (ids % 32).astype(np.uint32)))


def set_bit(row: np.ndarray, token: int) -> None:
    row.view(np.uint32)[token // 32] |= np.uint32(1) << np.uint32(token % 32)


class Constraints:
    def __init__(self, compiler: GrammarCompiler | None, vocab_size: int, eos_token_ids, device: torch.device,
                 max_rows: int):
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.eos_token_ids = sorted(eos_token_ids)
        self.device = device
        self.max_rows = max_rows
        self._rows: dict[str, _Row] = {}
        self._executor = None
        # Two staging buffers used in turn: a step's mask copy may still be queued on the
        # device while the next step's mask is filled (one step in flight at most).
        self._host: list[torch.Tensor] = []
        self._turn = 0
        self.stats = ConstraintStats()

    # ---- requests -------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Track `seq` if its sampling params constrain it. Raises GrammarError (bad
        grammar) or ValueError (a token id outside the vocabulary)."""
        sp = seq.sampling_params
        if not sp.constrained:
            return
        row = _Row(min_tokens=sp.min_tokens)
        for name, ids in sp.token_ids_to_check.items():
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} must be token ids in [0, {self.vocab_size}); got {bad[:3]}")
        if sp.allowed_token_ids is not None:
            row.allowed = pack_token_ids(sp.allowed_token_ids, self.words)
        if sp.min_tokens:
            stop = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_token_ids))
            row.early_stop_ids = np.asarray(sorted(stop), dtype=np.int64)
        if sp.logit_bias:
            row.bias_ids = np.asarray(list(sp.logit_bias), dtype=np.int64)
            row.bias_values = np.asarray(list(sp.logit_bias.values()), dtype=np.float32)
        so = sp.structured_outputs
        if so is not None:
            if self.compiler is None:
                raise GrammarError("structured outputs need a tokenizer, and this model has none")
            compiled = self.compiler.compile(so)
            row.matcher, shard = self.compiler.new_matcher(compiled)
            row.lexer = (shard, id(compiled))
            if so.reasoning is not None:
                row.think = so.reasoning
                row.phase = self._initial_phase(seq.prompt_token_ids, so.reasoning)
        self._rows[seq.request_id] = row

    def _initial_phase(self, prompt: list[int], think: tuple[int, int]) -> int:
        """CONSTRAINED when the prompt ends in a closed block (e.g. Qwen3 with thinking off:
        `<think>\\n\\n</think>\\n\\n`), THINKING when it ends inside one, else MAYBE. Only the
        prompt's tail counts: earlier turns of the conversation may hold whole blocks."""
        start, end = think
        tok = self.compiler.ll_tokenizer
        for t in reversed(prompt[-_TAIL:]):
            if t == end:
                return CONSTRAINED
            if t == start:
                return THINKING
            if tok.decode_bytes([t]).strip():
                break
        return MAYBE

    def remove(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rows

    def any_in(self, seqs: list[Sequence]) -> bool:
        rows = self._rows
        return bool(rows) and any(s.request_id in rows for s in seqs)

    def needs_previous_tokens(self, seqs: list[Sequence]) -> bool:
        """Whether a grammar row's mask depends on a token not read back yet (the row's
        placeholder of this step is its last output token; one before it is pending)."""
        rows = self._rows
        for s in seqs:
            row = rows.get(s.request_id)
            if row is not None and row.matcher is not None and s.num_resolved < s.num_output_tokens - 1:
                return True
        return False

    def check_drafts(self, seq: Sequence, drafts: list[int]) -> list[int]:
        """The leading drafts `seq`'s grammar accepts (a verify step computes the masks of
        the rows after them by consuming them). A reasoning block's start is not drafted
        across: no drafts while a block may open, none past its end."""
        row = self._rows.get(seq.request_id)
        if row is None or row.matcher is None or not drafts:
            return drafts
        if row.phase == MAYBE:
            return []
        if row.phase == THINKING:
            end = row.think[1]
            return drafts[: drafts.index(end)] if end in drafts else drafts
        return drafts[: row.matcher.validate_tokens(drafts)]

    def on_token(self, seq: Sequence, token: int) -> bool:
        """Advance `seq`'s grammar by its new token; True when the grammar is complete
        (or broken), so the sequence should stop here."""
        row = self._rows.get(seq.request_id)
        if row is None or row.matcher is None:
            return False
        if row.phase != CONSTRAINED:
            start, end = row.think
            if row.phase == THINKING:
                if token == end:
                    row.phase = CONSTRAINED
                return False
            if token == start:  # MAYBE, and the model opened a block
                row.phase = THINKING
                return False
            row.phase = CONSTRAINED
        m = row.matcher
        if not m.consume_token(token):
            log.warning("request %s: token %d broke its grammar (%s); stopping it", seq.request_id, token,
                        m.get_error())
            return True
        return m.is_stopped()

    # ---- one step -------------------------------------------------------------------

    def apply(self, seqs: list[Sequence], logits: torch.Tensor, drafts: list[list[int]] | None = None) -> torch.Tensor:
        """Apply the constraints of `seqs` (the step's sampling sequences, in order) to
        their logits, in place; returns the logits. One logit row per sequence, or with
        `drafts` (per sequence, as `check_drafts` left them) 1 + len(drafts) rows each:
        row j is constrained as if drafts[:j] had been generated."""
        with torch.profiler.record_function("structured.masks"):  # named in profiles (bench --profile)
            rows = [(seq, j) for seq, d in zip(seqs, drafts) for j in range(1 + len(d))] if drafts else \
                [(seq, 0) for seq in seqs]
            return self._apply(rows, logits, {id(s): d for s, d in zip(seqs, drafts or []) if d})

    def _apply(self, seq_rows: list[tuple[Sequence, int]], logits: torch.Tensor,
               drafts: dict[int, list[int]]) -> torch.Tensor:
        t0 = time.perf_counter()
        rows = self._rows
        mask_rows: list[int] = []
        mask_of: list[_Row] = []
        mask_at: list[tuple[Sequence, int]] = []
        bias_rows, bias_ids, bias_values = [], [], []
        for i, (seq, j) in enumerate(seq_rows):
            row = rows.get(seq.request_id)
            if row is None or seq.is_finished:
                continue  # unconstrained, or finished while this step was being prepared
            if row.bias_ids is not None:
                bias_rows.append(np.full(len(row.bias_ids), i, dtype=np.int64))
                bias_ids.append(row.bias_ids)
                bias_values.append(row.bias_values)
            if self._needs_mask(row, seq, j):
                mask_rows.append(i)
                mask_of.append(row)
                mask_at.append((seq, j))
        if bias_rows:
            index = (torch.from_numpy(np.concatenate(bias_rows)).to(logits.device, non_blocking=True),
                     torch.from_numpy(np.concatenate(bias_ids)).to(logits.device, non_blocking=True))
            values = torch.from_numpy(np.concatenate(bias_values)).to(logits.device, non_blocking=True)
            logits.index_put_(index, values.to(logits.dtype), accumulate=True)
        if mask_rows:
            host = self._fill(mask_at, mask_of, drafts)
            mask = host.to(logits.device, non_blocking=True)
            index = torch.tensor(mask_rows, dtype=torch.int64).to(logits.device, non_blocking=True)
            ops.apply_token_bitmask(logits, mask, index)
        self.stats.steps += 1
        self.stats.masked_rows += len(mask_rows)
        self.stats.host_seconds += time.perf_counter() - t0
        return logits

    @staticmethod
    def _needs_mask(row: _Row, seq: Sequence, offset: int = 0) -> bool:
        if row.allowed is not None:
            return True
        # The token being sampled now is output token num_output_tokens - 1 + offset (its
        # placeholder is already in place; `offset` drafts before it in a verify row).
        if row.early_stop_ids is not None and seq.num_output_tokens - 1 + offset < row.min_tokens:
            return True
        return row.matcher is not None and row.phase != THINKING

    def _fill(self, mask_at: list[tuple[Sequence, int]], mask_of: list[_Row],
              drafts: dict[int, list[int]]) -> torch.Tensor:
        """The bitmasks of the masked rows, [len(mask_at), words] int32 in (pinned) host
        memory. A row at draft offset j > 0 gets its grammar's mask after the first j
        drafts, consumed and then rolled back."""
        host = self._staging()[: len(mask_at)]
        arr = host.numpy()
        grammar = [(r.matcher, k) for k, r in enumerate(mask_of)
                   if r.matcher is not None and r.phase != THINKING and mask_at[k][1] == 0]
        ahead = [k for k, r in enumerate(mask_of) if r.matcher is not None and r.phase != THINKING and mask_at[k][1]]
        # Rows of one shard share a lexer lock (grammar.py): kept together, so the
        # executor's contiguous splits give each thread whole shards.
        grammar.sort(key=lambda mk: mask_of[mk[1]].lexer)
        if len(grammar) < len(mask_of):
            arr[:] = -1
        if len(grammar) == 1:
            m, k = grammar[0]
            m.unsafe_compute_mask_ptr(arr[k].ctypes.data, arr[k].nbytes)
        elif grammar:
            self.executor.unsafe_compute_mask_ptr(grammar, arr.ctypes.data, arr.shape[1] * 4, arr.shape[0])
        for k in ahead:  # one sequence's rows come in order: consume one draft per row
            seq, j = mask_at[k]
            m = mask_of[k].matcher
            m.consume_token(drafts[id(seq)][j - 1])
            m.unsafe_compute_mask_ptr(arr[k].ctypes.data, arr[k].nbytes)
            if j == len(drafts[id(seq)]):
                m.rollback(j)
        for k, ((seq, _), row) in enumerate(zip(mask_at, mask_of)):
            if row.matcher is not None and row.phase != THINKING and row.matcher.is_error():
                # A grammar that hit a limit (or broke) allows nothing; end the sequence
                # cleanly with EOS rather than sample from a row of -inf.
                log.warning("request %s: its grammar failed (%s); ending it", seq.request_id,
                            row.matcher.get_error().splitlines()[0] if row.matcher.get_error() else "")
                arr[k] = self._eos_mask
                continue
            if row.matcher is not None and len(self.eos_token_ids) > 1:
                self._widen_eos(arr[k])
            if row.matcher is not None and row.phase == MAYBE:
                set_bit(arr[k], row.think[0])  # the model may open a reasoning block instead
            if row.allowed is not None:
                np.bitwise_and(arr[k], row.allowed, out=arr[k])
            if row.early_stop_ids is not None and seq.num_output_tokens - 1 + mask_at[k][1] < row.min_tokens:
                clear_bits(arr[k], row.early_stop_ids)
        return host

    def _widen_eos(self, row: np.ndarray) -> None:
        """Where the grammar allows the EOS llguidance knows, allow every EOS of the engine."""
        eos = self.compiler.grammar_eos
        if eos is not None and (int(row.view(np.uint32)[eos // 32]) >> (eos % 32)) & 1:
            for t in self.eos_token_ids:
                set_bit(row, t)

    @functools.cached_property
    def _eos_mask(self) -> np.ndarray:
        return pack_token_ids(self.eos_token_ids[:1] or [0], self.words)

    @property
    def executor(self):
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(num_threads=self.compiler.shards)
        return self._executor

    def _staging(self) -> torch.Tensor:
        if not self._host:
            pin = self.device.type == "cuda"
            self._host = [torch.empty(self.max_rows, self.words, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        host = self._host[self._turn]
        self._turn ^= 1
        return host
