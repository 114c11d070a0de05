"""A scheduled batch as the host arrays of one step (`HostStep`), built once on rank 0 and
sent as is to tensor-parallel workers.

Attention rows: a prompt sequence's chunk is one row of several query tokens; a decode
sequence gives one row per token it computes, each attending up to its own position.
A plain decode row computes one token; a verify row (speculative decoding) its last
token and its k drafts, as k + 1 rows that are ordinary decode rows to the attention
kernels, to the CUDA graphs and to the LM head (every decode row samples).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from agent_infer.engine.scheduler import ScheduledBatch
from agent_infer.engine.structs import PLACEHOLDER
from agent_infer.kvcache.slots import ragged_slots


@dataclass
class DraftLookup:
    """The rows of a step whose drafts prompt lookup finds on the device, behind a row of
    their sequence still in flight (`ops.lookup_drafts`): per row, the sequence's tokens
    the host knows, the index of the row's first input token, its draft slots, and the
    last sample index and draft count of the row in flight. All of it in one int64 array
    for one host-to-device copy: `num_rows` + 1 offsets into the tokens, then the starts,
    the slots, the sample indices and the draft counts, `num_rows` each, then the tokens
    of every row back to back."""

    num_rows: int
    packed: np.ndarray  # int64

    @staticmethod
    def build(rows: list[tuple[np.ndarray, int, int, int, int]]) -> "DraftLookup":
        """From (known tokens, start, slots, sample index, draft count) per row."""
        histories = [r[0] for r in rows]
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(h) for h in histories], out=offsets[1:])
        head = np.asarray([r[1:] for r in rows], dtype=np.int64).T.ravel()
        return DraftLookup(len(rows), np.concatenate([offsets, head, *histories]).astype(np.int64, copy=False))


@dataclass
class HostStep:
    is_prefill: bool
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    block_tables: np.ndarray  # [B, max_blocks] int32, per attention row
    context_lens: np.ndarray  # [B] int32
    query_lens: np.ndarray  # [B] int32
    query_start_loc: np.ndarray  # [B + 1] int32
    sample_indices: np.ndarray  # [S] int64
    # Input tokens still on the device: index into the previous step's sampled tokens
    # (-1: the id in input_ids is real), one per input token. None when there are none.
    prev_index: np.ndarray | None = None
    # Rows placed as if the verify row still in flight in the previous step accepted all
    # its drafts (ops.resolve_rows moves them on the device): per input token, that row's
    # last sample index (-1: none) and its number of drafts. None when there are none.
    follow: np.ndarray | None = None  # [T] int64
    follow_k: np.ndarray | None = None  # [T] int64
    # Rows whose drafts the device looks up (None: none).
    lookup: DraftLookup | None = None
    # Whether some row verifies drafts: the next step may then follow it (the runner
    # keeps this step's input ids on the device for that).
    has_drafts: bool = False
    # A mixed step (is_prefill): its first num_decode attention rows are one-token decode rows.
    num_decode: int = 0
    # Prompt logprobs (prefill only; None when no sequence asks): the rows whose logits
    # predict a later prompt token, that token, how many rows each sequence has (batch
    # order), and the top-k to return.
    prompt_lp_rows: np.ndarray | None = None  # [R] int64
    prompt_lp_targets: np.ndarray | None = None  # [R] int64
    prompt_lp_counts: np.ndarray | None = None  # [batch sequences] int64
    prompt_lp_k: int = 0
    # The first attention row of each batch sequence, and the end: sequence i's input
    # tokens are query_start_loc[seq_rows[i]] .. query_start_loc[seq_rows[i + 1]].
    seq_rows: np.ndarray | None = None  # [batch sequences + 1] int64
    # A draft layer's input tokens (speculative method mtp) at each row, t_{p+1}, in a step
    # with prompt rows (a decode step's are its sampled tokens): ModelRunner.build_step.
    next_ids: np.ndarray | None = None  # [T] int64

    def token_range(self, i: int) -> tuple[int, int]:
        """Input token rows of batch sequence i."""
        return int(self.query_start_loc[self.seq_rows[i]]), int(self.query_start_loc[self.seq_rows[i + 1]])


def build_host_step(batch: ScheduledBatch, block_size: int) -> HostStep:
    num_decode_seqs = batch.num_decode_seqs
    ids: list[int] = []
    prev: list[int] | None = None
    follow: list[int] | None = None
    follow_k: list[int] | None = None
    lookup: list[tuple[np.ndarray, int, int, int, int]] = []  # DraftLookup.build's rows
    row_seq: list[int] = []  # the batch sequence of each attention row
    row_start: list[int] = []
    row_len: list[int] = []
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        start = seq.num_computed_tokens
        if i >= num_decode_seqs:
            ids.extend(seq.all_token_ids[start : start + n])
            row_seq.append(i)
            row_start.append(start)
            row_len.append(n)
            continue
        # A decode row: its token is the last sampled, maybe not read back yet; after a
        # verify row in flight, as if that row accepted all its drafts (the device moves
        # this row back by those it rejects).
        token = seq.last_token_id
        if token == PLACEHOLDER:
            if prev is None:
                prev = [-1] * batch.num_tokens
            prev[len(ids)] = seq.pending_row
            if seq.pending_drafts:
                if follow is None:
                    follow, follow_k = [-1] * batch.num_tokens, [0] * batch.num_tokens
                follow[len(ids) : len(ids) + n] = [seq.pending_row] * n
                follow_k[len(ids) : len(ids) + n] = [seq.pending_drafts] * n
        if batch.draft_histories and batch.draft_histories[i] is not None:
            lookup.append((batch.draft_histories[i], len(ids), n - 1, seq.pending_row, seq.pending_drafts))
        ids.append(token)
        ids.extend(batch.drafts_of(i))
        row_seq += [i] * n
        row_start += range(start, start + n)
        row_len += [1] * n
    owner = np.asarray(row_seq, dtype=np.int64)
    # A verify row's k + 1 attention rows share their sequence's table: built once a sequence.
    tables = block_tables(batch.seqs)
    if len(owner) != len(batch.seqs):
        tables = tables[owner]
    starts = np.asarray(row_start, dtype=np.int64)
    query_lens = np.asarray(row_len, dtype=np.int32)
    positions, slots, qsl = ragged_slots(tables, starts, query_lens, block_size)
    rows_per_seq = np.bincount(owner, minlength=len(batch.seqs))
    seq_rows = np.zeros(len(batch.seqs) + 1, dtype=np.int64)
    np.cumsum(rows_per_seq, out=seq_rows[1:])
    samples = np.asarray(batch.samples, dtype=bool)[owner]
    first_token = qsl[seq_rows[:-1]]
    prompt_lp = _prompt_lp_rows(batch, first_token) if batch.is_prefill else None
    num_decode_rows = int(seq_rows[num_decode_seqs])
    return HostStep(
        is_prefill=batch.is_prefill,
        input_ids=np.asarray(ids, dtype=np.int64),
        positions=positions,
        slot_mapping=slots,
        block_tables=tables,
        context_lens=(starts + query_lens).astype(np.int32),
        query_lens=query_lens,
        query_start_loc=qsl,
        sample_indices=(qsl[1:] - 1)[samples].astype(np.int64),
        prev_index=None if prev is None else np.asarray(prev, dtype=np.int64),
        follow=None if follow is None else np.asarray(follow, dtype=np.int64),
        follow_k=None if follow_k is None else np.asarray(follow_k, dtype=np.int64),
        lookup=DraftLookup.build(lookup) if lookup else None,
        has_drafts=batch.num_draft_tokens > 0,
        num_decode=num_decode_rows if batch.is_prefill else 0,
        seq_rows=seq_rows,
        **(prompt_lp or {}),
    )


def block_tables(seqs) -> np.ndarray:
    """The sequences' block tables as rows of one int32 array, zero-padded."""
    tables = np.zeros((len(seqs), max(len(s.block_table) for s in seqs)), dtype=np.int32)
    for r, seq in enumerate(seqs):
        tables[r, : len(seq.block_table)] = seq.block_table
    return tables


def _prompt_lp_rows(batch: ScheduledBatch, first_token: np.ndarray) -> dict | None:
    """For sequences asking for prompt logprobs: each row of this chunk at a position p
    whose next token p + 1 is still a prompt token (the last prompt position predicts
    the first output token, which the sampler reports)."""
    rows: list[np.ndarray] = []
    targets: list[int] = []
    counts = np.zeros(len(batch.seqs), dtype=np.int64)
    k = -1
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        want = seq.sampling_params.prompt_logprobs
        if want is None:
            continue
        start = seq.num_computed_tokens
        end = min(start + n, seq.num_prompt_tokens - 1)  # positions start .. end - 1
        if end <= start:
            continue
        rows.append(first_token[i] + np.arange(end - start))
        targets.extend(seq.prompt_token_ids[start + 1 : end + 1])
        counts[i] = end - start
        k = max(k, want)
    if not rows:
        return None
    return {
        "prompt_lp_rows": np.concatenate(rows).astype(np.int64),
        "prompt_lp_targets": np.asarray(targets, dtype=np.int64),
        "prompt_lp_counts": counts,
        "prompt_lp_k": k,
    }
