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

import numpy as np
import torch

from agent_infer.engine.forward_context import AttentionMetadata, forward_context

log = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    sizes += list(range(16, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class _Pinned:
    """Pinned host staging and its device twin; `load` stages an array and copies it over.

    Two host buffers, used in turn: with async scheduling the next step is staged while
    the previous step's copy may still be queued on the device, and must not overwrite
    what that copy is about to read. A buffer is reused only after the step that used it
    was read back (one step in flight at most)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, fill: int = 0):
        self.hosts = [torch.full(shape, fill, dtype=dtype, pin_memory=True) for _ in range(2)]
        self.dev = torch.full(shape, fill, dtype=dtype, device=device)
        self.turn = 0

    def load(self, values: np.ndarray, rows: int) -> None:
        """Stage `values` into the first rows and copy `rows` rows (values + padding)."""
        host = self._next_host()
        host[: values.shape[0]].numpy()[...] = values
        self.dev[:rows].copy_(host[:rows], non_blocking=True)

    def load_block(self, values: np.ndarray) -> None:
        """Stage and copy just the top-left corner `values` covers (2-D)."""
        host = self._next_host()
        r, c = values.shape
        host[:r, :c].numpy()[...] = values
        self.dev[:r, :c].copy_(host[:r, :c], non_blocking=True)

    def _next_host(self) -> torch.Tensor:
        host = self.hosts[self.turn]
        self.turn ^= 1
        return host


class DecodeGraphs:
    def __init__(
        self, model: torch.nn.Module, max_batch: int, max_blocks_per_seq: int, device: torch.device,
        decode_workspace: torch.Tensor | None = None,
    ):
        self.model = model
        self.device = device
        self.decode_workspace = decode_workspace
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        n = self.max_batch
        self.input_ids = _Pinned((n,), torch.int64, device)
        self.positions = _Pinned((n,), torch.int64, device)
        self.slots = _Pinned((n,), torch.int64, device, fill=-1)
        self.context_lens = _Pinned((n,), torch.int32, device, fill=1)
        self.block_tables = _Pinned((n, max_blocks_per_seq), torch.int32, device)
        self.prev_index = _Pinned((n,), torch.int64, device, fill=-1)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_prefill=False,
            slot_mapping=self.slots.dev[:bs],
            block_tables=self.block_tables.dev[:bs],
            context_lens=self.context_lens.dev[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            max_query_len=1,
            max_context_len=self.block_tables.dev.shape[1],  # unused by graph-safe decode kernels
            query_lens_host=[1] * bs,
            context_lens_host=[1] * bs,
            decode_counters=self.decode_workspace,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        with forward_context(self._meta(bs)):
            hidden = self.model(self.input_ids.dev[:bs], self.positions.dev[:bs])
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        # Largest first: smaller graphs then reuse the memory the large one reserved.
        for bs in reversed(self.sizes):
            self._forward(bs)  # warm-up: Triton compilation, cuBLAS handles, autotuning
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[bs] = self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured %d decode graphs (batch 1..%d) in %.1f s", len(self.sizes), self.max_batch, time.perf_counter() - t0)

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.max_batch

    def run(self, step, prev_tokens: torch.Tensor | None) -> torch.Tensor:
        """Replay the graph for `step` (a decode HostStep); returns logits [B, vocab].
        Placeholder inputs take their token from `prev_tokens` (the previous step's
        samples, still on the device)."""
        b = len(step.input_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, b)]
        pad = size - b
        self.input_ids.load(np.pad(step.input_ids, (0, pad)), size)
        if step.prev_index is not None:
            self.prev_index.load(np.pad(step.prev_index, (0, pad), constant_values=-1), size)
            idx = self.prev_index.dev[:size]
            ids = self.input_ids.dev[:size]
            torch.where(idx >= 0, prev_tokens[idx.clamp(min=0)], ids, out=ids)
        self.positions.load(np.pad(step.positions, (0, pad)), size)
        self.slots.load(np.pad(step.slot_mapping, (0, pad), constant_values=-1), size)
        self.context_lens.load(np.pad(step.context_lens, (0, pad), constant_values=1), size)
        self.block_tables.load_block(step.block_tables)
        self.graphs[size].replay()
        return self.logits[size][:b]
