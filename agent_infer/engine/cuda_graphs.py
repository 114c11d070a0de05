"""Decode steps replayed from CUDA graphs.

One graph per batch size in a ladder (1, 2, 4, 8, then steps of 8 up to the largest);
a batch is padded up to the next captured size. Inputs live in static device buffers
that the graphs read; each step copies its host arrays into them (pinned staging,
non-blocking) and replays. Padding rows store nothing (slot -1) and attend to one
token, so they cost almost nothing and never touch a real sequence's cache.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from agent_infer.attention.metadata import AttentionMetadata, forward_context, longest_first
from agent_infer.kernels import ops

log = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    sizes += list(range(16, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class _Pinned:
    """Pinned host staging and its device twin, for the block tables; `load_block` stages
    the top-left corner an array covers and copies just that.

    Two host buffers, used in turn: with async scheduling the next step is staged while
    the previous step's copy may still be queued on the device, and must not overwrite
    what that copy is about to read. A buffer is reused only after the step that used it
    was read back (one step in flight at most)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        pin = device.type == "cuda"  # (a CPU device only in tests of the staging)
        self.hosts = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(2)]
        self.dev = torch.zeros(shape, dtype=dtype, device=device)
        self.turn = 0

    def load_block(self, values: np.ndarray) -> None:
        host = self.hosts[self.turn]
        self.turn ^= 1
        r, c = values.shape
        host[:r, :c].numpy()[...] = values
        self.dev[:r, :c].copy_(host[:r, :c], non_blocking=True)


_ROWS = 7  # int64 rows of RowInputs (the last holds two int32 ones)


@dataclass
class RowInputs:
    """One graph size's per-row inputs: views into a flat buffer (host or device)."""

    input_ids: torch.Tensor  # int64
    prev_index: torch.Tensor  # int64, -1: the id is real
    positions: torch.Tensor  # int64
    slots: torch.Tensor  # int64, -1: padding row, stores nothing
    follow: torch.Tensor  # int64, HostStep.follow (-1: none)
    follow_k: torch.Tensor  # int64
    context_lens: torch.Tensor  # int32
    order: torch.Tensor  # int32, the rows by context length, longest first (padding rows last)

    @staticmethod
    def of(flat: torch.Tensor, size: int) -> "RowInputs":
        """The rows of a `size`-row batch packed back to back at the start of `flat`
        (int64; the int32 context lengths and row order share the last row), so one
        contiguous copy of 7 x size int64 moves all of them."""
        rows = flat[: _ROWS * size].view(_ROWS, size)
        last = rows[_ROWS - 1].view(torch.int32)
        return RowInputs(rows[0], rows[1], rows[2], rows[3], rows[4], rows[5], last[:size], last[size:])


class _RowStaging:
    """The per-row inputs of every step through one pinned buffer (two, used in turn as
    `_Pinned` explains) and one host-to-device copy: at batch 1 each copy is ~1 µs of the
    device's step, so seven separate ones cost more than their bytes."""

    def __init__(self, max_batch: int, device: torch.device):
        pin = device.type == "cuda"  # (a CPU device only in tests of the packing)
        self.hosts = [torch.zeros(_ROWS * max_batch, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.dev = torch.zeros(_ROWS * max_batch, dtype=torch.int64, device=device)
        self.turn = 0

    def device_rows(self, size: int) -> RowInputs:
        return RowInputs.of(self.dev, size)

    def load(self, step, size: int) -> RowInputs:
        """Stage `step`'s rows padded to `size` (padding rows: token 0, slot -1, context
        1; the order over all of them) and copy them; returns the device views the graph
        of `size` reads."""
        host = self.hosts[self.turn]
        self.turn ^= 1
        rows = RowInputs.of(host, size)
        b = len(step.input_ids)
        for dst, src, pad in (
            (rows.input_ids, step.input_ids, 0),
            (rows.prev_index, step.prev_index, -1),
            (rows.positions, step.positions, 0),
            (rows.slots, step.slot_mapping, -1),
            (rows.follow, step.follow, -1),
            (rows.follow_k, step.follow_k, 0),
            (rows.context_lens, step.context_lens, 1),
        ):
            arr = dst.numpy()
            if src is None:
                arr[:] = pad
            else:
                arr[:b] = src
                arr[b:] = pad
        rows.order.numpy()[:] = longest_first(rows.context_lens.numpy())
        self.dev[: _ROWS * size].copy_(host[: _ROWS * size], non_blocking=True)
        return self.device_rows(size)


class GraphUnsafe(RuntimeError):
    """A decode step synchronised with the host, so it cannot be captured."""


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, max_batch: int, max_blocks_per_seq: int, device: torch.device, backend,
                 draft_layer: bool = False):
        """`backend`: the attention backend, which adds its fields to the captured metadata.
        `draft_layer`: each size also gets a graph of the model's draft layer (speculative
        method mtp) over the step just replayed (`draft`)."""
        self.model = model
        self.device = device
        self.backend = backend
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        n = self.max_batch
        self.rows = _RowStaging(n, device)
        self.block_tables = _Pinned((n, max_blocks_per_seq), torch.int32, device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.shift = torch.zeros(n, dtype=torch.int64, device=device)  # rows moved back (ops.resolve_rows)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # the final hidden states (a draft layer reads them)
        self.pool = None
        self.draft_layer = draft_layer
        self.draft_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.drafts: dict[int, torch.Tensor] = {}
        # The tokens a draft pass reads (the replayed step's samples), outside the graph
        # pool: they are copied in between the two replays.
        self.draft_ids = torch.zeros(n, dtype=torch.int64, device=device) if draft_layer else None

    def _meta(self, bs: int, rows: RowInputs) -> AttentionMetadata:
        return self.backend.prepare(AttentionMetadata(
            is_prefill=False,
            slot_mapping=rows.slots,
            block_tables=self.block_tables.dev[:bs],
            context_lens=rows.context_lens,
            query_start_loc=self.query_start_loc[: bs + 1],
            max_query_len=1,
            query_lens_host=[1] * bs,
            context_lens_host=[1] * bs,
            decode_order=rows.order,
        ))

    def _forward(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.rows.device_rows(bs)
        with forward_context(self._meta(bs, rows)):
            hidden = self.model(rows.input_ids, rows.positions)
        return hidden, self.model.compute_logits(hidden)

    def _draft_forward(self, bs: int) -> torch.Tensor:
        """The draft layer at every row of the step that graph `bs` just replayed: its
        inputs, metadata and final hidden states are still in the static buffers."""
        rows = self.rows.device_rows(bs)
        with forward_context(self._meta(bs, rows)):
            out = self.model.draft_hidden(self.draft_ids[:bs], self.hidden[bs], rows.positions)
        return ops.argmax(self.model.compute_logits(out))

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        # Largest first: smaller graphs then reuse the memory the large one reserved.
        for bs in reversed(self.sizes):
            rows = self.rows.device_rows(bs)
            rows.slots.fill_(-1)  # every row a padding row: the warm-up pass stores nothing
            rows.context_lens.fill_(1)
            rows.order.copy_(torch.arange(bs, dtype=torch.int32, device=self.device))
            self.graphs[bs], (self.hidden[bs], self.logits[bs]) = self._capture(bs, lambda: self._forward(bs))
            if self.draft_layer:
                # Captured after its step's graph, in the same pool: that graph's outputs,
                # which it reads, stay live, so nothing it allocates overlaps them.
                self.draft_graphs[bs], self.drafts[bs] = self._capture(bs, lambda: self._draft_forward(bs))
        torch.cuda.synchronize(self.device)
        log.info("captured %d decode graphs (batch 1..%d) in %.1f s", len(self.sizes), self.max_batch, time.perf_counter() - t0)

    def _capture(self, bs: int, forward) -> tuple[torch.cuda.CUDAGraph, object]:
        """(the graph, its outputs) of `forward` for size `bs` in the shared pool, after a
        warm-up (Triton compilation, cuBLAS handles, autotuning) and, at the largest size,
        the host-sync check."""
        forward()
        torch.cuda.synchronize(self.device)
        if bs == self.sizes[-1] and self.model.graphs_after_sync_check:
            self._check_no_sync(forward)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out

    def _check_no_sync(self, forward) -> None:
        """Run the warmed-up `forward` again with host syncs turned into errors: a step that
        reads a value on the host would fail (or replay a stale value) in a graph."""
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            forward()
        except RuntimeError as e:
            raise GraphUnsafe(str(e).splitlines()[0]) from e
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.max_batch

    def run(self, step, prev_tokens: torch.Tensor | None, resolve=None, lookup=None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the graph for `step` (a decode HostStep); returns the final hidden states
        [B, hidden] and the logits [B, vocab], static buffers the next replay overwrites.
        `resolve`: ModelRunner.resolve_rows, for a step with rows that follow a verify row;
        `lookup`: ModelRunner.lookup_drafts, for a step with drafts to look up."""
        size = self.stage(step, prev_tokens, resolve, lookup)
        self.graphs[size].replay()
        n = len(step.input_ids)
        return self.hidden[size][:n], self.logits[size][:n]

    def draft(self, tokens: torch.Tensor) -> torch.Tensor:
        """The draft layer's argmax at each row of the step `run` just replayed, given the
        token sampled at each row (`tokens`, [rows]); a static buffer the next draft
        replay of this size overwrites."""
        n = len(tokens)
        size = self._size_for(n)
        self.draft_ids[:n].copy_(tokens)
        self.draft_graphs[size].replay()
        return self.drafts[size][:n]

    def _size_for(self, rows: int) -> int:
        """The smallest captured size that holds `rows`."""
        return self.sizes[bisect.bisect_left(self.sizes, rows)]

    def stage(self, step, prev_tokens: torch.Tensor | None, resolve=None, lookup=None) -> int:
        """Everything a replay needs that runs outside the graph: the inputs copied into the
        static buffers of the graph size that fits `step`, and placeholder inputs resolved
        to their tokens in `prev_tokens` (the previous step's samples, still on the
        device), through `resolve` where rows follow a verify row still in flight (they
        move by what it accepted), then the drafts the device looks up (`lookup`). Returns
        that graph size."""
        size = self._size_for(len(step.input_ids))
        rows = self.rows.load(step, size)
        self.block_tables.load_block(step.block_tables)
        if step.follow is not None:
            resolve(step, rows.input_ids, rows.positions, rows.slots, rows.context_lens, self.shift[:size],
                    rows.prev_index, rows.follow, rows.follow_k, self.block_tables.dev[:size])
        elif step.prev_index is not None:
            ops.fill_placeholders(rows.input_ids, rows.prev_index, prev_tokens)
        if step.lookup is not None:
            lookup(step, rows.input_ids[: len(step.input_ids)])
        return size

    def input_ids(self, step) -> torch.Tensor:
        """The input ids of `step`, the step just staged, in the static buffers."""
        n = len(step.input_ids)
        return self.rows.device_rows(self._size_for(n)).input_ids[:n]
